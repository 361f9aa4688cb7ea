"""Profiling: named ranges, kernel tables from torch.profiler, memory snapshots."""
