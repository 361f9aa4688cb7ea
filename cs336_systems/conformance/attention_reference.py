"""FlashAttention's float64 reference, the input layouts attention sees in practice, and the error model that
tells an implementation's rounding from a bug.

    reference = reference_attention(q, k, v, do, is_causal)    # o, L, dq, dk, dv in float64, and their scales
    found = discrepancies(got, reference, tolerance_for(q.device, q.dtype))   # [] where `got` conforms

The contract is the course's: o = softmax(q k^T / sqrt(d) + mask) v, where the causal mask adds MASKED_SCORE_BIAS
to the score of query i and key j > i (positions counted from the start of both sequences, also where
n_queries != n_keys), and L = logsumexp of those scores, fp32, shaped (..., n_queries). The reference is
computed in float64 from the very (already rounded) inputs the implementation gets, so what remains is the
implementation's own arithmetic, which the error model bounds in four ways, each of which a rounding error
and a bug meet differently (TOLERANCES gives each bound its measured reason):

  - elementwise: the largest error over the tensor's magnitude (the one number most tests use). Rounding
    noise has long tails, so this bound is the loosest; it catches what a few elements show (a dropped key
    makes its dK and dV rows zero).
  - normwise: the root-sum-square error over that of the tensor's scale. Noise adds up in root sum of
    squares and a systematic error adds up linearly, so it is several times tighter.
  - projection: the least-squares coefficient of the result on the reference, less 1, over the scale: a
    result 1.01 times too large reads 0.01, while rounding noise, uncorrelated with the reference, averages
    out (over n elements to 1/sqrt(n) of the normwise error).
  - the logsumexp: scores are sums of products of the inputs accumulated in fp32 (the course's kernels keep
    them and the softmax statistics in fp32), so L is exact to fp32 rounding of those sums, far tighter than o
    in bf16 or fp16; a softmax scale 1% off moves it by 1% of the scores' softmax-weighted mean.

Scores rounded in their dot (tf32, which GPUs use for fp32 tl.dot) carry errors that grow with the scores'
size: every bound allows for that, in proportion to the scores' rounding scale (`score_scale`). Where the dot
truncates its operands instead (Hopper's tensor cores drop an fp32 operand's low 13 bits), every product comes
out a little small, so a score is too small by a share of itself that rounding noise does not average away:
L's bound also allows that share of the scores' softmax-weighted size (`score_bias`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# The course's masked-score bias: exp(s - 1e6 - L) is exactly 0 in fp32.
MASKED_SCORE_BIAS = -1e6
# The results an implementation is compared on, in order: the output, the logsumexp it saves, the gradients.
RESULTS = ("o", "L", "dq", "dk", "dv")
# The reference forms (rows, n_keys) blocks of scores, so that 16k-token checks fit in GPU memory.
REFERENCE_ROWS_PER_BLOCK = 1024


@dataclass(frozen=True)
class Reference:
    """The float64 results by name (RESULTS), and what each one's error is measured against.

    scales: per element, at least the result's own size: for dq and dk also the size of the softmax
    Jacobian's P * dP part and of the rounding of dP, which cancellation can leave far larger than the result.
    magnitudes: one number per result for the elementwise bound, the largest of its scale.
    row_score_scales: per query row (shaped like L), the softmax-weighted size of a score's rounding error
    in units of its dot's unit roundoff, sum_j P_ij sqrt(sum_t q_it^2 k_jt^2) / sqrt(d): L's error is judged
    against it.
    row_score_magnitudes: per query row, the softmax-weighted size of its scores, sum_j P_ij |s_ij|: what a
    dot that shrinks every product moves L by, in proportion.
    score_scale: its largest value, how far score rounding can move o and the gradients.
    max_score: the largest unmasked score, for messages about overflow.
    """

    results: dict[str, torch.Tensor]
    scales: dict[str, torch.Tensor]
    magnitudes: dict[str, float]
    row_score_scales: torch.Tensor
    row_score_magnitudes: torch.Tensor
    score_scale: float
    max_score: float


def causal_future(query_start: int, n_rows: int, n_keys: int, device) -> torch.Tensor:
    """(n_rows, n_keys) bool: True where the query at row query_start + i may not see key j (j > i)."""
    queries = torch.arange(query_start, query_start + n_rows, device=device)
    return torch.arange(n_keys, device=device)[None, :] > queries[:, None]


def reference_attention(q, k, v, do, is_causal: bool) -> Reference:
    """o, L, dq, dk, dv in float64 by the textbook formulas (the softmax Jacobian, not the D = rowsum(dO * O)
    shortcut implementations use), a block of query rows at a time, with the scales the error model needs.

    dQ and dK are sums of P * (dP - D): with one key D equals dP and dQ is 0 up to rounding, so their scale is
    at least that of the P * dP part alone. dP = dO . V can itself cancel (dO nearly orthogonal to V), so the
    scale is also at least the typical size of the rounding in those sums: each dP term's |dO| . |V| /
    sqrt(d) (the square-root growth of a d-term sum's rounding), carried through P and K (or Q) as
    independent errors add, in root sum of squares.
    """
    q, k, v, do = (t.detach().double() for t in (q, k, v, do))
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    o, dq = torch.empty_like(q), torch.empty_like(q)
    L, row_score_scales, row_score_magnitudes = (torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device)
                                                 for _ in range(3))
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dq_terms, dk_terms = torch.empty_like(q), torch.zeros_like(k)
    dq_rounding, dk_rounding_squared = torch.empty_like(q), torch.zeros_like(k)
    max_score = -math.inf
    for start in range(0, q.shape[-2], REFERENCE_ROWS_PER_BLOCK):
        rows = slice(start, start + REFERENCE_ROWS_PER_BLOCK)
        q_rows, do_rows = q[..., rows, :], do[..., rows, :]
        s = q_rows @ k.transpose(-2, -1) * scale
        if is_causal:
            future = causal_future(start, q_rows.shape[-2], k.shape[-2], q.device)
            max_score = max(max_score, s.masked_fill(future, -math.inf).max().item())
            s = torch.where(future, s + MASKED_SCORE_BIAS, s)
        else:
            max_score = max(max_score, s.max().item())
        L[..., rows] = torch.logsumexp(s, dim=-1)
        p = torch.softmax(s, dim=-1)
        o[..., rows, :] = p @ v
        score_rounding = (q_rows.square() @ k.square().transpose(-2, -1)).sqrt() * scale
        row_score_scales[..., rows] = (p * score_rounding).sum(dim=-1)
        row_score_magnitudes[..., rows] = (p * s.abs()).sum(dim=-1)
        dp = do_rows @ v.transpose(-2, -1)
        ds = p * (dp - (p * dp).sum(dim=-1, keepdim=True))
        dq[..., rows, :] = ds @ k * scale
        dk += ds.transpose(-2, -1) @ q_rows * scale
        dv += p.transpose(-2, -1) @ do_rows
        dq_terms[..., rows, :] = (p * dp) @ k * scale
        dk_terms += (p * dp).transpose(-2, -1) @ q_rows * scale
        dp_rounding_squared = (p * (do_rows.abs() @ v.abs().transpose(-2, -1))).square() / d
        dq_rounding[..., rows, :] = (dp_rounding_squared @ k.square()).sqrt() * scale
        dk_rounding_squared += dp_rounding_squared.transpose(-2, -1) @ q_rows.square() * scale**2
    results = {"o": o, "L": L, "dq": dq, "dk": dk, "dv": dv}
    scales = {"o": o.abs(), "dv": dv.abs(),
              "dq": torch.maximum(torch.maximum(dq.abs(), dq_terms.abs()), dq_rounding),
              "dk": torch.maximum(torch.maximum(dk.abs(), dk_terms.abs()), dk_rounding_squared.sqrt())}
    magnitudes = {name: scales[name].max().item() for name in scales}
    magnitudes["L"] = max(1.0, L.abs().max().item())
    return Reference(results, scales, magnitudes, row_score_scales, row_score_magnitudes,
                     row_score_scales.max().item(), max_score)


# ------------------------------------------------------------------------------------------ the error model

@dataclass(frozen=True)
class Tolerance:
    """What an implementation's rounding may reach in one (device, dtype), each bound as the module docstring
    defines it: for o and the gradients `elementwise`, `normwise` and `projection` (fractions of their
    magnitude or scale); for L `logsumexp` (a multiple of the row's score scale, as `score_rounding` is) plus
    `score_bias` times the row's softmax-weighted score size. `score_rounding` is the unit roundoff of a score's
    dot, and each of o's and the gradients' bounds grows by SCORE_ROUNDING_REACH times it, times the scores'
    rounding scale; `score_bias` is the largest share of itself by which the dot shrinks a score (0 where
    products are exact or rounded)."""

    elementwise: float
    normwise: float
    projection: float
    logsumexp: float
    score_rounding: float
    score_bias: float = 0.0


# Unit roundoff of a score's dot: products of fp16 or bf16 inputs are exact in fp32 and so is fp32 on a CPU, which
# leaves fp32 accumulation; a GPU's tl.dot rounds fp32 operands to tf32 (10 bits).
FP32_ROUNDING = 2.0**-24
TF32_ROUNDING = 2.0**-11
# An fp32 operand truncated to tf32 loses less than 2^-10 of itself, so a product of two loses less than 2^-9.
TF32_TRUNCATION_BIAS = 2.0**-9
# Each bound is 2.4 to 11 times the worst that correct implementations reached, on 30 drawn cases per
# implementation and dtype (n up to 70, d 16 to 128, causal and not, every layout, scores spread 1 to 4): this
# project's two Functions and the from-scratch ones (examples/from_scratch) on a CPU, and on 150 to 400 cases
# (n up to 300, spreads up to 100) an emulation in PyTorch of a kernel's rounding: P and dS rounded to the input
# dtype before their dots, fp32 operands rounded to tf32 on a GPU. Worst (elementwise, normwise, projection, L):
#   fp32, CPU: 5.8e-6 (this project's Triton dV, d 128), 1.6e-6, 1.8e-7, 1.1e-6;
#   fp16: 6.7e-4 (the from-scratch Triton dK), 3.2e-4, 8e-5, 1.2e-6; the emulation 6e-4, 3.1e-4, 1.1e-4, 1.5e-6;
#   bf16: the PyTorch Functions (fp32 inside) 3.8e-3, 1.8e-3, 3.4e-4, 6.7e-7; the emulation 4.8e-3, 2.5e-3,
#     7e-4, 1.4e-6: P rounded to 8 bits (unit roundoff 3.9e-3) is the bulk of it;
#   fp32 with tf32 dots (the emulation): 1.8e-3, 7.9e-4, 1.9e-4, and L 1.1e-3 of its row's score scale, the
#     same at scores spread 100 (2.3 times tf32's unit roundoff), where o's error grew to 3.7e-2 at a score
#     scale of 338 (what SCORE_ROUNDING_REACH allows for: 0.11 of tf32's unit roundoff per unit of score scale).
#     Hopper's tensor cores do not round an fp32 operand to tf32 but drop its low 13 bits, which shrinks every
#     product: through the two dots each of dQ and dK comes from, both gradients come out 0.9978 to 0.9992 times
#     the reference (o and dV 0.9984 to 0.9996), a bias no rounding emulation shows. Emulated so, on 250 cases
#     (n up to 300, d 16 to 128, spreads 1 to 4), that bias needs 1.1e-3 of projection beyond the other
#     allowances, which the kernels on an H100 also reached (dQ and dK 0.9980 times the reference at d 40 to
#     128); the bound, 3e-3, is 2.6 times that. Every score shrinks the same way, so L came out too small by 8e-4 to
#     9e-4 of itself on an H100 (a single key's L, and L from 3.8 to 233 at large scores), past 3e-3 of the row's
#     score scale: L's bound adds TF32_TRUNCATION_BIAS of the row's softmax-weighted score size, a fifth of what a
#     1% scale error moves it by.
# A softmax scale 1% off moves L by 1% of the softmax-weighted mean score, 1.3e-2 of the row's score scale at the
# least over those cases: over 1,000 times the fp32 accumulation's bound and 4 times tf32's. A scale 1% off in
# the gradients' last step alone makes dQ and dK 1.01 times too large: 5 times the bf16 projection bound, 3 times
# the fp32 one on a GPU.
TOLERANCES: dict[tuple[str, torch.dtype], Tolerance] = {
    ("cpu", torch.float32): Tolerance(2e-5, 1e-5, 2e-6, 1e-5, FP32_ROUNDING),
    ("cpu", torch.float16): Tolerance(3e-3, 1e-3, 5e-4, 1e-5, FP32_ROUNDING),
    ("cpu", torch.bfloat16): Tolerance(2e-2, 6e-3, 2e-3, 1e-5, FP32_ROUNDING),
    ("cuda", torch.float32): Tolerance(1e-2, 3e-3, 3e-3, 3e-3, TF32_ROUNDING, TF32_TRUNCATION_BIAS),
    ("cuda", torch.float16): Tolerance(3e-3, 1e-3, 5e-4, 1e-5, FP32_ROUNDING),
    ("cuda", torch.bfloat16): Tolerance(2e-2, 6e-3, 2e-3, 1e-5, FP32_ROUNDING),
}
# How far each of o's and the gradients' bounds grows per unit of the scores' rounding scale, in units of
# `score_rounding`: 9 times the worst the tf32 emulation reached (0.11, above).
SCORE_ROUNDING_REACH = 1.0
# A kernel also forms each probability's exponent from its score in fp32 steps that each round to FP32_ROUNDING of
# the score's size, not of its rounding scale: the score's scaling (by log2(e)/sqrt(d), where it works in base 2),
# the subtraction of the running maximum or of L, L's conversion to natural log for the saved tensor and back in
# the backward. Where scores are large that moves P, and o and every gradient with it, by more than the dot's
# rounding: at scores spread 30 and 60 (up to about 250), d 64 to 128, fp32 on a CPU, the worst of 8 cases each
# used 1.28 of the bounds without this allowance (this project's Triton Function; its PyTorch Function 0.94, the
# from-scratch ones 0.56 and 0.34) and 0.43 with it. Each bound grows by this many roundings of the scores'
# largest softmax-weighted size: a softmax scale 1% off moves the exponents by 1% of it, 40,000 times as much.
EXPONENT_ROUNDINGS = 4.0
# Standard deviations of rounding noise the projection allows for on top of its bound: its noise is the
# normwise error over sqrt(elements), which small tensors (a few rows of d columns) leave large.
PROJECTION_NOISE_SIGMAS = 4.0


# exp of a score above this overflows fp32 (the log of its largest value, 3.4e38).
EXP_OVERFLOW_SCORE = math.log(torch.finfo(torch.float32).max)
# A result's error is named a scale error where more than this share of its square lies along the reference, and
# the result is within SCALE_ERROR_LARGEST of the reference's size (a result a fraction of it has lost more than
# its scale).
SCALE_ERROR_SHARE = 0.8
SCALE_ERROR_LARGEST = 0.1


def tolerance_for(device: torch.device | str, dtype: torch.dtype) -> Tolerance:
    device_type = torch.device(device).type
    try:
        return TOLERANCES[(device_type, dtype)]
    except KeyError:
        raise ValueError(f"no FlashAttention tolerance for {dtype} on {device_type}") from None


def _where(index: tuple[int, ...], name: str, shape: tuple[int, ...]) -> str:
    """Words for an element's place: its leading (batch, head) index and its query or key row."""
    row_kind = "key" if name in ("dk", "dv") else "query"
    lead = index[:-1] if name == "L" else index[:-2]
    row = index[-1] if name == "L" else index[-2]
    rows = shape[-1] if name == "L" else shape[-2]
    at = f"{row_kind} {row} of {rows}"
    return f"{at}, batch index {tuple(lead)}" if lead else at


def _worst(error: torch.Tensor) -> tuple[int, ...]:
    flat = int(error.abs().reshape(-1).argmax())
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), error.shape))


def discrepancies(got: dict[str, torch.Tensor], reference: Reference, tolerance: Tolerance,
                  expected_dtype: torch.dtype) -> list[str]:
    """A sentence for each result in `got` (results by name, any of RESULTS) that breaks the contract: a shape
    or dtype other than the contract's, values that are not finite, or bounds exceeded, with the worst
    element's place and each bound. L first: where it is wrong, the forward is. [] where `got` conforms."""
    found = []
    score_allowance = (SCORE_ROUNDING_REACH * tolerance.score_rounding * reference.score_scale
                       + EXPONENT_ROUNDINGS * FP32_ROUNDING * reference.row_score_magnitudes.max().item())
    for name in sorted(got, key=("L", "o", "dq", "dk", "dv").index):
        actual, expected = got[name], reference.results[name]
        what = "the saved logsumexp L" if name == "L" else name
        want_dtype = torch.float32 if name == "L" else expected_dtype
        if tuple(actual.shape) != tuple(expected.shape):
            found.append(f"{what} has shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
            continue
        if actual.dtype != want_dtype:
            found.append(f"{what} is {actual.dtype}, expected {want_dtype}")
        values = actual.detach().to(expected.device, torch.float64)
        finite = torch.isfinite(values)
        if not finite.all():
            first = tuple(int(i) for i in (~finite).nonzero()[0])
            overflow = (f"; the largest score is {reference.max_score:.3g}, past exp's range in fp32: is the "
                        "running maximum subtracted before exp?" if reference.max_score > EXP_OVERFLOW_SCORE else "")
            found.append(f"{what} has {int((~finite).sum())} NaN or infinite values (the first at "
                         f"{_where(first, name, tuple(expected.shape))}){overflow}")
            continue
        error = values - expected
        sentence = (_logsumexp_discrepancy(error, reference, tolerance) if name == "L"
                    else _result_discrepancy(name, error, reference, tolerance, score_allowance))
        if sentence:
            found.append(sentence)
    return found


def _logsumexp_discrepancy(error: torch.Tensor, reference: Reference, tolerance: Tolerance) -> str | None:
    allowed = (tolerance.logsumexp * reference.row_score_scales.clamp_min(1.0)
               + tolerance.score_bias * reference.row_score_magnitudes)
    worst = _worst(error.abs() / allowed)
    if error[worst].abs() <= allowed[worst]:
        return None
    return (f"the saved logsumexp L is off by {error[worst].item():+.3g} at {_where(worst, 'L', tuple(error.shape))}"
            f" (where it is {reference.results['L'][worst].item():.6g}), allowed {allowed[worst].item():.2g}")




def _result_discrepancy(name: str, error: torch.Tensor, reference: Reference, tolerance: Tolerance,
                        score_allowance: float) -> str | None:
    """One sentence naming every bound that `name`'s error exceeds, or None."""
    expected, scale, magnitude = reference.results[name], reference.scales[name], reference.magnitudes[name]
    shape = tuple(error.shape)
    if magnitude == 0.0:  # every value is 0 (causal, and no query sees the keys these gradients are of)
        worst = _worst(error)
        return None if error[worst] == 0 else (f"{name} should be 0 and is {error[worst].item():.3g} at "
                                               f"{_where(worst, name, shape)}")
    exceeded = []
    elementwise, allowed = error.abs().max().item() / magnitude, tolerance.elementwise + score_allowance
    if elementwise > allowed:
        exceeded.append(f"by {elementwise:.2g} of its magnitude ({magnitude:.3g}) at "
                        f"{_where(_worst(error), name, shape)}, allowed {allowed:.2g}")
    scale_norm, error_norm = scale.norm().item(), error.norm().item()
    normwise, allowed = error_norm / scale_norm, tolerance.normwise + score_allowance
    if normwise > allowed:
        exceeded.append(f"by {normwise:.2g} of its norm over its {error.numel()} values, allowed {allowed:.2g}")
    expected_norm = expected.norm().item()
    scale_error = False
    if expected_norm > 0:
        gain_error = (error * expected).sum().item() / expected_norm**2
        allowed = (tolerance.projection + score_allowance
                   + PROJECTION_NOISE_SIGMAS * tolerance.normwise / math.sqrt(_effective_count(scale)))
        if abs(gain_error) * expected_norm / scale_norm > allowed:
            exceeded.append(f"as {1 + gain_error:.4f} times the reference by least squares, rounding allows "
                            f"1 +- {allowed * scale_norm / expected_norm:.2g}")
            scale_error = (abs(gain_error) <= SCALE_ERROR_LARGEST
                           and (gain_error * expected_norm / error_norm) ** 2 > SCALE_ERROR_SHARE)
    if not exceeded:
        return None
    return f"{name} differs " + "; ".join(exceeded) + (" (a scale error)" if scale_error else "")


def _effective_count(scale: torch.Tensor) -> float:
    """How many of `scale`'s elements count, by their squares' participation ratio: all n where they are
    alike, fewer where a few dominate (rows no query sees, a peaked softmax), whose rounding averages less."""
    squares = scale.square()
    return max(1.0, squares.sum().item() ** 2 / max(squares.square().sum().item(), 1e-300))


# ---------------------------------------------------------------------------------------------------- inputs

# How attention inputs are laid out in practice, each a view an implementation must read as it is: contiguous;
# heads transposed out of (batch, sequence, heads, d) memory; sliced, a column slice of a fused (..., sequence,
# 3 d) QKV projection; strided, every other feature (a last dim whose stride is not 1).
LAYOUTS = ("contiguous", "transposed", "sliced", "strided")


def make_tensor(lead: tuple[int, ...], n: int, d: int, layout: str, dtype: torch.dtype, device,
                spread: float = 1.0) -> torch.Tensor:
    """A (*lead, n, d) tensor of normals with standard deviation `spread` in one of LAYOUTS (one without leading
    dims has no heads to transpose: `transposed` lays it out as `strided`)."""

    def normals(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=device) * spread).to(dtype)

    if layout == "contiguous":
        return normals(*lead, n, d)
    if layout == "transposed" and lead:
        return normals(*lead[:-1], n, lead[-1], d).transpose(-3, -2)
    if layout == "sliced":
        return normals(*lead, n, 3 * d)[..., d:2 * d]
    if layout in ("strided", "transposed"):
        return normals(*lead, n, 2 * d)[..., ::2]
    raise ValueError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
