"""FlashAttention-2 in Triton as PyTorch sees it: a `torch.library` op pair with registered autograd,
which torch.compile keeps inside one graph (and CUDA graphs capture), and the course's autograd.Function
over the same kernels.

    o = flash_attention_triton(q, k, v, is_causal=True)   # what the model uses
    o = FlashAttentionTriton.apply(q, k, v, True)          # the course's Function

Where the kernels are compiled the ops are `torch.library.triton_op`s: torch.compile traces into them
and launches the kernels from its own graph (their body is their fake implementation too). Under
TRITON_INTERPRET=1 they are opaque custom ops: interpreted kernels run in Python on real CPU tensors,
which a traced graph cannot hand them.

On CUDA tensors the forward op's autograd is its own autograd.Function (_CudaAutograd), registered for
AutogradCUDA: the one register_autograd makes redispatches every call below autograd through
torch.library's Python layers, which nearly doubled an eager forward+backward's host time against the
Function's, and at training shapes that host time is already longer than the kernels take. Called eagerly,
either entry point launches the kernels directly, as does the op's backward: the backward op is there for
the compiler's graph. flash_attention_triton takes the Function in eager, a few microseconds cheaper still.
"""

from __future__ import annotations

import torch

from cs336_systems.attention.flash_pytorch import check_inputs
from cs336_systems.attention.flash_triton import launch

_define_op = torch.library.custom_op if launch.INTERPRETED else torch.library.triton_op
FORWARD_OP = "cs336_systems::flash_attention_forward"
BACKWARD_OP = "cs336_systems::flash_attention_backward"


@_define_op(FORWARD_OP, mutates_args=())
def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, L): o shaped and laid out like q (launch.forward says how), L (..., n_queries) fp32, the row
    log-sum-exp."""
    return launch.forward(q, k, v, is_causal)


@_define_op(BACKWARD_OP, mutates_args=())
def flash_attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                             lse: torch.Tensor, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of the forward's output gradient `do`, shaped and laid out like q, k, v."""
    return launch.backward(q, k, v, o, lse, do, is_causal)


if not launch.INTERPRETED:
    # torch.compile's cache of compiled graphs keys a graph that holds a triton_op on the sources of the
    # kernels it finds by reading the op's body. Ours reach their kernels through launch.py, past where
    # that reading goes, so they are named here: else an edit to kernels.py would leave graphs compiled
    # from the old kernels in the on-disk cache, and a later process would run them.
    for _name in (FORWARD_OP, BACKWARD_OP):
        torch._library.triton.triton_ops_to_kernels[_name] = list(launch.KERNELS.values())
else:
    @flash_attention_forward.register_fake
    def _forward_fake(q, k, v, is_causal):
        check_inputs(q, k, v, is_causal)  # a traced call with bad inputs fails where it is traced
        return launch.empty_output(q), q.new_empty(q.shape[:-1], dtype=torch.float32)

    @flash_attention_backward.register_fake
    def _backward_fake(do, q, k, v, o, lse, is_causal):
        return launch.empty_output(q), launch.empty_output(k), launch.empty_output(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, is_causal = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.is_causal = is_causal
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # L's gradient, never used, is not made into zeros


def _backward(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    if all(type(t) is torch.Tensor for t in (do, q, k, v, o, lse)):  # eager: launched directly, as the Function's
        dq, dk, dv = launch.backward(q, k, v, o, lse, do, ctx.is_causal)
    else:  # traced (fake or functional tensors): the backward op, which the compiler keeps in its graph
        dq, dk, dv = flash_attention_backward(do, q, k, v, o, lse, ctx.is_causal)
    return dq, dk, dv, None


flash_attention_forward.register_autograd(_backward, setup_context=_setup_context)


class _CudaAutograd(torch.autograd.Function):
    """The forward op's autograd on CUDA tensors (the module docstring says why): it launches as the
    Function does; a traced call's kernels become graph nodes (launch.py), and its backward is the
    backward op."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal):
        output = launch.forward(q, k, v, is_causal)
        _setup_context(ctx, (q, k, v, is_causal), output)
        return output

    backward = staticmethod(_backward)


if not launch.INTERPRETED:  # the interpreter's CPU calls, opaque when traced, keep register_autograd's
    _LIBRARY = torch.library.Library(FORWARD_OP.split("::")[0], "FRAGMENT")
    torch.library.impl(FORWARD_OP, "AutogradCUDA", _CudaAutograd.apply, lib=_LIBRARY)


def flash_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """FlashAttention-2 in Triton as an attention function (q, k, v, is_causal) -> o: the op where
    torch.compile traces, the Function's direct launches in eager."""
    if torch.compiler.is_compiling():
        return flash_attention_forward(q, k, v, is_causal)[0]
    return FlashAttentionTriton.apply(q, k, v, is_causal)


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
