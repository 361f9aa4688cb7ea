"""What problem mixed_precision_accumulation's rows name (cs336_systems.benchmarks.mixed_precision measures, the
report reads): how many times which number is added."""

ACCUMULATION_STEPS = 1000
ADDEND = 0.01
