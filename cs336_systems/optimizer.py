"""AdamW as the course's basics model implements it (assignment 1's algorithm): one parameter at a time,
in plain PyTorch ops, the moments kept beside each parameter in its dtype (fp32 for the fp32 parameters
the benchmarks train, mixed precision or not).

    optimizer = AdamW(model.parameters(), lr=1e-4)

Per parameter, with t the step count:
    m <- beta1 m + (1 - beta1) g
    v <- beta2 v + (1 - beta2) g^2
    theta <- theta - lr_t m / (sqrt(v) + eps),  lr_t = lr sqrt(1 - beta2^t) / (1 - beta1^t)
    theta <- theta - lr weight_decay theta

Memory: the state is two parameter-sized moments; the step allocates one temporary at a time, sqrt(v)
of the parameter being updated, so its transient is the largest parameter, where torch's multi-tensor
(foreach) AdamW computes sqrt(v) for every parameter at once. Time: a few kernels per parameter,
launched from Python, where torch's fused AdamW updates every parameter in one kernel launch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch


class AdamW(torch.optim.Optimizer):
    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        _check_hyperparameters(defaults)
        super().__init__(params, {**defaults, "betas": tuple(betas)})

    def add_param_group(self, param_group: dict) -> None:
        """torch's, with the group's hyperparameters (its own, or the defaults it takes) checked."""
        super().add_param_group(param_group)
        try:
            _check_hyperparameters(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                _check_gradient(p)
        for group in self.param_groups:
            lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                lr_t = lr * math.sqrt(1 - beta2**t) / (1 - beta1**t)
                p.addcdiv_(m, v.sqrt().add_(eps), value=-lr_t)
                p.mul_(1 - lr * weight_decay)
        return loss


def _check_hyperparameters(group: dict) -> None:
    """Each hyperparameter finite and in its range (a NaN compares False, so each test is written to pass
    only for good values)."""
    lr, betas, eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if not 0 <= lr < math.inf:
        raise ValueError(f"learning rate must be finite and >= 0, got {lr}")
    if len(betas) != 2 or not all(0 <= beta < 1 for beta in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas}")
    if not 0 < eps < math.inf:
        raise ValueError(f"eps must be finite and > 0, got {eps}")
    if not 0 <= weight_decay < math.inf:
        raise ValueError(f"weight decay must be finite and >= 0, got {weight_decay}")


def _check_gradient(p: torch.Tensor) -> None:
    """Refuse what the update's dense, real arithmetic would get wrong or fail on halfway through a step."""
    if p.is_complex():
        raise TypeError(f"AdamW updates real parameters; got a {p.dtype} parameter of shape {tuple(p.shape)}")
    if p.grad is not None and p.grad.is_sparse:
        raise TypeError(f"AdamW needs dense gradients; a parameter of shape {tuple(p.shape)} has a sparse one "
                        "(an Embedding with sparse=True makes them)")
