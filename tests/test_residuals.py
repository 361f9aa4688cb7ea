"""memory_profiling part (f) on the tiny model: each block's residuals against the accounting model, the
operations that allocated them, its weight gradients, and the report's sentences from GPU-shaped rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cs336_systems.accounting.activations import block_saved_bytes, residual_stream_bytes
from cs336_systems.model import ModelConfig, TransformerLM
from cs336_systems.profiling.residuals import block_memory
from cs336_systems.reports import problems

CONFIG = ModelConfig.for_size("tiny", 16)
BATCH = 2


def _profile(attention: str, precision: str):
    torch.manual_seed(0)
    model = TransformerLM(CONFIG, attention=attention)
    inputs, targets = torch.randint(0, CONFIG.vocab_size, (2, BATCH, 16))

    def loss():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())

    return model, block_memory(model, loss, model.layers, exclude=[inputs, targets])


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_each_block_saves_what_the_accounting_model_counts(attention, precision):
    _, profile = _profile(attention, precision)
    expected = sum(block_saved_bytes(CONFIG, BATCH, 16, precision, attention, "cpu").values())
    assert [b.saved_bytes for b in profile.blocks] == [expected] * CONFIG.num_layers
    # The block's input, the residual stream, was allocated before the block began.
    assert all(b.allocated_elsewhere_bytes == residual_stream_bytes(CONFIG, BATCH, 16) for b in profile.blocks)
    assert profile.saved_outside_blocks_bytes > 0  # the head's log-softmax, the embedding's indices


def test_operations_behind_the_residuals_add_up_and_name_the_matmuls():
    _, profile = _profile("naive", "fp32")
    block = profile.blocks[1]
    assert sum(block.by_operation.values()) == block.saved_bytes
    top = block.top_operations(5)
    assert [size for _, size, _ in top] == sorted((size for _, size, _ in top), reverse=True)
    # d_ff-wide SwiGLU activations: w1 and w3 outputs (mm), SiLU's output, and its product with w3's.
    assert {"aten::mm", "aten::silu", "aten::mul"} <= {op for op, _, _ in top}
    assert sum(share for _, _, share in top) < 1 and "aten::add" in block.by_operation  # its input


def test_weight_gradients_take_four_bytes_per_parameter_and_hooks_are_removed():
    model, profile = _profile("sdpa", "bf16")
    per_block = 4 * CONFIG.d_model ** 2 + 3 * CONFIG.d_model * CONFIG.d_ff + 2 * CONFIG.d_model
    assert all(b.parameter_count == per_block and b.gradient_parameter_bytes == 4 * per_block for b in profile.blocks)
    assert all(b.gradient_bytes is None for b in profile.blocks)  # no allocator to read on CPU
    assert not any(block._forward_hooks or block._forward_pre_hooks or block._backward_hooks
                   for block in model.layers)


def _gpu_block_rows(extra: int) -> list[dict]:
    mib = 2**20
    base = {"size": "xl", "batch_size": 4, "attention": "naive", "device": "cuda", "precision": "fp32",
            "context_length": 128, "size_table": "2026"}
    residual, saved, params = 5 * mib, 166 * mib, 104_862_720
    rows = [{**base, "table": "peak", "mode": "train_step", "status": "ok", "start_bytes": 38 * 2**30,
             "peak_increase_bytes": 20 * 2**30, "peak_bytes": 58 * 2**30, "predicted_peak_bytes": 57 * 2**30,
             "predicted_phase": "end of forward", "predicted_parameters_bytes": 0, "predicted_gradients_bytes": 0,
             "predicted_optimizer_state_bytes": 0, "predicted_activations_bytes": 0,
             "predicted_weight_cache_bytes": 0, "predicted_transient_bytes": 0}]
    rows += [{**base, "table": "block", "status": "ok", "block": i, "saved_bytes": saved,
              "predicted_saved_bytes": saved, "input_bytes": residual, "forward_allocated_bytes": saved,
              "backward_allocated_bytes": 4 * params + extra - saved, "gradient_bytes": 4 * params + extra,
              "weight_gradient_bytes": 4 * params, "parameters": params, "residual_stream_bytes": residual}
             for i in range(32)]
    rows += [{**base, "table": "block_operation", "block": 16, "rank": rank, "operation": op, "bytes": 20 * mib,
              "share": 20 / 166} for rank, op in enumerate(["aten::mm", "aten::silu", "aten::mul"], 1)]
    return rows


def test_report_answers_f_from_gpu_rows():
    body = problems.report("memory_profiling").render(_gpu_block_rows(extra=5 * 2**20)).body
    section = body[body.index("## (f)"):]
    # Residuals measured and modelled, the top 3 operations' share, then the gradients: 104,862,720 parameters
    # x 4 bytes = 400.02 MiB expected and found as .grad; the allocator saw that and one residual-stream tensor.
    assert "| 166.00 MiB            | 166.00 MiB | 36%                | 4 x 104,862,720 = 400.02 MiB" in section
    assert "| 400.02 MiB                 | 405.02 MiB" in section
    assert "| fp32        | 16      | aten::mm    | 20.00 MiB   | 12.0%   |" in section
    other = problems.report("memory_profiling").render(_gpu_block_rows(extra=0)).body
    assert "| 400.02 MiB                 | 400.02 MiB" in other
