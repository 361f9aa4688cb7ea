"""FlashAttention-2 (PyTorch and Triton autograd Functions) against a float64 reference: the contract
both implement.

Property tests draw leading dims, sequence lengths (tails that are no multiple of a tile
included), head dims (no power of two too), causality, dtype and memory layout. Without a GPU the
Triton kernels run in the interpreter on small shapes in fp32 and fp16; on a GPU the shapes grow and
bf16 joins. What is particular to the Triton kernels (launch paths, alignment, the op under
torch.compile and CUDA graphs, long sequences) is in test_flash_triton.py.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cs336_systems.attention.flash_pytorch import MASKED_SCORE_BIAS, MAX_HEAD_DIM, flash_attention_pytorch
from cs336_systems.attention.flash_triton import flash_attention_triton
from cs336_systems.model import ModelConfig, TransformerLM
from tests.flash_reference import (
    FUNCTIONS,
    LAYOUTS,
    assert_close_to_reference,
    assert_matches_reference,
    leaf_inputs,
    make_tensor,
    reference_attention,
    seed_from,
)

# The Triton interpreter turns loop bounds into ints through a NumPy conversion that NumPy deprecates;
# the warning is the interpreter's, once per loop, and says nothing about these kernels.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


# ------------------------------------------------------------------------------ property tests

# Examples per implementation: the interpreter runs Triton programs one by one in Python, every new
# shape class costs the PyTorch backward a torch.compile, and on a GPU every new (head dim, dtype,
# causal) combination a Triton compile: seconds each, so the counts stay small here.
# test_flash_triton.py draws hundreds of examples on a GPU, steered through every launch path.
CPU_EXAMPLES = {"pytorch": 6, "triton": 15}
GPU_EXAMPLES = {"pytorch": 10, "triton": 20}
# Head dims that are no power of two are padded with masked columns on chip, or run as a chunk and a tail
# (40 = 32 + 16, 80 = 64 + 16); 8 is below a dot's 16.
CPU_HEAD_DIMS = [8, 16, 24, 40, 64, 80]
GPU_HEAD_DIMS = [16, 24, 40, 64, 80, 96, 112, 128]


def _draw_case(data, on_gpu: bool):
    lead = data.draw(st.sampled_from([(), (3,), (2, 2), (1, 3), (2, 1, 2)] if not on_gpu
                                     else [(2,), (2, 4), (1, 8), (2, 2, 2)]), label="leading dims")
    max_len = 1100 if on_gpu else 70
    n_queries = data.draw(st.integers(1, max_len), label="n_queries")
    n_keys = data.draw(st.one_of(st.just(n_queries), st.integers(1, max_len)), label="n_keys")
    d = data.draw(st.sampled_from(GPU_HEAD_DIMS if on_gpu else CPU_HEAD_DIMS), label="head dim")
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
        seed_from(data)
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
        reference = reference_attention(q, k, v, do, is_causal).results
        for got, want in zip((reference[name] for name in ("o", "L", "dq", "dk", "dv")), expected):
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
        FUNCTIONS["pytorch"].apply(x, x, x, is_causal=True)
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


# torch 2.11's Function.apply refuses keywords, and both Functions keep torch's apply: overriding it to
# take keywords made torch.compile (2.11) trace wrong gradients. The attention functions take is_causal
# as a keyword on every torch.
@pytest.mark.parametrize("impl", FUNCTIONS)
def test_apply_takes_is_causal_as_a_keyword(impl, device):
    if not _apply_takes_keywords():
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
    assert_close_to_reference({"L": rows[0]}, reference_attention(q, k, v, torch.zeros_like(q), True), torch.float16)


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
def test_gradients_that_cancel_to_rounding_are_judged_by_their_rounding_bound(impl, device):
    # With one key, dQ = (dO . V - rowsum(dO * O)) K / sqrt(d) is 0 up to rounding; with dO nearly
    # orthogonal to V both terms are tiny next to the products they sum, so the error must be judged
    # against those products (float32 rounding of order 1e-7 of them), not against dO . V itself.
    q, k, v, do = leaf_inputs((3,), 1, 1, 8, torch.float32, device)
    do = do - (do * v).sum(-1, keepdim=True) / (v * v).sum(-1, keepdim=True) * v + 1e-4 * v
    assert_matches_reference(impl, q, k, v, do, False)


@pytest.mark.parametrize("impl", FUNCTIONS)
def test_backward_accepts_a_broadcast_output_gradient(impl, device):
    # o.sum().backward() hands backward an expanded dO whose strides are all zero.
    q, k, v, _ = leaf_inputs((2, 2), 33, 33, 16, torch.float32, device)
    dq, dk, dv = torch.autograd.grad(FUNCTIONS[impl].apply(*(t.requires_grad_() for t in (q, k, v)), True).sum(),
                                     (q, k, v))
    assert_close_to_reference({"dq": dq, "dk": dk, "dv": dv}, reference_attention(q, k, v, torch.ones_like(q), True),
                              torch.float32)


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


@pytest.mark.parametrize("impl", FUNCTIONS)
def test_function_under_torch_compile_gives_the_eager_output_and_gradients(impl, device):
    # The PyTorch Function, inlined into the enclosing graph, gave wrong gradients on CUDA with torch
    # 2.11. Under torch.compile the Triton Function runs the kernels through its torch.library ops.
    shape = ((2, 4), 300, 300, 64) if impl == "pytorch" or device.type == "cuda" else ((1, 2), 70, 70, 32)
    q, k, v, do = leaf_inputs(*shape, torch.float32, device)

    def attend_and_differentiate(attend):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*inputs)
        return (out, *torch.autograd.grad(out, inputs, do))

    def attend(q, k, v):
        return FUNCTIONS[impl].apply(q, k, v, True)

    # Compiled first, so that no buffer the compiled forward allocates can hold the eager results.
    torch.compiler.reset()
    compiled = attend_and_differentiate(torch.compile(attend, backend="aot_eager"))
    eager = attend_and_differentiate(attend)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want)
