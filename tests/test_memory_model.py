"""The closed-form training memory model: worked values (by hand, in the comments) and the saved
activations counted against what autograd actually saves on this machine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cs336_systems.accounting.memory import (
    activation_bytes,
    fsdp_shard_elements,
    parameter_count,
    parameter_counts,
    residual_stream_bytes,
    saved_activations,
    training_memory,
)
from cs336_systems.model import ModelConfig, TransformerLM

# d_model 64, d_ff 256, 2 layers, 4 heads (d_head 16), vocabulary 10,000.
TINY = ModelConfig.for_size("tiny", context_length=16)
# The 2025 table's xl, whose values the worked examples below use.
XL = ModelConfig.for_size("xl", context_length=512, table="2025")


@pytest.mark.parametrize("table, size, expected", [
    ("2025", "small", 128_625_408), ("2025", "medium", 423_183_360), ("2025", "large", 969_411_840),
    ("2025", "xl", 1_998_235_200), ("2025", "2.7B", 3_406_809_600),
    ("2026", "xl", 3_406_809_600), ("2026", "10B", 12_832_823_808),
])
def test_parameter_count_matches_the_size_table(table, size, expected):
    assert parameter_count(ModelConfig.for_size(size, 128, table=table)) == expected


def test_parameter_count_matches_the_model():
    # embedding 10,000 x 64 = 640,000; attention 2 x 4 x 64^2 = 32,768; feed-forward
    # 2 x 3 x 64 x 256 = 98,304; norms 5 x 64 = 320; LM head 640,000: 1,411,392 in all.
    assert parameter_counts(TINY) == {"embedding": 640_000, "attention": 32_768, "feed_forward": 98_304,
                                      "norms": 320, "lm_head": 640_000}
    assert parameter_count(TINY) == sum(p.numel() for p in TransformerLM(TINY).parameters()) == 1_411_392


# Tiny, batch 2, sequence 16: T = 32 tokens, T d = 2,048 and T d_ff = 8,192 elements.
#   fp32, SDPA: token ids 32 x 8 = 256; RMSNorm input and normed 5 norms x 2,048 x 4 = 40,960 each;
#   rsqrt 5 x 32 x 4 = 640; q/k/v input, output-projection input, w1/w3 input 2 layers x 2,048 x 4
#   = 16,384 each; RoPE tables 8 x (16 x 8) x 4 = 4,096; w1, silu, w3 outputs 6 x 8,192 x 4 =
#   196,608; w2 input 2 x 8,192 x 4 = 65,536; final norm output 2,048 x 4 = 8,192; log-probs
#   32 x 10,000 x 4 = 1,280,000; targets 256; normaliser 4; q, k, v 6 x 2,048 x 4 = 49,152;
#   attention output 16,384; log-sum-exp 2 x (2 x 4 x 16) x 4 = 1,024. Sum: 1,753,220.
#   naive instead of SDPA: no output (16,384) or log-sum-exp (1,024); probabilities
#   2 x (2 x 4 x 16 x 16) x 4 = 16,384 and masks 2 x 256 = 512: 1,752,708.
#   bf16 autocast (CPU), SDPA: norms' fp32 tensors as above (82,560 with rsqrt); q/k/v inputs cast
#   three times 2 x 3 x 2,048 x 2 = 24,576; RoPE tables in bf16 2,048; output-projection input
#   8,192; w1/w3 inputs cast twice 16,384; feed-forward 98,304 + 32,768; final norm output 4,096;
#   log-probs (fp32) 1,280,000; ids, targets, normaliser 516; q, k, v 24,576; output 8,192;
#   log-sum-exp 1,024; bf16 copies of the 771,072 Linear weights 1,542,144. Sum: 3,125,380.
@pytest.mark.parametrize("precision, attention, expected", [
    ("fp32", "sdpa", 1_753_220), ("fp32", "naive", 1_752_708), ("bf16", "sdpa", 3_125_380),
])
def test_tiny_activation_bytes_worked_by_hand(precision, attention, expected):
    assert activation_bytes(TINY, 2, 16, precision, attention, device_type="cpu") == expected


def _measured_saved_bytes(config: ModelConfig, batch_size: int, seq_len: int, precision: str, attention: str) -> int:
    """Bytes of the distinct storages autograd saves in one forward and loss, parameters excluded."""
    torch.manual_seed(0)
    model = TransformerLM(config, attention=attention)
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameter_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    generator = torch.Generator().manual_seed(0)
    inputs, targets = (torch.randint(config.vocab_size, (batch_size, seq_len), generator=generator) for _ in range(2))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    del loss
    return sum(saved.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("attention", ["sdpa", "naive"])
def test_model_counts_what_autograd_saves(precision, attention):
    config = ModelConfig(d_model=48, d_ff=128, num_layers=3, num_heads=3, context_length=24, vocab_size=500)
    measured = _measured_saved_bytes(config, 3, 24, precision, attention)
    assert activation_bytes(config, 3, 24, precision, attention, device_type="cpu") == measured


def test_sdpa_on_cuda_merges_heads_without_a_copy():
    # CUDA's SDPA output is laid out (batch, seq, heads, d_head), so the output projection's input is
    # a view of it: one (T, d) fp32 tensor less per layer, 2 x 2,048 x 4 = 16,384 bytes.
    difference = (activation_bytes(TINY, 2, 16, "fp32", "sdpa", device_type="cpu")
                  - activation_bytes(TINY, 2, 16, "fp32", "sdpa", device_type="cuda"))
    assert difference == 16_384


def test_naive_bf16_on_cuda_saves_fp32_probabilities_and_a_bf16_copy():
    # CUDA autocast runs softmax in fp32 (4 bytes) and the matmul after it casts to bf16 (2 more);
    # the CPU keeps the bf16 probabilities (2): 4 bytes more per score, 2 layers x 2 x 4 x 16 x 16.
    difference = (activation_bytes(TINY, 2, 16, "bf16", "naive", device_type="cuda")
                  - activation_bytes(TINY, 2, 16, "bf16", "naive", device_type="cpu"))
    assert difference == 2 * (2 * 4 * 16 * 16) * 4


# XL, batch 4, context 512, SDPA on CUDA: T = 2,048, d 1,600, d_ff 6,400, 25 heads of 64,
# P = 1,998,235,200. Per block, in elements: 10 T d (norm inputs and normed x4, q/k/v input, q, k,
# v, attention output, w1/w3 input; the merged heads are a view) = 32,768,000; 4 T d_ff =
# 52,428,800; rsqrt 2 T = 4,096; RoPE tables 4 x 512 x 32 = 65,536; log-sum-exp 4 x 25 x 512 =
# 51,200; 85,317,632 x 4 bytes x 48 blocks = 16,380,985,344. Final norm 3 T d + T = 9,832,448 x 4 =
# 39,329,792; log-probs 2,048 x 10,000 x 4 = 81,920,000; ids and targets 2 x 2,048 x 8 = 32,768;
# normaliser 4. Activations: 16,502,267,908 bytes.
XL_ACTIVATIONS = 16_502_267_908
XL_PARAMETERS = 1_998_235_200


def test_xl_activations_worked_by_hand():
    assert activation_bytes(XL, 4, 512) == XL_ACTIVATIONS


def test_xl_training_memory_with_and_without_sharding():
    p = XL_PARAMETERS
    # torch DDP: parameters 4P, AdamW 8P, buckets 4P persist; the activations (larger than the
    # gradients, 4P) are the rest of the peak: 16P + A = 48,474,031,108 bytes (45.1 GiB).
    ddp = training_memory(XL, 4, 512, ddp_buckets=True)
    assert (ddp.parameters, ddp.gradients, ddp.optimizer_state, ddp.buffers) == (4 * p, 4 * p, 8 * p, 4 * p)
    assert ddp.peak == 16 * p + XL_ACTIVATIONS == 48_474_031_108
    # ZeRO stage 1 on 2 ranks: AdamW on 999,117,600 parameters, 7,992,940,800 bytes; peak
    # 4P + 4P + 4P + A = 40,481,090,308.
    zero = training_memory(XL, 4, 512, strategy="optimizer_state", world_size=2, ddp_buckets=True)
    assert zero.optimizer_state == 7_992_940_800
    assert zero.peak == 40_481_090_308
    # FSDP on 2 ranks: every XL weight has an even size, so the shards hold (P - 155,200 norm
    # parameters) / 2 = 999,040,000, plus the 155,200 replicated: 999,195,200 parameters, 4 bytes
    # each, 8 for AdamW. Buffers: the largest weight (10,000 x 1,600) three times gathered and three
    # times as a full fp32 gradient, 24 x 16,000,000 = 384,000,000. Peak 3,996,780,800 +
    # 7,993,561,600 + 384,000,000 + A = 28,876,610,308 bytes (26.9 GiB).
    fsdp = training_memory(XL, 4, 512, strategy="fsdp", world_size=2)
    assert (fsdp.parameters, fsdp.optimizer_state, fsdp.buffers) == (3_996_780_800, 7_993_561_600, 384_000_000)
    assert fsdp.peak == 28_876_610_308
    assert fsdp.as_row()["peak_gib"] == pytest.approx(28_876_610_308 / 2**30)


def test_fsdp_shards_round_each_weight_up_to_a_multiple_of_the_world_size():
    # Tiny on 3 ranks: embedding and LM head 640,000 -> 213,334 each; q, k, v, output 4,096 -> 1,366
    # each; w1, w2, w3 16,384 -> 5,462 each; 2 x (4 x 1,366 + 3 x 5,462) + 2 x 213,334 = 470,368.
    assert fsdp_shard_elements(TINY, 3) == 470_368
    assert fsdp_shard_elements(TINY, 1) == parameter_count(TINY) - parameter_counts(TINY)["norms"]


def test_fsdp_keeps_no_autocast_weight_copies():
    # Gathered per layer and dropped after use, so the bf16 copies (2 bytes x 771,072 Linear weights)
    # are not among the saved tensors.
    with_copies = activation_bytes(TINY, 2, 16, "bf16")
    without = sum(t.total_bytes for t in saved_activations(TINY, 2, 16, "bf16", weight_copies=False))
    assert with_copies - without == 2 * 771_072
    assert training_memory(TINY, 2, 16, "bf16", strategy="fsdp", world_size=2).activations == without


def test_residual_stream_is_fp32():
    assert residual_stream_bytes(XL, 4, 512) == 4 * 512 * 1600 * 4


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(precision="fp8"), ValueError, "precision"),
    (dict(attention="flash"), ValueError, "attention"),
    (dict(strategy="zero2"), ValueError, "strategy"),
    (dict(world_size=0), ValueError, "world_size"),
    (dict(world_size=2.0), TypeError, "world_size"),
    (dict(strategy="fsdp", world_size=2, ddp_buckets=True), ValueError, "DDP buckets"),
])
def test_bad_input_is_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        training_memory(TINY, 2, 16, **kwargs)
