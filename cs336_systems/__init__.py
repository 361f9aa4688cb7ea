"""cs336-systems: benchmarks, kernels and parallelism for language-model training, tested with pytest."""
