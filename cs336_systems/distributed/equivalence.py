"""Whether a parallelism trains as one process does: a wrapped model trained beside a one-process reference on
the same batches, each rank on its rows of the batch (or all of it), and how far apart they end, over ranks.

    reference = Trainer(deepcopy(model), unwrapped, sgd, loss)
    trainer = Trainer(model, wrap, sgd, loss)
    train_beside(reference, trainer, batches)
    difference = worst_over_ranks(max_abs_difference(reference.module.parameters(), trainer.module.parameters()))

The benchmarks that report these comparisons choose the models, batches and tolerances, and write the rows;
`equivalence_failures` words the rows outside their tolerance.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from cs336_systems.distributed.ddp import batch_shard
from cs336_systems.distributed.training import Trainer


def train_beside(reference: Trainer, trainer: Trainer, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                 share: bool = True) -> None:
    """A step of `reference` on each whole batch, then one of `trainer` on this rank's rows of it (batch_shard)
    where `share`, on all of it otherwise."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for inputs, targets in batches:
        reference.step(inputs, targets)
        rows = batch_shard(len(inputs), rank, world_size) if share else slice(None)
        trainer.step(inputs[rows], targets[rows])


def max_abs_difference(expected: Iterable[torch.Tensor], actual: Iterable[torch.Tensor]) -> float:
    """The largest elementwise difference between paired tensors."""
    return max((a.detach() - b.detach()).abs().max().item() for a, b in zip(expected, actual, strict=True))


def max_relative_difference(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> float:
    """The largest difference between tensors of the same name, each relative to the expected one's largest
    magnitude; the names must be the same."""
    if expected.keys() != actual.keys():
        raise RuntimeError(f"tensors of other names than expected: {sorted(expected.keys() ^ actual.keys())}")
    return max(((actual[name] - want).abs().max() / want.abs().max()).item() for name, want in expected.items())


def gathered(value: object) -> list:
    """`value` from every rank, by rank."""
    values: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def worst_over_ranks(difference: float) -> float:
    return max(gathered(difference))


def equivalence_failures(rows: list[dict], label: str = "variant") -> list[str]:
    """Each equivalence row outside its tolerance as "<label>: <difference> > <tolerance>"."""
    return [f"{r[label]}: max abs difference {r['max_abs_difference']:.3g} > tolerance {r['tolerance']:g}"
            for r in rows if not r["matches"]]
