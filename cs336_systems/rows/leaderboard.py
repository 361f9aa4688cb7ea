"""What problem leaderboard's rows name (cs336_systems.benchmarks.leaderboard measures, the report reads): its
variants, from all the project's parts to all torch's."""

OURS_FSDP, OURS, OURS_SDPA = "ours with FSDP", "ours", "ours with SDPA"
TORCH_FUSED_LOSS, TORCH = "torch with the fused loss", "torch"
# The variants of torch's own parallelism, against the fastest of which ours with FSDP is gated.
TORCH_VARIANTS = (TORCH_FUSED_LOSS, TORCH)
