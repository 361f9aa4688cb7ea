"""What problem distributed_communication_single_node's rows name (cs336_systems.benchmarks.allreduce measures, the
report reads): how each cell was timed."""

WARMUP = 5
# Timed iterations per cell: enough for a stable median, at most about the benchmark's SECONDS_PER_CELL of
# all-reduces (1 GB over gloo takes on the order of a second each).
MIN_ITERATIONS, MAX_ITERATIONS = 3, 20
