"""Parallelism applied to an unchanged model: launching ranks, DDP variants, sharding."""
