"""The LM head and the cross-entropy loss fused, chunk by chunk: the (tokens, vocabulary) logits are never
whole in memory.

    loss = linear_cross_entropy(hidden, model.lm_head.weight, targets)   # = lm_loss(hidden @ W.T, targets)

At the 2026 leaderboard's shape (32,768 tokens per GPU, a 151,936-token vocabulary) the logits are 9.3 GiB
in bf16, and the loss's fp32 copy, its log-softmax and their gradients take about 40 GiB more. Here forward
takes `chunk_tokens` tokens at a time: their logits (upcast to fp32, as `lm_loss` upcasts them), their share
of the loss, and at once their gradients, softmax minus one-hot, pushed back through the head into the
hidden states' gradient and the weight's (accumulated in fp32 over the chunks). Backward only scales those
by the loss's gradient. The peak is one chunk's fp32 logits and their low-precision product and gradient, and
the weight's fp32 gradient, whatever the sequence length.

Numerically it is `lm_loss(hidden @ weight.T, targets)` (cs336_systems.lm_training): logits rounded
to the inputs' dtype by the matmul, softmax in fp32. The weight's gradient adds the chunks' products in
fp32, where autograd's one matmul accumulates all tokens at once, so low-precision results differ from it
in the last bits.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from cs336_systems.checks import check_positive_int

# Tokens per chunk: 8,192 tokens' fp32 logits over a 151,936-token vocabulary take 4.6 GiB; the head's
# matmuls at 8,192 rows run at the GEMM's full rate, so smaller chunks save memory, not time.
DEFAULT_CHUNK_TOKENS = 8192


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> torch.Tensor:
    """Mean cross-entropy of the logits `hidden @ weight.T` against `targets`: a scalar of fp32 (float64 for
    float64 inputs).

    hidden (..., d_model) floating point, weight (vocab_size, d_model) of the same dtype and device,
    targets (...) integer token ids in [0, vocab_size), with hidden's leading shape."""
    check_positive_int(chunk_tokens=chunk_tokens)
    _check_inputs(hidden, weight, targets)
    return _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1).long(),
                                     chunk_tokens)


def _check_inputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> None:
    if not hidden.dtype.is_floating_point or hidden.dtype != weight.dtype:
        raise TypeError(f"hidden and weight must share one floating-point dtype, got {hidden.dtype} and {weight.dtype}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"targets must be integer token ids, got {targets.dtype}")
    if hidden.device != weight.device or targets.device != hidden.device:
        raise ValueError(f"hidden, weight and targets must be on one device, got {hidden.device}, {weight.device} "
                         f"and {targets.device}")
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"need hidden (..., d_model) and weight (vocab_size, d_model), got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:-1] or targets.numel() == 0:
        raise ValueError(f"targets must have hidden's leading shape {tuple(hidden.shape[:-1])} with at least one "
                         f"token, got {tuple(targets.shape)}")
    vocab_size = weight.shape[0]
    # One synchronisation: a target outside the vocabulary would otherwise index past a chunk's logits
    # (a device-side assert on a GPU, in the middle of a step).
    if ((targets < 0) | (targets >= vocab_size)).any().item():
        raise ValueError(f"targets must lie in [0, {vocab_size}), got values from {targets.min().item()} to "
                         f"{targets.max().item()}")


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk_tokens: int) -> torch.Tensor:
        n_tokens = hidden.shape[0]
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        # fp32 at least (float64 inputs stay float64), as lm_loss upcasts low-precision logits.
        loss_dtype = torch.promote_types(hidden.dtype, torch.float32)
        loss_sum = torch.zeros((), dtype=loss_dtype, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=loss_dtype, device=weight.device) if want_weight else None
        for start in range(0, n_tokens, chunk_tokens):
            rows = slice(start, min(start + chunk_tokens, n_tokens))
            chunk, chunk_targets = hidden[rows], targets[rows]
            logits = (chunk @ weight.T).to(loss_dtype)
            target_logits = logits.gather(1, chunk_targets[:, None]).squeeze(1)
            row_max = logits.amax(dim=-1, keepdim=True)
            # exp(logits - max) in the logits' own memory: the softmax's numerator, and through its sum the
            # log-sum-exp, with no second chunk-sized tensor.
            exps = logits.sub_(row_max).exp_()
            sums = exps.sum(dim=-1, keepdim=True)
            loss_sum += ((sums.log() + row_max).squeeze(1) - target_logits).sum()
            if not (want_hidden or want_weight):
                del logits, exps
                continue
            # d loss / d logits = (softmax - one_hot) / n_tokens, still in the same memory.
            probs = exps.div_(sums)
            probs[torch.arange(len(chunk_targets), device=probs.device), chunk_targets] -= 1.0
            grad_logits = probs.div_(n_tokens).to(hidden.dtype)
            del logits, exps, probs
            if want_hidden:
                grad_hidden[rows] = grad_logits @ weight
            if want_weight and chunk.dtype == loss_dtype:
                grad_weight.addmm_(grad_logits.T, chunk)
            elif want_weight:
                grad_weight += (grad_logits.T @ chunk).to(loss_dtype)
            # Before the next chunk's logits exist (in fp32 it is this chunk's logits' memory).
            del grad_logits
        ctx.save_for_backward(grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype))
        return loss_sum / n_tokens

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (None if grad_hidden is None else grad_hidden * grad_loss.to(grad_hidden.dtype),
                None if grad_weight is None else grad_weight * grad_loss.to(grad_weight.dtype), None, None)
