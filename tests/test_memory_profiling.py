"""The snapshot parser on a synthetic snapshot, CPU peak and saved-tensor measurement, and the memory
reports. The analytical memory model they are compared with is tested in test_memory_model.py."""

import weakref

import pytest
import torch

from cs336_systems.benchmarks.gradient_checkpointing import CheckpointSweepConfig, checkpoint_sweep
from cs336_systems.benchmarks.memory_profiling import MemoryProfileConfig, memory_profile
from cs336_systems.profiling.memory import (
    PREEXISTING,
    SMALLER,
    active_memory_layout,
    active_memory_timeline,
    compact_snapshot,
    downsample_peaks,
    largest_allocations,
    load_snapshot,
    peak_memory_increase,
    plot_active_memory,
    record_memory_history,
    saved_tensor_bytes,
    short_path,
    source_frame,
    write_snapshot,
)
from cs336_systems.reports import PREDICTED_OOM, gradient_checkpointing, memory_profiling, problems
from cs336_systems.rows import OOM

# ---------------------------------------------------------------------------------------- snapshots

def _frames(*locations):
    return [{"filename": filename, "line": line, "name": name} for filename, line, name in locations]


LINEAR = ("/venv/lib/python3.12/site-packages/torch/nn/functional.py", 10, "linear")
MODEL = ("/repo/cs336_systems/model.py", 77, "forward")
STEP = ("/repo/cs336_systems/benchmarks/harness.py", 88, "training_step")


def synthetic_snapshot() -> dict:
    """4096 B allocated before recording and alive at the end; then A (1000 B) comes and goes, B and
    C (3000 B each, one line) overlap; C is alive at the end."""
    trace = [
        {"action": "segment_alloc", "addr": 0, "size": 1 << 20, "time_us": 0, "frames": []},
        {"action": "alloc", "addr": 1, "size": 1000, "time_us": 1, "frames": _frames(LINEAR, MODEL, STEP)},
        {"action": "alloc", "addr": 2, "size": 3000, "time_us": 2, "frames": _frames(STEP)},
        {"action": "free_requested", "addr": 1, "size": 1000, "time_us": 3, "frames": []},
        {"action": "free_completed", "addr": 1, "size": 1000, "time_us": 4, "frames": []},
        {"action": "alloc", "addr": 3, "size": 3000, "time_us": 5, "frames": _frames(STEP)},
        {"action": "free_completed", "addr": 2, "size": 3000, "time_us": 6, "frames": []},
    ]
    blocks = [{"size": 4096, "state": "active_allocated"}, {"size": 3000, "state": "active_allocated"},
              {"size": 1000, "state": "inactive"}]
    return {"segments": [{"device": 0, "blocks": blocks}], "device_traces": [trace]}


def test_timeline_recovers_the_starting_level_and_follows_events():
    timeline = active_memory_timeline(synthetic_snapshot())
    # Start: 7096 active at the end minus the trace's net +3000 = 4096.
    assert timeline == [(1, 5096), (2, 8096), (4, 7096), (5, 10096), (6, 7096)]


def test_downsampling_keeps_the_peak():
    timeline = [(t, v) for t, v in enumerate([1, 5, 2, 9, 3, 4, 8, 1, 0])]
    sampled = downsample_peaks(timeline, 3)
    assert len(sampled) == 3 and max(v for _, v in sampled) == 9
    assert downsample_peaks(timeline, 100) == timeline
    with pytest.raises(ValueError, match="positive"):
        downsample_peaks(timeline, 0)


def test_largest_allocations_group_by_size_and_source():
    top = largest_allocations(synthetic_snapshot(), top=5)
    assert [(a.size_bytes, a.count, a.source) for a in top] == [
        (3000, 2, "cs336_systems/benchmarks/harness.py:88 (training_step)"),
        (1000, 1, "cs336_systems/model.py:77 (forward)")]
    assert top[1].innermost == "torch/nn/functional.py:10 (linear)"
    assert source_frame(_frames(LINEAR)) == "outside cs336_systems"


def _stack_at(layout, step: int) -> list[tuple[int, int, str]]:
    """(bottom, top, kind) of every area that covers `step`, bottom up."""
    stack = []
    for area in layout.areas:
        if area.steps[0] <= step < area.steps[-1]:
            i = max(i for i, s in enumerate(area.steps) if s <= step)
            if area.tops[i] > area.bottoms[i]:
                stack.append((area.bottoms[i], area.tops[i], area.kind))
    return sorted(stack)


@pytest.mark.parametrize("max_allocations", [0, 1, 3])
def test_layout_stacks_bands_without_gaps_up_to_the_active_memory(max_allocations):
    snapshot = synthetic_snapshot()
    layout = active_memory_layout(snapshot, max_allocations=max_allocations)
    levels = [active for _, active in active_memory_timeline(snapshot)]
    assert layout.events == len(levels) and layout.peak_bytes == max(levels)
    for step, active in enumerate(levels, 1):
        stack = _stack_at(layout, step)
        assert stack[0][0] == 0 and stack[-1][1] == active, stack
        assert all(upper[0] == lower[1] for lower, upper in zip(stack, stack[1:])), stack
    assert sum(area.kind == "allocation" for area in layout.areas) == min(max_allocations, 3)


def test_layout_slides_a_band_down_when_one_below_is_freed():
    # Every allocation shown: B (3000) sits on A (1000) until A is freed, then on what came before.
    layout = active_memory_layout(synthetic_snapshot(), max_allocations=3)
    b = next(a for a in layout.areas if a.kind == "allocation" and a.steps[0] == 2)
    assert list(zip(b.steps, b.bottoms)) == [(2, 5096), (3, 4096), (5, 4096)]
    assert [a.kind for a in layout.areas][0] == PREEXISTING and layout.areas[-1].kind == SMALLER


def test_compact_snapshot_keeps_one_trace_and_the_package_frames():
    pytest_frame = ("/venv/lib/python3.12/site-packages/_pytest/python.py", 1, "pytest_pyfunc_call")
    snapshot = synthetic_snapshot()
    snapshot["device_traces"][0][1]["frames"] = _frames(LINEAR, MODEL, STEP, pytest_frame)
    snapshot["device_traces"].append([{"action": "alloc", "addr": 9, "size": 1, "time_us": 0, "frames": []}])
    snapshot["segments"][0]["blocks"][0]["frames"] = _frames(pytest_frame)
    compact = compact_snapshot(snapshot, min_frames_bytes=2000)
    trace = compact["device_traces"][0]
    assert trace[1]["frames"] == []  # 1000 B, under min_frames_bytes
    # File names from the package's or the libraries' directory on: no machine's own paths.
    relative = [("cs336_systems/benchmarks/harness.py", 88, "training_step")]
    assert trace[2]["frames"] == _frames(*relative) and compact["device_traces"][1] == []
    assert compact_snapshot(snapshot)["device_traces"][0][1]["frames"] == _frames(
        ("torch/nn/functional.py", 10, "linear"), ("cs336_systems/model.py", 77, "forward"), *relative)
    assert "frames" not in compact["segments"][0]["blocks"][0]
    assert short_path("/home/someone/repo/cs336_systems/model.py") == "cs336_systems/model.py"
    assert short_path("/usr/lib/python3.12/runpy.py") == "/usr/lib/python3.12/runpy.py"
    # What memory_viz's timeline and the parsers read is unchanged.
    assert active_memory_timeline(compact) == active_memory_timeline(snapshot)


def test_written_snapshot_reads_back_and_its_timeline_plots(tmp_path):
    path = tmp_path / "snapshot.pickle"
    assert write_snapshot(synthetic_snapshot(), path) == path.stat().st_size
    layout = active_memory_layout(load_snapshot(path))
    figure = plot_active_memory(layout, "synthetic")
    assert figure.axes[0].get_ylim()[1] >= layout.peak_bytes / 2**30
    with pytest.raises(ValueError, match="max_allocations"):
        active_memory_layout(synthetic_snapshot(), max_allocations=-1)


def test_bad_snapshots_are_refused():
    with pytest.raises(ValueError, match="not a memory snapshot"):
        active_memory_timeline({"segments": []})
    with pytest.raises(ValueError, match="device 1"):
        active_memory_timeline(synthetic_snapshot(), device=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_memory_history_needs_cuda():
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        with record_memory_history():
            pass


def test_cpu_peak_memory_from_profiler_records():
    def fn():
        first = torch.empty(1 << 20, dtype=torch.uint8)
        second = torch.empty(2 << 20, dtype=torch.uint8)
        del first, second
        return torch.empty(1 << 10, dtype=torch.uint8)

    peak, end = peak_memory_increase(fn, "cpu")
    assert peak >= 3 << 20 and end < 1 << 20


def test_saved_tensor_bytes_count_a_storage_once():
    weight = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16)

    def fn():
        y = x @ weight  # saves x (excluded) and weight (excluded)
        return (y * y).sum()  # saves y: 4 x 16 x 4 B, once for both operands

    assert saved_tensor_bytes(fn, exclude=[weight, x]) == 4 * 16 * 4


def test_saved_tensor_bytes_frees_the_graph_it_measured():
    outputs = []

    def fn():
        x = torch.randn(1000, requires_grad=True)
        y = x.exp()  # exp saves its own output for backward
        outputs.append(weakref.ref(y))
        return (y * 2).sum()

    assert saved_tensor_bytes(fn) == 1000 * 4
    assert outputs[0]() is None, "the measured graph (and so every tensor it saved) is still alive"


# ----------------------------------------------------------------------------------------- reports

def test_memory_profile_on_cpu_gives_peaks_saved_bytes_and_the_residual_check():
    rows = memory_profile(MemoryProfileConfig(size="tiny", contexts=(8, 16), precisions=("fp32",), batch_size=1), "cpu")
    peaks = [r for r in rows if r["table"] == "peak"]
    assert len(peaks) == 4 and all(r["status"] == "ok" and r["peak_increase_bytes"] > 0 for r in peaks)
    train = [r for r in peaks if r["mode"] == "train_step"]
    assert all(r["measured_saved_bytes"] == r["predicted_saved_bytes"] for r in train)
    residual = next(r for r in rows if r["table"] == "residual")
    # At the shown context, the shortest: 1 x 8 x 64 x 4 bytes.
    assert residual["measured_bytes"] == residual["computed_bytes"] == 1 * 8 * 64 * 4
    blocks = [r for r in rows if r["table"] == "block"]
    assert [r["block"] for r in blocks] == [0, 1] and all(r["context_length"] == 8 for r in blocks)
    assert all(r["saved_bytes"] == r["predicted_saved_bytes"] for r in blocks)
    body = problems.report("memory_profiling").render(rows).body
    assert "Residual-stream activation size" in body and "| +0.00%  |" in body
    assert "## (f) Residuals and gradients per TransformerBlock" in body


def _gpu_memory_rows() -> list[dict]:
    base = {"size": "2.7B", "size_table": "2025", "batch_size": 4, "attention": "naive", "device": "cuda",
            "context_length": 512}
    gib = 2**30
    rows = [{**base, "table": "residual", "precision": "fp32", "d_model": 2560, "computed_bytes": 20_971_520,
             "measured_bytes": 20_971_520, "shape": "4x512x2560", "dtype": "float32"}]
    for mode, start, peak, predicted in [("inference", 12.7, 13.1, 13.0), ("train_step", 38.1, 70.0, 60.0)]:
        rows.append({**base, "table": "peak", "mode": mode, "precision": "fp32", "status": "ok",
                     "start_bytes": start * gib, "peak_increase_bytes": (peak - start) * gib, "peak_bytes": peak * gib,
                     "timeline_peak_bytes": peak * gib, "predicted_peak_bytes": predicted * gib,
                     "predicted_phase": "optimizer step", "predicted_parameters_bytes": 12.7 * gib,
                     "predicted_gradients_bytes": 12.7 * gib if mode == "train_step" else 0,
                     "predicted_optimizer_state_bytes": 25.4 * gib if mode == "train_step" else 0,
                     "predicted_activations_bytes": 20.4 * gib if mode == "train_step" else 0,
                     "predicted_weight_cache_bytes": 0, "predicted_transient_bytes": 0.25 * gib})
        rows += [{**base, "table": "timeline", "mode": mode, "precision": "fp32", "time_ms": t, "active_gib": v}
                 for t, v in [(0, start), (5, peak), (9, start)]]
        rows.append({**base, "table": "allocation", "mode": mode, "precision": "fp32", "rank": 1, "size_mib": 400.0,
                     "count": 32, "source": "cs336_systems/model.py:77 (forward)", "innermost": "torch/x.py:1 (f)"})
    rows.append({**base, "table": "peak", "mode": "train_step", "precision": "bf16", "status": OOM})
    rows.append({**base, "context_length": 2048, "table": "peak", "mode": "train_step", "precision": "fp32",
                 "status": OOM, "oom_predicted": True, "predicted_peak_bytes": 171.8 * gib})
    return rows


def test_memory_report_from_gpu_rows():
    rendered = problems.report("memory_profiling").render(_gpu_memory_rows())
    assert set(rendered.figures) == {"memory_timeline.png"}
    body = rendered.body
    assert "1 of 2 measured peaks within 15%" in body
    # The miss is explained from the rows: 10 GiB above the prediction, closest in size to the
    # predicted parameters (12.7 GiB).
    assert "+10.00 GiB, parameters (12.70 GiB)" in body
    # A cell run out of memory and one the estimate refused read differently.
    assert f"| {OOM} " in body and f"| {PREDICTED_OOM} " in body
    assert "Largest allocations" in body and "cs336_systems/model.py:77 (forward)" in body


def test_checkpoint_sweep_on_cpu_and_its_report():
    rows = checkpoint_sweep(CheckpointSweepConfig(size="tiny", context_length=8, batch_size=1, ks=(1, 2, 4, None),
                                                  nested_levels=(None,)), "cpu")
    sweep = [r for r in rows if r["table"] == "sweep"]
    # k = 4 is k = 2 for two blocks: run once.
    assert [(r["plan_kind"], r["k"]) for r in sweep] == [("every_k", 1), ("every_k", 2), ("every_k", "none"),
                                                          ("sublayers", None), ("optimal", None)]
    assert all(r["status"] == "ok" and r["measured_peak_bytes"] > 0 for r in sweep)
    rendered = problems.report("gradient_checkpointing").render(rows)
    assert "Measured best:" in rendered.body and "gradient_checkpointing.png" in rendered.figures


def _gpu_checkpoint_rows() -> list[dict]:
    base = {"size": "xl", "batch_size": 4, "precision": "fp32", "attention": "sdpa", "device": "cuda",
            "num_layers": 48, "context_length": 1024, "block_bytes": 734_003_200, "boundary_bytes": 26_214_400,
            "head_bytes": 300_000_000, "transient_bytes": 330_000_000, "table": "sweep"}
    gib = 2**30
    rows = []
    for k, peak in [(1, 2.3), (2, 2.9), (4, 4.5), (48, 33.0), ("none", 33.1)]:
        rows.append({**base, "plan_kind": "every_k", "k": k, "levels": None, "plan": "...", "recomputed_blocks": 48,
                     "status": "ok", "measured_peak_bytes": peak * gib, "predicted_peak_bytes": peak * 0.95 * gib,
                     "measured_kept_bytes": 1.0 * gib, "predicted_kept_bytes": 0.9 * gib, "step_ms": 1500.0})
    rows.append({**base, "plan_kind": "sublayers", "k": None, "levels": None, "plan": "...", "recomputed_blocks": 48,
                 "status": "ok", "measured_peak_bytes": 2.6 * gib, "predicted_peak_bytes": 2.5 * gib,
                 "measured_kept_bytes": 2.0 * gib, "predicted_kept_bytes": 1.9 * gib, "step_ms": 1510.0,
                 "attention_sublayer_bytes": 500_000_000, "ffn_sublayer_bytes": 234_003_200})
    rows.append({**base, "plan_kind": "optimal", "k": None, "levels": "unlimited", "plan": "...",
                 "recomputed_blocks": 1128, "status": "ok", "measured_peak_bytes": 1.5 * gib,
                 "predicted_peak_bytes": 1.4 * gib, "measured_kept_bytes": 0.5 * gib,
                 "predicted_kept_bytes": 0.4 * gib, "step_ms": 9000.0})
    rows.append({**{k: base[k] for k in ("size", "batch_size", "precision", "attention", "device", "num_layers")},
                 "table": "longest", "plan_kind": "every_k", "k": 1, "levels": None, "capacity_bytes": 79.1 * gib,
                 "start_bytes": 15.0 * gib, "usable_share": 0.9, "predicted_longest_context": 16384,
                 "predicted_peak_bytes": 60 * gib, "next_context": 32768, "next_predicted_peak_bytes": 100 * gib,
                 "run_context": 16384, "run_status": "ok", "run_peak_bytes": 58 * gib,
                 "run_predicted_peak_bytes": 60 * gib, "run_step_ms": 61000.0})
    return rows


def test_checkpoint_report_from_gpu_rows():
    body = problems.report("gradient_checkpointing").render(_gpu_checkpoint_rows()).body
    # (b): a = 28 b moves the best single level below sqrt(48); every block beats its neighbours on both sides.
    assert ("here a = 28 b, and minimising b L / k + a k gives k = sqrt(L b / a) = 1.31 blocks. Measured best: every "
            "1 block, 2.30 GiB; every 2 blocks 2.90 GiB and each block's two sublayers 2.60 GiB.") in body
    # (a): the chain's code as it runs, and its cost for 48 blocks.
    assert "```python\ndef checkpoint_chain(" in body and "L(L - 1)/2 = 1128 recomputed block forwards" in body
    assert '"""' not in body
    assert "Run at context 16384 (every 1 block): peak 58.00 GiB, predicted 60.00 GiB" in body


def test_checkpoint_report_says_which_plans_were_predicted_out_of_memory():
    rows = _gpu_checkpoint_rows()
    unchecked = next(r for r in rows if r.get("k") == "none")
    unchecked.update(status=OOM, oom_predicted=True, measured_peak_bytes=None, measured_kept_bytes=None, step_ms=None)
    body = problems.report("gradient_checkpointing").render(rows).body
    (line,) = [line for line in body.splitlines() if line.startswith("| no checkpointing ")]
    assert line.count(PREDICTED_OOM) == 2  # kept after forward, and the peak
    answer = " ".join(gradient_checkpointing.answer_gradient_checkpointing({"gradient_checkpointing": rows}))
    assert "out of memory at this context: no checkpointing (predicted, not run)" in answer


def test_checkpoint_plot_y_labels_do_not_overlap_and_reach_the_lowest_line():
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure = problems.report("gradient_checkpointing").render(_gpu_checkpoint_rows()).figures["gradient_checkpointing.png"]
    FigureCanvasAgg(figure).draw()
    axes = figure.axes[0]
    low, high = axes.get_ylim()
    labels = [t for t in axes.yaxis.get_ticklabels(which="both") if t.get_text() and low <= t.get_position()[1] <= high]
    boxes = sorted((t.get_window_extent() for t in labels), key=lambda box: box.y0)
    assert all(lower.y1 <= upper.y0 for lower, upper in zip(boxes, boxes[1:])), [t.get_text() for t in labels]
    # The data run from 1.4 GiB (the nested plan's prediction) to 33 GiB: a label below 2 and one above 20.
    values = [float(t.get_text()) for t in labels]
    assert min(values) < 2 and max(values) > 20 and len(values) >= 6


def test_memory_report_names_the_adamw_its_rows_used():
    rows = _gpu_memory_rows()
    foreach = [{**r, "adamw": "foreach"} if r.get("mode") == "train_step" else r for r in rows]
    body = problems.report("memory_profiling").render(foreach).body
    assert "(forward, backward, foreach AdamW step, zero_grad)" in body
    fused = [{**r, "adamw": "fused"} if r.get("mode") == "train_step" else r for r in rows]
    assert "(forward, backward, fused AdamW step, zero_grad)" in problems.report("memory_profiling").render(fused).body
    course = [{**r, "adamw": "course"} if r.get("mode") == "train_step" else r for r in rows]
    body = problems.report("memory_profiling").render(course).body
    # 2.7B: sqrt(v) of one 10,240 x 2,560 weight against that of all 3,406,809,600 parameters.
    assert "(forward, backward, the course's AdamW step, zero_grad)" in body
    assert "(+100.00 MiB at its step)" in body and "(+12.69 GiB)" in body


def _xl_block_rows(precision: str) -> list[dict]:
    base = {"size": "xl", "batch_size": 4, "attention": "naive", "device": "cuda", "context_length": 128,
            "precision": precision, "status": "ok", "table": "block"}
    weights = 4 * 104_862_720
    rows = [{**base, "block": b, "saved_bytes": 300 * 2**20, "predicted_saved_bytes": 300 * 2**20,
             "input_bytes": 5 * 2**20, "forward_allocated_bytes": 295 * 2**20,
             "backward_allocated_bytes": weights + 5 * 2**20 - 300 * 2**20, "gradient_bytes": weights + 5 * 2**20,
             "weight_gradient_bytes": weights, "parameters": 104_862_720, "residual_stream_bytes": 5 * 2**20}
            for b in range(32)]
    rows += [{**base, "table": "block_operation", "block": 16, "rank": rank, "operation": op, "bytes": size,
              "share": size / (300 * 2**20)} for rank, (op, size) in enumerate([("aten::mm", 120 * 2**20),
                                                                                ("aten::mul", 60 * 2**20)], 1)]
    return rows


def test_memory_report_answers_part_f_with_the_expected_gradient_size():
    rows = _gpu_memory_rows() + _xl_block_rows("fp32")
    body = problems.report("memory_profiling").render(rows).body
    assert "4 x 104,862,720 = 400.02 MiB" in body and "| aten::mm" in body
    (answer,) = [s for s in memory_profiling.answer_memory_profiling({"memory_profiling": rows}) if s.startswith("(f)")]
    assert "4 bytes x 104,862,720 parameters = 400.02 MiB and take 400.02 MiB" in answer
    assert "5.00 MiB beyond the weights'" in answer and "60% of it allocated by `aten::mm` (40%)" in answer


def test_snapshot_timelines_are_drawn_beside_their_pickles_and_linked(tmp_path):
    write_snapshot(synthetic_snapshot(), tmp_path / "memory_xl_inference_fp32_ctx128.pickle")
    row = {"table": "snapshot", "size": "xl", "mode": "inference", "precision": "fp32", "context_length": 128,
           "batch_size": 4, "file": "memory_xl_inference_fp32_ctx128.pickle", "file_bytes": 1000, "stacks": "all"}
    (png,) = memory_profiling.render_snapshot_timelines([row], tmp_path)
    assert png == tmp_path / "memory_xl_inference_fp32_ctx128.png" and png.stat().st_size > 0
    body = problems.report("memory_profiling").render(_gpu_memory_rows() + [row]).body
    assert "(memory_xl_inference_fp32_ctx128.png)" in body and "[memory_xl_inference_fp32_ctx128.pickle]" in body
