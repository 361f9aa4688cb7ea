"""DDP, the sharded optimizer and FSDP from scratch (to be written): OverlappingDDP, BucketedDDP,
ShardedOptimizer, FullyShardedDP."""
