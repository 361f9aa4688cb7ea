"""The PyTorch Function's forward ignores is_causal (its backward masks): every query sees every key."""

import math

import torch

from examples.from_scratch import flash


class FlashAttention2Pytorch(flash.FlashAttention2Pytorch):
    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        flash._check_inputs(q, k, v, is_causal)
        q3, k3, v3 = map(flash._as_batch_of_matrices, (q, k, v))
        batch, n_queries, head_dim = q3.shape
        n_keys = k3.shape[1]
        scale = 1.0 / math.sqrt(head_dim)
        out = torch.empty_like(q3, memory_format=torch.contiguous_format)
        logsumexp = torch.empty(batch, n_queries, dtype=torch.float32, device=q.device)
        for query_start in range(0, n_queries, flash.TORCH_QUERY_TILE):
            rows = slice(query_start, query_start + flash.TORCH_QUERY_TILE)
            q_tile = q3[:, rows].float()
            n_rows = q_tile.shape[1]
            row_max = torch.full((batch, n_rows), -math.inf, device=q.device)
            row_sum = torch.zeros(batch, n_rows, device=q.device)
            acc = torch.zeros(batch, n_rows, head_dim, device=q.device)
            for key_start in range(0, n_keys, flash.TORCH_KEY_TILE):
                cols = slice(key_start, key_start + flash.TORCH_KEY_TILE)
                # The bug: the mask is never applied.
                scores = flash._tile_scores(q_tile, k3[:, cols].float(), scale, False, query_start, key_start)
                new_max = torch.maximum(row_max, scores.amax(dim=-1))
                p = torch.exp(scores - new_max[..., None])
                rescale = torch.exp(row_max - new_max)
                row_sum = rescale * row_sum + p.sum(dim=-1)
                acc = rescale[..., None] * acc + p @ v3[:, cols].float()
                row_max = new_max
            out[:, rows] = (acc / row_sum[..., None]).to(q.dtype)
            logsumexp[:, rows] = row_max + torch.log(row_sum)
        out = out.reshape(q.shape)
        logsumexp = logsumexp.reshape(q.shape[:-1])
        ctx.save_for_backward(logsumexp, q, k, v, out)
        ctx.is_causal = is_causal
        return out


def get_flashattention_autograd_function_pytorch() -> type:
    return FlashAttention2Pytorch


def get_flashattention_autograd_function_triton() -> type:
    return flash.FlashAttention2Triton
