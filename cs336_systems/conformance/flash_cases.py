"""FlashAttention conformance cases: one set of inputs (shape, dtype, causality, layout of each input, how
large the scores are), the words that name it in a failure, and the check of an autograd Function on it
against the float64 reference.

    case = Case(lead=(2, 3), n_queries=77, n_keys=130, head_dim=80, dtype=torch.bfloat16, is_causal=True)
    check_function(Function, case, device, "the Triton Function")   # AssertionError naming what is wrong

A Function is the course's: Function.apply(q, k, v, is_causal) -> o, whose forward saves exactly one tensor
shaped (batch..., n_queries), the logsumexp L, found in o.grad_fn.saved_tensors as the course's tests find it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from cs336_systems.conformance.attention_reference import (
    discrepancies,
    make_tensor,
    reference_attention,
    tolerance_for,
)

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class Case:
    """Attention inputs: q (*lead, n_queries, head_dim), k and v (*lead, n_keys, head_dim), each laid out as
    `layouts` says (attention_reference.LAYOUTS), q and k drawn with standard deviation sqrt(score_spread) so that
    the scores' is about score_spread; dO is contiguous."""

    lead: tuple[int, ...]
    n_queries: int
    n_keys: int
    head_dim: int
    dtype: torch.dtype
    is_causal: bool
    layouts: tuple[str, str, str] = ("contiguous", "contiguous", "contiguous")
    score_spread: float = 1.0
    seed: int = 0
    note: str = field(default="", compare=False)  # what the case is for, where a name says more than its shape

    def describe(self) -> str:
        """The words a failure names the case in: "is_causal=True, n_q=77, n_k=130, d=80, bf16, 4-D inputs (2, 3,
        ...), q transposed, ..."."""
        words = [f"is_causal={self.is_causal}", f"n_q={self.n_queries}", f"n_k={self.n_keys}", f"d={self.head_dim}",
                 DTYPE_NAMES[self.dtype], f"{len(self.lead) + 2}-D inputs {(*self.lead, 'n', 'd')}".replace("'", "")]
        laid_out = [f"{name} {layout}" for name, layout in zip("qkv", self.layouts) if layout != "contiguous"]
        words.append(", ".join(laid_out) if laid_out else "contiguous inputs")
        if self.score_spread != 1.0:
            words.append(f"scores spread {self.score_spread:g}")
        if self.note:
            words.append(self.note)
        return ", ".join(words)

    def inputs(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v, dO on `device`, the same for the same case."""
        torch.manual_seed(self.seed)
        input_spread = math.sqrt(self.score_spread)
        q = make_tensor(self.lead, self.n_queries, self.head_dim, self.layouts[0], self.dtype, device, input_spread)
        k = make_tensor(self.lead, self.n_keys, self.head_dim, self.layouts[1], self.dtype, device, input_spread)
        v = make_tensor(self.lead, self.n_keys, self.head_dim, self.layouts[2], self.dtype, device)
        do = make_tensor(self.lead, self.n_queries, self.head_dim, "contiguous", self.dtype, device)
        return q, k, v, do


class ConformanceFailure(AssertionError):
    """A Function broke the contract on a case; the message says where and how."""


def saved_logsumexp(o: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The one tensor shaped (batch..., n_queries) the forward saved, as the course's tests find L."""
    if o.grad_fn is None:
        raise ConformanceFailure("the output has no grad_fn: the forward did not run as an autograd.Function "
                                 "on inputs that require grad")
    rows = tuple(q.shape[:-1])
    saved = [t for t in o.grad_fn.saved_tensors if tuple(t.shape) == rows]
    if len(saved) != 1:
        raise ConformanceFailure(f"the forward saved {len(saved)} tensors shaped {rows} (batch..., n_queries); "
                                 "the contract is exactly one, the logsumexp L, saved with ctx.save_for_backward")
    return saved[0]


def results_of(function: type, q, k, v, do, is_causal: bool) -> dict[str, torch.Tensor]:
    """o, L, dq, dk, dv of one forward and backward of `function` (a ConformanceFailure where L is not found)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = function.apply(q, k, v, is_causal)
    lse = saved_logsumexp(o, q)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    return {"o": o, "L": lse, "dq": dq, "dk": dk, "dv": dv}


def check_function(function: type, case: Case, device, label: str) -> None:
    """Raise ConformanceFailure, naming `label`, the case and every discrepancy, where `function` on `case`
    raises, saves no L, or breaks the error model."""
    q, k, v, do = case.inputs(device)
    where = f"{label} is wrong where {case.describe()}"
    try:
        got = results_of(function, q, k, v, do, case.is_causal)
    except ConformanceFailure as failure:
        raise ConformanceFailure(f"{where}: {failure}") from None
    except Exception as error:  # noqa: BLE001 - whatever the implementation raises is the finding
        raise ConformanceFailure(f"{label} raised where {case.describe()}: {type(error).__name__}: {error}") from error
    reference = reference_attention(q, k, v, do, case.is_causal)
    found = discrepancies(got, reference, tolerance_for(device, case.dtype), case.dtype)
    if found:
        raise ConformanceFailure(where + ":\n" + "\n".join(f"  - {sentence}" for sentence in found))

