"""The sharded optimizer, through the course's adapter get_sharded_optimizer(params, optimizer_cls, **kwargs).

What it must do:
  - after each step, every parameter is equal on every rank (each rank updated its own share, then they were
    synchronised);
  - its training matches the unsharded optimizer's: AdamW over two parameter groups of a model with tied
    weights, SGD with momentum, and a group added in the middle of training (add_param_group);
  - each rank keeps about 1/world_size of the optimizer state: the bytes of the state tensors reachable from
    the optimizer object (inner optimizers included, whatever the implementation calls them), against what the
    unsharded optimizer keeps. A split by whole parameters cannot be exact, so a rank may hold 1/world_size
    plus or minus the largest parameter's share.

Every rank trains on the same batch, as the course's test does (gradients already agree, as under DDP). At 3
ranks the parameters do not split evenly. All checks run in one launch of ranks per world size (see
rank_checks); each is a subtest.
"""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cs336_systems.conformance.compare import Tolerance, fail_if, largest_difference
from cs336_systems.conformance.contract import load_adapters
from cs336_systems.conformance.models import (
    TOY_FEATURES_IN,
    TOY_FEATURES_OUT,
    LayerStack,
    ToyModel,
    ToyModelWithTiedWeights,
)
from cs336_systems.conformance.observe import reachable_tensors, storage_bytes
from cs336_systems.conformance.rank_checks import Check, CheckFailed, placements, run_on_ranks
from cs336_systems.distributed.launch import rank_device

WORLD_SIZES = (2, 3)
LAUNCH_TIMEOUT_S = 120  # one check's deadline; see test_ddp
STEPS = 4
EXAMPLES = 12
FLOAT64 = Tolerance(rtol=1e-7, atol=1e-10)
ADAMW = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
SGD_MOMENTUM = dict(lr=0.05, momentum=0.9)
# The model whose state is weighed: 6 layers of 12 features, so that the largest parameter (a weight, 144 of
# the 936 elements) is a small share, and a split by whole parameters can come close to 1/world_size.
SHARE_WIDTH, SHARE_LAYERS = 12, 6
NEEDS = ("get_sharded_optimizer",)


def _sharded(adapters_spec: str, params, optimizer_cls, **kwargs) -> torch.optim.Optimizer:
    return load_adapters(adapters_spec).function("get_sharded_optimizer")(params, optimizer_cls, **kwargs)


def _model(model_class, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return model_class().double().to(rank_device())


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """One step on a batch the same on every rank."""
    generator = torch.Generator().manual_seed(1000 + step)
    features_in = model.layers[0].in_features if isinstance(model, LayerStack) else TOY_FEATURES_IN
    features_out = model.layers[-1].out_features if isinstance(model, LayerStack) else TOY_FEATURES_OUT
    x = torch.randn(EXAMPLES, features_in, generator=generator, dtype=torch.float64).to(rank_device())
    y = torch.randn(EXAMPLES, features_out, generator=generator, dtype=torch.float64).to(rank_device())
    optimizer.zero_grad(set_to_none=True)
    F.mse_loss(model(x), y).backward()
    optimizer.step()


def _share_model() -> nn.Module:
    return _model(lambda: LayerStack(SHARE_WIDTH, SHARE_LAYERS))


def _snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# ------------------------------------------------------------------------------------------ checks

def _parameters_are_equal_on_every_rank(adapters_spec: str, rank: int, world_size: int) -> None:
    """After each AdamW step every rank holds the same parameters, and they have moved as the unsharded
    optimizer moves them: a parameter still at its value from before the step on some ranks was updated on its
    owner only. Every rank sees every rank's parameters; rank 0 reports."""
    model = _share_model()
    unsharded_model = deepcopy(model)
    optimizer = _sharded(adapters_spec, model.parameters(), torch.optim.AdamW, **ADAMW)
    unsharded = torch.optim.AdamW(unsharded_model.parameters(), **ADAMW)
    problems, differing = [], set()
    for step in range(STEPS):
        before = _snapshot(model)
        _step(model, optimizer, step)
        _step(unsharded_model, unsharded, step)
        mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        everyone = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(everyone, mine)
        offset = 0
        for (name, p), old, expected in zip(model.named_parameters(), before, unsharded_model.parameters()):
            held = [values[offset:offset + p.numel()].view_as(p) for values in everyone]
            offset += p.numel()
            if name in differing or all(torch.equal(value, held[0]) for value in held):
                continue
            differing.add(name)
            stale = [r for r, value in enumerate(held) if torch.equal(value, old)]
            updated = [r for r, value in enumerate(held) if FLOAT64.close(value, expected)]
            if stale and not torch.equal(old, expected):
                problems.append(f"after step {step}, {name} differs between ranks: ranks {stale} hold its value from "
                                f"before the step, ranks {updated} the updated one: the sharded optimizer did not "
                                "synchronise parameters after step (only the rank that owns a parameter updated it)")
            else:
                spread = max(largest_difference(value, held[0]) for value in held)
                problems.append(f"after step {step}, {name} differs between ranks, by up to {spread:.3g}")
    if rank == 0:
        fail_if(problems, f"{SHARE_LAYERS} Linear layers, AdamW, every rank on the same batch")


def _group_hyperparameters(model: nn.Module) -> list[dict]:
    """Two groups with their own learning rate and weight decay; a shared weight is in one of them once."""
    params = list(model.parameters())
    return [{"params": params[:2], "lr": 0.02}, {"params": params[2:], "lr": 0.05, "weight_decay": 0.0}]


def _assert_same_as_unsharded(model: nn.Module, unsharded_model: nn.Module, before: list[torch.Tensor], what: str,
                              rank: int, step: int, problems: list, differing: set) -> None:
    """Each parameter's first difference from the unsharded optimizer's, `before` holding the values the
    step started from: one the step left where it was is named so."""
    for (name, p), old, expected in zip(model.named_parameters(), before, unsharded_model.parameters()):
        if name in differing or FLOAT64.close(p, expected):
            continue
        differing.add(name)
        if torch.equal(p, old):
            problems.append(f"step {step} left rank {rank}'s {name} where it was, the unsharded {what} moved it by up "
                            f"to {largest_difference(old, expected):.3g}: no rank's optimizer updates it")
        else:
            problems.append(f"after step {step}, rank {rank}'s {name} differs from the unsharded {what}'s by up to "
                            f"{largest_difference(p, expected):.3g}")


def _matches_unsharded_adamw(adapters_spec: str, rank: int, world_size: int) -> None:
    """AdamW (weight decay) over two parameter groups of the model with tied weights, against torch's AdamW."""
    model = _model(ToyModelWithTiedWeights)
    unsharded_model = deepcopy(model)
    optimizer = _sharded(adapters_spec, _group_hyperparameters(model), torch.optim.AdamW, **ADAMW)
    unsharded = torch.optim.AdamW(_group_hyperparameters(unsharded_model), **ADAMW)
    problems, differing = [], set()
    for step in range(STEPS):
        before = _snapshot(model)
        _step(model, optimizer, step)
        _step(unsharded_model, unsharded, step)
        _assert_same_as_unsharded(model, unsharded_model, before, "AdamW", rank, step, problems, differing)
    fail_if(problems, "tied weights, two parameter groups, AdamW")


def _matches_unsharded_sgd_with_momentum(adapters_spec: str, rank: int, world_size: int) -> None:
    """Another optimizer class, whose state is one buffer per parameter."""
    model = _share_model()
    unsharded_model = deepcopy(model)
    optimizer = _sharded(adapters_spec, model.parameters(), torch.optim.SGD, **SGD_MOMENTUM)
    unsharded = torch.optim.SGD(unsharded_model.parameters(), **SGD_MOMENTUM)
    problems, differing = [], set()
    for step in range(STEPS):
        before = _snapshot(model)
        _step(model, optimizer, step)
        _step(unsharded_model, unsharded, step)
        _assert_same_as_unsharded(model, unsharded_model, before, "SGD with momentum", rank, step, problems, differing)
    fail_if(problems, f"{SHARE_LAYERS} Linear layers, SGD with momentum")


class _GrowingModel(nn.Module):
    """The course's toy model and a layer whose output is added in from the middle of training on."""

    def __init__(self):
        super().__init__()
        self.base = ToyModel()
        self.extra = nn.Linear(TOY_FEATURES_IN, TOY_FEATURES_OUT)
        self.use_extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (self.extra(x) if self.use_extra else 0)


def _add_param_group_mid_training(adapters_spec: str, rank: int, world_size: int) -> None:
    """A group added with add_param_group after some steps (unfreezing a layer) is sharded and trained as the
    unsharded optimizer trains it."""
    model = _model(_GrowingModel)
    unsharded_model = deepcopy(model)
    optimizer = _sharded(adapters_spec, model.base.parameters(), torch.optim.AdamW, **ADAMW)
    unsharded = torch.optim.AdamW(unsharded_model.base.parameters(), **ADAMW)
    problems, differing = [], set()
    for step in range(STEPS):
        if step == STEPS // 2:
            for m, opt in ((model, optimizer), (unsharded_model, unsharded)):
                m.use_extra = True
                opt.add_param_group({"params": list(m.extra.parameters()), "lr": 0.02})
        before = _snapshot(model)
        _step(model, optimizer, step)
        _step(unsharded_model, unsharded, step)
        _assert_same_as_unsharded(model, unsharded_model, before, "AdamW", rank, step, problems, differing)
    fail_if(problems, f"a parameter group added by add_param_group before step {STEPS // 2}")


def _state_bytes(optimizer: torch.optim.Optimizer, model: nn.Module) -> int:
    """Bytes of the tensors reachable from the optimizer that are neither parameters nor gradients."""
    params = list(model.parameters())
    gradients = [p.grad for p in params if p.grad is not None]
    return storage_bytes(reachable_tensors(optimizer, excluding=params + gradients))


def _each_rank_keeps_its_share_of_the_state(adapters_spec: str, rank: int, world_size: int) -> None:
    """After a step, each rank's optimizer holds 1/world_size of the unsharded AdamW's state bytes, give or take
    the largest parameter's share (what a split by whole parameters may put on one rank more or less)."""
    model = _share_model()
    unsharded_model = deepcopy(model)
    optimizer = _sharded(adapters_spec, model.parameters(), torch.optim.AdamW, **ADAMW)
    unsharded = torch.optim.AdamW(unsharded_model.parameters(), **ADAMW)
    _step(model, optimizer, 0)
    _step(unsharded_model, unsharded, 0)
    total = _state_bytes(unsharded, unsharded_model)
    largest_share = max(p.numel() for p in model.parameters()) / sum(p.numel() for p in model.parameters())
    most, least = 1 / world_size + largest_share, 1 / world_size - largest_share
    held: list[int | None] = [None] * world_size
    dist.all_gather_object(held, _state_bytes(optimizer, model))
    shares = ", ".join(f"rank {r} {b / total:.0%}" for r, b in enumerate(held))
    if sum(held) == 0:
        raise CheckFailed(f"no rank's optimizer holds any state tensor after a step ({shares}); an unsharded AdamW "
                          f"keeps {total:,} bytes")
    mine = held[rank] / total
    holds = (f"rank {rank} holds {mine:.0%} of the optimizer state ({held[rank]:,} bytes; an unsharded AdamW keeps "
             f"{total:,}), expected about {1 / world_size:.0%}")
    if mine > most:
        raise CheckFailed(f"{holds}: at most {most:.0%}, 1/{world_size} plus the largest parameter's "
                          f"{largest_share:.0%} ({shares})")
    if mine < least:
        raise CheckFailed(f"{holds}: at least {least:.0%}, 1/{world_size} less the largest parameter's "
                          f"{largest_share:.0%} ({shares}): the other ranks keep state this one should")


CHECKS = {
    "parameters are equal on every rank after each step": Check(_parameters_are_equal_on_every_rank, NEEDS),
    "each rank keeps about 1/world_size of the optimizer state": Check(_each_rank_keeps_its_share_of_the_state,
                                                                        NEEDS),
    "matches the unsharded AdamW (two groups, tied weights)": Check(_matches_unsharded_adamw, NEEDS),
    "matches the unsharded SGD with momentum": Check(_matches_unsharded_sgd_with_momentum, NEEDS),
    "add_param_group during training": Check(_add_param_group_mid_training, NEEDS),
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    from cs336_systems.pytest_plugin import settings

    if "placement" in metafunc.fixturenames:
        metafunc.parametrize("placement", placements(settings(metafunc.config).on_gpu, WORLD_SIZES))


@pytest.mark.sharding
def test_sharded_optimizer(subtests, adapters, placement):
    run_on_ranks(subtests, adapters, CHECKS, placement, LAUNCH_TIMEOUT_S)
