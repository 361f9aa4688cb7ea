"""What the FlashAttention kernel rows name: problem flash_benchmarking's sweep, speed-up gates, host issue time
and 2025 leaderboard cell, the kernel rows of flash_in_training, and the leaderboard's kernels. The benchmark
(cs336_systems.benchmarks.flash) measures in these terms and the reports name the rows by them."""

from __future__ import annotations

from cs336_systems.rows import Row, ran

# The sweep's grid: sequence lengths, head dims and precisions.
SEQ_LENS = tuple(2**p for p in range(7, 17))  # 128 ... 65536
HEAD_DIMS = (16, 32, 64, 128)
PRECISIONS = ("bf16", "fp32")
# The passes of attention a kernel row times (its `mode`); cs336_systems.accounting.attention counts their FLOPs.
ATTENTION_MODES = ("forward", "backward", "forward_backward")
# flash_in_training times its kernels in each mode eagerly (host time shows where it exceeds the GPU's), and
# forward+backward replayed from a CUDA graph (the kernels alone).
GRAPHED_MODE = "forward_backward_graphed"
KERNEL_MODES = (*ATTENTION_MODES, GRAPHED_MODE)
MODE_LABELS = {"forward": "forward", "backward": "backward", "forward_backward": "forward+backward",
               GRAPHED_MODE: "forward+backward, CUDA graph"}
PROVIDER_LABELS = {"flash_triton": "triton", "flash_triton_compiled": "triton (compiled)",
                   "flash_triton_op": "triton (torch.library op)", "naive": "naive", "sdpa": "sdpa",
                   "sdpa_flash": "sdpa flash", "sdpa_cudnn": "sdpa cuDNN"}

# The least ratio of each gated provider's time over Triton's that the speed-up gate promises at its cell (the
# longest sequence, d 64, bf16, forward+backward: cs336_systems.benchmarks.flash.GATE_CELL). Naive attention writes
# and reads the N x N scores and probabilities (8 GiB each in bf16) where the kernels keep them on chip: on an H100
# it took 19.4x Triton's time, and half that lead is promised. SDPA's FlashAttention-2 took 1.42x Triton's time
# there: Triton is promised to be no slower.
GATE_PROMISES = {"naive": 10.0, "sdpa_flash": 1.0}
GATED_PROVIDERS = tuple(GATE_PROMISES)
# What a promise of the implementation under test may be held against at the same cell (--adapters-promise
# REFERENCE=RATIO: the reference's time over the implementation's is at least RATIO), this project's kernels
# among them.
UNDER_TEST_REFERENCES = ("naive", "sdpa_flash", "sdpa_cudnn", "flash_triton")


def provider_label(name: str) -> str:
    """How tables and plots name a provider: the implementation under test's by its own name."""
    return PROVIDER_LABELS.get(name, name)


def median_ratio(slow: Row | None, fast: Row | None) -> float | None:
    """`slow`'s median time over `fast`'s; None unless both ran."""
    return slow["median_ms"] / fast["median_ms"] if ran(slow) and ran(fast) else None
