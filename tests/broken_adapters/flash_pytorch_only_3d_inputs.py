"""The PyTorch Function handles only (batch, n, d) inputs: it unpacks three dims where it should merge the
leading ones."""

import math

import torch

from examples.from_scratch import flash


class FlashAttention2Pytorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        flash._check_inputs(q, k, v, is_causal)
        # The bug: no leading dims merged.
        q3, k3, v3 = q, k, v
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
                scores = flash._tile_scores(q_tile, k3[:, cols].float(), scale, is_causal, query_start, key_start)
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

    @staticmethod
    def backward(ctx, grad_out):
        logsumexp, q, k, v, out = ctx.saved_tensors
        is_causal = ctx.is_causal
        q3, k3, v3, do3 = q, k, v, grad_out
        lse = logsumexp.reshape(q3.shape[:2])
        n_queries, head_dim = q3.shape[1:]
        n_keys = k3.shape[1]
        scale = 1.0 / math.sqrt(head_dim)
        delta = (do3.float() * out.float()).sum(dim=-1)
        dq = torch.zeros(q3.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k3.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v3.shape, dtype=torch.float32, device=q.device)
        for key_start in range(0, n_keys, flash.TORCH_KEY_TILE):
            cols = slice(key_start, key_start + flash.TORCH_KEY_TILE)
            k_tile, v_tile = k3[:, cols].float(), v3[:, cols].float()
            for query_start in range(0, n_queries, flash.TORCH_QUERY_TILE):
                rows = slice(query_start, query_start + flash.TORCH_QUERY_TILE)
                q_tile, do_tile = q3[:, rows].float(), do3[:, rows].float()
                scores = flash._tile_scores(q_tile, k_tile, scale, is_causal, query_start, key_start)
                p = torch.exp(scores - lse[:, rows, None])
                dv[:, cols] += p.transpose(-1, -2) @ do_tile
                dp = do_tile @ v_tile.transpose(-1, -2)
                ds = p * (dp - delta[:, rows, None])
                dq[:, rows] += ds @ k_tile * scale
                dk[:, cols] += ds.transpose(-1, -2) @ q_tile * scale
        return (dq.to(q.dtype).reshape(q.shape), dk.to(k.dtype).reshape(k.shape), dv.to(v.dtype).reshape(v.shape),
                None)


def get_flashattention_autograd_function_pytorch() -> type:
    return FlashAttention2Pytorch


def get_flashattention_autograd_function_triton() -> type:
    return flash.FlashAttention2Triton
