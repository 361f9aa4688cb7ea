"""FlashAttention-2 in Triton as PyTorch sees it: a `torch.library` op pair with fake implementations
and registered autograd, which torch.compile keeps inside one graph (and CUDA graphs capture), and the
course's autograd.Function over the same kernels.

    o = flash_attention_triton(q, k, v, is_causal=True)   # the op; what the model uses
    o = FlashAttentionTriton.apply(q, k, v, True)          # the course's Function
"""

from __future__ import annotations

import torch

from cs336_systems.attention.flash_pytorch import check_inputs
from cs336_systems.attention.flash_triton import launch


@torch.library.custom_op("cs336_systems::flash_attention_forward", mutates_args=())
def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, L): o shaped like q (contiguous), L (..., n_queries) fp32, the row log-sum-exp."""
    return launch.forward(q, k, v, is_causal)


@flash_attention_forward.register_fake
def _forward_fake(q, k, v, is_causal):
    check_inputs(q, k, v, is_causal)  # a traced call with bad inputs fails where it is traced
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("cs336_systems::flash_attention_backward", mutates_args=())
def flash_attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                             lse: torch.Tensor, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of the forward's output gradient `do`, contiguous, shaped like q, k, v."""
    return launch.backward(q, k, v, o, lse, do, is_causal)


@flash_attention_backward.register_fake
def _backward_fake(do, q, k, v, o, lse, is_causal):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, is_causal = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.is_causal = is_causal
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = flash_attention_backward(do, q, k, v, o, lse, ctx.is_causal)
    return dq, dk, dv, None


flash_attention_forward.register_autograd(_backward, setup_context=_setup_context)


def flash_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """FlashAttention-2 in Triton as an attention function (q, k, v, is_causal) -> o."""
    return flash_attention_forward(q, k, v, is_causal)[0]


class FlashAttentionTriton(torch.autograd.Function):
    """The course's FlashAttention-2 Function: apply(q, k, v, is_causal=False) -> o; saves L, q, k, v, o.

    Eager calls launch the kernels directly, past the op's dispatch; under torch.compile the forward and
    backward go through the op pair, which the compiler keeps in its graph."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        if torch.compiler.is_compiling():
            o, lse = flash_attention_forward(q, k, v, is_causal)
        else:
            o, lse = launch.forward(q, k, v, is_causal)
        ctx.save_for_backward(lse, q, k, v, o)
        ctx.is_causal = is_causal
        return o

    @staticmethod
    def backward(ctx, do: torch.Tensor):
        lse, q, k, v, o = ctx.saved_tensors
        if torch.compiler.is_compiling():
            dq, dk, dv = flash_attention_backward(do, q, k, v, o, lse, ctx.is_causal)
        else:
            dq, dk, dv = launch.backward(q, k, v, o, lse, do, ctx.is_causal)
        return dq, dk, dv, None
