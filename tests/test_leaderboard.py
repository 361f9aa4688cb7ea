"""The leaderboard's parts on a CPU: the loss module both ways, the configuration's checks, the memory estimate
(against the peaks the committed reports measured, and the plans it picks on two GPUs), ours with FSDP over
gloo against one process, and the report's comparisons. Every variant's whole step over ranks runs in
perf/test_leaderboard.py."""

from pathlib import Path

import pytest
import torch

from cs336_systems.accounting.activations import parameter_counts
from cs336_systems.accounting.memory import GIB
from cs336_systems.benchmarks.leaderboard import (
    PLAN_HEADROOM_BYTES,
    LeaderboardConfig,
    benchmark_leaderboard,
    block_kept_bytes,
    estimated_peak_bytes,
    fewest_checkpoints,
)
from cs336_systems.distributed.checkpointing import Checkpoint
from cs336_systems.distributed.equivalence import LEADERBOARD_CHUNK_TOKENS, LEADERBOARD_MODEL, leaderboard_equivalence
from cs336_systems.distributed.launch import launch
from cs336_systems.gpus import GPU_SPECS
from cs336_systems.leaderboard_variants import DDP, FSDP, OUR_FSDP, VARIANTS, LossModel, Variant, checkpoint_plan
from cs336_systems.lm_training import build_model, random_batch
from cs336_systems.memory_guard import FIT_SHARE, MemoryCheck
from cs336_systems.model import LEADERBOARD, ModelConfig
from cs336_systems.runs import read_rows
from cs336_systems.reports.leaderboard import answer_leaderboard
from cs336_systems.reports.problems import report
from cs336_systems.rows.leaderboard import OURS, OURS_FSDP, OURS_SDPA, TORCH, TORCH_FUSED_LOSS
from tests.flash_reference import kernels_on_cpu_tensors

REPO = Path(__file__).resolve().parents[1]
SMALL = ModelConfig(d_model=32, d_ff=96, num_layers=2, num_heads=4, context_length=16, vocab_size=200)
# Measured peaks the estimate must stay within: the memory guard refuses a variant on it, so an estimate far
# above the truth hides a step that fits, one far below lets a step run out of memory. On two H200s it was
# within 2%.
ESTIMATE_TOLERANCE = 0.05


def test_the_fused_loss_model_matches_the_full_logits_loss_model():
    inputs, targets = random_batch(SMALL, 3, SMALL.context_length, "cpu", seed=1)
    results = []
    for fused in (False, True):
        model = LossModel(build_model(SMALL, "cpu", "sdpa", dtype=torch.float64, seed=0), fused, chunk_tokens=7)
        loss = model(inputs, targets)
        loss.backward()
        results.append((loss.detach(), {name: p.grad for name, p in model.named_parameters()}))
    (full_loss, full_grads), (fused_loss, fused_grads) = results
    torch.testing.assert_close(fused_loss, full_loss, rtol=1e-12, atol=0)
    assert fused_grads.keys() == full_grads.keys()
    for name, grad in full_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-10, atol=1e-14, msg=name)


def test_every_variant_differs_from_the_next_in_one_part():
    variants = list(VARIANTS.values())
    for first, second in zip(variants, variants[1:]):
        differences = [a != b for a, b in zip((first.parallelism, first.attention, first.fused_loss),
                                              (second.parallelism, second.attention, second.fused_loss))]
        assert sum(differences) == 1, (first, second)
    assert VARIANTS[OURS_FSDP] == Variant(OUR_FSDP, "flash_triton", fused_loss=True)
    assert VARIANTS[OURS] == Variant(DDP, "flash_triton", fused_loss=True)
    assert VARIANTS[TORCH] == Variant(FSDP, "sdpa", fused_loss=False)
    assert VARIANTS[OURS].setup == "bucketed DDP, Triton FlashAttention, LM head fused with the loss"


def test_the_default_configuration_is_the_handouts():
    cfg = LeaderboardConfig()
    assert cfg.model == ModelConfig(**LEADERBOARD)
    assert (cfg.model.d_model, cfg.model.num_layers, cfg.model.vocab_size, cfg.model.context_length) == (
        4096, 34, 151_936, 32_768)
    assert (cfg.batch_size, cfg.dtype, cfg.torch_dtype) == (2, "bf16", torch.bfloat16)
    assert cfg.per_rank_batch(2) == 1


@pytest.mark.parametrize("kwargs, error, match", [
    ({"dtype": "fp16"}, ValueError, "dtype must be one of bf16, fp32"),
    ({"batch_size": 0}, ValueError, "batch_size must be >= 1"),
    ({"steps": 0}, ValueError, "steps must be >= 1"),
    ({"warmup": 1.5}, TypeError, "warmup must be an int"),
    ({"loss_chunk_tokens": 0}, ValueError, "loss_chunk_tokens must be >= 1"),
    ({"checkpointed_blocks": 35}, ValueError, "checkpointed_blocks must be from 0 to the model's 34 blocks, got 35"),
    ({"checkpointed_blocks": -1}, ValueError, "checkpointed_blocks must be from 0"),
    ({"checkpointed_blocks": True}, TypeError, "checkpointed_blocks must be an int or None, got bool"),
])
def test_a_bad_configuration_is_refused_naming_the_setting(kwargs, error, match):
    with pytest.raises(error, match=match):
        LeaderboardConfig(**kwargs)


def test_a_batch_that_does_not_split_over_the_ranks_is_refused():
    with pytest.raises(ValueError, match="batch size 2 does not split evenly over world size 3"):
        LeaderboardConfig().per_rank_batch(3)


def test_the_estimate_orders_the_variants_as_their_parts_say():
    cfg = LeaderboardConfig()
    peaks = {name: estimated_peak_bytes(variant, cfg, 2, 34) for name, variant in VARIANTS.items()}
    # The attention does not change the estimate; sharding saves the replicated state, the fused loss the logits.
    assert peaks[OURS] == peaks[OURS_SDPA]
    assert peaks[TORCH_FUSED_LOSS] < peaks[OURS_SDPA]
    assert peaks[TORCH_FUSED_LOSS] + 30 * GIB < peaks[TORCH]
    # Our FSDP shards the state as torch's does, and holds neither the root's weights nor two blocks' gathered.
    assert peaks[OURS_FSDP] + 30 * GIB < peaks[OURS]
    assert peaks[TORCH_FUSED_LOSS] - 4 * GIB < peaks[OURS_FSDP] < peaks[TORCH_FUSED_LOSS]
    # More ranks shard torch FSDP's state further and leave each DDP rank's state whole.
    assert estimated_peak_bytes(VARIANTS[TORCH], LeaderboardConfig(batch_size=4), 4, 34) < peaks[TORCH]


def test_each_block_run_plainly_adds_what_it_keeps_less_the_input_a_checkpoint_keeps():
    cfg = LeaderboardConfig()
    kept, hidden = block_kept_bytes(cfg, 1), 32768 * 4096 * 2
    assert abs(kept / GIB - 4.02) < 0.01  # a compiled block, as measured on an H200
    for variant in VARIANTS.values():
        peaks = [estimated_peak_bytes(variant, cfg, 2, checkpointed) for checkpointed in range(35)]
        assert all(more >= fewer for more, fewer in zip(peaks, peaks[1:]))
        assert peaks[10] - peaks[11] == pytest.approx(kept - hidden, abs=1)


def test_our_fsdp_shards_the_weights_gradients_and_moments_over_the_ranks():
    """Twice the ranks at the same batch per rank: each rank holds half the shards of the Linear and Embedding
    weights and of their two AdamW moments; the RMSNorm weights stay whole, as do the activations."""
    model = ModelConfig(**LEADERBOARD)
    sharded_bytes = 2 * (sum(parameter_counts(model).values()) - parameter_counts(model)["norms"])  # bf16
    variant = VARIANTS[OURS_FSDP]
    for checkpointed in (0, 16, 34):
        two, four = (estimated_peak_bytes(variant, LeaderboardConfig(batch_size=ranks), ranks, checkpointed)
                     for ranks in (2, 4))
        assert two - four == pytest.approx(3 * sharded_bytes * (1 / 2 - 1 / 4), abs=1)


# The memory the plans below are made for: each GPU of the handout's pairs with all of its memory free.
TWO_GPUS = {"2 x 141 GB (H200)": GPU_SPECS["h200"].memory_bytes, "2 x 80 GB (H100)": GPU_SPECS["h100"].memory_bytes}


def _plan(name: str, free_bytes: float) -> tuple[int, bool]:
    """The blocks the benchmark checkpoints for variant `name` at the leaderboard's shape on two GPUs with
    `free_bytes` free each (its headroom and the memory guard's share for ranks in collectives), and whether
    the guard then lets it run."""
    cfg = LeaderboardConfig()

    def check(estimate: int) -> MemoryCheck:
        return MemoryCheck(estimate, int(free_bytes), share=FIT_SHARE)

    checkpointed = fewest_checkpoints(VARIANTS[name], cfg, 2,
                                      lambda estimate: check(estimate + PLAN_HEADROOM_BYTES).fits)
    return checkpointed, check(estimated_peak_bytes(VARIANTS[name], cfg, 2, checkpointed)).fits


@pytest.mark.parametrize("gpus, ours_with_fsdp, ours", [
    ("2 x 141 GB (H200)", (17, True), (26, True)),
    ("2 x 80 GB (H100)", (30, True), (34, False)),  # replicated, even every block checkpointed does not fit
], ids=["h200", "h100"])
def test_our_fsdp_keeps_more_blocks_than_ddp_on_two_gpus(gpus, ours_with_fsdp, ours):
    """The plans the memory estimate picks for the real 8B-class step: ours with FSDP keeps 17 blocks' activations
    on two H200s where bucketed DDP's replicated weights, gradients and moments leave room for 8, and runs on two
    H100s where DDP fits with none."""
    free = TWO_GPUS[gpus]
    assert _plan(OURS_FSDP, free) == ours_with_fsdp
    assert _plan(OURS, free) == ours
    assert _plan(OURS_FSDP, free)[0] < _plan(OURS, free)[0]


def test_the_fewest_checkpoints_are_the_fewest_whose_estimate_fits():
    cfg = LeaderboardConfig()
    variant = VARIANTS[TORCH_FUSED_LOSS]
    budget = estimated_peak_bytes(variant, cfg, 2, 14)
    assert fewest_checkpoints(variant, cfg, 2, lambda estimate: estimate <= budget) == 14
    assert fewest_checkpoints(variant, cfg, 2, lambda estimate: True) == 0
    assert fewest_checkpoints(variant, cfg, 2, lambda estimate: False) == 34  # for the guard to refuse


def test_the_plan_checkpoints_the_first_blocks_and_runs_the_rest_plainly():
    assert checkpoint_plan(4, 2) == (Checkpoint((0,)), Checkpoint((1,)), 2, 3)
    assert checkpoint_plan(3, 0) == (0, 1, 2)
    assert checkpoint_plan(2, 2) == (Checkpoint((0,)), Checkpoint((1,)))


def _committed_steps() -> list[dict]:
    return [row for path in sorted((REPO / "reports").glob("*/leaderboard.csv")) for row in read_rows(path)
            if row.get("table") == "step" and row.get("status") == "ok" and row.get("peak_gib") is not None]


@pytest.mark.parametrize("row", _committed_steps(), ids=lambda row: row["variant"])
def test_the_estimate_is_within_a_few_percent_of_each_committed_measured_peak(row):
    model = ModelConfig(d_model=row["d_model"], d_ff=row["d_ff"], num_layers=row["num_layers"],
                        num_heads=row["num_heads"], context_length=row["seq_len"], vocab_size=row["vocab_size"])
    cfg = LeaderboardConfig(model=model, batch_size=row["batch_size"], dtype=row["dtype"], compile=row["compile"],
                            loss_chunk_tokens=row["loss_chunk_tokens"])
    estimate = estimated_peak_bytes(VARIANTS[row["variant"]], cfg, row["world_size"],
                                    row["checkpointed_blocks"]) / GIB
    assert abs(estimate / row["peak_gib"] - 1) <= ESTIMATE_TOLERANCE, (estimate, row["peak_gib"])


# The leaderboard's CPU path (perf/test_leaderboard.py) on the equivalence check's model, the cheapest through
# the Triton interpreter: one warm-up and one timed step, the loss in two chunks.
GLOO_CONFIG = LeaderboardConfig(model=LEADERBOARD_MODEL, dtype="fp32", warmup=1, steps=1, compile=False,
                                loss_chunk_tokens=LEADERBOARD_CHUNK_TOKENS)


def ours_with_fsdp_on_gloo(rank: int, world_size: int) -> list[dict]:
    """Run under launch: ours with FSDP against one process, then its training steps on the tiny model."""
    return (leaderboard_equivalence(rank, world_size, (OURS_FSDP,))
            + benchmark_leaderboard(rank, world_size, GLOO_CONFIG, (OURS_FSDP,)))


@pytest.fixture(scope="module")
def gloo_rows() -> list[dict]:
    return launch(ours_with_fsdp_on_gloo, 2, device="cpu", timeout_s=300)[0]


# Ours attends with the Triton kernels; on a GPU perf/test_leaderboard.py runs ours with FSDP over NCCL.
@kernels_on_cpu_tensors
def test_ours_with_fsdp_matches_one_process_training_the_plain_model(gloo_rows):
    """One fp32 step over two gloo ranks (the Triton kernels interpreted, the first block checkpointed, the head
    gathered for the fused loss) against one process on the whole batch: the loss and every gradient."""
    (row,) = [r for r in gloo_rows if r["table"] == "equivalence"]
    assert row["variant"] == OURS_FSDP and row["backend"] == "gloo"
    assert row["matches"], row


@kernels_on_cpu_tensors
def test_ours_with_fsdp_trains_on_gloo_with_the_tiny_model(gloo_rows):
    (row,) = [r for r in gloo_rows if r["table"] == "step"]
    assert (row["variant"], row["status"], row["steps"]) == (OURS_FSDP, "ok", 1)
    assert row["model_peak_gib"] < 1  # a CPU counts no GPU overhead
    assert row["first_loss"] > row["last_loss"]  # two AdamW steps on the same batch lower its loss


def _step(variant: str, median_ms: float, run: int = 1, status: str = "ok", std_share: float = 0.01) -> dict:
    config = {"batch_size": 2, "seq_len": 32768, "d_model": 4096, "d_ff": 11008, "num_layers": 34, "num_heads": 32,
              "vocab_size": 151936, "parameters": 8_125_698_048, "dtype": "bf16", "world_size": 2,
              "backend": "nccl", "compile": True, "warmup": 2, "steps": 5}
    row = {"table": "step", "variant": variant, "setup": VARIANTS[variant].setup, "run": run, "status": status,
           "model_peak_gib": 85.0, "checkpointed_blocks": 20, **config}
    if status == "ok":
        row.update(median_ms=median_ms, mean_ms=median_ms, std_ms=median_ms * std_share, iqr_ms=5.0, min_ms=median_ms - 5, max_ms=median_ms + 5, forward_ms=1.0,
                   backward_ms=2.0, optimizer_ms=3.0, tokens_per_s=1e4, tflops_per_gpu=500.0, peak_gib=84.0)
    else:
        row.update(oom_predicted=True)
    return row


def test_the_report_compares_variants_only_within_one_run():
    same = report("leaderboard").render([_step(OURS, 6400.0), _step(TORCH, 5800.0)]).body
    assert "Ours takes 1.10x torch's time per step" in same
    apart = report("leaderboard").render([_step(OURS, 6400.0, run=2), _step(TORCH, 5800.0, run=1)]).body
    assert "Ours takes" not in apart and "none: different runs" in apart


def test_the_report_and_answer_say_when_a_variant_did_not_fit():
    rows = [_step(OURS, 6400.0), _step(TORCH, 0.0, status="OOM")]
    body = report("leaderboard").render(rows).body
    assert "No comparison" in body and "OOM" in body
    answer = answer_leaderboard({"leaderboard": rows})[0]
    assert answer.startswith("The 8B-class model's full training step at batch 2 x 32,768 tokens, bf16, on 2 GPUs")
    assert "6.40 s" in answer


def test_a_run_on_gloo_ranks_is_said_to_be_one_on_the_cpu_and_its_small_model_is_not_called_8b_class():
    # The CPU smoke run's model and ranks (perf/test_leaderboard.py), two gloo ranks sharing the CPU.
    small = {"seq_len": 64, "d_model": 64, "d_ff": 176, "num_layers": 2, "num_heads": 4, "vocab_size": 1000,
             "parameters": 230_000, "dtype": "fp32", "backend": "gloo"}
    rows = [{**_step(name, median_ms), **small} for name, median_ms in ((OURS, 8235.0), (TORCH, 47.4))]
    answer = answer_leaderboard({"leaderboard": rows})[0]
    assert answer.startswith("A 0.23M-parameter stand-in for the 8B-class model (d_model 64, 2 layers): its full "
                             "training step at batch 2 x 64 tokens, fp32, on 2 gloo ranks on the CPU (")
    assert "model TFLOP/s per rank, peak 84.0 GiB per rank." in answer and "GPU" not in answer
    body = report("leaderboard").render(rows).body
    assert "| model TFLOP/s per rank " in body and "per GPU" not in body


def test_a_step_time_that_varied_by_more_than_a_fifth_is_marked_noisy_and_so_are_its_ratios():
    body = report("leaderboard").render([_step(OURS, 6400.0, std_share=0.3), _step(TORCH, 5800.0)]).body
    assert "6,400.0 ms (IQR 5 ms) (noisy)" in body
    assert "Ours takes 1.10x (noisy) torch's time per step" in body


def test_the_report_sets_ours_with_fsdp_against_the_fastest_torch_variant():
    rows = [_step(OURS_FSDP, 5000.0), _step(OURS, 6400.0), _step(TORCH_FUSED_LOSS, 5100.0), _step(TORCH, 5800.0)]
    body = report("leaderboard").render(rows).body
    assert ("Ours with FSDP takes 0.98x the time per step of the fastest torch variant, torch with the fused loss "
            "(5,000.0 ms against 5,100.0 ms, medians of one run), checkpointing 20 blocks against its 20.") in body
    assert "- data parallelism (our FSDP against bucketed DDP): 0.78x, 5,000.0 ms against 6,400.0 ms" in body
    answer = answer_leaderboard({"leaderboard": rows})[0]
    assert answer.startswith("The 8B-class model's full training step at batch 2 x 32,768 tokens, bf16, on 2 GPUs "
                             "(our FSDP (gathers layer by layer), Triton FlashAttention, LM head fused with the loss): "
                             "5.00 s")
    assert "Ours with FSDP takes 0.98x" in answer
    alone = report("leaderboard").render([_step(OURS_FSDP, 5000.0), _step(TORCH, 0.0, status="OOM")]).body
    assert "No comparison of ours with FSDP: ours with FSDP ran, no torch variant ran." in alone
