"""The float64 reference the FlashAttention tests compare both implementations with, the input
layouts attention sees in practice, and the tolerance each dtype earns."""

import math

import torch
from hypothesis import strategies as st

from cs336_systems.attention.flash_pytorch import MASKED_SCORE_BIAS, FlashAttentionPytorch
from cs336_systems.attention.flash_triton import FlashAttentionTriton

FUNCTIONS = {"pytorch": FlashAttentionPytorch, "triton": FlashAttentionTriton}

# Largest error allowed, as a fraction of the reference's magnitude (per tensor: o, L, dq, dk, dv;
# reference_attention says what magnitude means for each). The reference is computed in float64
# from the very same (already rounded) inputs, so what remains is the implementation's arithmetic.
# fp32 differs by device: on a GPU tl.dot rounds fp32 operands to tf32 (unit roundoff 2^-11 =
# 4.9e-4), so scores, P and every gradient carry errors of a few 1e-4 relative, more after the
# backward's cancellation in dP - D (the largest over ~1e5 elements reached 5.4e-3: dk, d=16,
# N=848, on an H100); on CPU (interpreter, PyTorch) fp32 dots are fp32, within ~1e-6.
TOLERANCES = {
    ("cpu", torch.float32): 2e-5,
    ("cuda", torch.float32): 1e-2,
    # P and dS are rounded to fp16 (unit roundoff 4.9e-4) before their dots, outputs on store.
    ("cpu", torch.float16): 5e-3,
    ("cuda", torch.float16): 5e-3,
    # bf16 keeps 8 bits (unit roundoff 3.9e-3): eight times fp16's rounding error.
    ("cuda", torch.bfloat16): 4e-2,
}
# The reference forms (rows, n_keys) blocks of scores, so 16k-token checks fit in GPU memory.
REFERENCE_ROWS_PER_BLOCK = 1024
LAYOUTS = ("contiguous", "heads_transposed", "fused_projection", "strided_features")


def reference_attention(q, k, v, do, is_causal: bool):
    """o, L, dq, dk, dv in float64 by the textbook formulas (softmax Jacobian, not the D = rowsum(dO
    * O) shortcut the implementations use), a block of query rows at a time.

    Also returns the scale each result's error is measured against: its own largest magnitude,
    except where cancellation can make a result tiny while its rounding error is not. L is a log
    (an absolute error of 1e-3 is a relative error of 1e-3 in the sum of exponentials), so at least
    1. dQ and dK are sums of P * (dP - D): with one key D equals dP and dQ is 0 up to rounding, so
    their scale is at least that of the P * dP part alone. dP = dO . V can itself cancel (dO nearly
    orthogonal to V), so the scale is also at least the typical size of the rounding in those sums:
    each dP term's |dO| . |V| / sqrt(d) (the square-root growth of a d-term sum's rounding), carried
    through P and K (or Q) as independent errors add, in root sum of squares.
    """
    q, k, v, do = (t.detach().double() for t in (q, k, v, do))
    scale = 1.0 / math.sqrt(q.shape[-1])
    o, L, dq = torch.empty_like(q), torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device), torch.empty_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dq_terms, dk_terms = torch.empty_like(q), torch.zeros_like(k)
    dq_rounding, dk_rounding_squared = torch.empty_like(q), torch.zeros_like(k)
    for start in range(0, q.shape[-2], REFERENCE_ROWS_PER_BLOCK):
        rows = slice(start, start + REFERENCE_ROWS_PER_BLOCK)
        q_rows, do_rows = q[..., rows, :], do[..., rows, :]
        s = q_rows @ k.transpose(-2, -1) * scale
        if is_causal:
            query_pos = torch.arange(start, start + q_rows.shape[-2], device=q.device)
            future = torch.arange(k.shape[-2], device=q.device)[None, :] > query_pos[:, None]
            s = torch.where(future, s + MASKED_SCORE_BIAS, s)
        L[..., rows] = torch.logsumexp(s, dim=-1)
        p = torch.softmax(s, dim=-1)
        o[..., rows, :] = p @ v
        dp = do_rows @ v.transpose(-2, -1)
        ds = p * (dp - (p * dp).sum(dim=-1, keepdim=True))
        dq[..., rows, :] = ds @ k * scale
        dk += ds.transpose(-2, -1) @ q_rows * scale
        dv += p.transpose(-2, -1) @ do_rows
        dq_terms[..., rows, :] = (p * dp) @ k * scale
        dk_terms += (p * dp).transpose(-2, -1) @ q_rows * scale
        dp_rounding_squared = (p * (do_rows.abs() @ v.abs().transpose(-2, -1))).square() / q.shape[-1]
        dq_rounding[..., rows, :] = (dp_rounding_squared @ k.square()).sqrt() * scale
        dk_rounding_squared += dp_rounding_squared.transpose(-2, -1) @ q_rows.square() * scale**2
    results = (o, L, dq, dk, dv)
    magnitudes = [r.abs().max() for r in results]
    magnitudes[1] = magnitudes[1].clamp_min(1.0)
    magnitudes[2] = max(magnitudes[2], dq_terms.abs().max(), dq_rounding.max())
    magnitudes[3] = max(magnitudes[3], dk_terms.abs().max(), dk_rounding_squared.sqrt().max())
    return results, tuple(m.item() for m in magnitudes)


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.double() - expected).abs().max().item()


def make_tensor(lead: tuple[int, ...], n: int, d: int, layout: str, dtype, device,
                aligned: bool = True) -> torch.Tensor:
    """A (*lead, n, d) tensor of standard normals laid out as attention inputs come in practice, in memory
    that starts on a 16-byte boundary or (aligned=False) one element past one."""

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=dtype, device=device) if aligned else misaligned_randn(shape, dtype, device)

    if layout == "contiguous":
        return randn(*lead, n, d)
    if layout == "heads_transposed" and lead:  # (batch, seq, heads, d) viewed as (batch, heads, seq, d)
        return randn(*lead[:-1], n, lead[-1], d).transpose(-3, -2)
    if layout == "fused_projection":  # a column slice of a (..., seq, 3 d) fused QKV output
        return randn(*lead, n, 3 * d)[..., d:2 * d]
    # strided_features (and heads_transposed without a head dim): every other feature
    return randn(*lead, n, 2 * d)[..., ::2]


def run(impl: str, q, k, v, do, is_causal: bool):
    """o, L (the saved tensor shaped like q's rows), dq, dk, dv."""
    q, k, v = (t.requires_grad_() if t.is_leaf else t for t in (q, k, v))
    o = FUNCTIONS[impl].apply(q, k, v, is_causal)
    saved_rows = [t for t in o.grad_fn.saved_tensors if t.shape == q.shape[:-1]]
    assert len(saved_rows) == 1, f"expected one saved tensor of shape {tuple(q.shape[:-1])}"
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    return o, saved_rows[0], dq, dk, dv


def assert_matches_reference(impl, q, k, v, do, is_causal):
    got = run(impl, q, k, v, do, is_causal)
    assert_close_to_reference(got, *reference_attention(q, k, v, do, is_causal), dtype=q.dtype)


def assert_close_to_reference(got, expected, magnitudes, dtype, names=("o", "L", "dq", "dk", "dv")):
    tolerance = TOLERANCES[(got[0].device.type, dtype)]
    for name, actual, ref, magnitude in zip(names, got, expected, magnitudes):
        assert actual.shape == ref.shape, f"{name}: shape {tuple(actual.shape)}, expected {tuple(ref.shape)}"
        assert actual.dtype == (torch.float32 if name == "L" else dtype), f"{name}: dtype {actual.dtype}"
        error = max_error(actual, ref) / magnitude
        assert error <= tolerance, f"{name}: error {error:.2e} of its magnitude {magnitude:.2g} > {tolerance:.0e}"


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


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """The same values, contiguous, one element past a 16-byte boundary."""
    view = _off_boundary(t.shape, t.dtype, t.device)
    view.copy_(t)
    return view


def misaligned_randn(shape, dtype, device) -> torch.Tensor:
    """Standard normals of `shape`, contiguous, one element past a 16-byte boundary."""
    return _off_boundary(shape, dtype, device).normal_()


def _off_boundary(shape, dtype, device) -> torch.Tensor:
    buffer = torch.empty(math.prod(shape) + 1, dtype=dtype, device=device)
    view = buffer[1:].view(shape)
    assert view.data_ptr() % 16 != 0
    return view
