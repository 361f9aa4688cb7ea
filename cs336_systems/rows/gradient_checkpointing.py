"""What problem gradient_checkpointing's rows name (cs336_systems.benchmarks.gradient_checkpointing measures, the
report reads): the handout's context, and which of the sweep's plans are single-level."""

from __future__ import annotations

from cs336_systems.rows import Row

# The 2026 handout's gradient_checkpointing (b): xl at batch 4 and this sequence length.
HANDOUT_CHECKPOINT_CONTEXT = 2048


def single_level_rows(sweep: list[Row], measured: bool = True) -> list[Row]:
    """The sweep's single-level plans (every k blocks, or every block split) that ran, or all of them."""
    return [r for r in sweep if (r["plan_kind"] == "sublayers" or r["plan_kind"] == "every_k" and r["k"] != "none")
            and (r["status"] == "ok" or not measured)]
