"""Training transforms applied to an unchanged model: launching ranks, DDP variants, sharding, FSDP,
activation checkpointing."""
