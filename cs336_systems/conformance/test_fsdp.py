"""FSDP, through the course's adapters: get_fsdp(module, compute_dtype), fsdp_on_after_backward(model, optimizer)
(called after each backward where the module has it) and fsdp_gather_full_params(model) (every parameter,
unsharded, by name).

What it must do:
  - gradients are averaged over ranks: one SGD step of learning rate 1 moves each parameter, read back whole
    through fsdp_gather_full_params, by exactly the single-process gradient of the whole batch (whatever the
    shards' layout, this reads the gradient the optimizer was given);
  - training matches one process training on the whole batch: fp32 within the course's tolerances (each rank
    adds its rows' contributions to a weight gradient in its own order), and with compute_dtype=bf16 each
    parameter's update within BF16_UPDATE_TOLERANCE of the fp32 one, its master weights staying fp32 and the
    weights all-gathered in bf16 (cast before communicating, as the handout says);
  - at rest (after construction, and after a training step) a rank's parameters hold about 1/world_size of the
    Linear and Embedding weights, and nothing else it keeps alive adds up to more than GATHER_BUFFERS of the
    largest weights: the full weights are gone;
  - the full weights are there for compute only: during the forward pass no more than GATHER_BUFFERS weights'
    worth more is alive than one process's own forward holds (the handout starts a gather at most two layers
    ahead of its use, and frees a gathered weight after use, so it is not saved for backward either).
Memory is every storage a tensor created on the rank still holds (observe.LiveStorages), however the
implementation keeps it: an attribute, a hook, autograd's saved tensors.

At 3 ranks no weight of the course's toy model splits evenly. All checks run in one launch of ranks per world
size (see rank_checks); each is a subtest.
"""

from __future__ import annotations

import math
from copy import deepcopy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cs336_systems.conformance.compare import Tolerance, fail_if, gradient_problem, largest_difference
from cs336_systems.conformance.contract import load_adapters
from cs336_systems.conformance.models import FSDPLayerStack, ToyFSDPModel, sharded_weight_names
from cs336_systems.conformance.observe import CollectiveLog, LiveStorages, storage_bytes
from cs336_systems.conformance.rank_checks import Check, CheckFailed, placements, run_on_ranks
from cs336_systems.distributed.launch import rank_device

WORLD_SIZES = (2, 3)
LAUNCH_TIMEOUT_S = 120  # one check's deadline; see test_ddp
# fsdp_on_after_backward is called where the module has it.
NEEDS = ("get_fsdp", "fsdp_gather_full_params")
BATCH, SEQ_LEN = 12, 8  # every world size tested divides the batch
STEPS = 3
SGD_LR = 0.1
# The course's published tolerances for fp32: splitting the batch over ranks changes the order in which each
# token's contribution is added into a weight gradient, a few units in the last place.
FP32 = Tolerance(rtol=1e-4, atol=1e-6)
# A gradient read back from one SGD step of learning rate 1: the parameter's own rounding (fp32, weights of order
# one) is in it as well.
STEP_GRADIENT = Tolerance(rtol=1e-3, atol=1e-6)
# bf16 keeps 8 significant bits. One process computing with its Linear and Embedding weights in bf16 moves the
# toy model's embedding and first layer up to 12% away from its fp32 updates over STEPS steps (measured, seeds
# 0-2; the later layers 0.5%); 25% leaves room for casting in other places, while a gradient off by a factor
# (summed over 2 ranks) is 100% off.
BF16_UPDATE_TOLERANCE = 0.25
# The handout gathers a layer's weight at most two layers ahead of its use: the weight in use and two more.
# A rank may keep this many buffers of the largest weight's size for gathering (the handout's accounting sets
# preallocated gather buffers aside), at rest or during forward.
GATHER_BUFFERS = 3
# The model weighed: an embedding, 8 square layers and a head, 32 x 32 each: GATHER_BUFFERS of its 10 weights are
# 30% of them, and a forward over a few tokens holds activations small beside one weight.
MEMORY_WIDTH, MEMORY_LAYERS = 32, 8
MEMORY_TOKENS = (2, 4)


def _adapters(adapters_spec: str):
    """get_fsdp, the after-backward hook (doing nothing where the module lacks it), fsdp_gather_full_params."""
    adapters = load_adapters(adapters_spec)
    after_backward = (adapters.function("fsdp_on_after_backward") if not adapters.missing("fsdp_on_after_backward")
                      else lambda model, optimizer: None)
    return adapters.function("get_fsdp"), after_backward, adapters.function("fsdp_gather_full_params")


def _toy(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return ToyFSDPModel().to(rank_device())


def _tokens(seed: int, vocab_size: int = ToyFSDPModel.VOCAB_SIZE, shape=(BATCH, SEQ_LEN)):
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randint(vocab_size, shape, generator=generator)
    targets = torch.randint(vocab_size, shape, generator=generator)
    return inputs.to(rank_device()), targets.to(rank_device())


def _rows(rank: int, world_size: int) -> slice:
    rows = BATCH // world_size
    return slice(rank * rows, (rank + 1) * rows)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _full_params(gather, model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in gather(model).items()}


def _missing_names(full: dict[str, torch.Tensor], reference: nn.Module) -> str | None:
    missing = [name for name, _ in reference.named_parameters() if name not in full]
    return f"fsdp_gather_full_params lacks {missing} (it gave {sorted(full)})" if missing else None


# ------------------------------------------------------------------------------------------ checks

def _gradients_are_averaged(adapters_spec: str, rank: int, world_size: int) -> None:
    """One backward on this rank's rows and one SGD step of learning rate 1: each parameter, gathered whole,
    moved by the single-process gradient of the whole batch."""
    get_fsdp, after_backward, gather = _adapters(adapters_spec)
    module = _toy()
    single_process, own = deepcopy(module), deepcopy(module)
    inputs, targets = _tokens(seed=1)
    rows = _rows(rank, world_size)
    _loss(single_process(inputs), targets).backward()
    _loss(own(inputs[rows]), targets[rows]).backward()
    model = get_fsdp(module)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = _full_params(gather, model)
    _loss(model(inputs[rows]), targets[rows]).backward()
    after_backward(model, optimizer)
    optimizer.step()
    after = _full_params(gather, model)
    fail_if([_missing_names(after, single_process)])
    fail_if([gradient_problem(f"rank {rank}'s {name} gradient (read back from one SGD step)",
                              before[name] - after[name], p.grad, world_size=world_size, tolerance=STEP_GRADIENT,
                              own=own_p.grad)
             for (name, p), own_p in zip(single_process.named_parameters(), own.parameters())],
            "after one backward on each rank's rows and the after-backward hook")


def _train(adapters_spec: str, rank: int, world_size: int, compute_dtype: torch.dtype | None):
    """STEPS SGD steps, each rank on its rows of fresh tokens: the parameters gathered after each step, the
    single-process model's after each (fp32), the FSDP model, and the dtypes its all-gathers sent in training."""
    get_fsdp, after_backward, gather = _adapters(adapters_spec)
    single_process = _toy()
    model = get_fsdp(deepcopy(single_process), compute_dtype=compute_dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    single_process_optimizer = torch.optim.SGD(single_process.parameters(), lr=SGD_LR)
    rows = _rows(rank, world_size)
    snapshots, gathered_dtypes = [], set()
    for step in range(STEPS):
        inputs, targets = _tokens(seed=100 + step)
        single_process_optimizer.zero_grad(set_to_none=True)
        _loss(single_process(inputs), targets).backward()
        single_process_optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with CollectiveLog() as log:
            _loss(model(inputs[rows]), targets[rows]).backward()
        gathered_dtypes |= {str(c.dtype).removeprefix("torch.") for c in log.issued
                            if c.kind == "all_gather" and c.dtype.is_floating_point}
        after_backward(model, optimizer)
        optimizer.step()
        snapshots.append((_full_params(gather, model),
                          {name: p.detach().clone() for name, p in single_process.named_parameters()}))
    return snapshots, model, gathered_dtypes


def _matches_single_process_fp32(adapters_spec: str, rank: int, world_size: int) -> None:
    """Every parameter after every step within FP32 of single-process training; where the first steps matched,
    the failure says so: what one step hands the next (a weight gathered ahead, a gradient) is then stale."""
    snapshots, _, _ = _train(adapters_spec, rank, world_size, compute_dtype=None)
    problems, differing, first_differing_step = [_missing_names(snapshots[0][0], _toy())], set(), None
    for step, (full, expected) in enumerate(snapshots):
        for name, value in expected.items():
            if name in full and name not in differing and not FP32.close(full[name], value):
                differing.add(name)
                first_differing_step = step if first_differing_step is None else first_differing_step
                problems.append(f"after step {step}, rank {rank}'s {name} differs from single-process training by up "
                                f"to {largest_difference(full[name], value):.3g} (tolerance {FP32})")
    if first_differing_step:
        matched = "step 0" if first_differing_step == 1 else f"steps 0 to {first_differing_step - 1}"
        problems.insert(0, f"every parameter matched after {matched}: something carried from one step into the next "
                           "is stale (a weight gathered before the optimizer step updated its shard, a gradient or "
                           "buffer kept from the step before)")
    fail_if(problems, f"fp32, {STEPS} SGD steps, each rank on its rows")


def _matches_single_process_bf16(adapters_spec: str, rank: int, world_size: int) -> None:
    """compute_dtype=bf16: each parameter's update after STEPS steps within BF16_UPDATE_TOLERANCE of the fp32
    single-process update, the parameters the optimizer updates (the master weights) fp32, and the weights
    all-gathered in bf16 (the handout casts them before communicating)."""
    initial = {name: p.detach().clone() for name, p in _toy().named_parameters()}
    snapshots, model, gathered_dtypes = _train(adapters_spec, rank, world_size, compute_dtype=torch.bfloat16)
    full, expected = snapshots[-1]
    problems = [_missing_names(full, _toy())]
    if gathered_dtypes - {"bfloat16"}:
        problems.append(f"with compute_dtype=bf16, rank {rank} all-gathered weights as {sorted(gathered_dtypes)}: "
                        "the handout casts them to the compute dtype before communicating")
    problems += [f"rank {rank}'s parameter {name} (what the optimizer updates) is {p.dtype}: master weights must stay "
                 "float32" for name, p in model.named_parameters() if p.dtype != torch.float32]
    for name, value in expected.items():
        if name not in full:
            continue
        if full[name].dtype != torch.float32:
            problems.append(f"fsdp_gather_full_params gave {name} as {full[name].dtype}: master weights must stay "
                            "float32")
        update, expected_update = full[name].float() - initial[name], value - initial[name]
        size = expected_update.norm().item()
        off = (update - expected_update).norm().item() / size
        if not off <= BF16_UPDATE_TOLERANCE:
            problems.append(f"rank {rank}'s {name} moved {off:.1%} away from the fp32 single-process update "
                            f"(tolerance {BF16_UPDATE_TOLERANCE:.0%}; {update.norm().item() / size:.2f}x its size)")
    fail_if(problems, f"compute_dtype=bf16, {STEPS} SGD steps, each rank on its rows")


def _weight_bytes(module: nn.Module, world_size: int) -> tuple[int, int, int, int]:
    """(all Linear and Embedding weights' bytes, the most a rank's shards of them may hold, the largest one's
    bytes, the other parameters' bytes) of an unwrapped module."""
    sharded = sharded_weight_names(module)
    weights = [p for name, p in module.named_parameters() if name in sharded]
    # A split by rows or columns cannot be exact: a rank's shard of each weight may exceed 1/world_size by up to
    # one row or column.
    allowed = sum((p.numel() / world_size + max(p.shape)) * p.element_size() for p in weights)
    replicated = sum(p.numel() * p.element_size() for name, p in module.named_parameters() if name not in sharded)
    return (sum(p.numel() * p.element_size() for p in weights), math.ceil(allowed),
            max(p.numel() * p.element_size() for p in weights), replicated)


def _at_rest_problems(rank: int, world_size: int, when: str, model: nn.Module, storages: LiveStorages,
                      weights: tuple) -> list[str]:
    full_bytes, allowed_shard_bytes, largest, replicated = weights
    params = list(model.parameters())
    held = storage_bytes(params) - replicated
    own = sum(p.numel() * p.element_size() for p in params) - replicated
    problems = []
    if held > allowed_shard_bytes:
        if own <= allowed_shard_bytes:
            problems.append(f"{when}, rank {rank}'s parameters are shards of {own / full_bytes:.0%} of the Linear and "
                            f"Embedding weights' bytes, but views of storages holding {held / full_bytes:.0%} "
                            f"({held:,} of {full_bytes:,} bytes): the full weights are kept alive at rest")
        else:
            problems.append(f"{when}, rank {rank}'s parameters hold {held / full_bytes:.0%} of the Linear and "
                            f"Embedding weights' bytes ({held:,} of {full_bytes:,}), expected about "
                            f"{1 / world_size:.0%} (at most {allowed_shard_bytes / full_bytes:.0%}): the weights "
                            "are not sharded")
    besides = storages.live_bytes(excluding=params)
    if besides > GATHER_BUFFERS * largest:
        problems.append(f"{when}, rank {rank} keeps {besides:,} bytes alive besides its parameters, "
                        f"{besides / full_bytes:.0%} of the full Linear and Embedding weights (at most "
                        f"{GATHER_BUFFERS} gather buffers the size of the largest weight, "
                        f"{GATHER_BUFFERS * largest / full_bytes:.0%}, expected): the full weights are kept at rest, "
                        "not freed after use")
    return problems


def _weights_are_sharded_at_rest(adapters_spec: str, rank: int, world_size: int) -> None:
    """Built, and again after a training step (gradients set to None, inputs dropped): the parameters are this
    rank's shards, and nothing else holds the full weights."""
    get_fsdp, after_backward, _ = _adapters(adapters_spec)
    torch.manual_seed(0)
    weights = _weight_bytes(FSDPLayerStack(MEMORY_WIDTH, MEMORY_LAYERS), world_size)
    with LiveStorages() as storages:
        torch.manual_seed(0)
        model = get_fsdp(FSDPLayerStack(MEMORY_WIDTH, MEMORY_LAYERS).to(rank_device()))
        problems = _at_rest_problems(rank, world_size, "once built", model, storages, weights)
        optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)
        inputs, targets = _tokens(seed=rank, vocab_size=MEMORY_WIDTH, shape=MEMORY_TOKENS)
        _loss(model(inputs), targets).backward()
        after_backward(model, optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del inputs, targets
        problems += _at_rest_problems(rank, world_size, "after a training step", model, storages, weights)
    fail_if(problems, f"an embedding and {MEMORY_LAYERS + 1} Linear layers, {MEMORY_WIDTH} x {MEMORY_WIDTH} each")


def _forward_excess_bytes(model: nn.Module, inputs: torch.Tensor, storages: LiveStorages,
                          after_backward=None) -> int:
    """The most bytes alive during forward beyond those alive before it, the output included. The step is then
    finished (backward, and `after_backward(model, None)` where given) outside the measurement: an implementation
    may start collectives at forward's end for the backward it expects (gathers of backward's first weights), and
    a model dropped with those in flight leaves them to run beside the next check's collectives, which gloo
    cannot pair ("Received data size doesn't match")."""
    storages.watch_peak()
    before = storages.peak_bytes
    output = model(inputs)
    peak = storages.stop_peak()
    output.float().square().mean().backward()
    if after_backward is not None:
        after_backward(model, None)
    del output
    return peak - before


def _forward_gathers_few_weights_at_once(adapters_spec: str, rank: int, world_size: int) -> None:
    """During the forward pass (with gradients on) no more than GATHER_BUFFERS of the largest weight's bytes are
    alive beyond what one process's own forward over the same tokens holds (its activations, the output)."""
    get_fsdp, after_backward, _ = _adapters(adapters_spec)
    inputs, _ = _tokens(seed=rank, vocab_size=MEMORY_WIDTH, shape=MEMORY_TOKENS)
    torch.manual_seed(0)
    full_bytes, _, largest, _ = _weight_bytes(FSDPLayerStack(MEMORY_WIDTH, MEMORY_LAYERS), world_size)
    with LiveStorages() as storages:
        torch.manual_seed(0)
        single_process = FSDPLayerStack(MEMORY_WIDTH, MEMORY_LAYERS).to(rank_device())
        single_process_excess = _forward_excess_bytes(single_process, inputs, storages)
    del single_process
    with LiveStorages() as storages:
        torch.manual_seed(0)
        model = get_fsdp(FSDPLayerStack(MEMORY_WIDTH, MEMORY_LAYERS).to(rank_device()))
        excess = _forward_excess_bytes(model, inputs, storages, after_backward)
    extra = excess - single_process_excess
    if extra > GATHER_BUFFERS * largest:
        raise CheckFailed(
            f"during forward, rank {rank} held up to {extra:,} bytes beyond one process's forward over the same "
            f"tokens: {extra / largest:.1f} full weights of the {MEMORY_LAYERS + 2} ({extra / full_bytes:.0%} of "
            f"them), where the handout's gathers run at most two layers ahead ({GATHER_BUFFERS} weights): gathered "
            "weights are kept after use (saved for backward, or never freed)")


CHECKS = {
    "gradients are averaged": Check(_gradients_are_averaged, NEEDS),
    "weights are sharded at rest": Check(_weights_are_sharded_at_rest, NEEDS),
    "forward gathers a few weights at a time": Check(_forward_gathers_few_weights_at_once, NEEDS),
    "matches single-process training (fp32)": Check(_matches_single_process_fp32, NEEDS),
    "matches single-process training (compute_dtype=bf16)": Check(_matches_single_process_bf16, NEEDS),
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    from cs336_systems.pytest_plugin import settings

    if "placement" in metafunc.fixturenames:
        metafunc.parametrize("placement", placements(settings(metafunc.config).on_gpu, WORLD_SIZES))


@pytest.mark.fsdp
def test_fsdp(subtests, adapters, placement):
    run_on_ranks(subtests, adapters, CHECKS, placement, LAUNCH_TIMEOUT_S)
