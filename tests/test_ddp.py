"""The DDP wrappers against single-process training (gloo on CPU, ranks started by launch); the
profiler timelines and the DDP reports, from synthetic traces and rows.

Starting ranks costs seconds of imports, so one launch per world size runs every check and each
check's outcome is then asserted by its own test. Once a check fails on any rank, the checks after
it do not run (tests.common.run_checks), and their tests are skipped, naming it.
"""

from __future__ import annotations

import functools
import gc
import weakref
from copy import deepcopy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.distributed.equivalence import ddp_equivalence, equivalence_failures
from cs336_systems.distributed.ddp import (
    BucketedDDP,
    FlatDDP,
    NaiveDDP,
    OverlapIndividualDDP,
    batch_shard,
    write_back_gradient,
)
from cs336_systems.distributed.launch import launch
from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer
from cs336_systems.profiling.timeline import (
    MIN_BAR_WIDTH_SHARE,
    Interval,
    communication_summary,
    intervals_from_events,
    plot_timeline,
)
from cs336_systems.reports.ddp import answer_ddp_overlap_bucketed
from cs336_systems.reports.problems import report
from cs336_systems.rows import OOM
from cs336_systems.rows.ddp import variant_label
from tests import adapters
from tests.common import (
    CheckOutcome,
    ToyModel,
    ToyModelWithTiedWeights,
    assert_passed_on_every_rank,
    assert_step_after_forward_alone_is_allowed,
    assert_step_before_finish_raises,
    assert_step_of_another_model_is_unaffected,
    course_ddp_check,
    run_checks,
)

WORLD_SIZES = (2, 3)
# Generous for one check (each reports progress to the launch), since ranks import torch on a busy
# machine; a hang still ends here, not in CI's timeout.
LAUNCH_TIMEOUT_S = 180
STEPS = 5
# Small enough that the toy models (float64) split into several buckets, some holding two parameters.
SMALL_BUCKET_MB = 0.004
EXAMPLES = 24  # divisible by every world size tested
TOY_MODELS = {"ToyModel": ToyModel, "ToyModelWithTiedWeights": ToyModelWithTiedWeights}
WRAPPERS = {
    "naive": NaiveDDP,
    "flat": FlatDDP,
    "overlap_individual": OverlapIndividualDDP,
    "bucketed": functools.partial(BucketedDDP, bucket_size_mb=SMALL_BUCKET_MB),
}
OVERLAPPED = ("overlap_individual", "bucketed")


# ------------------------------------------------------------------------------------------ checks

def _random_batch(examples: int, features_in: int, features_out: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(examples, features_in, generator=generator, dtype=torch.float64),
            torch.randn(examples, features_out, generator=generator, dtype=torch.float64))


def _assert_same_parameters(reference: nn.Module, ddp_model: nn.Module, when: str) -> None:
    for (name, p_ref), p_ddp in zip(reference.named_parameters(), ddp_model.module.parameters()):
        torch.testing.assert_close(p_ddp, p_ref, msg=lambda m: f"{when}, {name}: {m}")


def _matches_single_process(rank: int, world_size: int, wrapper: str, model_class, set_to_none: bool = True) -> None:
    """float64, AdamW with weight decay, fresh random data each step; compared on every rank.
    With set_to_none=False gradients are zeroed in place, and backward accumulates into the same
    tensors step after step."""
    torch.manual_seed(rank)
    ddp_model = WRAPPERS[wrapper](model_class().double())
    reference = deepcopy(ddp_model.module)  # rank 0's weights, as broadcast
    ddp_optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=1e-2, weight_decay=0.1)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    shard = batch_shard(EXAMPLES, rank, world_size)
    for step in range(STEPS):
        x, y = _random_batch(EXAMPLES, 10, 5, seed=step)
        reference_optimizer.zero_grad(set_to_none=set_to_none)
        nn.functional.mse_loss(reference(x), y).backward()
        reference_optimizer.step()
        ddp_optimizer.zero_grad(set_to_none=set_to_none)
        nn.functional.mse_loss(ddp_model(x[shard]), y[shard]).backward()
        ddp_model.finish_gradient_synchronization()
        ddp_optimizer.step()
    _assert_same_parameters(reference, ddp_model, f"{wrapper} after {STEPS} steps")


def _lm_matches_single_process(rank: int, world_size: int) -> None:
    """The DDP benchmark's own comparison: every wrapper training the tiny LM in float64, each rank on
    its shard, against one process on the whole batch. On 3 ranks the scale 1/3 of each rank's mean
    loss does not commute with rounding, so any fp32 rounding inside the float64 model would show."""
    failures = equivalence_failures(ddp_equivalence(rank, world_size))
    assert not failures, "\n".join(failures)


class BranchyModel(nn.Module):
    """A branch that forward may skip, and a layer it never uses: both get no gradient then."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.branch = nn.Linear(8, 8)
        self.never_used = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, take_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        if take_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


def _takes_branch(step: int, rank: int) -> bool:
    # Over the steps: taken on some ranks only, and (world size 2, step 1) on none.
    return (step + rank) % 3 == 0


def _unused_parameters(rank: int, world_size: int, wrapper: str) -> None:
    """Parameters without a gradient on some or all ranks: no hang, and single-process results.

    A parameter unused everywhere keeps grad None (AdamW skips it, as it does single-process);
    one used on some ranks gets the average with zeros from the others, which is the gradient of
    the mean loss over all shards.
    """
    torch.manual_seed(rank)
    ddp_model = WRAPPERS[wrapper](BranchyModel().double())
    reference = deepcopy(ddp_model.module)
    ddp_optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=1e-2, weight_decay=0.1)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    shards = [batch_shard(EXAMPLES, r, world_size) for r in range(world_size)]
    problems = []
    for step in range(STEPS):
        x, y = _random_batch(EXAMPLES, 8, 3, seed=step)
        reference_optimizer.zero_grad()
        losses = [nn.functional.mse_loss(reference(x[s], _takes_branch(step, r)), y[s]) for r, s in enumerate(shards)]
        (sum(losses) / world_size).backward()
        reference_optimizer.step()
        ddp_optimizer.zero_grad()
        nn.functional.mse_loss(ddp_model(x[shards[rank]], _takes_branch(step, rank)), y[shards[rank]]).backward()
        ddp_model.finish_gradient_synchronization()
        for (name, p_ref), p_ddp in zip(reference.named_parameters(), ddp_model.module.parameters()):
            if (p_ref.grad is None) != (p_ddp.grad is None):
                problems.append(f"step {step}: {name}.grad is None is {p_ddp.grad is None}, single-process "
                                f"{p_ref.grad is None}")
        ddp_optimizer.step()
    assert not problems, "\n".join(problems)
    _assert_same_parameters(reference, ddp_model, f"{wrapper} after {STEPS} steps with unused parameters")


def _second_backward_raises(rank: int, world_size: int, wrapper: str) -> None:
    """Two backwards without finish_gradient_synchronization() between them are an error, not a hang."""
    ddp_model = WRAPPERS[wrapper](ToyModel().double())
    x, _ = _random_batch(4, 10, 5, seed=rank)
    ddp_model(x).sum().backward()
    try:
        ddp_model.on_train_batch_start()
    except RuntimeError as error:
        assert "finish_gradient_synchronization" in str(error)
    else:
        raise AssertionError("on_train_batch_start() accepted an unfinished step")
    try:
        ddp_model(x).sum().backward()
    except RuntimeError as error:
        assert "finish_gradient_synchronization" in str(error)
    else:
        raise AssertionError("a second backward before finish_gradient_synchronization() was accepted")
    ddp_model.finish_gradient_synchronization()
    ddp_model.on_train_batch_start()  # a finished step leaves nothing behind


def _dropped_wrapper_frees_the_model(rank: int, world_size: int, wrapper: str) -> None:
    """Once the wrapper and the model are dropped, their parameters and gradients are freed: a
    benchmark that builds one wrapper after another must not keep every earlier model alive."""
    ddp_model = WRAPPERS[wrapper](ToyModel().double())
    x, _ = _random_batch(4, 10, 5, seed=rank)
    ddp_model(x).sum().backward()
    ddp_model.finish_gradient_synchronization()
    parameter = weakref.ref(next(ddp_model.module.parameters()))
    del ddp_model
    gc.collect()
    assert parameter() is None, f"{wrapper}: a parameter outlived its dropped wrapper and model"


def _gradient_accumulation(rank: int, world_size: int, wrapper: str) -> None:
    """Two backwards, then one finish_gradient_synchronization() and the step: the accumulated
    gradients are averaged, as one process's over both micro-batches."""
    torch.manual_seed(rank)
    ddp_model = WRAPPERS[wrapper](ToyModel().double())
    reference = deepcopy(ddp_model.module)
    ddp_optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    shard = batch_shard(EXAMPLES, rank, world_size)
    for micro_batch in range(2):
        x, y = _random_batch(EXAMPLES, 10, 5, seed=micro_batch)
        nn.functional.mse_loss(reference(x), y).backward()
        nn.functional.mse_loss(ddp_model(x[shard]), y[shard]).backward()
    ddp_model.finish_gradient_synchronization()
    ddp_optimizer.step()
    reference_optimizer.step()
    _assert_same_parameters(reference, ddp_model, f"{wrapper} after two accumulated micro-batches")


def _toy_wrapper_and_loss(rank: int, wrapper: str):
    ddp_model = WRAPPERS[wrapper](ToyModel().double())
    x, _ = _random_batch(4, 10, 5, seed=rank)
    return ddp_model, lambda: ddp_model(x).sum()


def _step_before_finish_raises(rank: int, world_size: int, wrapper: str) -> None:
    ddp_model, loss = _toy_wrapper_and_loss(rank, wrapper)
    assert_step_before_finish_raises(ddp_model, torch.optim.SGD(ddp_model.parameters(), lr=0.1), loss)


def _sharded_optimizer_step_before_finish_raises(rank: int, world_size: int) -> None:
    """The guard holds for an Optimizer subclass whose step communicates: every rank refuses the step
    before any broadcast starts, so none is left waiting in one."""
    ddp_model, loss = _toy_wrapper_and_loss(rank, "bucketed")
    optimizer = ShardedOptimizer(ddp_model.parameters(), torch.optim.SGD, lr=0.1)
    assert_step_before_finish_raises(ddp_model, optimizer, loss)


def _step_of_another_model_is_unaffected(rank: int, world_size: int, wrapper: str) -> None:
    assert_step_of_another_model_is_unaffected(*_toy_wrapper_and_loss(rank, wrapper))


def _step_after_forward_alone_is_allowed(rank: int, world_size: int, wrapper: str) -> None:
    ddp_model, loss = _toy_wrapper_and_loss(rank, wrapper)
    assert_step_after_forward_alone_is_allowed(ddp_model, torch.optim.SGD(ddp_model.parameters(), lr=0.1), loss)


def _step_guard_keeps_no_dropped_wrapper_alive(rank: int, world_size: int, wrapper: str) -> None:
    """The step guard's registry holds wrappers weakly: a wrapper dropped while it waits for
    finish_gradient_synchronization() is freed, its parameters with it."""
    ddp_model, loss = _toy_wrapper_and_loss(rank, wrapper)
    loss().backward()
    dropped, parameter = weakref.ref(ddp_model), weakref.ref(next(ddp_model.module.parameters()))
    del ddp_model, loss
    gc.collect()
    assert dropped() is None and parameter() is None, f"{wrapper}: an unfinished wrapper outlived being dropped"


class _Widened(ToyModel):
    """ToyModel with a parameter or a buffer that some ranks lack, or have in another shape or dtype."""

    def __init__(self, extra: str | None):
        super().__init__()
        if extra == "parameter":
            self.extra = nn.Parameter(torch.zeros(3))
        elif extra == "buffer":
            self.register_buffer("running", torch.zeros(3))
        elif extra == "buffer_shape":
            self.register_buffer("running", torch.zeros(4))
        elif extra == "buffer_dtype":
            self.register_buffer("running", torch.zeros(3, dtype=torch.float64))


def _models_that_differ_between_ranks_raise(rank: int, world_size: int, wrapper: str) -> None:
    """A model that differs on one rank is refused on every rank, naming the first difference,
    where the broadcasts that follow would hang or abort in the backend."""
    last = rank == world_size - 1
    for mine, theirs, named in ((None, "parameter", "extra"), ("buffer", "buffer_shape", "running"),
                                ("buffer", "buffer_dtype", "running"), ("buffer", None, "running")):
        with pytest.raises(ValueError, match=rf"differs between ranks.*'{named}'"):
            WRAPPERS[wrapper](_Widened(theirs if last else mine))
    with pytest.raises(ValueError, match="differs between ranks.*'no_grad_fixed_param'.*float64"):
        WRAPPERS[wrapper](_Widened(None).double() if last else _Widened(None))
    WRAPPERS[wrapper](_Widened("buffer"))  # the same on every rank again: accepted


def _buffers_are_rank_0_s(rank: int, world_size: int, wrapper: str) -> None:
    torch.manual_seed(rank)
    model = _Widened("buffer")
    model.running.normal_()
    ddp_model = WRAPPERS[wrapper](model)
    everyone: list[torch.Tensor | None] = [None] * world_size
    dist.all_gather_object(everyone, ddp_model.module.running)
    assert all(torch.equal(other, everyone[0]) for other in everyone), everyone


def _sparse_gradients_are_refused_by_the_flat_wrappers(rank: int, world_size: int, wrapper: str) -> None:
    """Flat and bucketed pack gradients into dense buffers: a sparse gradient is a clear error."""
    ddp_model = WRAPPERS[wrapper](nn.Embedding(10, 3, sparse=True))
    with pytest.raises(TypeError, match="sparse.*weight|weight.*sparse"):
        ddp_model(torch.tensor([[1, 2, 2]])).sum().backward()
        ddp_model.finish_gradient_synchronization()


CHECKS = {
    **{f"course_individual_parameters_{name}": functools.partial(
        course_ddp_check, model_class=cls, make_ddp=adapters.get_ddp_individual_parameters,
        after_backward=adapters.ddp_individual_parameters_on_after_backward) for name, cls in TOY_MODELS.items()},
    **{f"course_get_ddp_{name}": functools.partial(
        course_ddp_check, model_class=cls, make_ddp=adapters.get_ddp,
        after_backward=adapters.ddp_on_after_backward) for name, cls in TOY_MODELS.items()},
    **{f"{wrapper}_matches_single_process_{name}": functools.partial(
        _matches_single_process, wrapper=wrapper, model_class=cls)
       for wrapper in WRAPPERS for name, cls in TOY_MODELS.items()},
    **{f"{wrapper}_matches_single_process_zeroing_in_place": functools.partial(
        _matches_single_process, wrapper=wrapper, model_class=ToyModel, set_to_none=False) for wrapper in WRAPPERS},
    "lm_in_float64_matches_single_process": _lm_matches_single_process,
    **{f"{wrapper}_unused_parameters_match_single_process": functools.partial(_unused_parameters, wrapper=wrapper)
       for wrapper in WRAPPERS},
    **{f"{wrapper}_second_backward_without_finish_raises": functools.partial(_second_backward_raises, wrapper=wrapper)
       for wrapper in OVERLAPPED},
    **{f"{wrapper}_dropped_wrapper_frees_the_model": functools.partial(_dropped_wrapper_frees_the_model,
                                                                     wrapper=wrapper) for wrapper in WRAPPERS},
    **{f"{wrapper}_two_backwards_then_finish_accumulate": functools.partial(_gradient_accumulation, wrapper=wrapper)
       for wrapper in WRAPPERS if wrapper not in OVERLAPPED},
    **{f"{wrapper}_step_before_finish_raises_and_changes_nothing": functools.partial(
        _step_before_finish_raises, wrapper=wrapper) for wrapper in WRAPPERS},
    "sharded_optimizer_step_before_finish_raises_on_every_rank": _sharded_optimizer_step_before_finish_raises,
    **{f"{wrapper}_step_of_another_model_is_unaffected_while_unfinished": functools.partial(
        _step_of_another_model_is_unaffected, wrapper=wrapper) for wrapper in WRAPPERS},
    **{f"{wrapper}_step_after_forward_alone_is_allowed": functools.partial(
        _step_after_forward_alone_is_allowed, wrapper=wrapper) for wrapper in WRAPPERS},
    **{f"{wrapper}_step_guard_keeps_no_dropped_wrapper_alive": functools.partial(
        _step_guard_keeps_no_dropped_wrapper_alive, wrapper=wrapper) for wrapper in WRAPPERS},
    **{f"{wrapper}_models_that_differ_between_ranks_raise": functools.partial(
        _models_that_differ_between_ranks_raise, wrapper=wrapper) for wrapper in WRAPPERS},
    **{f"{wrapper}_buffers_are_rank_0_s": functools.partial(_buffers_are_rank_0_s, wrapper=wrapper)
       for wrapper in WRAPPERS},
    **{f"{wrapper}_sparse_gradients_are_refused": functools.partial(
        _sparse_gradients_are_refused_by_the_flat_wrappers, wrapper=wrapper) for wrapper in ("flat", "bucketed")},
}


# ------------------------------------------------------------------------------------------- tests

@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"{n}ranks")
def outcomes(request) -> list[dict[str, CheckOutcome]]:
    return launch(run_checks, request.param, CHECKS, device="cpu", timeout_s=LAUNCH_TIMEOUT_S)


@pytest.mark.parametrize("check", CHECKS)
def test_ddp(check, outcomes):
    assert_passed_on_every_rank(check, outcomes)


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_building_before_init_process_group_raises(wrapper):
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="process group"):
        WRAPPERS[wrapper](ToyModel())


def test_wrapping_something_that_is_not_a_module_raises():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        NaiveDDP(lambda x: x)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_batch_shards_are_equal_in_rank_order_and_cover_the_batch(world_size):
    batch = torch.arange(12)
    shards = [batch[batch_shard(len(batch), rank, world_size)] for rank in range(world_size)]
    assert {len(shard) for shard in shards} == {12 // world_size}
    assert torch.equal(torch.cat(shards), batch)


def test_a_batch_that_does_not_split_evenly_over_the_ranks_is_refused():
    with pytest.raises(ValueError, match="a batch of 4 does not split evenly over 3 ranks"):
        batch_shard(4, 0, 3)
    with pytest.raises(ValueError, match="rank 3 is not one of the 3 ranks"):
        batch_shard(6, 3, 3)


@pytest.mark.parametrize("summed_over", [1, 4])
def test_a_reduced_gradient_is_written_back_as_the_average_into_the_grad_this_rank_had(summed_over):
    param = nn.Parameter(torch.zeros(2, 3))
    param.grad = grad = torch.ones(2, 3)
    reduced = torch.full((2, 3), 8.0)
    write_back_gradient(param, reduced, summed_over, had_gradient=True, used_anywhere=True)
    assert param.grad is grad and torch.equal(grad, torch.full((2, 3), 8.0 / summed_over))
    # Reduced in place, .grad itself holds the sum.
    write_back_gradient(param, grad, 2, had_gradient=True, used_anywhere=True)
    assert param.grad is grad and torch.equal(grad, torch.full((2, 3), 4.0 / summed_over))


@pytest.mark.parametrize("copy", [False, True])
def test_a_gradient_only_other_ranks_had_becomes_a_new_grad_shared_only_without_copy(copy):
    param = nn.Parameter(torch.zeros(4))
    buffer = torch.full((6,), 6.0)  # the parameter's slot and two more elements
    write_back_gradient(param, buffer[:4], 3, had_gradient=False, used_anywhere=True, copy=copy)
    assert torch.equal(param.grad, torch.full((4,), 2.0))
    assert (param.grad.data_ptr() == buffer.data_ptr()) is not copy
    assert torch.equal(buffer[4:], torch.full((2,), 6.0))  # the rest of the buffer is left alone


def test_a_parameter_no_rank_had_a_gradient_for_keeps_none():
    param = nn.Parameter(torch.zeros(4))
    write_back_gradient(param, torch.zeros(4), 2, had_gradient=False, used_anywhere=False)
    assert param.grad is None


def test_equivalence_failures_give_each_failing_variant_s_difference_and_tolerance():
    rows = [{"variant": "naive", "max_abs_difference": 3e-15, "tolerance": 1e-9, "matches": True},
            {"variant": "flat", "max_abs_difference": 1.05e-6, "tolerance": 1e-9, "matches": False}]
    assert equivalence_failures(rows) == ["flat: max abs difference 1.05e-06 > tolerance 1e-09"]


# ------------------------------------------------------------------ profiler timelines and reports

def _span(cat: str, name: str, start_us: float, duration_us: float, **extra) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": start_us, "dur": duration_us, **extra}


def _launched(correlation: int, launch_us: float, kernel: str, start_us: float, duration_us: float,
              stream: int, thread: int = 1) -> list[dict]:
    """A kernel and the host-side runtime call that launched it, as torch.profiler exports them."""
    return [_span("cuda_runtime", "cudaLaunchKernel", launch_us, 2, tid=thread, args={"correlation": correlation}),
            _span("kernel", kernel, start_us, duration_us, args={"stream": stream, "correlation": correlation})]


def test_gpu_timeline_puts_nccl_kernels_apart_and_measures_overlap():
    events = [
        _span("user_annotation", "backward", 900, 400, tid=1),
        _span("user_annotation", "bucket", 950, 20, tid=2),  # nested, launched from another thread
        _span("user_annotation", "unused", 980, 5, tid=2),  # launched nothing
        *_launched(1, 910, "sm90_xmma_gemm", 1000, 100, stream=7),
        *_launched(2, 960, "elementwise_kernel", 1100, 50, stream=7, thread=2),
        *_launched(3, 965, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 1120, 60, stream=20, thread=2),
        # A blocking collective on the compute stream: communication, on that stream's own NCCL row.
        *_launched(4, 1200, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 1190, 10, stream=7),
        _span("gpu_user_annotation", "backward", 1000, 150),  # the profiler's own: not used
        _span("cpu_op", "aten::mm", 905, 5, tid=1),  # host side: not drawn when there are kernels
    ]
    intervals = intervals_from_events(events, phase_names={"backward", "bucket", "unused"})
    assert {(i.kind, i.row) for i in intervals} == {
        ("compute", "compute (stream 7)"), ("communication", "NCCL (stream 20)"),
        ("communication", "NCCL (stream 7)"), ("phase", "phases")}
    # Device spans, from the first kernel at 1000 us: each range covers the work it launched.
    phases = {i.name: (i.start_ms, i.end_ms) for i in intervals if i.kind == "phase"}
    assert phases.keys() == {"backward", "bucket"}
    assert phases["backward"] == pytest.approx((0.0, 0.2))
    assert phases["bucket"] == pytest.approx((0.1, 0.18))
    summary = communication_summary(intervals)
    # NCCL runs 1120-1180 and 1190-1200 us; compute 1000-1150 us: 30 us together, 40 us alone.
    assert summary == pytest.approx({"communication_ms": 0.07, "compute_ms": 0.15,
                                     "overlapped_ms": 0.03, "exposed_ms": 0.04})
    figure = plot_timeline(intervals, "test")
    assert [t.get_text() for t in figure.axes[0].get_yticklabels()] == [
        "phases", "compute (stream 7)", "NCCL (stream 20)", "NCCL (stream 7)"]


def test_timeline_rows_of_short_kernels_are_drawn_visible():
    # A 500 ms step of compute on stream 7 with three 5 us NCCL kernels on the same stream: drawn at true
    # width, they would be 1e-5 of the axis, an empty row.
    intervals = [Interval("compute", "compute (stream 7)", "gemm", 0.0, 500.0)]
    intervals += [Interval("communication", "NCCL (stream 7)", "nccl", t, t + 0.005) for t in (10.0, 200.0, 400.0)]
    figure = plot_timeline(intervals, "test")
    axes = figure.axes[0]
    bars = {label.get_text(): collection for label, collection in
            zip(axes.get_yticklabels(), axes.collections)}
    nccl = bars["NCCL (stream 7)"].get_paths()
    assert len(nccl) == 3
    widths = [path.vertices[:, 0].max() - path.vertices[:, 0].min() for path in nccl]
    assert min(widths) >= MIN_BAR_WIDTH_SHARE * 500.0 - 1e-9


def test_cpu_timeline_takes_gloo_work_from_its_own_threads():
    events = [
        _span("cpu_op", "aten::mm", 0, 100, tid=1),
        _span("user_annotation", "gloo:all_reduce", 50, 100, tid=9),
        _span("cpu_op", "aten::copy_", 60, 10, tid=9),  # gloo's own thread: not compute
        _span("user_annotation", "forward", 0, 100, tid=1),
    ]
    intervals = intervals_from_events(events, phase_names={"forward"})
    assert sorted((i.row, i.name) for i in intervals) == [
        ("compute (CPU)", "aten::mm"), ("gloo", "gloo:all_reduce"), ("phases", "forward")]
    assert communication_summary(intervals)["overlapped_ms"] == pytest.approx(0.05)


XL_GRADIENT_BYTES = 7_992_940_800


def _step_row(method: str, step_ms: float, gradient_sync_ms: float, communication_ms: float | None,
              overlapped_ms: float = 0.0, bucket_size_mb: float | None = None, all_reduces: int | None = None) -> dict:
    """A step row shaped as benchmark_ddp writes them on GPUs."""
    return {"table": "step", "variant": variant_label(method, bucket_size_mb), "method": method,
            "bucket_size_mb": bucket_size_mb, "size": "xl", "size_table": "2025", "context_length": 512,
            "batch_size": 4, "warmup": 3, "steps": 10, "attention": "sdpa", "world_size": 2, "backend": "nccl",
            "status": "ok",
            "trainable_bytes": XL_GRADIENT_BYTES, "all_reduces_per_step": all_reduces, "step_ms": step_ms,
            "step_std_ms": 1.0, "forward_ms": 200.0, "backward_ms": 400.0, "gradient_sync_ms": gradient_sync_ms,
            "optimizer_ms": 40.0, "peak_memory_gib": 45.0, "profiled_communication_ms": communication_ms,
            "profiled_compute_ms": 640.0, "profiled_overlapped_ms": overlapped_ms,
            "profiled_exposed_ms": (communication_ms or 0.0) - overlapped_ms}


@pytest.fixture
def gpu_like_rows() -> list[dict]:
    return [
        {"table": "allreduce_probe", "small_bytes": 4096, "small_ms": 0.05, "large_bytes": 10**9, "large_ms": 3.38,
         "per_call_overhead_ms": 0.05, "algbw_gbps": 300.0, "world_size": 2},
        _step_row("local", 640.0, 0.01, 0.0),
        _step_row("naive", 700.0, 55.0, 40.0, all_reduces=435),
        _step_row("flat", 690.0, 45.0, 30.0, all_reduces=1),
        _step_row("overlap_individual", 660.0, 15.0, 40.0, overlapped_ms=30.0, all_reduces=435),
        _step_row("bucketed", 665.0, 14.0, 35.0, overlapped_ms=30.0, bucket_size_mb=1, all_reduces=340),
        _step_row("bucketed", 650.0, 6.0, 30.0, overlapped_ms=28.0, bucket_size_mb=100, all_reduces=80),
        {**_step_row("bucketed", 0.0, 0.0, None, bucket_size_mb=1000), "status": OOM},
        _step_row("bucketed", 648.0, 9.0, 30.0, overlapped_ms=25.0, bucket_size_mb=10, all_reduces=200),
        _step_row("torch_ddp", 655.0, 0.01, 31.0, overlapped_ms=27.0),
        _step_row("torch_ddp_bucket_view", 620.0, 0.01, 31.0, overlapped_ms=27.0),
        {"table": "timeline", "variant": "naive", "file": "ddp_timeline_naive.png"},
        {"table": "timeline", "variant": "overlap_individual", "file": "ddp_timeline_overlap_individual.png"},
    ]


def test_benchmark_reports_answer_from_the_rows(gpu_like_rows):
    naive = report("naive_ddp_benchmarking").render(gpu_like_rows).body
    assert "55.0 ms (8%) is the 435 all-reduces" in naive and "costs 60.0 ms per step" in naive
    assert "Flattening wins" in report("minimal_ddp_flat_benchmarking").render(gpu_like_rows).body
    overlap = report("ddp_overlap_individual_parameters_benchmarking").render(gpu_like_rows).body
    assert "75% of it while compute kernels ran" in overlap  # 30 of 40 ms
    assert "(ddp_timeline_overlap_individual.png)" in overlap
    bucketed = report("ddp_bucketed_benchmarking").render(gpu_like_rows).body
    assert "| bucketed 1000 MB      |               | OOM" in bucketed
    assert "it falls, then rises, as expected" in bucketed  # 665, 648, 650 ms for 1, 10, 100 MB
    # b* = sqrt(s w o) = sqrt(7.99e9 B * 300e9 B/s * 50e-6 s) = 3.46e8 B = 330.2 MiB, in the MiB that bucket_size_mb
    # counts (BYTES_PER_MB = 2^20), beside s in GB = 10^9 bytes: each named for what it is.
    assert "s = 7.99 GB: n_b* = 23.1, b* = 330.2 MiB" in bucketed and "| bucket MiB " in bucketed
    assert "torch DDP (25 MiB buckets)" in bucketed
    # The best bucketed step, 648 ms, against each torch DDP; 6 of 665 ms is under 10%, 14 is not.
    assert "bucketed 10 MB 648.0 ms against 655.0 ms (-1.1%) | yes" in bucketed
    assert "bucketed 10 MB 648.0 ms against 620.0 ms (+4.5%) | yes" in bucketed
    assert "14.00 of 665.0 ms (2.1%)" in bucketed
    # The index names the fastest and slowest bucket sizes, whose times the report's table holds.
    answer = " ".join(answer_ddp_overlap_bucketed({"ddp_bucketed_benchmarking": gpu_like_rows}))
    assert "fastest bucket size is 10 MiB (648.0 ms per step, 9 ms" in answer
    assert "the slowest 1 MiB (665.0 ms)" in answer
    assert "the optimal bucket at sqrt(s w o) = 330.2 MiB for s = 7.99 GB of gradients." in answer


def test_equivalence_reports_say_whether_each_wrapper_matched():
    rows = [{"table": "equivalence", "method": "naive", "variant": "naive", "model": "tiny LM, float64",
             "world_size": 2, "backend": "nccl", "steps": 5, "max_abs_difference": 3e-15, "tolerance": 1e-9,
             "matches": True},
            {"table": "equivalence", "method": "bucketed", "variant": "bucketed 0.05 MB", "model": "tiny LM, float64",
             "world_size": 2, "backend": "nccl", "steps": 5, "max_abs_difference": 0.5, "tolerance": 1e-9,
             "matches": False}]
    assert "3e-15, within the tolerance" in report("naive_ddp").render(rows).body
    assert "0.5, OUTSIDE the tolerance" in report("ddp_overlap_bucketed").render(rows).body
