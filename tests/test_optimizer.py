"""The course's AdamW: its algorithm step by step, against torch's AdamW, and the memory its step takes."""

import math

import pytest
import torch

from cs336_systems.accounting.activations import adamw_step_temporary_bytes, largest_parameter_count
from cs336_systems.lm_training import adamw
from cs336_systems.model import ModelConfig, TransformerLM
from cs336_systems.optimizer import AdamW
from cs336_systems.profiling.memory import peak_memory_increase

HYPERPARAMETERS = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
STEPS = 5
SCALARS_BYTES = 1024


def _parameters(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((7, 5), (5,), (3, 4, 2))]


def _gradients(parameters, step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=generator) for p in parameters]


def test_each_step_follows_the_course_algorithm_in_float64():
    parameters = _parameters()
    optimizer = AdamW(parameters, **HYPERPARAMETERS)
    expected = [p.detach().double().clone() for p in parameters]
    m = [torch.zeros_like(e) for e in expected]
    v = [torch.zeros_like(e) for e in expected]
    lr, (beta1, beta2), eps, decay = (HYPERPARAMETERS[k] for k in ("lr", "betas", "eps", "weight_decay"))
    for t in range(1, STEPS + 1):
        gradients = _gradients(parameters, t)
        for p, g in zip(parameters, gradients):
            p.grad = g.clone()
        optimizer.step()
        lr_t = lr * math.sqrt(1 - beta2**t) / (1 - beta1**t)
        for i, g in enumerate(gradients):
            g = g.double()
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            expected[i] = expected[i] - lr_t * m[i] / (v[i].sqrt() + eps)
            expected[i] = expected[i] - lr * decay * expected[i]
    for p, e in zip(parameters, expected):
        torch.testing.assert_close(p.detach().double(), e, rtol=1e-6, atol=1e-6)
    assert all(optimizer.state[p]["step"] == STEPS for p in parameters)


def test_it_tracks_torch_adamw_up_to_where_eps_and_weight_decay_are_applied():
    # torch adds eps to the bias-corrected sqrt(v) and decays before the update; the course adds eps to sqrt(v)
    # and decays after: the same update to first order in lr * weight_decay.
    ours, theirs = _parameters(), _parameters()
    course = AdamW(ours, **HYPERPARAMETERS)
    reference = torch.optim.AdamW(theirs, **HYPERPARAMETERS)
    for t in range(1, STEPS + 1):
        for a, b, g in zip(ours, theirs, _gradients(ours, t)):
            a.grad, b.grad = g.clone(), g.clone()
        course.step()
        reference.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_parameters_without_gradients_are_left_alone():
    parameters = _parameters()
    before = parameters[1].detach().clone()
    parameters[0].grad = torch.ones_like(parameters[0])
    optimizer = AdamW(parameters, **HYPERPARAMETERS)
    optimizer.step()
    assert torch.equal(parameters[1].detach(), before) and parameters[1] not in optimizer.state


def test_its_step_allocates_the_largest_parameter_and_foreach_one_of_every_parameter():
    config = ModelConfig(d_model=32, d_ff=96, num_layers=2, num_heads=4, context_length=8, vocab_size=50)
    model = TransformerLM(config, attention="naive")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    measured = {}
    for implementation, optimizer in (("course", AdamW(model.parameters())),
                                      ("foreach", torch.optim.AdamW(model.parameters(), foreach=True))):
        optimizer.step()  # the first step creates the moments; the measured one is a steady-state step
        measured[implementation], _ = peak_memory_increase(optimizer.step, "cpu")
    assert largest_parameter_count(config) == max(p.numel() for p in model.parameters())
    # Beside sqrt(v) the step allocates only scalar tensors.
    assert 0 <= measured["course"] - adamw_step_temporary_bytes(config, "course") < SCALARS_BYTES
    assert measured["foreach"] >= adamw_step_temporary_bytes(config, "foreach")


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=-1.0), "learning rate"),
    (dict(betas=(0.9, 1.0)), "betas"),
    (dict(betas=(0.9,)), "betas"),
    (dict(eps=0.0), "eps"),
    (dict(weight_decay=-0.1), "weight decay"),
    (dict(lr=math.nan), "learning rate"),
    (dict(lr=math.inf), "learning rate"),
    (dict(eps=math.nan), "eps"),
    (dict(weight_decay=math.nan), "weight decay"),
    (dict(betas=(math.nan, 0.9)), "betas"),
])
def test_bad_hyperparameters_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdamW(_parameters(), **kwargs)


def test_a_parameter_group_with_bad_hyperparameters_is_refused_and_not_kept():
    parameters = _parameters()
    with pytest.raises(ValueError, match="learning rate"):
        AdamW([{"params": parameters[:1], "lr": -1.0}])
    optimizer = AdamW(parameters[:1])
    with pytest.raises(ValueError, match="betas"):
        optimizer.add_param_group({"params": parameters[1:], "betas": (0.9, 1.5)})
    assert len(optimizer.param_groups) == 1


@pytest.mark.parametrize("case", ["sparse gradient", "complex parameter"])
def test_what_the_update_cannot_do_is_refused_before_any_state_changes(case):
    dense = torch.nn.Parameter(torch.randn(4))
    if case == "sparse gradient":
        embedding = torch.nn.Embedding(10, 3, sparse=True)
        embedding(torch.tensor([1, 2])).sum().backward()
        other, message = embedding.weight, "dense gradients"
    else:
        other = torch.nn.Parameter(torch.randn(5, dtype=torch.cfloat))
        other.grad, message = torch.randn_like(other), "real parameters"
    dense.grad = torch.randn_like(dense)
    before = dense.detach().clone()
    optimizer = AdamW([dense, other])
    with pytest.raises(TypeError, match=message):
        optimizer.step()
    assert torch.equal(dense.detach(), before) and not optimizer.state


def test_the_harness_builds_each_implementation_and_refuses_others():
    model = torch.nn.Linear(4, 4)
    assert isinstance(adamw(model), AdamW)
    assert type(adamw(model, implementation="fused")) is torch.optim.AdamW
    with pytest.raises(ValueError, match="unknown AdamW implementation 'lion'"):
        adamw(model, implementation="lion")
    with pytest.raises(ValueError, match="unknown AdamW implementation"):
        adamw_step_temporary_bytes(ModelConfig(64, 256, 2, 4, 16), "lion")
