"""The PyTorch Function's backward ignores is_causal (its forward masks): gradients flow from every key."""

import math

import torch

from examples.from_scratch import flash


class FlashAttention2Pytorch(flash.FlashAttention2Pytorch):
    @staticmethod
    def backward(ctx, grad_out):
        logsumexp, q, k, v, out = ctx.saved_tensors
        q3, k3, v3, do3 = map(flash._as_batch_of_matrices, (q, k, v, grad_out))
        lse = logsumexp.reshape(q3.shape[:2])
        n_queries, head_dim = q3.shape[1:]
        n_keys = k3.shape[1]
        scale = 1.0 / math.sqrt(head_dim)
        delta = (do3.float() * flash._as_batch_of_matrices(out).float()).sum(dim=-1)
        dq = torch.zeros(q3.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k3.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v3.shape, dtype=torch.float32, device=q.device)
        for key_start in range(0, n_keys, flash.TORCH_KEY_TILE):
            cols = slice(key_start, key_start + flash.TORCH_KEY_TILE)
            k_tile, v_tile = k3[:, cols].float(), v3[:, cols].float()
            for query_start in range(0, n_queries, flash.TORCH_QUERY_TILE):
                rows = slice(query_start, query_start + flash.TORCH_QUERY_TILE)
                q_tile, do_tile = q3[:, rows].float(), do3[:, rows].float()
                # The bug: the mask is never applied.
                scores = flash._tile_scores(q_tile, k_tile, scale, False, query_start, key_start)
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
