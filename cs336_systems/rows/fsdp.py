"""What problem fsdp's rows name (cs336_systems.benchmarks.fsdp measures, cs336_systems.reports.fsdp reads): its
variants."""

OURS, OURS_NO_PREFETCH, TORCH_FSDP, TORCH_DDP = ("FSDP", "FSDP, no prefetch", "torch FSDP (fully_shard per block)",
                                                 "torch DDP")
