"""The course's FlashAttention-2 checks, run through tests/adapters.py.

Batch 4, 128 queries and keys, head dim 64, seed 0; forward output and L, then dq, dk, dv, at
rtol = atol = 1e-2 against attention computed the plain way with -1e6 on masked scores. The PyTorch
Function runs on CPU; the Triton one on the run's device (the interpreter when there is no GPU).
"""

import pytest
import torch

from tests.adapters import get_flashattention_autograd_function_pytorch, get_flashattention_autograd_function_triton

# The Triton interpreter turns loop bounds into ints through a NumPy conversion that NumPy deprecates;
# the warning is the interpreter's, once per loop, and says nothing about these kernels.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

BATCH, N_QUERIES, N_KEYS, HEAD_DIM = 4, 128, 128, 64
COURSE_TOLERANCE = 1e-2
MASKED_SCORE = -1e6


def make_inputs(device):
    torch.manual_seed(0)
    shapes = ((BATCH, N_QUERIES, HEAD_DIM), (BATCH, N_KEYS, HEAD_DIM), (BATCH, N_KEYS, HEAD_DIM),
              (BATCH, N_QUERIES, HEAD_DIM))
    q, k, v, do = (torch.randn(shape, device=device) for shape in shapes)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do


def attention_and_logsumexp(q, k, v, is_causal: bool):
    scores = q @ k.transpose(-2, -1) / HEAD_DIM**0.5
    if is_causal:
        queries, keys = torch.arange(q.shape[-2], device=q.device), torch.arange(k.shape[-2], device=q.device)
        sees = queries[:, None] >= keys[None, :]
        scores = torch.where(sees, scores, MASKED_SCORE)
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


def check_forward(impl, device, is_causal):
    q, k, v, _ = make_inputs(device)
    o = impl(q, k, v, is_causal)
    saved = [t for t in o.grad_fn.saved_tensors if t.shape == (q.shape[0], q.shape[1])]
    assert len(saved) == 1, f"expected exactly one saved tensor of shape {(q.shape[0], q.shape[1])}, found {len(saved)}"
    o_ref, L_ref = attention_and_logsumexp(q, k, v, is_causal)
    torch.testing.assert_close(o, o_ref, rtol=COURSE_TOLERANCE, atol=COURSE_TOLERANCE)
    torch.testing.assert_close(saved[0], L_ref, rtol=COURSE_TOLERANCE, atol=COURSE_TOLERANCE)


def check_backward(impl, device, is_causal):
    q, k, v, do = make_inputs(device)
    impl(q, k, v, is_causal).backward(do)
    q_ref, k_ref, v_ref, do_ref = make_inputs(device)
    attention_and_logsumexp(q_ref, k_ref, v_ref, is_causal)[0].backward(do_ref)
    for name, got, want in (("dq", q.grad, q_ref.grad), ("dk", k.grad, k_ref.grad), ("dv", v.grad, v_ref.grad)):
        torch.testing.assert_close(got, want, rtol=COURSE_TOLERANCE, atol=COURSE_TOLERANCE, msg=name)


@pytest.mark.flash
@pytest.mark.parametrize("is_causal", [False, True])
def test_flash_forward_pass_pytorch(is_causal):
    check_forward(get_flashattention_autograd_function_pytorch().apply, "cpu", is_causal)


@pytest.mark.flash
@pytest.mark.parametrize("is_causal", [False, True])
def test_flash_forward_pass_triton(is_causal, device):
    check_forward(get_flashattention_autograd_function_triton().apply, device, is_causal)


@pytest.mark.flash
@pytest.mark.parametrize("is_causal", [False, True])
def test_flash_backward_pytorch(is_causal):
    check_backward(get_flashattention_autograd_function_pytorch().apply, "cpu", is_causal)


@pytest.mark.flash
@pytest.mark.parametrize("is_causal", [False, True])
def test_flash_backward_triton(is_causal, device):
    check_backward(get_flashattention_autograd_function_triton().apply, device, is_causal)
