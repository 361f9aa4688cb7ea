"""What problem nsys_profile's rows name (cs336_systems.benchmarks.nsys_profile profiles, the report reads): the
annotated ranges that are profiled beside the step's phases (cs336_systems.rows.STEP_PHASES), and which kernels
count as a main cost."""

STEP_RANGE = "step"
ATTENTION_RANGES = ("attention/scores", "attention/softmax", "attention/final_matmul")
# The kernel table of forward and backward together, merged from theirs.
FORWARD_BACKWARD = "forward+backward"
# A non-matmul kernel above this share of forward kernel time counts as a main forward cost.
MAIN_KERNEL_SHARE = 0.02
