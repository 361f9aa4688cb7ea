"""What the end-to-end model benchmarks (cs336_systems.benchmarks.e2e) and their reports both name beyond the
package's shared vocabulary (cs336_systems.rows): the modes a cell runs, the phases each mode reports, and what a
cell's steps are expected to cost."""

from __future__ import annotations

from dataclasses import dataclass

MODEL_MODES = ("forward", "forward_backward", "train")
# The phases each mode reports, in order; the composite ones are sums of the measured phases.
MODE_PHASES = {
    "forward": ("forward",),
    "forward_backward": ("forward", "backward", "forward_backward"),
    "train": ("forward", "backward", "optimizer", "forward_backward", "train_step"),
}


@dataclass(frozen=True)
class CellCost:
    """What a cell's steps cost by the FLOP model, and how long that takes at a measured rate."""
    warmup: int
    timed: int
    profiled: int
    step_flops: float  # matmul FLOPs of each step, its mode's whole step (cs336_systems.accounting.flops)
    flops_per_s: float  # the rate a matmul of the model's feed-forward shape ran at on the device

    @property
    def steps(self) -> int:
        return self.warmup + self.timed + self.profiled

    @property
    def expected_s(self) -> float:
        """The steps' matmuls alone: elementwise work, the optimizer's, building and compiling the model come on
        top."""
        return self.steps * self.step_flops / self.flops_per_s
