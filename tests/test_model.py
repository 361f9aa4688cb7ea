"""The Transformer LM: sizes, shapes, causality, RoPE, layers against float64 references."""

import math

import pytest
import torch

from cs336_systems.accounting.activations import parameter_count
from cs336_systems.model import (
    DEFAULT_SIZE_TABLE,
    SIZE_TABLES,
    CausalSelfAttention,
    Embedding,
    Linear,
    ModelConfig,
    RMSNorm,
    RotaryEmbedding,
    TransformerLM,
    count_parameters,
    model_sizes,
)

# The parameter counts of the course's model sizes (vocabulary 10,000, untied LM head, SwiGLU, RMSNorm
# weights): per block 4 d^2 + 3 d d_ff + 2 d, plus 2 x 10,000 d for the embedding and the head and d for
# the final norm. The 2025 ones are the handout's; 2026's xl is 2025's 2.7B.
EXPECTED_PARAMETERS = {
    ("2025", "small"): 128_625_408,
    ("2025", "medium"): 423_183_360,
    ("2025", "large"): 969_411_840,
    ("2025", "xl"): 1_998_235_200,
    ("2025", "2.7B"): 3_406_809_600,
    ("2026", "small"): 128_625_408,
    ("2026", "medium"): 423_183_360,
    ("2026", "large"): 969_411_840,
    ("2026", "xl"): 3_406_809_600,
    ("2026", "10B"): 12_832_823_808,
}
# float64 against float64, computed in a different order: a few units of 1e-16, well inside this.
FLOAT64_RTOL = 1e-12


@pytest.mark.parametrize(("table", "size"), EXPECTED_PARAMETERS)
def test_parameter_count_matches_the_size_table(table, size):
    config = ModelConfig.for_size(size, context_length=128, table=table)
    with torch.device("meta"):  # no memory: the 10B model would need 51 GB
        model = TransformerLM(config)
    assert count_parameters(model) == parameter_count(config) == EXPECTED_PARAMETERS[(table, size)]


def test_the_2026_table_is_the_default_and_the_2025_one_is_selectable():
    assert DEFAULT_SIZE_TABLE == "2026" and ModelConfig.for_size("xl", 128).d_model == 2560
    assert ModelConfig.for_size("xl", 128, table="2025").d_model == 1600
    assert model_sizes() == model_sizes("2026") != model_sizes("2025")
    with pytest.raises(ValueError, match="select the 2026 table"):
        ModelConfig.for_size("10B", 128, table="2025")
    with pytest.raises(ValueError, match="unknown size table '2024'; choose one of 2026, 2025"):
        ModelConfig.for_size("xl", 128, table="2024")


def tiny_model(attention="naive", context_length=32, seed=0) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(ModelConfig.for_size("tiny", context_length), attention=attention)


def test_logits_shape_and_weight_layout():
    model = tiny_model()
    tokens = torch.randint(model.config.vocab_size, (3, 17))
    assert model(tokens).shape == (3, 17, model.config.vocab_size)
    d = model.config
    assert model.layers[0].ffn.w1.weight.shape == (d.d_ff, d.d_model)  # (d_out, d_in)
    assert model.lm_head.weight.shape == (d.vocab_size, d.d_model)
    assert all("bias" not in name for name, _ in model.named_parameters())


def test_changing_a_future_token_leaves_earlier_logits_unchanged():
    model = tiny_model().double()
    tokens = torch.randint(model.config.vocab_size, (2, 20))
    changed = tokens.clone()
    changed[:, 12] = (changed[:, 12] + 1) % model.config.vocab_size
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :12], after[:, :12], rtol=0, atol=0)
    assert not torch.allclose(before[:, 12:], after[:, 12:])


def test_rope_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(d_head=16, context_length=64).double()
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)

    def score(i, j):
        return rope(q[None], torch.tensor([i])) @ rope(k[None], torch.tensor([j])).T

    torch.testing.assert_close(score(5, 3), score(40, 38))
    torch.testing.assert_close(score(0, 0), (q @ k)[None, None])
    assert not torch.allclose(score(5, 3), score(5, 4))


def test_rope_rotates_heads_laid_out_after_the_sequence_as_it_rotates_them_laid_out_before():
    rope = RotaryEmbedding(d_head=8, context_length=16).double()
    x = torch.randn(2, 16, 3, 8, dtype=torch.float64)  # (batch, seq, heads, d_head)
    by_heads = rope(x.transpose(1, 2), torch.arange(16)).transpose(1, 2)
    torch.testing.assert_close(rope(x, torch.arange(16)[:, None]), by_heads, rtol=0, atol=0)


def test_attention_takes_q_k_v_and_gives_o_with_the_heads_after_the_sequence_in_memory():
    # So merging o's heads for the output projection is a view, not a copy (CausalSelfAttention says why).
    attention = CausalSelfAttention(ModelConfig(d_model=32, d_ff=64, num_layers=1, num_heads=4, context_length=16),
                                    "sdpa")
    seen = []

    def recording(q, k, v, is_causal):
        seen.extend((q, k, v))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    attention.attention = recording
    attention(torch.randn(2, 16, 32))
    assert [t.shape for t in seen] == [(2, 4, 16, 8)] * 3
    assert all(t.transpose(1, 2).is_contiguous() for t in seen)


def test_rope_preserves_norms():
    rope = RotaryEmbedding(d_head=8, context_length=16).double()
    x = torch.randn(2, 16, 8, dtype=torch.float64)
    torch.testing.assert_close(rope(x, torch.arange(16)).norm(dim=-1), x.norm(dim=-1))


@pytest.mark.parametrize("attention", ["sdpa", "naive_compiled"])
def test_attention_variants_agree_with_naive(attention):
    tokens = torch.randint(10_000, (2, 24))
    reference = tiny_model("naive")(tokens)
    torch.testing.assert_close(tiny_model(attention)(tokens), reference, rtol=1e-4, atol=1e-4)


def test_layers_match_float64_references():
    x = torch.randn(4, 6, 10)
    linear = Linear(10, 7)
    # fp32 output against the float64 product rounded to fp32, at fp32's default tolerances.
    torch.testing.assert_close(linear(x), (x.double() @ linear.weight.double().T).float())
    norm = RMSNorm(10)
    norm.weight.data.uniform_(0.5, 1.5)
    expected = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
    torch.testing.assert_close(norm(x).double(), expected, rtol=1e-5, atol=1e-6)
    embedding = Embedding(50, 8)
    ids = torch.randint(50, (3, 4))
    assert torch.equal(embedding(ids), embedding.weight[ids])


def test_rmsnorm_keeps_the_input_dtype():
    norm = RMSNorm(16)
    assert norm(torch.randn(2, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_rmsnorm_of_float64_is_computed_in_float64():
    # Normalising in fp32 would be off by about 1e-7 relative (fp32's precision).
    x = torch.randn(4, 6, 10, dtype=torch.float64)
    norm = RMSNorm(10, dtype=torch.float64)
    norm.weight.data.uniform_(0.5, 1.5)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight
    torch.testing.assert_close(norm(x), expected, rtol=FLOAT64_RTOL, atol=0)


def test_linear_init_is_truncated_normal_with_the_course_std():
    torch.manual_seed(0)
    linear = Linear(400, 600)
    std = math.sqrt(2 / (400 + 600))
    assert abs(linear.weight.std().item() - std) / std < 0.05
    assert linear.weight.abs().max().item() <= 3 * std + 1e-6


def test_bad_input_gives_clear_errors():
    model = tiny_model(context_length=8)
    with pytest.raises(ValueError, match="exceeds the model's context length 8"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(batch, seq\)"):
        model(torch.zeros(9, dtype=torch.long))
    for empty in ((0, 4), (2, 0)):
        with pytest.raises(ValueError, match="at least one token"):
            model(torch.zeros(empty, dtype=torch.long))
    for dtype in (torch.float32, torch.bool):
        with pytest.raises(TypeError, match="integers"):
            model(torch.zeros(1, 4, dtype=dtype))
    vocab = model.config.vocab_size
    for bad_id in (-1, -vocab, vocab):
        with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {vocab}\).* {bad_id}"):
            model(torch.tensor([[0, bad_id, 1]]))
    with pytest.raises(ValueError, match="unknown model size"):
        ModelConfig.for_size("huge", 16)
    with pytest.raises(ValueError, match="unknown attention"):
        TransformerLM(ModelConfig.for_size("tiny", 16), attention="fast")
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(d_model=30, d_ff=64, num_layers=1, num_heads=4, context_length=8)


@pytest.mark.parametrize("field, value, error", [
    ("d_model", -8, ValueError), ("d_ff", 0, ValueError), ("num_layers", -3, ValueError), ("num_heads", 0, ValueError),
    ("context_length", 0, ValueError), ("vocab_size", -1, ValueError), ("rope_theta", 0.0, ValueError),
    ("d_model", 64.0, TypeError), ("num_layers", True, TypeError),
])
def test_a_config_with_a_nonsense_size_is_refused_naming_it(field, value, error):
    sizes = dict(d_model=64, d_ff=128, num_layers=2, num_heads=4, context_length=8)
    with pytest.raises(error, match=field):
        ModelConfig(**{**sizes, field: value})


def test_size_tables_are_the_single_source_of_sizes():
    assert {(table, size) for table in SIZE_TABLES for size in SIZE_TABLES[table]} == set(EXPECTED_PARAMETERS)
    assert all("tiny" in model_sizes(table) for table in SIZE_TABLES)
