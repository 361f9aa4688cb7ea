"""What this project's FlashAttention tests add to the conformance suite's reference and error model
(cs336_systems.conformance.attention_reference, which they share): this project's two Functions by name, inputs
that start off a 16-byte boundary (which the Triton launch code copies), and the assertions in the form these
tests call them."""

import pytest
import torch
from hypothesis import strategies as st

from cs336_systems.attention.flash_pytorch import FlashAttentionPytorch
from cs336_systems.attention.flash_triton import INTERPRETED, FlashAttentionTriton
from cs336_systems.conformance import attention_reference
from cs336_systems.conformance.attention_reference import (  # noqa: F401 - the tests import them from here
    LAYOUTS,
    RESULTS,
    reference_attention,
    tolerance_for,
)
from cs336_systems.conformance.flash_cases import saved_logsumexp

FUNCTIONS = {"pytorch": FlashAttentionPytorch, "triton": FlashAttentionTriton}
# For a test that runs the Triton kernels on CPU tensors.
kernels_on_cpu_tensors = pytest.mark.skipif(not INTERPRETED, reason="Triton kernels compiled for a GPU refuse CPU "
                                            "tensors; the interpreter (no GPU) runs them")


def make_tensor(lead: tuple[int, ...], n: int, d: int, layout: str, dtype, device,
                aligned: bool = True) -> torch.Tensor:
    """attention_reference.make_tensor's (*lead, n, d) tensor of standard normals in `layout`, its memory starting
    on a 16-byte boundary or (aligned=False) one element past one."""
    t = attention_reference.make_tensor(lead, n, d, layout, dtype, device)
    return t if aligned else misaligned(t, keep_strides=True)


def run(impl: str, q, k, v, do, is_causal: bool) -> dict[str, torch.Tensor]:
    """o, L (the saved tensor shaped like q's rows), dq, dk, dv."""
    q, k, v = (t.requires_grad_() if t.is_leaf else t for t in (q, k, v))
    o = FUNCTIONS[impl].apply(q, k, v, is_causal)
    lse = saved_logsumexp(o, q)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    return {"o": o, "L": lse, "dq": dq, "dk": dk, "dv": dv}


def assert_matches_reference(impl, q, k, v, do, is_causal):
    assert_close_to_reference(run(impl, q, k, v, do, is_causal), reference_attention(q, k, v, do, is_causal),
                              q.dtype)


def assert_close_to_reference(got, reference: attention_reference.Reference, dtype, names=RESULTS):
    """`got` (results in the order of `names`, or by name) within the conformance suite's error model."""
    got = got if isinstance(got, dict) else dict(zip(names, got, strict=True))
    device = next(iter(got.values())).device
    found = attention_reference.discrepancies(got, reference, tolerance_for(device, dtype), dtype)
    assert not found, "\n".join(found)


def leaf_inputs(lead, n_queries, n_keys, d, dtype, device, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(*lead, n_queries, d, dtype=dtype, device=device)
    k = torch.randn(*lead, n_keys, d, dtype=dtype, device=device)
    v = torch.randn(*lead, n_keys, d, dtype=dtype, device=device)
    do = torch.randn(*lead, n_queries, d, dtype=dtype, device=device)
    return q, k, v, do


def seed_from(data) -> None:
    """Seeds torch from a hypothesis draw, so that a failing example's tensors come back when
    hypothesis replays or shrinks it (hypothesis seeds Python's and numpy's generators, not torch's)."""
    torch.manual_seed(data.draw(st.integers(0, 2**32 - 1), label="torch seed"))


def misaligned(t: torch.Tensor, keep_strides: bool = False) -> torch.Tensor:
    """The same values one element past a 16-byte boundary: contiguous, or (keep_strides) laid out as t is."""
    if not keep_strides:
        t = t.contiguous()
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    buffer = torch.empty(extent + 1, dtype=t.dtype, device=t.device)
    view = buffer[1:].as_strided(t.shape, t.stride())
    assert view.data_ptr() % 16 != 0
    view.copy_(t)
    return view

