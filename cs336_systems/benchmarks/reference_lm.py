"""The reference the end-to-end benchmark times beside the project's LM: the same architecture
(cs336_systems.model: pre-norm blocks, RMSNorm, RoPE on interleaved pairs, causal attention, SwiGLU,
no biases) written with torch's own modules (nn.Embedding, nn.Linear, nn.RMSNorm, one fused q/k/v
projection, F.scaled_dot_product_attention; RoPE, which torch has no module for, is the project's)
and compiled as a whole. What the project's step takes beyond it is what its model code and harness
cost.

    reference = build_reference(ModelConfig.for_size("xl", 512), "cuda", compile=True)
    reference.load_from(project_model)   # the same weights: the same logits
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cs336_systems.model import RMSNORM_EPS, ModelConfig, RotaryEmbedding, TransformerLM


class _Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        d_model, d_ff = config.d_model, config.d_ff
        self.num_heads = config.num_heads
        self.attention_norm = nn.RMSNorm(d_model, eps=RMSNORM_EPS)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.attention_out = nn.Linear(d_model, d_model, bias=False)
        self.ffn_norm = nn.RMSNorm(d_model, eps=RMSNORM_EPS)
        self.gate = nn.Linear(d_model, d_ff, bias=False)
        self.up = nn.Linear(d_model, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).view(batch, seq, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(rope(q, positions), rope(k, positions), v, is_causal=True)
        x = x + self.attention_out(out.transpose(1, 2).reshape(batch, seq, d_model))
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class ReferenceLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.num_layers))
        self.final_norm = nn.RMSNorm(config.d_model, eps=RMSNORM_EPS)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # RoPE has no torch module: the project's, shared by every block.
        self.rope = RotaryEmbedding(config.d_head, config.context_length, config.rope_theta)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(token_ids.shape[1], device=token_ids.device)
        x = self.embedding(token_ids)
        for block in self.blocks:
            x = block(x, self.rope, positions)
        return self.head(self.final_norm(x))

    @torch.no_grad()
    def load_from(self, model: TransformerLM) -> ReferenceLM:
        """Copy `model`'s weights (q, k and v stacked into the fused projection)."""
        self.embedding.weight.copy_(model.token_embeddings.weight)
        for block, layer in zip(self.blocks, model.layers, strict=True):
            attention = layer.attn
            block.attention_norm.weight.copy_(layer.ln1.weight)
            block.qkv.weight.copy_(torch.cat([attention.q_proj.weight, attention.k_proj.weight,
                                              attention.v_proj.weight]))
            block.attention_out.weight.copy_(attention.output_proj.weight)
            block.ffn_norm.weight.copy_(layer.ln2.weight)
            block.gate.weight.copy_(layer.ffn.w1.weight)
            block.up.weight.copy_(layer.ffn.w3.weight)
            block.down.weight.copy_(layer.ffn.w2.weight)
        self.final_norm.weight.copy_(model.ln_final.weight)
        self.head.weight.copy_(model.lm_head.weight)
        return self


def build_reference(config: ModelConfig, device: torch.device | str, *, compile: bool = False) -> nn.Module:
    """The reference LM on `device`, compiled as one graph if `compile` (torch's default initialisation:
    its times, not its values, are what the benchmark uses)."""
    with torch.device(device):
        model = ReferenceLM(config)
    if compile:
        torch.compiler.reset()
        model = torch.compile(model)
    return model
