"""The LM head fused with the cross-entropy, chunk by chunk: loss and gradients against a float64 reference
and against lm_loss on the whole logits, the loss's dtype, frozen inputs, bad input, second order refused,
and a peak that grows with the chunk, not the tokens (on a CPU), and stays below the whole fp32 logits'
(on a GPU, in bf16)."""

import math
import re
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from cs336_systems.linear_cross_entropy import linear_cross_entropy
from cs336_systems.lm_training import lm_loss
from cs336_systems.profiling.memory import peak_memory_increase

VOCAB_SIZE = 37
D_MODEL = 16
# The logits' standard deviation: large enough that the softmax is far from uniform, small enough that
# bf16's rounding of the logits stays a small part of them.
LOGIT_SCALE = 2.0
UPSTREAM_GRADIENT = 3.7  # not 1: backward must scale the gradients forward made by the loss's gradient


def _cpu_matmul_supports(dtype: torch.dtype) -> bool:
    try:
        torch.ones(2, 2, dtype=dtype) @ torch.ones(2, 2, dtype=dtype)
    except RuntimeError:
        return False
    return True


FLOAT16 = pytest.param(torch.float16, id="float16", marks=pytest.mark.skipif(
    not _cpu_matmul_supports(torch.float16), reason="this CPU build of torch has no float16 matmul"))
DTYPES = [pytest.param(torch.float64, id="float64"), pytest.param(torch.float32, id="float32"),
          pytest.param(torch.bfloat16, id="bfloat16"), FLOAT16]

# Tolerances are fractions of the magnitude of the terms each result sums (see _float64_reference): a result
# smaller than its terms (the target's logit cancelling the log-sum-exp, a softmax-weighted row cancelling the
# target's row) keeps its terms' rounding errors. Each names the worst fraction measured over 300 seeds of the
# shapes below, and is 2-10 times that.
LOSS_RTOL = {
    torch.float64: 1e-12,  # float64 both, summed in another order: 2.6e-16
    torch.float32: 1e-6,   # fp32 logits and sums: 1.2e-7
    torch.bfloat16: 1e-2,  # logits rounded to bf16's 8 significant bits: 1.9e-3
    torch.float16: 1e-3,   # logits rounded to fp16's 11 significant bits: 2.0e-4
}
GRAD_RTOL = {
    torch.float64: 1e-12,  # 2.6e-15
    torch.float32: 1e-5,   # 1.4e-6
    # Logits of up to ~8 rounded to 8 bits move probabilities by up to 3%, then three more roundings: 2.6e-2
    # (2.4e-2 at the GPU test's shape, on a CPU).
    torch.bfloat16: 6e-2,
    torch.float16: 1.5e-2,  # the same with 11 bits: 4.8e-3
}
# Against lm_loss on the same dtype's logits. The loss: the same rounded logits, the fp32 softmax summed in
# another order: 3.1e-7. The gradients round more often than autograd's (the upstream scale is applied in the
# input dtype, the weight's is summed over chunks in fp32 and then rounded): 2 eps at worst, so 4 eps.
LM_LOSS_LOSS_RTOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-6, torch.float16: 1e-6}
LM_LOSS_GRAD_RTOL = {torch.float64: 1e-12, torch.float32: 1e-5,
                     torch.bfloat16: 4 * torch.finfo(torch.bfloat16).eps,
                     torch.float16: 4 * torch.finfo(torch.float16).eps}
# A few scalars and per-chunk index tensors, beside the tensors the peak-memory tests count.
PEAK_SLACK_BYTES = 16 * 1024

# Leading shapes and chunk sizes: 12 tokens in chunks of 1, a divisor (4), a non-divisor (5) and more
# than all of them (20); a single token, whose targets are a 0-d tensor, in chunks of 1 and of more.
SHAPES_AND_CHUNKS = [
    *(pytest.param(lead, chunk, id=f"{name}-chunk{chunk}") for name, lead in (("batch_seq", (3, 4)), ("tokens", (12,)))
      for chunk in (1, 4, 5, 20)),
    *(pytest.param((), chunk, id=f"single_token-chunk{chunk}") for chunk in (1, 20)),
]


class Result(NamedTuple):
    loss: torch.Tensor
    grad_hidden: torch.Tensor | None
    grad_weight: torch.Tensor | None


def _inputs(lead: tuple[int, ...], dtype: torch.dtype, *, vocab_size: int = VOCAB_SIZE, d_model: int = D_MODEL,
            seed: int = 0, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden (*lead, d_model) and weight (vocab_size, d_model) of dtype, drawn in float64 and rounded, so that
    the float64 reference sees exactly the values the function does; targets (*lead) int64."""
    generator = torch.Generator(device).manual_seed(seed)
    hidden = LOGIT_SCALE * torch.randn(*lead, d_model, generator=generator, dtype=torch.float64, device=device)
    weight = torch.randn(vocab_size, d_model, generator=generator, dtype=torch.float64, device=device)
    weight /= math.sqrt(d_model)
    targets = torch.randint(vocab_size, lead, generator=generator, device=device)
    return hidden.to(dtype), weight.to(dtype), targets


def _loss_and_gradients(loss_fn, hidden, weight, targets, *, upstream: float = UPSTREAM_GRADIENT) -> Result:
    """loss_fn's loss, and the gradients of upstream * loss with respect to fresh leaf copies of hidden and weight."""
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    loss = loss_fn(hidden, weight, targets)
    (loss * upstream).backward()
    return Result(loss.detach(), hidden.grad, weight.grad)


def _float64_reference(hidden, weight, targets, *, upstream: float = UPSTREAM_GRADIENT) -> tuple[Result, Result]:
    """The loss and the gradients of upstream * loss in float64, and the magnitudes of the terms each sums: for
    the loss, per token, the log-sum-exp's and the largest logit's (rounding the logits moves a token's loss by
    a fraction of the largest); for the gradients, softmax plus one-hot (the terms of d loss / d logits, whose
    difference cancels where the target's probability nears 1) through |weight| or |hidden|. Each of those
    terms, and each gradient, at least the inputs' dtype's smallest normal number times |upstream|: below it
    fp16 has only subnormals, whose spacing is that number's eps (the least likely tokens' gradients underflow,
    in lm_loss as here)."""
    smallest_normal = torch.finfo(hidden.dtype).smallest_normal
    hidden = hidden.detach().double().requires_grad_()
    weight = weight.detach().double().requires_grad_()
    vocab_size, d_model = weight.shape
    logits, flat_targets = (hidden @ weight.T).reshape(-1, vocab_size), targets.reshape(-1)
    loss = F.cross_entropy(logits, flat_targets)
    (loss * upstream).backward()
    with torch.no_grad():
        grad_logits = ((logits.softmax(-1) + F.one_hot(flat_targets, vocab_size)) / len(logits))
        grad_logits = grad_logits.clamp_min(smallest_normal) * abs(upstream)
        floor = smallest_normal * abs(upstream)
        magnitudes = Result((logits.logsumexp(-1).abs() + logits.abs().amax(-1)).mean(),
                            (grad_logits @ weight.abs()).reshape(hidden.shape).clamp_min(floor),
                            (grad_logits.T @ hidden.abs().reshape(-1, d_model)).clamp_min(floor))
    return Result(loss.detach(), hidden.grad, weight.grad), magnitudes


def _assert_close(actual: Result, expected: Result, magnitudes: Result, loss_rtol: float, grad_rtol: float) -> None:
    """Each element of each result within rtol of the magnitude of the terms it sums; a None result (no
    gradient) only where None is expected."""
    for name, rtol in (("loss", loss_rtol), ("grad_hidden", grad_rtol), ("grad_weight", grad_rtol)):
        got, want, magnitude = getattr(actual, name), getattr(expected, name), getattr(magnitudes, name)
        if want is None or got is None:
            assert got is want is None, f"{name}: got {got}, expected {want}"
            continue
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        error = (got.double() - want.double()).abs()
        worst = (error / magnitude).nan_to_num(0.0).max().item()  # 0 / 0 where the vocabulary has one token
        assert (error <= rtol * magnitude).all(), f"{name}: error up to {worst:.3g} of its terms' magnitude, " \
                                                  f"allowed {rtol:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead, chunk_tokens", SHAPES_AND_CHUNKS)
def test_loss_and_gradients_match_float64_cross_entropy(lead, chunk_tokens, dtype):
    hidden, weight, targets = _inputs(lead, dtype, seed=len(lead) * 100 + chunk_tokens)
    got = _loss_and_gradients(lambda h, w, t: linear_cross_entropy(h, w, t, chunk_tokens=chunk_tokens),
                              hidden, weight, targets)
    assert got.loss.shape == () and got.grad_hidden.dtype == got.grad_weight.dtype == dtype
    _assert_close(got, *_float64_reference(hidden, weight, targets), LOSS_RTOL[dtype], GRAD_RTOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_tokens", [1, 5, 8192])
def test_it_equals_lm_loss_on_the_whole_logits_in_the_same_dtype(chunk_tokens, dtype):
    hidden, weight, targets = _inputs((3, 4), dtype, seed=chunk_tokens)
    got = _loss_and_gradients(lambda h, w, t: linear_cross_entropy(h, w, t, chunk_tokens=chunk_tokens),
                              hidden, weight, targets)
    expected = _loss_and_gradients(lambda h, w, t: lm_loss(h @ w.T, t), hidden, weight, targets)
    _, magnitudes = _float64_reference(hidden, weight, targets)
    assert got.loss.dtype == expected.loss.dtype
    _assert_close(got, expected, magnitudes, LM_LOSS_LOSS_RTOL[dtype], LM_LOSS_GRAD_RTOL[dtype])


@pytest.mark.parametrize("dtype, loss_dtype", [
    (torch.float64, torch.float64), (torch.float32, torch.float32), (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32)])
def test_the_loss_is_fp32_at_least_and_float64_for_float64_inputs(dtype, loss_dtype):
    hidden, weight, targets = _inputs((5,), dtype)
    assert linear_cross_entropy(hidden, weight, targets).dtype == loss_dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("trained", ["hidden", "weight", "neither"])
def test_only_the_inputs_that_require_grad_get_one_and_the_result_still_matches(trained, dtype):
    hidden, weight, targets = _inputs((3, 4), dtype, seed=7)
    hidden.requires_grad_(trained == "hidden")  # a leaf either way
    weight.requires_grad_(trained == "weight")
    loss = linear_cross_entropy(hidden, weight, targets, chunk_tokens=5)
    assert loss.requires_grad == (trained != "neither")
    if loss.requires_grad:
        (loss * UPSTREAM_GRADIENT).backward()
    expected, magnitudes = _float64_reference(hidden, weight, targets)
    expected = expected._replace(grad_hidden=expected.grad_hidden if trained == "hidden" else None,
                                 grad_weight=expected.grad_weight if trained == "weight" else None)
    _assert_close(Result(loss.detach(), hidden.grad, weight.grad), expected, magnitudes,
                  LOSS_RTOL[dtype], GRAD_RTOL[dtype])


def test_int32_targets_give_what_int64_targets_give():
    hidden, weight, targets = _inputs((3, 4), torch.float32, seed=3)

    def fused(h, w, t):
        return linear_cross_entropy(h, w, t, chunk_tokens=5)

    for got, expected in zip(_loss_and_gradients(fused, hidden, weight, targets.int()),
                             _loss_and_gradients(fused, hidden, weight, targets)):
        assert torch.equal(got, expected)


def test_a_non_contiguous_hidden_and_strided_targets_match_float64_cross_entropy():
    hidden, weight, targets = _inputs((12,), torch.float32, seed=5)
    transposed_hidden = hidden.T.contiguous().T  # the same values, column-major
    strided_targets = torch.stack([targets, targets], dim=1)[:, 0]
    assert not transposed_hidden.is_contiguous() and not strided_targets.is_contiguous()
    got = _loss_and_gradients(lambda h, w, t: linear_cross_entropy(h.T.contiguous().T, w, t, chunk_tokens=5),
                              hidden, weight, strided_targets)
    _assert_close(got, *_float64_reference(hidden, weight, targets), LOSS_RTOL[torch.float32],
                  GRAD_RTOL[torch.float32])


def _bad_input_cases():
    hidden, weight, targets = _inputs((3, 4), torch.float32)
    vocab = weight.shape[0]
    meta_targets = torch.empty(targets.shape, dtype=torch.long, device="meta")
    return [
        pytest.param(hidden.double(), weight, targets, {}, TypeError,
                     "hidden and weight must share one floating-point dtype, got torch.float64 and torch.float32",
                     id="dtype_mismatch"),
        pytest.param(hidden.long(), weight.long(), targets, {}, TypeError,
                     "share one floating-point dtype, got torch.int64 and torch.int64", id="integer_hidden"),
        pytest.param(hidden, weight, targets.float(), {}, TypeError,
                     "targets must be integer token ids, got torch.float32", id="float_targets"),
        pytest.param(hidden, weight, targets > 0, {}, TypeError,
                     "targets must be integer token ids, got torch.bool", id="bool_targets"),
        pytest.param(hidden, weight[None], targets, {}, ValueError,
                     f"need hidden (..., d_model) and weight (vocab_size, d_model), got (3, 4, {D_MODEL}) and "
                     f"(1, {vocab}, {D_MODEL})", id="weight_3d"),
        pytest.param(hidden, weight[0], targets, {}, ValueError,
                     f"and weight (vocab_size, d_model), got (3, 4, {D_MODEL}) and ({D_MODEL},)", id="weight_1d"),
        pytest.param(hidden, weight[:, :-1], targets, {}, ValueError,
                     f"got (3, 4, {D_MODEL}) and ({vocab}, {D_MODEL - 1})", id="d_model_mismatch"),
        pytest.param(hidden, weight, targets[:, :3], {}, ValueError,
                     "targets must have hidden's leading shape (3, 4) with at least one token, got (3, 3)",
                     id="targets_shape_mismatch"),
        pytest.param(hidden, weight, targets.reshape(-1), {}, ValueError,
                     "leading shape (3, 4) with at least one token, got (12,)", id="targets_flattened"),
        pytest.param(hidden[:0], weight, targets[:0], {}, ValueError,
                     "leading shape (0, 4) with at least one token, got (0, 4)", id="empty_targets"),
        pytest.param(hidden, weight, targets.index_fill(1, torch.tensor([2]), vocab), {}, ValueError,
                     f"targets must lie in [0, {vocab}), got values from", id="target_equal_to_vocab_size"),
        pytest.param(hidden, weight, targets.index_fill(1, torch.tensor([2]), -1), {}, ValueError,
                     f"targets must lie in [0, {vocab}), got values from -1 to", id="negative_target"),
        pytest.param(hidden, weight, meta_targets, {}, ValueError,
                     "hidden, weight and targets must be on one device, got cpu, cpu and meta", id="device_mismatch"),
        pytest.param(hidden, weight, targets, dict(chunk_tokens=0), ValueError, "chunk_tokens must be >= 1, got 0",
                     id="chunk_zero"),
        pytest.param(hidden, weight, targets, dict(chunk_tokens=-3), ValueError, "chunk_tokens must be >= 1, got -3",
                     id="chunk_negative"),
        pytest.param(hidden, weight, targets, dict(chunk_tokens=4.0), TypeError,
                     "chunk_tokens must be an int, got float", id="chunk_float"),
        pytest.param(hidden, weight, targets, dict(chunk_tokens=True), TypeError,
                     "chunk_tokens must be an int, got bool", id="chunk_bool"),
    ]


@pytest.mark.parametrize("hidden, weight, targets, kwargs, error, message", _bad_input_cases())
def test_bad_input_is_refused_with_a_message_that_names_it(hidden, weight, targets, kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        linear_cross_entropy(hidden, weight, targets, **kwargs)


# once_differentiable's backward runs without a graph: its gradients have no grad_fn when the upstream gradient
# needs none (torch.autograd.grad's default ones), and one that raises on use when it does.
@pytest.mark.parametrize("upstream_requires_grad, message", [
    (False, "does not require grad and does not have a grad_fn"),
    (True, "trying to differentiate twice a function that was marked with @once_differentiable")])
def test_a_second_derivative_is_refused(upstream_requires_grad, message):
    hidden, weight, targets = _inputs((3, 4), torch.float64)
    hidden.requires_grad_()
    weight.requires_grad_()
    upstream = torch.tensor(UPSTREAM_GRADIENT, dtype=torch.float64, requires_grad=upstream_requires_grad)
    grad_hidden, grad_weight = torch.autograd.grad(linear_cross_entropy(hidden, weight, targets), (hidden, weight),
                                                   grad_outputs=upstream, create_graph=True)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        (grad_hidden.sum() + grad_weight.sum()).backward()


@st.composite
def _problems(draw):
    n_tokens = draw(st.integers(1, 48), label="n_tokens")
    return dict(n_tokens=n_tokens,
                vocab_size=draw(st.integers(1, 64), label="vocab_size"),
                d_model=draw(st.integers(1, 32), label="d_model"),
                chunk_tokens=draw(st.integers(1, n_tokens + 8), label="chunk_tokens"),
                dtype=draw(st.sampled_from([torch.float32, torch.float64]), label="dtype"),
                seed=draw(st.integers(0, 2**32 - 1), label="seed"))


@settings(max_examples=30, deadline=None)
@given(_problems())
def test_any_chunking_of_any_shape_matches_float64_cross_entropy(problem):
    dtype = problem["dtype"]
    hidden, weight, targets = _inputs((problem["n_tokens"],), dtype, vocab_size=problem["vocab_size"],
                                      d_model=problem["d_model"], seed=problem["seed"])
    got = _loss_and_gradients(lambda h, w, t: linear_cross_entropy(h, w, t, chunk_tokens=problem["chunk_tokens"]),
                              hidden, weight, targets)
    _assert_close(got, *_float64_reference(hidden, weight, targets), LOSS_RTOL[dtype], GRAD_RTOL[dtype])


def _forward_backward_peak_bytes(n_tokens: int, vocab_size: int, d_model: int, chunk_tokens: int,
                                  dtype: torch.dtype, device: str) -> tuple[int, torch.Tensor, torch.Tensor,
                                                                            torch.Tensor, torch.Tensor]:
    """The peak bytes allocated, above those before, by forward and backward on fresh inputs; the loss; and
    hidden, weight (which then hold their gradients) and targets."""
    hidden, weight, targets = _inputs((n_tokens,), dtype, vocab_size=vocab_size, d_model=d_model, device=device)
    hidden.requires_grad_()
    weight.requires_grad_()
    if device == "cuda":  # a first small call creates cuBLAS's workspace, which the measured one would count
        linear_cross_entropy(hidden[:8], weight, targets[:8]).backward()
        hidden.grad = weight.grad = None
    losses = []

    def forward_backward():
        losses.append(linear_cross_entropy(hidden, weight, targets, chunk_tokens=chunk_tokens))
        losses[-1].backward()

    peak_bytes, _ = peak_memory_increase(forward_backward, device)
    return peak_bytes, losses[0].detach(), hidden, weight, targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cpu_more_tokens_raise_the_peak_only_by_their_hidden_gradient(dtype):
    vocab_size, d_model, chunk_tokens, few_tokens, many_tokens = 4000, 64, 128, 512, 2048
    few_peak_bytes, *_ = _forward_backward_peak_bytes(few_tokens, vocab_size, d_model, chunk_tokens, dtype, "cpu")
    many_peak_bytes, *_ = _forward_backward_peak_bytes(many_tokens, vocab_size, d_model, chunk_tokens, dtype, "cpu")
    hidden_gradient_growth_bytes = (many_tokens - few_tokens) * d_model * dtype.itemsize
    assert many_peak_bytes - few_peak_bytes <= hidden_gradient_growth_bytes + PEAK_SLACK_BYTES
    assert many_peak_bytes < many_tokens * vocab_size * 4  # below the whole fp32 logits


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_in_bf16_the_peak_stays_below_the_fp32_logits_and_the_result_matches_float64():
    n_tokens, vocab_size, d_model, chunk_tokens = 4096, 32_000, 512, 1024
    # 524 MB; the chunked peak measured on a CPU is 397 MB, about three chunks' fp32 logits and the weight's
    # fp32 gradient.
    full_fp32_logits_bytes = n_tokens * vocab_size * 4
    peak_allocated_bytes, loss, hidden, weight, targets = _forward_backward_peak_bytes(
        n_tokens, vocab_size, d_model, chunk_tokens, torch.bfloat16, "cuda")
    assert peak_allocated_bytes < full_fp32_logits_bytes

    _assert_close(Result(loss, hidden.grad, weight.grad), *_float64_reference(hidden, weight, targets, upstream=1.0),
                  LOSS_RTOL[torch.bfloat16], GRAD_RTOL[torch.bfloat16])
