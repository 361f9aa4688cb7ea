"""Activation checkpointing of the LM's blocks: every k blocks, any nested plan, and the plan that
minimises peak activation memory.

A plan is a tuple of items run in order. An int is a block run plainly: autograd keeps its
activations for backward. A `Checkpoint` is a group of items run under torch.utils.checkpoint
(non-reentrant): forward keeps only the group's input; in backward the group's forward runs again
(with its own inner plan, so groups nest) and backward goes through the recomputed activations.
`Sublayers` splits one block: its attention sublayer and its feed-forward sublayer (each with its
residual addition) are checkpointed one at a time, a granularity below a block.

    apply_checkpointing(model, every_k(model.config.num_layers, 4))
    apply_checkpointing(model, every_sublayer(model.config.num_layers))
    plan, cost = optimal_plan(48, block_bytes=a, boundary_bytes=b)
    apply_checkpointing(model, plan)

Memory model (used by `plan_cost` and `optimal_plan`): a plain block keeps `a` bytes (its saved
activations, which include its input), a checkpointed group keeps `b` (its input, one residual-stream
tensor). Backward visits items last to first; while it is inside item i, the items before it still
hold what they kept, so a sequence peaks at max_i (kept by items before i + peak of item i). A plain
block peaks at `a`; a group at `b` plus the peak of its inner sequence, recomputed. The first item
inside a group shares its input with the group (one tensor), so it is not counted twice. A split
block keeps its two sublayers' inputs (2 b) and peaks at the larger of b + a_ffn (the feed-forward
sublayer recomputed, the attention sublayer's input held) and a_attn, where a_attn + a_ffn = a and
each includes its sublayer's input.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from cs336_systems.checks import check_non_negative_finite, check_positive_int


@dataclass(frozen=True)
class Checkpoint:
    items: tuple[int | Checkpoint, ...]

    def __post_init__(self):
        if not self.items:
            raise ValueError("a checkpointed group needs at least one block")


@dataclass(frozen=True)
class Sublayers:
    """Block `block` run as its two residual sublayers, each checkpointed on its own."""
    block: int


Item = int | Checkpoint | Sublayers
Plan = tuple[Item, ...]


def blocks_of(items: Sequence[Item]) -> list[int]:
    """The block indices a plan runs, in order."""
    return [block for item in items
            for block in (blocks_of(item.items) if isinstance(item, Checkpoint) else
                          [item.block] if isinstance(item, Sublayers) else [item])]


def validate_plan(plan: Plan, num_layers: int) -> None:
    if blocks_of(plan) != list(range(num_layers)):
        raise ValueError(f"a plan must run blocks 0..{num_layers - 1} once each, in order; "
                         f"this one runs {blocks_of(plan)}")


def every_k(num_layers: int, k: int | None) -> Plan:
    """Checkpoint each run of k consecutive blocks (the last run may be shorter); None: no checkpoints."""
    check_positive_int(num_layers=num_layers)
    if k is None:
        return tuple(range(num_layers))
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"checkpoint every k blocks needs an int k, got {type(k).__name__}")
    if not 1 <= k:
        raise ValueError(f"checkpoint every k blocks needs k >= 1, got {k}")
    return tuple(Checkpoint(tuple(range(start, min(start + k, num_layers))))
                 for start in range(0, num_layers, k))


def every_sublayer(num_layers: int) -> Plan:
    """Checkpoint each block's attention and feed-forward sublayers one at a time."""
    check_positive_int(num_layers=num_layers)
    return tuple(Sublayers(block) for block in range(num_layers))


def describe(plan: Plan) -> str:
    """Compact text of a plan: blocks as numbers, checkpointed groups in brackets, a block split into
    its checkpointed sublayers as `{i}`; runs of plain blocks and groups of consecutive blocks
    shortened to first-last."""
    def item_text(item: Item) -> str:
        if isinstance(item, int):
            return str(item)
        if isinstance(item, Sublayers):
            return f"{{{item.block}}}"
        blocks = blocks_of(item.items)
        if all(isinstance(i, int) for i in item.items) and len(blocks) > 2:
            return f"[{blocks[0]}-{blocks[-1]}]"
        return "[" + " ".join(item_text(i) for i in item.items) + "]"

    return " ".join(item_text(item) for item in plan)


# ------------------------------------------------------------------------------------ memory model

@dataclass(frozen=True)
class PlanCost:
    peak_bytes: float  # activation memory at the peak of forward + backward
    kept_bytes: float  # activation memory kept at the end of forward
    recomputed_blocks: int  # block forwards run a second (or later) time during backward


def _sequence_cost(items: Sequence[Item], a: float, b: float, input_held: bool,
                   sublayers: tuple[float, float] | None) -> PlanCost:
    kept, peak, recomputed = 0.0, 0.0, 0
    for position, item in enumerate(items):
        shared = b if input_held and position == 0 else 0.0
        if isinstance(item, Checkpoint):
            inner = _sequence_cost(item.items, a, b, True, sublayers)
            item_kept, item_peak = b - shared, b - shared + inner.peak_bytes
            recomputed += len(blocks_of(item.items)) + inner.recomputed_blocks
        elif isinstance(item, Sublayers):
            if sublayers is None:
                raise ValueError("a plan that splits blocks into sublayers needs sublayer_bytes (a_attn, a_ffn)")
            a_attn, a_ffn = sublayers
            item_kept, item_peak = 2 * b - shared, max(b + a_ffn, a_attn) - shared
            recomputed += 1
        else:
            item_kept = item_peak = a - shared
        peak = max(peak, kept + item_peak)
        kept += item_kept
    return PlanCost(peak, kept, recomputed)


def plan_cost(plan: Plan, block_bytes: float, boundary_bytes: float,
              sublayer_bytes: tuple[float, float] | None = None) -> PlanCost:
    """Peak and kept activation memory of a plan, and its recomputation, under the module's model;
    `sublayer_bytes` (a_attn, a_ffn, adding up to `block_bytes`) prices blocks split into sublayers."""
    validate_plan(plan, len(blocks_of(plan)))
    check_non_negative_finite(block_bytes=block_bytes, boundary_bytes=boundary_bytes)
    if block_bytes < boundary_bytes:
        raise ValueError(f"a block keeps its input, so block_bytes ({block_bytes}) cannot be below "
                         f"boundary_bytes ({boundary_bytes})")
    if sublayer_bytes is not None and (min(sublayer_bytes) < boundary_bytes
                                       or abs(sum(sublayer_bytes) - block_bytes) > 1e-9 * block_bytes):
        raise ValueError(f"sublayer_bytes {sublayer_bytes} must each keep at least their input "
                         f"({boundary_bytes}) and add up to block_bytes ({block_bytes})")
    return _sequence_cost(plan, block_bytes, boundary_bytes, False, sublayer_bytes)


def optimal_plan(num_layers: int, block_bytes: float, boundary_bytes: float,
                 max_recomputations: int | None = None) -> tuple[Plan, PlanCost]:
    """The plan of least peak activation memory in which no block's forward runs more than
    `max_recomputations` extra times (None: no limit); fewest recomputed blocks among equals.

    Dynamic programming over the first item of a sequence of n blocks: either a plain block (it keeps
    `a` while the other n - 1 are backpropagated), or a checkpointed group of m < n blocks (it keeps
    `b` while the other n - m are backpropagated, then peaks at b plus the best inner plan of its m
    blocks, one recomputation level deeper). With P(n) the best peak,
    P(n) = min(a + P(n - 1), min_m b + max(P_in(m), P(n - m))), where P_in is the same for a sequence
    whose input its group already holds. Exact under the module's model, O(L^2 r) for L blocks and
    r levels.

    What it finds:
    - No limit: peak a + b, by a chain of groups nested inside each other that recomputes every
      block from the model's input: O(1) memory for L(L - 1)/2 recomputed blocks, O(L^2).
    - r levels: each level splits its sequence into about L^(1/r) groups, so the peak is about
      a + r L^(1/r) b with at most r L recomputed blocks. r = 1 is single-level checkpointing (best
      every k = sqrt(L b / a) blocks: peak about 2 sqrt(L a b), O(sqrt L)); r = log2 L gives the
      recursive halving of Chen et al. (2016): peak a + O(b log L) for O(L log L) recomputation.
    """
    check_positive_int(num_layers=num_layers)
    check_non_negative_finite(block_bytes=block_bytes, boundary_bytes=boundary_bytes)
    if block_bytes < boundary_bytes:
        raise ValueError(f"a block keeps its input, so block_bytes ({block_bytes}) cannot be below "
                         f"boundary_bytes ({boundary_bytes})")
    if max_recomputations is not None and (isinstance(max_recomputations, bool)
                                           or not isinstance(max_recomputations, int) or max_recomputations < 0):
        raise ValueError(f"max_recomputations must be an int >= 0 or None, got {max_recomputations!r}")
    a, b = block_bytes, boundary_bytes
    # More levels than blocks can never help: each level needs a group of at least one block fewer.
    depth = num_layers if max_recomputations is None else min(max_recomputations, num_layers)

    @functools.cache
    def best(n: int, input_held: bool, levels: int) -> tuple[float, int, tuple]:
        """(peak, recomputed blocks, items) for n blocks; an item is 1 (a plain block) or -m (a
        checkpointed group of m blocks)."""
        if n == 0:
            return 0.0, 0, ()
        shared = b if input_held else 0.0
        rest_peak, rest_recomputed, rest = best(n - 1, False, levels)
        candidates = [(a - shared + rest_peak, rest_recomputed, (1,) + rest)]
        for m in range(1, n) if levels > 0 else ():
            inner_peak, inner_recomputed, _ = best(m, True, levels - 1)
            rest_peak, rest_recomputed, rest = best(n - m, False, levels)
            peak = b - shared + max(inner_peak, rest_peak)
            candidates.append((peak, m + inner_recomputed + rest_recomputed, (-m,) + rest))
        return min(candidates, key=lambda c: (c[0], c[1]))

    def build(n: int, input_held: bool, levels: int, first_block: int) -> Plan:
        items: list[Item] = []
        for size in best(n, input_held, levels)[2]:
            if size == 1:
                items.append(first_block)
            else:
                items.append(Checkpoint(build(-size, True, levels - 1, first_block)))
            first_block += abs(size)
            input_held = False
        return tuple(items)

    plan = build(num_layers, False, depth, 0)
    return plan, plan_cost(plan, a, b)


# ------------------------------------------------------------------------------ applying to a model

def _run(items: Sequence[Item], blocks: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for item in items:
        if isinstance(item, Checkpoint):
            x = checkpoint(_run, item.items, blocks, x, use_reentrant=False)
        elif isinstance(item, Sublayers):
            block = blocks[item.block]
            for sublayer in (block.attention_sublayer, block.ffn_sublayer):
                x = checkpoint(sublayer, x, use_reentrant=False)
        else:
            x = blocks[item](x)
    return x


def checkpoint_chain(blocks: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """The memory-optimal plan (optimal_plan with no limit) as code: blocks[:-1] run as one checkpointed
    group, nested the same way, and the last block plainly. Backward of block i recomputes blocks 0..i-1
    from the input: one block's activations and one boundary alive, O(n^2) recomputed block forwards."""
    if len(blocks) > 1:
        x = checkpoint(checkpoint_chain, blocks[:-1], x, use_reentrant=False)
    return blocks[-1](x)


class CheckpointedStack(nn.Module):
    """The model's blocks under their own names (layers.0, layers.1, ...: same parameters, same
    state_dict) run by a checkpoint plan.

    TransformerLM.forward runs `for layer in self.layers: x = layer(x)`; iterating this stack yields
    the plan's top-level stages, plain blocks as themselves and checkpointed groups as callables, so
    the model's own forward runs the plan.
    """

    def __init__(self, blocks: Sequence[nn.Module], plan: Plan):
        super().__init__()
        validate_plan(plan, len(blocks))
        for index, block in enumerate(blocks):
            self.add_module(str(index), block)
        self.plan = plan

    def blocks(self) -> list[nn.Module]:
        return list(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, index: int) -> nn.Module:
        return self.blocks()[index]

    def __iter__(self) -> Iterator[nn.Module | Callable[[torch.Tensor], torch.Tensor]]:
        blocks = self.blocks()
        for item in self.plan:
            yield blocks[item] if isinstance(item, int) else functools.partial(_run, (item,), blocks)

    def extra_repr(self) -> str:
        return f"plan={describe(self.plan)}"


def apply_checkpointing(model: nn.Module, plan: Plan) -> nn.Module:
    """Run `model.layers` (a TransformerLM's blocks) by `plan`; returns the model."""
    layers = getattr(model, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has no .layers of Transformer blocks to checkpoint")
    blocks = layers.blocks() if isinstance(layers, CheckpointedStack) else list(layers)
    model.layers = CheckpointedStack(blocks, plan)
    return model


def remove_checkpointing(model: nn.Module) -> nn.Module:
    if isinstance(model.layers, CheckpointedStack):
        model.layers = nn.ModuleList(model.layers.blocks())
    return model
