"""The torch-native reference LM: the project's architecture, so that timing it beside the project's
model compares code, not models."""

import pytest
import torch

from cs336_systems.__main__ import main
from cs336_systems.benchmarks.e2e import E2EConfig, benchmark_model
from cs336_systems.benchmarks.reference_lm import ReferenceLM
from cs336_systems.lm_training import lm_loss
from cs336_systems.model import ModelConfig, TransformerLM, count_parameters
from cs336_systems.reports import problems
from cs336_systems.rows import REFERENCE_MODEL


def test_with_the_project_s_weights_it_gives_the_project_s_logits_and_gradients():
    torch.manual_seed(0)
    config = ModelConfig.for_size("tiny", 24)
    project = TransformerLM(config, attention="sdpa").double()
    reference = ReferenceLM(config).double().load_from(project)
    assert count_parameters(reference) == count_parameters(project)
    tokens, targets = torch.randint(0, config.vocab_size, (2, 2, 19))
    losses = [lm_loss(model(tokens), targets) for model in (project, reference)]
    # Both in float64 throughout: agreement to float64's precision, up to the order of additions; a
    # wrong weight, rotation or mask would be off in the first digits.
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-12, atol=0)
    for loss in losses:
        loss.backward()
    qkv = reference.blocks[0].qkv.weight.grad
    attention = project.layers[0].attn
    expected = torch.cat([attention.q_proj.weight.grad, attention.k_proj.weight.grad, attention.v_proj.weight.grad])
    torch.testing.assert_close(qkv, expected, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(reference.head.weight.grad, project.lm_head.weight.grad, rtol=1e-10, atol=1e-14)


def test_benchmark_rows_of_the_reference_say_so_and_the_report_sets_them_beside_the_project():
    cfg = E2EConfig("tiny", 16, batch_size=1, warmup=1, steps=2, compile=True, attention="sdpa", optimizer="fused")
    project = [{**row, "table": "sweep"} for row in benchmark_model(cfg, "cpu")]
    reference = [{**row, "table": "reference"} for row in benchmark_model(cfg, "cpu", reference=True)]
    assert {r["model"] for r in reference} == {REFERENCE_MODEL} and all("model" not in r for r in project)
    body = problems.report("torch_compile").render(project + reference).body
    assert "## The compiled step against a torch-native reference" in body
    ratio = project[-1]["median_ms"] / reference[-1]["median_ms"]
    assert "| tiny   | 16        | fp32        |" in body and f"{ratio:.2f}x" in body
    with pytest.raises(ValueError, match="the torch reference uses SDPA"):
        benchmark_model(E2EConfig("tiny", 16, attention="naive"), "cpu", reference=True)


def test_command_refuses_a_reference_with_other_attention(capsys):
    assert main(["e2e", "--size", "tiny", "--context", "16", "--reference", "--attention", "naive"]) == 2
    assert "--reference: the torch reference uses SDPA attention" in capsys.readouterr().err
