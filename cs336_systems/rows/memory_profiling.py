"""What problem memory_profiling's rows name (cs336_systems.benchmarks.memory_profiling measures, the report reads):
the modes and contexts the handout profiles."""

# The memory model's modes (cs336_systems.accounting.activations.MEMORY_MODES) that the handout profiles.
PROFILED_MODES = ("inference", "train_step")
# The 2026 handout's memory_profiling contexts (for its xl).
HANDOUT_MEMORY_CONTEXTS = (128, 2048)
