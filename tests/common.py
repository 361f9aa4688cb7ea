"""What the course's DDP test files import from tests.common, written for this project.

The toy models have the shapes the course's tests rely on (10 features in, 5 out; a frozen bias;
a frozen parameter named no_grad_fixed_param; two layers sharing one weight), so those tests and
the fixtures in tests/fixtures run unchanged; they are the conformance suite's, which ships them.
`course_ddp_check` is the course's DDP test procedure, for running inside ranks this project starts
with launch. The `assert_step_*` checks hold any wrapper with finish_gradient_synchronization() (the
DDP wrappers, FSDP) to the optimizer-step guard. `run_checks` runs a file's checks in one launch, and
`assert_passed_on_every_rank` reports each check as a test of its own (both from the conformance
suite's rank_checks).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from copy import deepcopy

import torch
import torch.distributed as dist
from torch import nn, optim

from cs336_systems.conformance.models import ToyModel, ToyModelWithTiedWeights  # noqa: F401 - the course's names
from cs336_systems.conformance.rank_checks import (  # noqa: F401 - what the test files import from here
    CheckOutcome,
    assert_passed_on_every_rank,
    run_checks,
)

FIXTURES_PATH = pathlib.Path(__file__).resolve().parent / "fixtures"

# Ranks started by one parent (mp.spawn) must agree on a rendezvous port without talking to each
# other. Deriving it from the parent's process id gives every parent, such as each pytest-xdist
# worker, its own port; MASTER_PORT in the environment overrides it.
_PORT_BASE = 20_000
_PORT_SPAN = 20_000
COURSE_STEPS = 5
COURSE_LR = 0.1


def _setup_process_group(rank: int, world_size: int, backend: str) -> str:
    """Join the default process group; returns the device this rank should use."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_PORT_BASE + os.getppid() % _PORT_SPAN))
    device = "cpu"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("the nccl backend needs CUDA GPUs, and torch sees none")
        local_rank = rank % torch.cuda.device_count()
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    return device


def _cleanup_process_group() -> None:
    dist.barrier()  # no rank tears the group down while another is still in a collective
    dist.destroy_process_group()


def validate_ddp_net_equivalence(net: nn.Module) -> None:
    """Assert that every tensor of net.module's state is the same on all ranks."""
    for name, tensor in net.module.state_dict().items():
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, tensor.contiguous())
        for rank, other in enumerate(gathered):
            assert torch.allclose(other, tensor), f"{name} on rank {rank} differs from rank {dist.get_rank()}'s"


def course_ddp_check(rank: int, world_size: int, model_class, make_ddp, after_backward, before_batch=None) -> None:
    """The course's DDP test, run on a rank inside an initialised process group.

    Each rank starts from its own random model; the wrapper must replace it with rank 0's. Then 5
    SGD steps on the fixtures: a single-process model on the whole batch, the wrapped one on this
    rank's shard, shards reshuffled every step; rank 0 compares the two after every step.
    Differences are collected and asserted at the end, after the last collective, so a failure
    never leaves the other ranks waiting in one. `before_batch` and `after_backward` are the
    adapter hooks, called as the course's tests call them.
    """
    torch.manual_seed(rank)  # every rank starts from a different model
    reference = model_class()
    ddp_model = make_ddp(deepcopy(reference))
    problems = []
    for (name, p_ref), p_ddp in zip(reference.named_parameters(), ddp_model.module.parameters()):
        kept_own_value = torch.equal(p_ref, p_ddp)
        if kept_own_value != (rank == 0 or "no_grad_fixed_param" in name):
            problems.append(f"{name}: after construction equal to this rank's initial value is {kept_own_value}")
    validate_ddp_net_equivalence(ddp_model)

    all_x = torch.load(FIXTURES_PATH / "ddp_test_data.pt")
    all_y = torch.load(FIXTURES_PATH / "ddp_test_labels.pt")
    used = all_x.size(0) // world_size * world_size
    all_x, all_y = all_x[:used], all_y[:used]
    local_batch = used // world_size
    loss_fn = nn.MSELoss()
    ddp_optimizer = optim.SGD(ddp_model.parameters(), lr=COURSE_LR)
    reference_optimizer = optim.SGD(reference.parameters(), lr=COURSE_LR)
    for step in range(COURSE_STEPS):
        if before_batch is not None:
            before_batch(ddp_model=ddp_model, optimizer=ddp_optimizer)
        ddp_optimizer.zero_grad()
        reference_optimizer.zero_grad()
        loss_fn(reference(all_x), all_y).backward()
        reference_optimizer.step()
        shard = slice(rank * local_batch, (rank + 1) * local_batch)
        loss_fn(ddp_model(all_x[shard]), all_y[shard]).backward()
        after_backward(ddp_model=ddp_model, optimizer=ddp_optimizer)
        ddp_optimizer.step()
        if rank == 0:
            for (name, p_ref), p_ddp in zip(reference.named_parameters(), ddp_model.module.parameters()):
                if not torch.allclose(p_ref, p_ddp):
                    problems.append(f"step {step}: {name} differs by {(p_ref - p_ddp).abs().max():.3g}")
        torch.manual_seed(42 + step)  # the same permutation on every rank keeps shards disjoint
        permutation = torch.randperm(all_x.size(0))
        all_x, all_y = all_x[permutation], all_y[permutation]
    validate_ddp_net_equivalence(ddp_model)
    assert not problems, "\n".join(problems)


def _parameters_changed(module: nn.Module, before: list[torch.Tensor]) -> list[bool]:
    return [not torch.equal(p, old) for p, old in zip(module.parameters(), before)]


def assert_step_before_finish_raises(wrapper: nn.Module, optimizer: optim.Optimizer,
                                     loss: Callable[[], torch.Tensor]) -> None:
    """After `loss().backward()`, an optimizer step before finish_gradient_synchronization() is
    refused, naming the wrapper and the call it misses, and changes no parameter; after finish the
    same step updates them. Run on every rank."""
    loss().backward()
    before = [p.detach().clone() for p in wrapper.parameters()]
    # try/except rather than pytest.raises: its failure is not an Exception, which run_checks would
    # not catch, so the rank would end where its peers still wait.
    try:
        optimizer.step()
    except RuntimeError as error:
        expected = (f"{type(wrapper).__name__}: optimizer.step() after a backward whose gradients were not "
                    "synchronised; call finish_gradient_synchronization()")
        assert str(error).startswith(expected), str(error)
    else:
        raise AssertionError("an optimizer step before finish_gradient_synchronization() was accepted")
    assert not any(_parameters_changed(wrapper, before)), "the refused step changed parameters"
    wrapper.finish_gradient_synchronization()
    optimizer.step()
    assert any(_parameters_changed(wrapper, before)), "the step after finish changed no parameter"


def assert_step_of_another_model_is_unaffected(wrapper: nn.Module, loss: Callable[[], torch.Tensor]) -> None:
    """While `wrapper` waits for finish_gradient_synchronization(), an optimizer over another model's
    parameters in the same process steps as usual. Run on every rank."""
    loss().backward()
    assert wrapper.has_unsynchronised_gradients
    other = nn.Linear(3, 2)
    other_optimizer = optim.SGD(other.parameters(), lr=0.1)
    other(torch.ones(3)).sum().backward()
    before = [p.detach().clone() for p in other.parameters()]
    other_optimizer.step()
    assert all(_parameters_changed(other, before)), "the other model's step changed nothing"
    wrapper.finish_gradient_synchronization()


def assert_step_after_forward_alone_is_allowed(wrapper: nn.Module, optimizer: optim.Optimizer,
                                               forward: Callable[[], torch.Tensor]) -> None:
    """A forward with gradients enabled produces no gradient, so a step after it is no error: on a
    new wrapper, and after a finished step (a metric computed between finish and the step). Run on
    every rank."""
    forward()
    optimizer.step()  # no gradients yet: a step that changes nothing
    forward().sum().backward()
    wrapper.finish_gradient_synchronization()
    forward()  # a metric, no backward
    before = [p.detach().clone() for p in wrapper.parameters()]
    optimizer.step()
    assert any(_parameters_changed(wrapper, before)), "the step after finish changed no parameter"
