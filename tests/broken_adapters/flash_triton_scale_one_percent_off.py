"""The Triton Function's softmax scale is 1% off: 1.01 / sqrt(d), in its forward and its backward."""

import math

import torch
import triton

from examples.from_scratch import flash

# The bug.
SCALE_ERROR = 1.01


class FlashAttention2Triton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        flash._check_triton_inputs(q, k, v, is_causal)
        q3, k3, v3 = map(flash._as_batch_of_matrices, (q, k, v))
        batch, n_queries, head_dim = q3.shape
        n_keys = k3.shape[1]
        head_dim_padded, q_tile, k_tile = flash._triton_tiles(head_dim)
        out = torch.empty(q3.shape, dtype=q.dtype, device=q.device)
        logsumexp = torch.empty(batch, n_queries, dtype=torch.float32, device=q.device)
        with flash._on_device(q.device):
            flash._forward_kernel[(triton.cdiv(n_queries, q_tile), batch)](
                q3, k3, v3, out, logsumexp,
                *q3.stride(), *k3.stride(), *v3.stride(), *out.stride(), *logsumexp.stride(),
                n_queries, n_keys, SCALE_ERROR / math.sqrt(head_dim),
                HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded, Q_TILE=q_tile, K_TILE=k_tile,
                IS_CAUSAL=is_causal,
            )
        out = out.reshape(q.shape)
        logsumexp = logsumexp.reshape(q.shape[:-1])
        ctx.save_for_backward(logsumexp, q, k, v, out)
        ctx.is_causal = is_causal
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logsumexp, q, k, v, out = ctx.saved_tensors
        q3, k3, v3, do3 = map(flash._as_batch_of_matrices, (q, k, v, grad_out))
        batch, n_queries, head_dim = q3.shape
        n_keys = k3.shape[1]
        lse = logsumexp.reshape(batch, n_queries)
        delta = (do3.float() * flash._as_batch_of_matrices(out).float()).sum(dim=-1)
        head_dim_padded, q_tile, k_tile = flash._triton_tiles(head_dim)
        dq = torch.empty(q3.shape, dtype=q.dtype, device=q.device)
        dk = torch.empty(k3.shape, dtype=k.dtype, device=q.device)
        dv = torch.empty(v3.shape, dtype=v.dtype, device=q.device)
        inputs = (q3, k3, v3, do3, lse, delta)
        input_strides = (*q3.stride(), *k3.stride(), *v3.stride(), *do3.stride(), *lse.stride(), *delta.stride())
        sizes = dict(HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded, Q_TILE=q_tile, K_TILE=k_tile,
                     IS_CAUSAL=ctx.is_causal)
        scale = SCALE_ERROR / math.sqrt(head_dim)
        with flash._on_device(q.device):
            flash._backward_dk_dv_kernel[(triton.cdiv(n_keys, k_tile), batch)](
                *inputs, dk, dv, *input_strides, *dk.stride(), *dv.stride(), n_queries, n_keys, scale, **sizes)
            flash._backward_dq_kernel[(triton.cdiv(n_queries, q_tile), batch)](
                *inputs, dq, *input_strides, *dq.stride(), n_queries, n_keys, scale, **sizes)
        return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), None


def get_flashattention_autograd_function_pytorch() -> type:
    return flash.FlashAttention2Pytorch


def get_flashattention_autograd_function_triton() -> type:
    return FlashAttention2Triton
