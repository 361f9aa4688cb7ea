"""DDP, through the course's adapters: per-parameter (get_ddp_individual_parameters), bucketed
(get_ddp_bucketed) and the 2026 get_ddp, each with its hooks called as the course's tests call them.

What every DDP must do, checked on each of the three:
  - every rank starts from rank 0's parameters, though each built its model from its own seed;
  - after the after-backward hook every gradient is the average over ranks (the single-process gradient of the
    whole batch), not the sum, and not the rank's own;
  - communication overlaps backward: a gradient reduction is issued before backward reaches the model's first
    layer (counted as torch.distributed's collectives are issued, whatever calls them);
  - each gradient is reduced once a step: a weight shared by two layers once, as one parameter;
  - parameters that get no gradient (frozen, unused, a branch skipped) break nothing, on every rank or on some;
  - training matches one process training on the whole batch over several AdamW steps, for the course's toy
    model (frozen parameters) and its model with tied weights;
and of the bucketed one: each step issues the reductions its bucket plan implies (the handout's greedy buckets
of at most bucket_size_mb over the parameters in reverse order; a partial last bucket included).

All of it runs in one launch of ranks (see rank_checks); each check is a subtest. Models are float64, so that
only the order of additions in a reduction separates a rank's result from one process's.
"""

from __future__ import annotations

from collections import Counter
from copy import deepcopy
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cs336_systems.conformance.compare import Tolerance, fail_if, gradient_problem, largest_difference
from cs336_systems.conformance.contract import load_adapters
from cs336_systems.conformance.models import (
    TOY_FEATURES_IN,
    TOY_FEATURES_OUT,
    BranchyModel,
    LayerStack,
    ToyModel,
    ToyModelWithTiedWeights,
)
from cs336_systems.conformance.observe import CollectiveLog
from cs336_systems.conformance.rank_checks import Check, CheckFailed, placements, run_on_ranks
from cs336_systems.distributed.launch import rank_device

WORLD_SIZES = (2,)
# One check's deadline (each reports progress to the launch): ranks import torch and the implementation on a
# busy machine first. A collective some rank never joins ends here, not in CI's timeout.
LAUNCH_TIMEOUT_S = 120
STEPS = 4  # several: AdamW's moments carry one step's mistake into the next ones
EXAMPLES = 12  # every rank gets as many: averaging the ranks' mean losses is then the whole batch's mean
# float64 throughout: sums over ranks in another order differ from one process's in the last bits only.
FLOAT64 = Tolerance(rtol=1e-7, atol=1e-10)
ADAMW = dict(lr=1e-2, weight_decay=0.1)
SGD_LR = 0.1
# For the checks that are not about buckets: small enough that the toy model (float64: 2000, 4000 and 800
# bytes of trained weights) makes three buckets.
SEVERAL_BUCKETS_MB = 0.004
# The bucket plans checked, on a LayerStack of 5 layers of 16 features (float64: weights of 2,048 bytes,
# biases of 128): three buckets of which the last is partial, one bucket per parameter, and one for all.
# Each plan is the same whether a megabyte is 10^6 bytes or 2^20 (planned_bucket_elements refuses a size where
# they differ): the handout does not say which.
PLAN_WIDTH, PLAN_LAYERS = 16, 5
PLANNED_BUCKET_SIZES_MB = (0.005, 0.00001, 1.0)
BYTES_PER_MB = (10**6, 2**20)


@dataclass(frozen=True)
class Variant:
    """One of the course's DDP adapter families: the function that wraps a module, and its hooks, which the
    handout lets an implementation leave out (a hook the module lacks is not called)."""

    make: str
    after_backward: str
    before_batch: str | None = None

    @property
    def bucketed(self) -> bool:
        return self.make == "get_ddp_bucketed"

    @property
    def needs(self) -> tuple[str, ...]:
        return (self.make,)


VARIANTS = {
    "individual_parameters": Variant("get_ddp_individual_parameters", "ddp_individual_parameters_on_after_backward"),
    "bucketed": Variant("get_ddp_bucketed", "ddp_bucketed_on_after_backward", "ddp_bucketed_on_train_batch_start"),
    "get_ddp": Variant("get_ddp", "ddp_on_after_backward"),
}


class _DDP:
    """The implementation's DDP of one variant, driven as the course's tests drive it."""

    def __init__(self, adapters_spec: str, variant: str, bucket_size_mb: float = SEVERAL_BUCKETS_MB):
        adapters = load_adapters(adapters_spec)
        self.variant = VARIANTS[variant]
        self.bucket_size_mb = bucket_size_mb
        self._make = adapters.function(self.variant.make)
        self._after_backward, self._before_batch = (
            adapters.function(hook) if hook and not adapters.missing(hook) else None
            for hook in (self.variant.after_backward, self.variant.before_batch))

    def wrap(self, module: nn.Module) -> nn.Module:
        return self._make(module, self.bucket_size_mb) if self.variant.bucketed else self._make(module)

    def before_batch(self, ddp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self._before_batch is not None:
            self._before_batch(ddp_model, optimizer)

    def after_backward(self, ddp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self._after_backward is not None:
            self._after_backward(ddp_model, optimizer)

    def backward(self, ddp_model: nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> None:
        loss.backward()
        self.after_backward(ddp_model, optimizer)


def _batch(seed: int, examples: int = EXAMPLES):
    """Inputs and targets, the same on every rank (seeded), on this rank's device."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(examples, TOY_FEATURES_IN, generator=generator, dtype=torch.float64)
    y = torch.randn(examples, TOY_FEATURES_OUT, generator=generator, dtype=torch.float64)
    return x.to(rank_device()), y.to(rank_device())


def _shard(rank: int, world_size: int, examples: int = EXAMPLES) -> slice:
    rows = examples // world_size
    return slice(rank * rows, (rank + 1) * rows)


def _model(model_class, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return model_class().double().to(rank_device())


TOY_MODELS = {"toy_model": ToyModel, "tied_weights": ToyModelWithTiedWeights}


# ------------------------------------------------------------------------------------------ checks

def _starts_from_rank_0_s_parameters(adapters_spec: str, rank: int, world_size: int, variant: str) -> None:
    """Each rank builds the model from its own seed; after wrapping, every parameter (frozen ones too) is rank
    0's."""
    ddp = _DDP(adapters_spec, variant)
    rank_0_s = _model(ToyModel, seed=0)
    module = _model(ToyModel, seed=rank)
    own = deepcopy(module)
    ddp.wrap(module)
    problems = []
    for (name, p), expected, before in zip(module.named_parameters(), rank_0_s.parameters(), own.parameters()):
        if torch.equal(p, expected):
            continue
        if torch.equal(p, before):
            problems.append(f"rank {rank}'s {name} is still its own initial value, not rank 0's: the wrapper did "
                            "not broadcast rank 0's parameters")
        else:
            problems.append(f"rank {rank}'s {name} is neither rank 0's initial value nor its own (differs from "
                            f"rank 0's by up to {largest_difference(p, expected):.3g})")
    fail_if(problems, f"{variant}: after wrapping")


def _gradients_are_averaged(adapters_spec: str, rank: int, world_size: int, variant: str, model: str) -> None:
    """One backward on this rank's shard, then the after-backward hook: each trained parameter's gradient is
    the single-process gradient of the whole batch; a frozen one has none."""
    ddp = _DDP(adapters_spec, variant)
    module = _model(TOY_MODELS[model], seed=0)
    single_process, own = deepcopy(module), deepcopy(module)
    x, y = _batch(seed=1)
    shard = _shard(rank, world_size)
    F.mse_loss(single_process(x), y).backward()
    F.mse_loss(own(x[shard]), y[shard]).backward()
    ddp_model = ddp.wrap(module)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=SGD_LR)
    ddp.before_batch(ddp_model, optimizer)
    ddp.backward(ddp_model, optimizer, F.mse_loss(ddp_model(x[shard]), y[shard]))
    problems = []
    for (name, p), expected, rank_own in zip(module.named_parameters(), single_process.parameters(), own.parameters()):
        if not p.requires_grad:
            if p.grad is not None:
                problems.append(f"rank {rank}'s frozen {name} (requires_grad=False) got a gradient")
            continue
        problems.append(gradient_problem(f"rank {rank}'s {name} grad", p.grad, expected.grad, world_size=world_size,
                                         tolerance=FLOAT64, own=rank_own.grad))
    fail_if(problems, f"{variant}, {model}: after one backward and the after-backward hook")


def _communication_overlaps_backward(adapters_spec: str, rank: int, world_size: int, variant: str) -> None:
    """A reduction of gradients is issued before backward reaches the first layer: the input's gradient, which
    the first layer computes last of all, is hooked to count what had been issued by then."""
    ddp = _DDP(adapters_spec, variant, bucket_size_mb=PLANNED_BUCKET_SIZES_MB[0])
    ddp_model = ddp.wrap(_model(lambda: LayerStack(PLAN_WIDTH, layers=4), seed=0))
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=SGD_LR)
    x = torch.randn(4, PLAN_WIDTH, dtype=torch.float64, device=rank_device(), requires_grad=True)
    reached_first_layer: list[int] = []
    with CollectiveLog() as log:
        ddp.before_batch(ddp_model, optimizer)
        loss = ddp_model(x).square().mean()
        x.register_hook(lambda grad: reached_first_layer.append(log.mark()))
        loss.backward()
        returned = log.mark()
        ddp.after_backward(ddp_model, optimizer)
    before_first = len(log.reductions(end=reached_first_layer[0] if reached_first_layer else returned))
    during = len(log.reductions(end=returned))
    after = len(log.reductions(start=returned))
    if during == 0:
        raise CheckFailed(f"{variant}: no all-reduce was issued before backward returned ({after} issued after it, "
                          "by the after-backward hook): communication does not overlap backward")
    if before_first == 0:
        raise CheckFailed(f"{variant}: no all-reduce was issued before backward reached the first layer; the {during} "
                          "issued during backward came at its end, so communication does not overlap backward")


def _names_by_parameter(module: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter, by the parameter's id: a shared one has several."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _tied_names(module: nn.Module) -> list[list[str]]:
    """The names under which each shared parameter appears, for parameters that appear under several."""
    return [group for group in _names_by_parameter(module).values() if len(group) > 1]


def _each_gradient_is_reduced_once(adapters_spec: str, rank: int, world_size: int, variant: str) -> None:
    """On the model with tied weights, each step's reductions carry as many gradient elements as the distinct
    trained parameters hold: the shared weight's once. Per-parameter DDP issues one reduction per parameter."""
    ddp = _DDP(adapters_spec, variant)
    module = _model(ToyModelWithTiedWeights, seed=0)
    trained = [p for p in module.parameters() if p.requires_grad]  # parameters() yields a shared one once
    elements = sum(p.numel() for p in trained)
    tied = ", ".join(" and ".join(group) for group in _tied_names(module))
    ddp_model = ddp.wrap(module)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=SGD_LR)
    shard = _shard(rank, world_size)
    problems = []
    for step in range(2):
        x, y = _batch(seed=step)
        with CollectiveLog() as log:
            ddp.before_batch(ddp_model, optimizer)
            optimizer.zero_grad(set_to_none=True)
            ddp.backward(ddp_model, optimizer, F.mse_loss(ddp_model(x[shard]), y[shard]))
        optimizer.step()
        reductions = log.reductions()
        reduced = sum(c.numel for c in reductions)
        if reduced > elements:
            problems.append(f"step {step}: {len(reductions)} reductions carried {reduced} gradient elements, the "
                            f"{len(trained)} distinct trained parameters hold {elements}: a gradient was reduced "
                            f"more than once (the tied weight, {tied}, counts once)")
        elif reduced < elements:
            problems.append(f"step {step}: {len(reductions)} reductions carried {reduced} gradient elements, the "
                            f"{len(trained)} distinct trained parameters hold {elements}: some gradients were never "
                            "reduced")
        if variant == "individual_parameters" and len(reductions) != len(trained):
            problems.append(f"step {step}: {len(reductions)} all-reduces for {len(trained)} distinct trained "
                            f"parameters (the tied weight, {tied}, is one): per-parameter DDP issues one each")
    fail_if(problems, f"{variant}, on the model with tied weights")


def bucket_plan(sizes_bytes: list[int], bucket_size_bytes: float) -> list[list[int]]:
    """The handout's buckets: parameters 0..n-1 walked in reverse order and packed greedily, a bucket closing
    when the next parameter would take it past `bucket_size_bytes` (so a bucket exceeds it only when one
    parameter alone does). Lists of parameter indices."""
    buckets: list[list[int]] = [[]]
    held = 0
    for index in reversed(range(len(sizes_bytes))):
        if buckets[-1] and held + sizes_bytes[index] > bucket_size_bytes:
            buckets.append([])
            held = 0
        buckets[-1].append(index)
        held += sizes_bytes[index]
    return [bucket for bucket in buckets if bucket]


def planned_bucket_elements(module: nn.Module, bucket_size_mb: float) -> list[int]:
    """The elements of each bucket of `module`'s trained parameters under the plan for `bucket_size_mb`; a
    ValueError where the plan would depend on whether a megabyte is 10^6 bytes or 2^20."""
    params = [p for p in module.parameters() if p.requires_grad]
    sizes = [p.numel() * p.element_size() for p in params]
    plans = {tuple(map(tuple, bucket_plan(sizes, bucket_size_mb * mb))) for mb in BYTES_PER_MB}
    if len(plans) != 1:
        raise ValueError(f"bucket_size_mb={bucket_size_mb} makes different plans for a megabyte of 10^6 and of 2^20 "
                         "bytes; the check must use a size where they agree")
    return [sum(params[i].numel() for i in bucket) for bucket in plans.pop()]


def _reductions_follow_the_bucket_plan(adapters_spec: str, rank: int, world_size: int) -> None:
    """For each planned bucket size, each step's gradient reductions are the plan's buckets: as many, of the
    same sizes (in any order)."""
    problems = []
    shard = _shard(rank, world_size)
    for bucket_size_mb in PLANNED_BUCKET_SIZES_MB:
        ddp = _DDP(adapters_spec, "bucketed", bucket_size_mb=bucket_size_mb)
        module = _model(lambda: LayerStack(PLAN_WIDTH, PLAN_LAYERS), seed=0)
        planned = planned_bucket_elements(module, bucket_size_mb)
        ddp_model = ddp.wrap(module)
        optimizer = torch.optim.SGD(ddp_model.parameters(), lr=SGD_LR)
        for step in range(2):
            x = torch.randn(EXAMPLES, PLAN_WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
            with CollectiveLog() as log:
                ddp.before_batch(ddp_model, optimizer)
                optimizer.zero_grad(set_to_none=True)
                ddp.backward(ddp_model, optimizer, ddp_model(x[shard].to(rank_device())).square().mean())
            optimizer.step()
            reduced = [c.numel for c in log.reductions()]
            if sorted(reduced) != sorted(planned):
                partial = " (the last partial)" if len(planned) > 1 and planned[-1] < max(planned) else ""
                problems.append(f"step {step}: {_count(len(reduced), 'all-reduce')} per step, the plan for "
                                f"bucket_size_mb={bucket_size_mb:g} has {_count(len(planned), 'bucket')}{partial} "
                                f"of {planned} gradient elements (in reverse parameter order); this step's carried "
                                f"{reduced}")
    fail_if(problems, f"bucketed, on {PLAN_LAYERS} Linear layers of {PLAN_WIDTH} features (float64)")


def _count(number: int, thing: str) -> str:
    return f"{number} {thing}{'' if number == 1 else 's'}"


def _branch_on_every_rank_or_none(step: int, rank: int) -> bool:
    return step % 2 == 0


def _takes_branch_on_some_ranks(step: int, rank: int) -> bool:
    # Over the steps at 2 ranks: taken on rank 0 alone, on none, on rank 1 alone, on rank 0 alone.
    return (step + rank) % 3 == 0


def _train_with_a_branch(adapters_spec: str, rank: int, world_size: int, variant: str, takes_branch) -> None:
    """BranchyModel: a branch taken as `takes_branch(step, rank)` says, and a layer no rank uses. No error, no
    hang, and the single-process result, whose loss is the mean of every rank's shard loss with that rank's
    branch. SGD without weight decay, under which a zero gradient and none move a parameter alike."""
    ddp = _DDP(adapters_spec, variant)
    module = _model(BranchyModel, seed=0)
    single_process = deepcopy(module)
    ddp_model = ddp.wrap(module)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=SGD_LR)
    single_process_optimizer = torch.optim.SGD(single_process.parameters(), lr=SGD_LR)
    shards = [_shard(r, world_size) for r in range(world_size)]
    problems, differing = [], set()  # each parameter's first difference says enough
    for step in range(STEPS):
        x, y = _batch(seed=10 + step)
        takers = [r for r in range(world_size) if takes_branch(step, r)]
        situation = (f"step {step}, where branch.* gets a gradient on {f'ranks {takers}' if takers else 'no rank'} "
                     "and never_used.* on none")
        single_process_optimizer.zero_grad(set_to_none=True)
        losses = [F.mse_loss(single_process(x[s], takes_branch(step, r)), y[s]) for r, s in enumerate(shards)]
        (sum(losses) / world_size).backward()
        single_process_optimizer.step()
        try:
            ddp.before_batch(ddp_model, optimizer)
            optimizer.zero_grad(set_to_none=True)
            out = ddp_model(x[shards[rank]], takes_branch(step, rank))
            ddp.backward(ddp_model, optimizer, F.mse_loss(out, y[shards[rank]]))
            optimizer.step()
        except Exception as error:
            failed = CheckFailed if isinstance(error, CheckFailed) else RuntimeError
            raise failed(f"{variant}: {situation}, rank {rank} raised {type(error).__name__}: {error}") from error
        for (name, p), expected in zip(module.named_parameters(), single_process.parameters()):
            if name not in differing and not FLOAT64.close(p, expected):
                differing.add(name)
                problems.append(f"{situation}: rank {rank}'s {name} differs from single-process training by up to "
                                f"{largest_difference(p, expected):.3g}")
    fail_if(problems, f"{variant}, with parameters that get no gradient")


def _parameters_without_gradients_break_nothing(adapters_spec: str, rank: int, world_size: int, variant: str) -> None:
    """A layer no rank uses, and a branch every rank skips in some steps."""
    _train_with_a_branch(adapters_spec, rank, world_size, variant, _branch_on_every_rank_or_none)


def _a_branch_some_ranks_skip_breaks_nothing(adapters_spec: str, rank: int, world_size: int, variant: str) -> None:
    """A branch some ranks take and others skip in the same step: its parameters get a gradient on some ranks
    only, whose average (the others contributing zeros) is the single-process gradient."""
    _train_with_a_branch(adapters_spec, rank, world_size, variant, _takes_branch_on_some_ranks)


def _matches_single_process(adapters_spec: str, rank: int, world_size: int, variant: str, model: str) -> None:
    """Each rank built from its own seed, trained on its shard of fresh data every step with AdamW (weight
    decay), against one process on the whole batch from rank 0's initial model; compared on every rank after
    every step."""
    ddp = _DDP(adapters_spec, variant)
    single_process = _model(TOY_MODELS[model], seed=0)
    module = _model(TOY_MODELS[model], seed=rank)
    ddp_model = ddp.wrap(module)
    # torch's optimizers only warn of a parameter listed twice, and then update it twice a step.
    names = _names_by_parameter(module)
    problems = [f"ddp_model.parameters() lists {' and '.join(names.get(key, ['a parameter']))} (one tensor) {times} "
                f"times: an optimizer built on it updates that parameter {times} times a step"
                for key, times in Counter(map(id, ddp_model.parameters())).items() if times > 1]
    optimizer = torch.optim.AdamW(ddp_model.parameters(), **ADAMW)
    single_process_optimizer = torch.optim.AdamW(single_process.parameters(), **ADAMW)
    shard = _shard(rank, world_size)
    differing = set()  # each parameter's first difference says enough
    for step in range(STEPS):
        x, y = _batch(seed=100 + step)
        single_process_optimizer.zero_grad(set_to_none=True)
        F.mse_loss(single_process(x), y).backward()
        single_process_optimizer.step()
        ddp.before_batch(ddp_model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        ddp.backward(ddp_model, optimizer, F.mse_loss(ddp_model(x[shard]), y[shard]))
        optimizer.step()
        for (name, p), expected in zip(module.named_parameters(), single_process.parameters()):
            if name not in differing and not FLOAT64.close(p, expected):
                differing.add(name)
                problems.append(f"after step {step}, rank {rank}'s {name} differs from single-process training by up "
                                f"to {largest_difference(p, expected):.3g}")
    fail_if(problems, f"{variant}, {model}, {STEPS} AdamW steps")


def _checks() -> dict[str, Check]:
    """Diagnoses first: where training does not match one process, their messages say why."""
    checks = {}
    for variant_name, variant in VARIANTS.items():
        def add(name: str, function, **arguments) -> None:
            checks[f"{variant_name}: {name}"] = Check(function, variant.needs, {"variant": variant_name, **arguments})

        add("starts from rank 0's parameters", _starts_from_rank_0_s_parameters)
        for model in TOY_MODELS:
            add(f"gradients are averaged ({model})", _gradients_are_averaged, model=model)
        add("communication overlaps backward", _communication_overlaps_backward)
        add("each gradient is reduced once a step", _each_gradient_is_reduced_once)
        if variant.bucketed:
            checks[f"{variant_name}: reductions follow the bucket plan"] = Check(
                _reductions_follow_the_bucket_plan, variant.needs)
        add("parameters without gradients break nothing", _parameters_without_gradients_break_nothing)
        add("a branch some ranks skip breaks nothing", _a_branch_some_ranks_skip_breaks_nothing)
        for model in TOY_MODELS:
            add(f"matches single-process training ({model})", _matches_single_process, model=model)
    return checks


CHECKS = _checks()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    from cs336_systems.pytest_plugin import settings

    if "placement" in metafunc.fixturenames:
        metafunc.parametrize("placement", placements(settings(metafunc.config).on_gpu, WORLD_SIZES))


@pytest.mark.ddp
def test_ddp(subtests, adapters, placement):
    run_on_ranks(subtests, adapters, CHECKS, placement, LAUNCH_TIMEOUT_S)
