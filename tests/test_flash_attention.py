"""FlashAttention-2 (PyTorch and Triton autograd Functions) against a float64 reference.

Property tests draw leading dims, sequence lengths (tails that are no multiple of a tile
included), head dims, causality, dtype and memory layout. Without a GPU the Triton kernels run in
the interpreter on small shapes in fp32 and fp16; on a GPU the shapes grow, bf16 joins, and the
`gpu` tests check 16,384-token accuracy and that 65,536 tokens never allocate n x n.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cs336_systems.attention import flash_triton
from cs336_systems.attention.flash_pytorch import (
    MASKED_SCORE_BIAS,
    MAX_HEAD_DIM,
    FlashAttentionPytorch,
    flash_attention_pytorch,
)
from cs336_systems.attention.flash_triton import FlashAttentionTriton, flash_attention_triton
from cs336_systems.model import ModelConfig, TransformerLM

# The Triton interpreter turns loop bounds into ints through a NumPy conversion that NumPy deprecates;
# the warning is the interpreter's, once per loop, and says nothing about these kernels.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

FUNCTIONS = {"pytorch": FlashAttentionPytorch, "triton": FlashAttentionTriton}

# Largest error allowed, as a fraction of the reference's magnitude (per tensor: o, L, dq, dk, dv;
# reference_attention says what magnitude means for each). The reference is computed in float64
# from the very same (already rounded) inputs, so what remains is the implementation's arithmetic:
TOLERANCES = {
    # On a GPU tl.dot rounds fp32 operands to tf32 (unit roundoff 2^-11 = 4.9e-4): scores, P and
    # every gradient carry errors of a few 1e-4 relative, more after the backward's cancellation
    # in dP - D; the largest over ~1e5 elements reached 5.4e-3 (dk, d=16, N=848, on an H100).
    # On CPU (interpreter, PyTorch) fp32 is exact to ~1e-6.
    torch.float32: 1e-2,
    # P and dS are rounded to fp16 (unit roundoff 4.9e-4) before their dots, outputs on store.
    torch.float16: 5e-3,
    # bf16 keeps 8 bits (unit roundoff 3.9e-3): eight times fp16's rounding error.
    torch.bfloat16: 4e-2,
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
    their scale is at least that of the P * dP part alone.
    """
    q, k, v, do = (t.detach().double() for t in (q, k, v, do))
    scale = 1.0 / math.sqrt(q.shape[-1])
    o, L, dq = torch.empty_like(q), torch.empty(q.shape[:-1], dtype=q.dtype, device=q.device), torch.empty_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dq_terms, dk_terms = torch.empty_like(q), torch.zeros_like(k)
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
    results = (o, L, dq, dk, dv)
    magnitudes = [r.abs().max() for r in results]
    magnitudes[1] = magnitudes[1].clamp_min(1.0)
    magnitudes[2] = torch.maximum(magnitudes[2], dq_terms.abs().max())
    magnitudes[3] = torch.maximum(magnitudes[3], dk_terms.abs().max())
    return results, tuple(m.item() for m in magnitudes)


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.double() - expected).abs().max().item()


def make_tensor(lead: tuple[int, ...], n: int, d: int, layout: str, dtype, device) -> torch.Tensor:
    """A (*lead, n, d) tensor of standard normals laid out as attention inputs come in practice."""
    if layout == "contiguous":
        return torch.randn(*lead, n, d, dtype=dtype, device=device)
    if layout == "heads_transposed" and lead:  # (batch, seq, heads, d) viewed as (batch, heads, seq, d)
        return torch.randn(*lead[:-1], n, lead[-1], d, dtype=dtype, device=device).transpose(-3, -2)
    if layout == "fused_projection":  # a column slice of a (..., seq, 3 d) fused QKV output
        return torch.randn(*lead, n, 3 * d, dtype=dtype, device=device)[..., d:2 * d]
    # strided_features (and heads_transposed without a head dim): every other feature
    return torch.randn(*lead, n, 2 * d, dtype=dtype, device=device)[..., ::2]


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
    tolerance = TOLERANCES[dtype]
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


# ------------------------------------------------------------------------------ property tests

# Examples per implementation: the interpreter runs Triton programs one by one in Python, every new
# shape class costs the PyTorch backward a torch.compile, and on a GPU every new (head dim, dtype,
# causal) combination a Triton compile: seconds each, so the counts stay small.
CPU_EXAMPLES = {"pytorch": 6, "triton": 15}
GPU_EXAMPLES = {"pytorch": 10, "triton": 40}


def _draw_case(data, on_gpu: bool):
    lead = data.draw(st.sampled_from([(), (3,), (2, 2), (1, 3), (2, 1, 2)] if not on_gpu
                                     else [(2,), (2, 4), (1, 8), (2, 2, 2)]), label="leading dims")
    max_len = 1100 if on_gpu else 70
    n_queries = data.draw(st.integers(1, max_len), label="n_queries")
    n_keys = data.draw(st.one_of(st.just(n_queries), st.integers(1, max_len)), label="n_keys")
    d = data.draw(st.sampled_from([16, 32, 64, 80, 128] if on_gpu else [8, 16, 32, 64]), label="head dim")
    dtypes = [torch.float32, torch.float16, torch.bfloat16] if on_gpu else [torch.float32, torch.float16]
    dtype = data.draw(st.sampled_from(dtypes), label="dtype")
    is_causal = data.draw(st.booleans(), label="is_causal")
    layouts = [data.draw(st.sampled_from(LAYOUTS), label=f"{name} layout") for name in "qkv"]
    return lead, n_queries, n_keys, d, dtype, is_causal, layouts


@pytest.mark.flash
@pytest.mark.parametrize("impl", FUNCTIONS)
def test_output_logsumexp_and_gradients_match_float64_reference(impl, run_settings, device):
    examples = (GPU_EXAMPLES if run_settings.on_gpu else CPU_EXAMPLES)[impl]

    @given(data=st.data())
    @settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    def check(data):
        lead, n_queries, n_keys, d, dtype, is_causal, layouts = _draw_case(data, run_settings.on_gpu)
        q = make_tensor(lead, n_queries, d, layouts[0], dtype, device)
        k = make_tensor(lead, n_keys, d, layouts[1], dtype, device)
        v = make_tensor(lead, n_keys, d, layouts[2], dtype, device)
        do = torch.randn(*lead, n_queries, d, dtype=dtype, device=device)
        assert_matches_reference(impl, q, k, v, do, is_causal)

    check()


def test_reference_matches_autograd_of_naive_attention():
    q, k, v, do = leaf_inputs((2,), 9, 13, 8, torch.float64, "cpu")
    for is_causal in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        s = leaves[0] @ leaves[1].transpose(-2, -1) / math.sqrt(8)
        if is_causal:
            s = torch.where(torch.ones(9, 13, dtype=torch.bool).tril(), s, s + MASKED_SCORE_BIAS)
        o = torch.softmax(s, dim=-1) @ leaves[2]
        o.backward(do)
        expected = (o, torch.logsumexp(s, dim=-1), *(t.grad for t in leaves))
        for got, want in zip(reference_attention(q, k, v, do, is_causal)[0], expected):
            torch.testing.assert_close(got, want.detach())


# ------------------------------------------------------------------------------- explicit cases

@pytest.mark.parametrize("impl", FUNCTIONS)
@pytest.mark.parametrize("is_causal", [False, True])
def test_tails_that_are_no_multiple_of_any_tile(impl, is_causal, device):
    # 45 and 70: neither a multiple of 16 or 32, and n_queries < n_keys then n_queries > n_keys.
    for n_queries, n_keys in ((45, 70), (70, 45), (1, 1)):
        q, k, v, do = leaf_inputs((2, 3), n_queries, n_keys, 32, torch.float32, device)
        assert_matches_reference(impl, q, k, v, do, is_causal)


def _apply_takes_keywords() -> bool:
    """torch 2.13 hands keyword arguments of Function.apply to forward; earlier releases refuse them."""
    x = torch.ones(1, 2, 16)
    try:
        FlashAttentionPytorch.apply(x, x, x, is_causal=True)
    except TypeError as error:
        assert "keyword" in str(error)
        return False
    return True


ATTENTION_FUNCTIONS = {"pytorch": flash_attention_pytorch, "triton": flash_attention_triton}


@pytest.mark.parametrize("impl", FUNCTIONS)
def test_is_causal_is_keyword_or_positional_and_defaults_to_false(impl, device):
    q, k, v, _ = leaf_inputs((2,), 20, 20, 16, torch.float32, device)
    apply, attend = FUNCTIONS[impl].apply, ATTENTION_FUNCTIONS[impl]
    torch.testing.assert_close(attend(q, k, v, is_causal=True), apply(q, k, v, True), rtol=0, atol=0)
    torch.testing.assert_close(apply(q, k, v), apply(q, k, v, False), rtol=0, atol=0)
    torch.testing.assert_close(attend(q, k, v), apply(q, k, v, False), rtol=0, atol=0)
    assert not torch.allclose(apply(q, k, v), apply(q, k, v, True))


# torch 2.11's Function.apply refuses keywords. The PyTorch Function keeps that apply: overriding it
# to take keywords made torch.compile (2.11) trace wrong gradients. The Triton Function's own apply
# (which torch.compile does not run) and the attention functions take is_causal as a keyword anywhere.
@pytest.mark.parametrize("impl", FUNCTIONS)
def test_apply_takes_is_causal_as_a_keyword(impl, device):
    if impl == "pytorch" and not _apply_takes_keywords():
        pytest.skip(f"torch {torch.__version__}'s Function.apply refuses keywords")
    q, k, v, _ = leaf_inputs((2,), 20, 20, 16, torch.float32, device)
    apply = FUNCTIONS[impl].apply
    torch.testing.assert_close(apply(q, k, v, is_causal=True), apply(q, k, v, True), rtol=0, atol=0)


@pytest.mark.parametrize("impl", FUNCTIONS)
@pytest.mark.parametrize("lead", [(4,), (2, 3)])
def test_forward_saves_L_as_the_only_tensor_shaped_like_the_query_rows(impl, lead, device):
    q, k, v, _ = leaf_inputs(lead, 24, 24, 16, torch.float16, device)
    o = FUNCTIONS[impl].apply(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), True)
    saved = o.grad_fn.saved_tensors
    rows = [t for t in saved if t.shape == (*lead, 24)]
    assert len(rows) == 1 and rows[0].dtype == torch.float32
    assert len(saved) == 5  # L, q, k, v, o: nothing of size n_queries x n_keys
    expected, magnitudes = reference_attention(q, k, v, torch.zeros_like(q), True)
    assert_close_to_reference([rows[0]], [expected[1]], [magnitudes[1]], torch.float16, names=["L"])


@pytest.mark.parametrize("impl", FUNCTIONS)
def test_outputs_before_a_position_ignore_keys_after_it(impl, device):
    q, k, v, do = leaf_inputs((2,), 40, 40, 16, torch.float32, device)
    apply = FUNCTIONS[impl].apply
    cut = 17
    later_k, later_v = k.clone(), v.clone()
    later_k[..., cut + 1:, :] = torch.randn_like(later_k[..., cut + 1:, :])
    later_v[..., cut + 1:, :] = torch.randn_like(later_v[..., cut + 1:, :])
    before, after = apply(q, k, v, True), apply(q, later_k, later_v, True)
    torch.testing.assert_close(before[..., :cut + 1, :], after[..., :cut + 1, :], rtol=0, atol=0)
    assert not torch.allclose(before[..., cut + 1:, :], after[..., cut + 1:, :])
    # and no gradient flows from an early output to a later key or value
    k.requires_grad_(), v.requires_grad_()
    o = apply(q, k, v, True)
    dk, dv = torch.autograd.grad(o[..., :cut + 1, :], (k, v), do[..., :cut + 1, :])
    assert dk[..., cut + 1:, :].abs().max() == 0 and dv[..., cut + 1:, :].abs().max() == 0
    assert dk[..., :cut + 1, :].abs().max() > 0


@pytest.mark.parametrize("impl", FUNCTIONS)
def test_backward_accepts_a_broadcast_output_gradient(impl, device):
    # o.sum().backward() hands backward an expanded dO whose strides are all zero.
    q, k, v, _ = leaf_inputs((2, 2), 33, 33, 16, torch.float32, device)
    dq, dk, dv = torch.autograd.grad(FUNCTIONS[impl].apply(*(t.requires_grad_() for t in (q, k, v)), True).sum(),
                                     (q, k, v))
    expected, magnitudes = reference_attention(q, k, v, torch.ones_like(q), True)
    assert_close_to_reference((dq, dk, dv), expected[2:], magnitudes[2:], torch.float32, names=("dq", "dk", "dv"))


@pytest.mark.parametrize("attention", ["flash_pytorch", "flash_triton"])
def test_model_with_flash_attention_matches_naive_attention(attention, device):
    tokens = torch.randint(1000, (2, 24), device=device)
    logits, grads = {}, {}
    for name in ("naive", attention):
        torch.manual_seed(0)
        model = TransformerLM(ModelConfig.for_size("tiny", context_length=24), attention=name).to(device)
        logits[name] = model(tokens)
        logits[name].float().logsumexp(-1).mean().backward()
        grads[name] = {n: p.grad for n, p in model.named_parameters()}
    torch.testing.assert_close(logits[attention], logits["naive"], rtol=2e-3, atol=2e-3)
    for n, g in grads["naive"].items():
        torch.testing.assert_close(grads[attention][n], g, rtol=2e-3, atol=2e-3, msg=f"gradient of {n}")


# ----------------------------------------------------------------------------------- bad input

def _good(device):
    return leaf_inputs((2,), 8, 8, 16, torch.float32, device)[:3]


@pytest.mark.parametrize("impl", FUNCTIONS)
@pytest.mark.parametrize(("make", "error", "message"), [
    (lambda q, k, v: (q.half(), k, v), TypeError, "share one dtype"),
    (lambda q, k, v: (q.long(), k.long(), v.long()), TypeError, "floating-point"),
    (lambda q, k, v: (q.double(), k.double(), v.double()), TypeError, "supported are fp32, bf16 and fp16"),
    (lambda q, k, v: (q[None].expand(3, -1, -1, -1), k[None].expand(2, -1, -1, -1), v[None].expand(2, -1, -1, -1)),
     ValueError, "same batch dimensions"),
    (lambda q, k, v: (q, k, v[..., :5, :]), ValueError, "same number of keys"),
    (lambda q, k, v: (q, k[..., :8], v), ValueError, "one head dimension"),
    (lambda q, k, v: (q[..., :0, :], k, v), ValueError, "is empty"),
    (lambda q, k, v: (q.new_zeros(2, 8, MAX_HEAD_DIM * 2), k.new_zeros(2, 8, MAX_HEAD_DIM * 2),
                      v.new_zeros(2, 8, MAX_HEAD_DIM * 2)), ValueError, "head dimension 256 is not supported"),
    (lambda q, k, v: (q[0, 0], k[0, 0], v[0, 0]), ValueError, r"\(\.\.\., sequence, head_dim\)"),
    (lambda q, k, v: (q[0], k[0, 0], v[0, 0]), ValueError, r"k must be \(\.\.\., sequence, head_dim\)"),
    (lambda q, k, v: (q[:0], k[:0], v[:0]), ValueError, "is empty"),
    (lambda q, k, v: (q, k.to("meta"), v), ValueError, "one device"),
    (lambda q, k, v: (q.numpy(), k, v), TypeError, "must be a torch.Tensor"),
], ids=["dtype mismatch", "integer", "float64", "batch mismatch", "keys mismatch", "head dim mismatch",
        "empty", "head dim too large", "1-D", "1-D keys", "empty batch", "device mismatch", "not a tensor"])
def test_bad_input_raises_an_error_naming_the_problem(impl, make, error, message):
    q, k, v = make(*_good("cpu"))
    with pytest.raises(error, match=message):
        FUNCTIONS[impl].apply(q, k, v)


@pytest.mark.parametrize("impl", FUNCTIONS)
def test_is_causal_must_be_a_bool(impl, device):
    q, k, v = _good(device)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        FUNCTIONS[impl].apply(q, k, v, torch.ones(8, 8, dtype=torch.bool))


@pytest.mark.skipif(not flash_triton.INTERPRETED, reason="the Triton interpreter is not in use")
def test_interpreter_refuses_bf16_whose_dots_it_computes_wrongly():
    q, k, v = (t.bfloat16() for t in _good("cpu"))
    with pytest.raises(TypeError, match="bf16 is not supported under TRITON_INTERPRET=1"):
        FlashAttentionTriton.apply(q, k, v)


@pytest.mark.parametrize("key", sorted(flash_triton.TILE_TABLE) + ["interpreter"])
def test_every_tile_set_keeps_the_divisibility_the_causal_loop_split_relies_on(key):
    tile_set = flash_triton.INTERPRETER_TILES if key == "interpreter" else flash_triton.TILE_TABLE[key]
    # A program that owns a query tile steps over key tiles, and the other way round for dK/dV.
    query_owners = [tile_set.forward, tile_set.dq, tile_set.narrow_forward, tile_set.narrow_dq]
    assert all(t.block_m % t.block_n == 0 for t in query_owners if t is not None)
    assert all(t.block_n % t.block_m == 0 for t in (tile_set.dkdv, tile_set.narrow_dkdv) if t is not None)


@pytest.mark.parametrize(("kernel", "owned"), [("forward", "block_m"), ("dq", "block_m"), ("dkdv", "block_n")])
def test_narrow_tiles_are_taken_only_for_grids_below_the_programs_per_sm_threshold(kernel, owned, monkeypatch):
    monkeypatch.setattr(flash_triton, "_sm_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    tiles = flash_triton.Tiles
    wide = {"forward": tiles(128, 64, 4, 3), "dkdv": tiles(64, 128, 4, 3), "dq": tiles(128, 64, 4, 3)}
    narrow = {f"narrow_{name}": tiles(64, 64, 4, 3) for name in wide}
    tile_set = flash_triton.TileSet(**wide, **narrow)
    rows = getattr(wide[kernel], owned)  # rows one wide program owns
    threshold = flash_triton.NARROW_GRID_PROGRAMS_PER_SM * 132
    pick = flash_triton.kernel_tiles
    # batch x heads x tiles: one program short of the threshold, then exactly at it.
    assert pick(tile_set, kernel, 1, rows * (threshold - 1), gpu) == narrow[f"narrow_{kernel}"]
    assert pick(tile_set, kernel, 1, rows * (threshold - 1) - 1, gpu) == narrow[f"narrow_{kernel}"]
    assert pick(tile_set, kernel, threshold, rows, gpu) == wide[kernel]
    assert pick(tile_set, kernel, 16, 16384, gpu) == wide[kernel]  # the leaderboard's grid
    assert pick(flash_triton.TileSet(**wide), kernel, 1, 1024, gpu) == wide[kernel]
    assert pick(tile_set, kernel, 1, 1024, torch.device("cpu")) == wide[kernel]


def test_repeated_launches_follow_each_call_s_strides_and_alignment(device):
    # After the first call of a shape the kernels are launched from the compiled kernels kept by
    # launch key, and from the third the forward from its plan kept by input signature; calls that
    # differ only in pointer alignment or strides must not reuse a kernel specialised for another.
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    lead, n, d = (2,), 80, 32
    for rank_lead in ((2,), (), (2, 2, 1)):  # 3-D, 2-D and 5-D inputs, each viewed as 4-D differently
        for seed in range(3):
            assert_matches_reference("triton", *leaf_inputs(rank_lead, n, n, d, dtype, device, seed), is_causal=True)
    for seed in range(3):  # features a stride apart are copied before the kernels read them
        strided = [make_tensor(lead, n, d, "strided_features", dtype, device) for _ in range(4)]
        assert_matches_reference("triton", *strided, is_causal=True)
    q, k, v, do = leaf_inputs(lead, n, n, d, dtype, device, seed=2)

    def shifted(t):  # the same values one element past a 16-byte boundary
        buffer = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        view = buffer[1:].view(t.shape)
        view.copy_(t)
        return view

    assert shifted(q).data_ptr() % 16 != 0
    assert_matches_reference("triton", *(shifted(t) for t in (q, k, v, do)), is_causal=True)
    fused = [make_tensor(lead, n, d, "fused_projection", dtype, device) for _ in range(4)]
    assert_matches_reference("triton", *fused, is_causal=True)


@pytest.mark.gpu
def test_a_planned_signature_still_refuses_inputs_that_break_the_contract():
    # From a signature's third call the forward skips the input checks: what they look at must be in
    # the signature, so inputs that differ from planned ones only where the checks fail still fail.
    if flash_triton.INTERPRETED:
        pytest.skip("the interpreter keeps no plans")
    q, k, v, _ = leaf_inputs((2,), 80, 80, 32, torch.bfloat16, torch.device("cuda"))
    for _ in range(3):
        FlashAttentionTriton.apply(q, k, v, True)
    assert flash_triton._plan_signature(q, k, v, True) in flash_triton._FORWARD_PLANS
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        FlashAttentionTriton.apply(q, k, v, 1)
    with pytest.raises(TypeError, match="share one dtype"):
        FlashAttentionTriton.apply(q, k, v.view(torch.float16), True)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        FlashAttentionTriton.apply(q, k, v.tolist(), True)


@pytest.mark.parametrize("shares", [1, 2])
@pytest.mark.parametrize("head_dim", [24, 80])  # 80 (in a tile of 128): masked columns in the merge and in share 2
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(("n_queries", "n_keys"), [(80, 80), (100, 70), (50, 130), (16, 16)])
def test_split_forward_matches_the_whole_forward(n_queries, n_keys, is_causal, head_dim, shares, device):
    # Runs of one query tile up to more keys than any tile sees, the output's columns whole or in two
    # shares; the merge must give the whole forward's o and L (to rounding: the runs sum in another order).
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    q, k, v, _ = leaf_inputs((2, 3), n_queries, n_keys, head_dim, dtype, device)
    tiles = flash_triton.tiles_for(head_dim, dtype)
    tiles = tiles.narrow_forward or tiles.forward
    o, lse = flash_triton.launch_forward(q, k, v, is_causal, tiles)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for runs_of in (1, 2, 3):
        for _ in range(2):  # a second launch must find the arrival counts back at zero
            split_o, split_lse = flash_triton.launch_split_forward(q, k, v, is_causal, tiles, runs_of * tiles.block_m,
                                                                   shares)
            torch.testing.assert_close(split_o, o, atol=tolerance, rtol=tolerance)
            torch.testing.assert_close(split_lse, lse, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="multiple of the query tile"):
        flash_triton.launch_split_forward(q, k, v, is_causal, tiles, tiles.block_m + 1, shares)
    with pytest.raises(ValueError, match="shares 3 must be a power of two"):
        flash_triton.launch_split_forward(q, k, v, is_causal, tiles, tiles.block_m, 3)


def test_the_output_columns_are_shared_only_while_twice_the_programs_fit_on_the_sms(monkeypatch):
    monkeypatch.setattr(flash_triton, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert flash_triton.forward_column_shares(64, 128, cuda) == 2  # one head, N 1024: 16 query tiles x 4 runs
    assert flash_triton.forward_column_shares(66, 64, cuda) == 2
    assert flash_triton.forward_column_shares(67, 128, cuda) == 1  # a second wave
    assert flash_triton.forward_column_shares(128, 64, cuda) == 1  # one head, N 2048
    assert flash_triton.forward_column_shares(8, 16, cuda) == 1  # a share would be narrower than a dot


def test_split_forward_runs_are_a_quarter_of_the_longest_tile_in_query_tile_multiples():
    tiles = flash_triton.Tiles(64, 64, 4, 3)
    split = flash_triton.forward_split_keys
    assert split(tiles, 8192, 8192, is_causal=True) == 2048
    assert split(tiles, 1000, 1000, is_causal=True) == 256  # the longest tile ends at 1000: runs of 250 -> 256
    assert split(tiles, 100, 8192, is_causal=True) == 64  # causal: the queries' last tile ends at 128
    assert split(tiles, 100, 8192, is_causal=False) == 2048
    assert split(tiles, 64, 64, is_causal=True) is None  # one run: the whole forward


@pytest.mark.gpu
@pytest.mark.flash
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_one_head_grids_take_the_split_forward_and_match_the_reference(dtype, device):
    n, head_dim = 3000, 64
    tile_set = flash_triton.tiles_for(head_dim, dtype)
    tiles = flash_triton.kernel_tiles(tile_set, "forward", 1, n, device)
    assert tiles is tile_set.narrow_forward and flash_triton.forward_split_keys(tiles, n, n, True) is not None
    for seed in range(3):  # the third call launches from the forward's plan
        assert_matches_reference("triton", *leaf_inputs((1, 1), n, n, head_dim, dtype, device, seed), is_causal=True)
    assert all(int(counts.count_nonzero()) == 0 for counts, _ in flash_triton._SPLIT_BUFFERS.values())


@pytest.mark.gpu
@pytest.mark.flash
def test_a_captured_split_forward_keeps_its_buffers_when_later_launches_grow_them(device):
    # The split forward keeps its workspace per stream and replaces it when a launch needs more. A CUDA
    # graph replays on the addresses it captured, so a captured launch must have buffers of its own.
    if flash_triton.INTERPRETED:
        pytest.skip("the Triton interpreter does not capture CUDA graphs")
    stream = torch.cuda.Stream()
    q, k, v = (torch.randn(1, 1, 1000, 64, device=device, dtype=torch.bfloat16) for _ in range(3))
    expected = FlashAttentionTriton.apply(q, k, v, True)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compiled, kept, then planned: the capture takes the planned path
            FlashAttentionTriton.apply(q, k, v, True)
    kept_floats = flash_triton._SPLIT_BUFFERS[(q.device.index, stream.cuda_stream)][1].numel()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = FlashAttentionTriton.apply(q, k, v, True)
    with torch.cuda.stream(stream):  # four times the tiles: the stream's kept buffers are replaced
        FlashAttentionTriton.apply(*(torch.randn(1, 1, 4000, 64, device=device, dtype=torch.bfloat16)
                                     for _ in range(3)), True)
        # Blocks the size of the replaced workspace, which the allocator hands out again.
        bystanders = [torch.full((kept_floats,), 7.0, device=device) for _ in range(8)]
    stream.synchronize()
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, expected)
    assert all(bool((t == 7.0).all()) for t in bystanders)


@pytest.mark.gpu
def test_triton_launch_hooks_see_every_launch(device):
    # Profilers (Proton) hook Triton's launches; launches from kept kernels must reach them too.
    if flash_triton.INTERPRETED:
        pytest.skip("the Triton interpreter does not launch kernels")
    from triton import knobs

    launches = []

    def hook(metadata):
        launches.append(metadata)

    q, k, v, do = leaf_inputs((1, 2), 200, 200, 32, torch.bfloat16, device)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        for _ in range(3):  # forward (one kernel) and backward (two), the later calls from kept kernels
            torch.autograd.grad(FlashAttentionTriton.apply(*inputs, True), inputs, do)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(launches) == 9


@pytest.mark.gpu
def test_triton_refuses_cpu_tensors_when_compiled_for_the_gpu():
    if flash_triton.INTERPRETED:
        pytest.skip("the Triton interpreter runs CPU tensors")
    with pytest.raises(ValueError, match="needs CUDA tensors, got cpu"):
        FlashAttentionTriton.apply(*_good("cpu"))


# ---------------------------------------------------------------------------------- GPU scale

LONG_SEQUENCE = 16_384
LONG_HEAD_DIM = 128
MEMORY_SEQUENCE = 65_536
# Forward + backward keep q, k, v, o, dO, dq, dk, dv (8 tensors like q) and L, D; 16 x the bytes of
# q is generous for that and for allocator rounding, and 1/16 of one n x n bf16 score matrix.
MEMORY_BOUND_IN_Q_SIZES = 16


@pytest.mark.gpu
@pytest.mark.flash
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_triton_is_accurate_at_16k_tokens_and_head_dim_128(dtype, is_causal, device):
    q, k, v, do = leaf_inputs((1, 2), LONG_SEQUENCE, LONG_SEQUENCE, LONG_HEAD_DIM, dtype, device)
    assert_matches_reference("triton", q, k, v, do, is_causal)


@pytest.mark.gpu
@pytest.mark.flash
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_wide_tiles_are_accurate_on_grids_that_fill_the_gpu(dtype, head_dim, device):
    # The other GPU tests have few heads, so their kernels mostly take the narrow tiles; 16 heads
    # fill the GPU with the wide ones.
    heads, n = 16, 4096
    tile_set = flash_triton.tiles_for(head_dim, dtype)
    for kernel in ("forward", "dkdv", "dq"):
        assert flash_triton.kernel_tiles(tile_set, kernel, heads, n, device) == getattr(tile_set, kernel)
    q, k, v, do = leaf_inputs((1, heads), n, n, head_dim, dtype, device)
    assert_matches_reference("triton", q, k, v, do, is_causal=True)


@pytest.mark.gpu
@pytest.mark.flash
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_triton_forward_and_backward_at_64k_tokens_never_allocate_n_by_n(dtype, device):
    q, k, v, do = leaf_inputs((1, 2), MEMORY_SEQUENCE, MEMORY_SEQUENCE, LONG_HEAD_DIM, dtype, device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    dq, dk, dv = torch.autograd.grad(FlashAttentionTriton.apply(*(t.requires_grad_() for t in (q, k, v)), True),
                                     (q, k, v), do)
    torch.cuda.synchronize()
    peak_extra_bytes = torch.cuda.max_memory_allocated() - before
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert peak_extra_bytes <= MEMORY_BOUND_IN_Q_SIZES * q.nbytes, (
        f"peak {peak_extra_bytes / 2**20:.0f} MiB above the inputs; one n x n score matrix would be "
        f"{MEMORY_SEQUENCE**2 * q.element_size() / 2**20:.0f} MiB")


@pytest.mark.parametrize("impl", FUNCTIONS)
def test_function_under_torch_compile_gives_the_eager_output_and_gradients(impl, device):
    # The PyTorch Function, inlined into the enclosing graph, gave wrong gradients on CUDA with torch
    # 2.11. The Triton Function has an apply of its own, which torch.compile must not trace.
    shape = ((2, 4), 300, 300, 64) if impl == "pytorch" or device.type == "cuda" else ((1, 2), 70, 70, 32)
    q, k, v, do = leaf_inputs(*shape, torch.float32, device)

    def attend_and_differentiate(attend):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*inputs)
        return (out, *torch.autograd.grad(out, inputs, do))

    def attend(q, k, v):
        return FUNCTIONS[impl].apply(q, k, v, True)

    # Compiled first, so that no buffer the compiled forward allocates can hold the eager results.
    torch._dynamo.reset()
    compiled = attend_and_differentiate(torch.compile(attend, backend="aot_eager"))
    eager = attend_and_differentiate(attend)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want)
