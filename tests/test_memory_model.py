"""The closed-form memory models: saved activations and the one-GPU peak predictor
(accounting.activations) and per-device training memory under sharding (accounting.memory); worked
values by hand, in the comments, and the saved activations against what autograd saves here."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

from cs336_systems.accounting.activations import (
    DEVICE_TYPES,
    block_saved_bytes,
    head_saved_bytes,
    parameter_count,
    parameter_counts,
    predict_peak_memory,
    residual_stream_bytes,
    saved_activation_bytes,
)
from cs336_systems.accounting.memory import fsdp_shard_elements, training_memory
from cs336_systems.model import ModelConfig, TransformerLM
from cs336_systems.profiling.memory import saved_tensor_bytes

# d_model 64, d_ff 256, 2 layers, 4 heads (d_head 16), vocabulary 10,000.
TINY = ModelConfig.for_size("tiny", context_length=16)
# The 2025 table's xl, whose values the worked examples below use.
XL = ModelConfig.for_size("xl", context_length=512, table="2025")


def test_parameter_count_matches_the_model():
    # embedding 10,000 x 64 = 640,000; attention 2 x 4 x 64^2 = 32,768; feed-forward
    # 2 x 3 x 64 x 256 = 98,304; norms 5 x 64 = 320; LM head 640,000: 1,411,392 in all.
    assert parameter_counts(TINY) == {"embedding": 640_000, "attention": 32_768, "feed_forward": 98_304,
                                      "norms": 320, "lm_head": 640_000}
    assert parameter_count(TINY) == sum(p.numel() for p in TransformerLM(TINY).parameters()) == 1_411_392


# ------------------------------------------------------------------------------ saved activations

# T = 1 x 4 tokens, d = 8, f = 16, h = 2 heads of d_head 4, vocab 10: every term below is small
# enough to add up by hand.
SMALL = ModelConfig(d_model=8, d_ff=16, num_layers=2, num_heads=2, context_length=4, vocab_size=10)


def test_block_bytes_fp32_by_hand():
    parts = block_saved_bytes(SMALL, batch_size=1, seq_len=4, precision="fp32", attention="naive")
    # Each RMSNorm: input + normalised input (2 x 4 x 8 x 4 B = 256) + rsqrt per token (4 x 4 B) = 272.
    assert parts["attention_norm"] == parts["ffn_norm"] == 272
    # q/k/v share one fp32 input, w1/w3 another: 4 x 8 x 4 B = 128 each.
    assert parts["qkv_inputs"] == parts["ffn_inputs"] == 128
    # RoPE keeps cos and sin for q and for k: 4 tables of 4 positions x 2 pairs x 4 B = 128.
    assert parts["rope_tables"] == 128
    # Rotated q, rotated k, contiguous v: 3 x 128 = 384; the head-merge copy: 128.
    assert parts["attention_qkv"] == 384 and parts["output_proj_input"] == 128
    # Softmax output: 1 x 2 heads x 4 x 4 scores x 4 B = 128; the causal mask: 16 bools.
    assert parts["attention_scores"] == 128 and parts["causal_mask"] == 16
    # w1 out, SiLU out, w3 out, their product: 4 x (4 x 16) x 4 B = 1024.
    assert parts["ffn_hidden"] == 1024
    assert sum(parts.values()) == 2608


def test_block_bytes_bf16_autocast_on_cuda_by_hand():
    parts = block_saved_bytes(SMALL, 1, 4, precision="bf16", attention="naive", device_type="cuda")
    # Norms stay fp32 (272 each). Each Linear casts its input: q, k, v 3 x 4 x 8 x 2 B = 192; w1, w3 128.
    assert parts["attention_norm"] == 272 and parts["qkv_inputs"] == 192 and parts["ffn_inputs"] == 128
    # Softmax runs in fp32 under CUDA autocast and P v casts P to bf16: 32 scores x (4 + 2) B = 192.
    assert parts["attention_scores"] == 192
    # bf16 weight copies kept by the 7 Linears: (4 x 8 x 8 + 3 x 8 x 16) x 2 B = 1280.
    assert parts["weight_casts"] == 1280
    assert sum(parts.values()) == 3184


def test_head_bytes_by_hand():
    # Final norm 272 + LM head input 128 + fp32 log-softmax 4 x 10 x 4 B = 160 + nll's total weight 4 = 564.
    assert sum(head_saved_bytes(SMALL, 1, 4, "fp32").values()) == 564
    assert saved_activation_bytes(SMALL, 1, 4) == 2 * 2608 + 564


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_saved_bytes_match_what_autograd_saves(precision, attention):
    torch.manual_seed(0)
    batch, seq = 3, 24  # distinct sizes, so no term can stand in for another
    config = ModelConfig(d_model=64, d_ff=160, num_layers=3, num_heads=4, context_length=seq, vocab_size=500)
    model = TransformerLM(config, attention=attention)
    inputs, targets = torch.randint(0, config.vocab_size, (2, batch, seq))

    def loss():
        with torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else nullcontext():
            return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())

    measured = saved_tensor_bytes(loss, exclude=[*model.parameters(), inputs, targets])
    assert measured == saved_activation_bytes(config, batch, seq, precision, attention, device_type="cpu")
    # The training-memory model also counts the token ids and targets, which autograd keeps too.
    with_batch = saved_tensor_bytes(loss, exclude=list(model.parameters()))
    assert with_batch == training_memory(config, batch, seq, precision, attention, device_type="cpu").activations


def test_cuda_and_cpu_autocast_differ_only_where_their_rules_do():
    cuda = block_saved_bytes(SMALL, 1, 4, "bf16", "naive", "cuda")
    cpu = block_saved_bytes(SMALL, 1, 4, "bf16", "naive", "cpu")
    # CPU autocast runs softmax in bf16: P kept once in 2 bytes instead of fp32 + a bf16 copy.
    assert {k for k in cuda if cuda[k] != cpu[k]} == {"attention_scores"}
    assert cuda["attention_scores"] - cpu["attention_scores"] == 32 * 4


def test_residual_stream_is_fp32_sized():
    # 2.7B at batch 4, context 512: 4 x 512 x 2560 x 4 B = 20,971,520 B (20 MiB).
    assert residual_stream_bytes(ModelConfig.for_size("2.7B", 512, table="2025"), 4, 512) == 20_971_520


def test_training_peak_of_27b_is_the_optimizer_step():
    config = ModelConfig.for_size("2.7B", 512, table="2025")
    prediction = predict_peak_memory(config, 4, 512, "fp32", "naive", "train_step")
    params = 3_406_809_600 * 4  # 13,627,238,400 B
    # Saved activations: 32 blocks x 680,083,456 B + head 144,842,756 B.
    assert prediction.saved_activations_bytes == 32 * 680_083_456 + 144_842_756
    # End of forward: P + 2P (AdamW) + 21.9 GB saved + 268 MB of score gradients = 63.1 GB; the optimizer
    # step holds parameters, gradients, both moments and foreach AdamW's sqrt temporary: 5P = 68.1 GB.
    assert prediction.peak_bytes == 5 * params and prediction.peak_phase == "optimizer step"


def test_fused_adamw_and_forward_backward_peaks():
    config = ModelConfig.for_size("2.7B", 512, table="2025")
    params = 3_406_809_600 * 4
    fused = predict_peak_memory(config, 4, 512, "fp32", "naive", "train_step", adamw="fused")
    # Fused AdamW updates in place: the optimizer step holds 4P, below the end of forward (63.1 GB).
    assert fused.peak_phase == "end of forward" and fused.peak_bytes == 3 * params + 32 * 680_083_456 + 144_842_756 + \
        fused.transient_bytes
    no_optimizer = predict_peak_memory(config, 4, 512, "fp32", "naive", "forward_backward")
    assert no_optimizer.optimizer_state_bytes == 0 and no_optimizer.peak_bytes == fused.peak_bytes - 2 * params


def test_the_course_adamw_step_adds_only_the_largest_parameter():
    # The 2026 xl at context 128: the course's AdamW holds 4P and the sqrt(v) of a 10,240 x 2,560 feed-forward
    # weight (100 MiB, above the 10,000 x 2,560 embedding) at its step, 12.59 GiB less than foreach's 5P; the
    # step is still the training peak there.
    config = ModelConfig.for_size("xl", 128, table="2026")
    params = 3_406_809_600 * 4
    course = predict_peak_memory(config, 4, 128, "fp32", "naive", "train_step", adamw="course")
    foreach = predict_peak_memory(config, 4, 128, "fp32", "naive", "train_step", adamw="foreach")
    assert course.peak_phase == "optimizer step" and course.peak_bytes == 4 * params + 10_240 * 2560 * 4
    assert foreach.peak_bytes - course.peak_bytes == params - 10_240 * 2560 * 4


def test_inference_peak_by_hand():
    config = ModelConfig.for_size("2.7B", 512, table="2025")
    fp32 = predict_peak_memory(config, 4, 512, "fp32", "naive", "inference")
    # Residual + norm output 41,943,040 B; attention stage: rotated q, k and v 62,914,560 B + 33,554,432
    # scores x (masked 4 B + softmax 4 B) 268,435,456 B: transient 373,293,056 B on top of P.
    assert fp32.transient_bytes == 373_293_056 and fp32.peak_bytes == 3_406_809_600 * 4 + 373_293_056
    bf16 = predict_peak_memory(config, 4, 512, "bf16", "naive", "inference")
    # Autocast caches a bf16 copy of every Linear weight: 2 B x 3,381,043,200 matmul weights.
    assert bf16.autocast_weight_cache_bytes == 2 * 3_381_043_200


@pytest.mark.parametrize("kwargs, message", [
    (dict(precision="fp8"), "unknown precision"),
    (dict(attention="flash"), "no activation model"),
    (dict(device_type="mps"), "unknown device type"),
])
def test_bad_model_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        block_saved_bytes(SMALL, 1, 4, **kwargs)
    with pytest.raises(ValueError, match=message):
        training_memory(SMALL, 1, 4, **kwargs)
    with pytest.raises(ValueError, match="unknown mode"):
        predict_peak_memory(SMALL, 1, 4, mode="serve")


@pytest.mark.parametrize("batch_size, seq_len, error, message", [
    (-1, 16, ValueError, "batch_size"), (0, 16, ValueError, "batch_size"), (2, -16, ValueError, "seq_len"),
    (2.0, 16, TypeError, "batch_size"),
])
def test_every_activation_model_refuses_a_bad_batch_or_sequence(batch_size, seq_len, error, message):
    for model in (residual_stream_bytes, block_saved_bytes, head_saved_bytes, saved_activation_bytes,
                  predict_peak_memory, training_memory):
        with pytest.raises(error, match=message):
            model(SMALL, batch_size, seq_len)


# ------------------------------------------------------------------------- training memory per device

# Tiny, batch 2, sequence 16: T = 32 tokens, T d = 2,048 and T d_ff = 8,192 elements.
#   fp32, SDPA: token ids 32 x 8 = 256; RMSNorm input and normed 5 norms x 2,048 x 4 = 40,960 each;
#   rsqrt 5 x 32 x 4 = 640; q/k/v input, w1/w3 input 2 layers x 2,048 x 4 = 16,384 each; RoPE
#   tables 8 x (16 x 8) x 4 = 4,096; w1, silu, w3 outputs 6 x 8,192 x 4 = 196,608; w2 input
#   2 x 8,192 x 4 = 65,536; final norm output 2,048 x 4 = 8,192; log-probs 32 x 10,000 x 4 =
#   1,280,000; targets 256; normaliser 4; q, k, v 6 x 2,048 x 4 = 49,152;
#   attention output 16,384 (the output projection's input, a view of it); log-sum-exp
#   2 x (2 x 4 x 16) x 4 = 1,024. Sum: 1,736,836.
#   naive instead of SDPA: no log-sum-exp (1,024), the output projection's input a copy (16,384);
#   probabilities 2 x (2 x 4 x 16 x 16) x 4 = 16,384 and masks 2 x 256 = 512: 1,752,708.
#   bf16 autocast (CPU), SDPA: norms' fp32 tensors as above (82,560 with rsqrt); q/k/v inputs cast
#   three times 2 x 3 x 2,048 x 2 = 24,576; RoPE tables in bf16 2,048; w1/w3 inputs cast twice
#   16,384; feed-forward 98,304 + 32,768; final norm output 4,096;
#   log-probs (fp32) 1,280,000; ids, targets, normaliser 516; q, k, v 24,576; output 8,192;
#   log-sum-exp 1,024; bf16 copies of the 771,072 Linear weights 1,542,144. Sum: 3,117,188.
@pytest.mark.parametrize("precision, attention, expected", [
    ("fp32", "sdpa", 1_736_836), ("fp32", "naive", 1_752_708), ("bf16", "sdpa", 3_117_188),
])
def test_tiny_activation_bytes_worked_by_hand(precision, attention, expected):
    assert training_memory(TINY, 2, 16, precision, attention, device_type="cpu").activations == expected


def test_sdpa_merges_heads_without_a_copy_on_either_device_and_naive_attention_copies_them():
    # SDPA's output is laid out as q, (batch, seq, heads, d_head) in memory as the model passes it, so the
    # output projection's input is a view of it on CPU as on CUDA; naive attention's P v is (batch, heads,
    # seq, d_head) in memory, and merging its heads copies T x d: 2 x 16 x 64 x 4 = 8,192 fp32 bytes a block.
    for device_type in DEVICE_TYPES:
        assert "output_proj_input" not in block_saved_bytes(TINY, 2, 16, "fp32", "sdpa", device_type)
        assert block_saved_bytes(TINY, 2, 16, "fp32", "naive", device_type)["output_proj_input"] == 8_192


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
    assert training_memory(XL, 4, 512).activations == XL_ACTIVATIONS


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
    with_copies = saved_activation_bytes(TINY, 2, 16, "bf16", "sdpa")
    without = saved_activation_bytes(TINY, 2, 16, "bf16", "sdpa", weight_copies=False)
    assert with_copies - without == 2 * 771_072
    replicated = training_memory(TINY, 2, 16, "bf16").activations
    assert replicated - training_memory(TINY, 2, 16, "bf16", strategy="fsdp", world_size=2).activations == 2 * 771_072


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(precision="fp8"), ValueError, "precision"),
    (dict(attention="flash"), ValueError, "attention"),
    (dict(strategy="zero2"), ValueError, "strategy"),
    (dict(world_size=0), ValueError, "world_size"),
    (dict(world_size=2.0), TypeError, "world_size"),
    (dict(strategy="fsdp", world_size=2, ddp_buckets=True), ValueError, "DDP buckets"),
    (dict(strategy="fsdp", world_size=2, fsdp_gathered_weights=-3), ValueError, "fsdp_gathered_weights"),
    (dict(strategy="fsdp", world_size=2, fsdp_reduce_scatters_in_flight=0), ValueError,
     "fsdp_reduce_scatters_in_flight"),
])
def test_bad_input_is_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        training_memory(TINY, 2, 16, **kwargs)
