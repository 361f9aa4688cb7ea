"""Kernel tables per profiler range: a real CPU profile of the tiny model, and a synthetic CUDA trace
for the kernel path (launch calls and kernels by correlation id, ranges on another thread)."""

import itertools
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from cs336_systems.benchmarks.nsys_profile import ProfileConfig, profile_training_step
from cs336_systems.model import ModelConfig, TransformerLM
from cs336_systems.profiling import kernels
from cs336_systems.profiling.kernels import (
    Work,
    activity,
    call_until_finished,
    device_timeline,
    device_work,
    is_matmul,
    kernel_tables,
    merge_tables,
    profiler_activities,
    short_name,
    thread_ids,
)
from cs336_systems.profiling.ranges import annotate
from cs336_systems.reports import problems
from cs336_systems.runs import read_rows
from cs336_systems.rows import OOM
from cs336_systems.rows.nsys_profile import ATTENTION_RANGES

# The tiny model: 2 blocks of 7 Linears each, plus the LM head.
LINEARS_PER_FORWARD = 2 * 7 + 1


@pytest.fixture(scope="module")
def cpu_tables():
    torch.manual_seed(0)
    config = ModelConfig.for_size("tiny", 16)
    model = TransformerLM(config, attention="naive")
    optimizer = torch.optim.AdamW(model.parameters())
    inputs, targets = torch.randint(0, config.vocab_size, (2, 2, 16))
    with torch.profiler.profile(activities=profiler_activities("cpu")) as profiler:
        with annotate("step"):
            with annotate("forward"):
                loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
            with annotate("backward"):
                loss.backward()
            with annotate("optimizer"):
                optimizer.step()
    return kernel_tables(profiler.events(), "cpu")


def test_every_annotated_range_has_a_table(cpu_tables):
    for name in ("step", "forward", "backward", "optimizer", *ATTENTION_RANGES):
        assert name in cpu_tables and cpu_tables[name].work_us > 0
    assert cpu_tables["forward"].instances == 1
    assert all(cpu_tables[name].instances == 2 for name in ATTENTION_RANGES)  # once per block


def test_shares_sum_to_at_most_one(cpu_tables):
    for table in cpu_tables.values():
        if table.kernels:
            assert sum(k.share for k in table.kernels) == pytest.approx(1.0)
            assert all(0 <= k.share <= 1 for k in table.kernels)
            assert table.work_us <= table.wall_us + 1e-6  # self times of one thread fit in its interval


def test_nested_ranges_hold_no_more_than_their_parent(cpu_tables):
    step = cpu_tables["step"].work_us
    phases = sum(cpu_tables[p].work_us for p in ("forward", "backward", "optimizer"))
    assert phases <= step + 1e-6
    assert sum(cpu_tables[name].work_us for name in ATTENTION_RANGES) <= cpu_tables["forward"].work_us + 1e-6


def test_tables_name_the_operators_that_did_the_work(cpu_tables):
    forward = {k.name: k for k in cpu_tables["forward"].kernels}
    assert forward["aten::mm"].calls == LINEARS_PER_FORWARD and forward["aten::mm"].matmul
    assert "aten::_softmax" in {k.name for k in cpu_tables["attention/softmax"].kernels}
    assert any(k.matmul for k in cpu_tables["attention/scores"].kernels)
    assert cpu_tables["optimizer"].matmul_us == 0
    kernels = cpu_tables["forward"].kernels
    assert [k.total_us for k in kernels] == sorted((k.total_us for k in kernels), reverse=True)


def test_merged_table_adds_up(cpu_tables):
    merged = merge_tables("forward+backward", [cpu_tables["forward"], cpu_tables["backward"]])
    assert merged.work_us == pytest.approx(cpu_tables["forward"].work_us + cpu_tables["backward"].work_us)
    mm = {k.name: k.calls for k in merged.kernels}["aten::mm"]
    assert mm == sum({k.name: k.calls for k in cpu_tables[r].kernels}["aten::mm"] for r in ("forward", "backward"))


@pytest.mark.parametrize("name", [
    "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
    "nvjet_tst_128x64_64x6_1x2_h_bz_coopA_NNT",
    "cutlass_80_simt_sgemm_128x64_8x5_nn_align1",
    "ampere_sgemm_128x64_nn",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, float, float, float, false, true, false>(cublasLt::cublasSplitKParams<float>, float const*, float const*, float*, float const*, float const*, float const*)",
    "void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false, cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float>, float> >(cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float>, float>, float, float)",
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
])
def test_matmul_names(name):
    assert is_matmul(name)


@pytest.mark.parametrize("name", [
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)",
    "void (anonymous namespace)::softmax_warp_forward<float, float, float, 9, false, false>(float*, float const*, int, int, int, bool const*, int, bool)",
    "fmha_cutlassF_f32_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<float, cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)",
    "void flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4, false, false, cutlass::bfloat16_t> >(Flash_fwd_params)",
    "aten::softmax", "aten::add", "Memcpy HtoD (Pageable -> Device)", "aten::mul_",
])
def test_non_matmul_names(name):
    assert not is_matmul(name)


def test_short_name_drops_signature_and_namespaces():
    long = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
            "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)")
    assert short_name(long, 200) == "at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> >"
    assert short_name(long, 60) == "vectorized_elementwise_kernel<4, CUDAFunctor_add<float>, ar…"
    assert len(short_name(long, 60)) == 60
    assert short_name("void (anonymous namespace)::softmax_warp_forward<float>(float*)") == "softmax_warp_forward<float>"
    assert short_name("aten::mm") == "aten::mm"


class Trace:
    """A CUDA profile built event by event, as torch.profiler lists it: operators and ranges on host
    threads, launch calls and kernels tied by CUPTI correlation ids (their `id`), kernels linked to their
    operator's id. Operator ids and CUPTI ids are separate counters, so they overlap."""

    def __init__(self, records_activity: bool = True):
        # torch 2.11 records neither an event's activity type nor its linked operator; later builds do.
        self.records_activity = records_activity
        self.events: list[FunctionEvent] = []
        self._cupti_ids = itertools.count(1)

    def add(self, name, start, end, activity, thread=1, id=0, linked=0, device=DeviceType.CPU):
        event = FunctionEvent(id, name, thread, start, end, device_type=device,
                              is_user_annotation=activity in ("user_annotation", "gpu_user_annotation"))
        if self.records_activity:
            event.activity_type, event.linked_correlation_id = activity, linked
        self.events.append(event)
        return event

    def range(self, name, start, end, thread=1, id=0):
        return self.add(name, start, end, "user_annotation", thread, id)

    def operator(self, name, start, end, kernels=(), thread=1, id=0):
        """An operator and, per (kernel, device start, duration), its launch call inside it and the kernel."""
        operator = self.add(name, start, end, "cpu_op", thread, id)
        for i, (kernel, device_start, duration) in enumerate(kernels):
            cupti = next(self._cupti_ids)
            launch = start + (end - start) * (i + 1) / (len(kernels) + 1)
            self.add("cudaLaunchKernel", launch, launch + 0.5, "cuda_runtime", thread, cupti, linked=id)
            self.add(kernel, device_start, device_start + duration, "kernel", id=cupti, linked=id,
                     device=DeviceType.CUDA)
            # What torch.profiler does: the kernel is listed on every host event with its linked id.
            for host in self.events:
                if host.device_type == DeviceType.CPU and host.id == id and activity(host) == "cpu_op":
                    host.append_kernel(kernel, 0, duration)
        return operator


@pytest.mark.parametrize("records_activity", [True, False], ids=["activity recorded", "torch 2.11 events"])
def test_each_cuda_kernel_counts_once_in_the_innermost_range_open_at_its_launch(records_activity):
    trace = Trace(records_activity)
    trace.range("step", 0, 400, id=1)
    trace.range("forward", 0, 100, id=2)
    trace.range("attention/softmax", 40, 60, id=3)
    trace.range("backward", 100, 300, id=4)
    trace.operator("aten::mm", 10, 20, [("sm90_xmma_gemm_a", 110, 40.0)], id=10)
    trace.operator("aten::add", 30, 35, [("elementwise_add", 150, 5.0), ("elementwise_add", 155, 5.0)], id=11)
    trace.operator("aten::_softmax", 45, 50, [("softmax_warp_forward", 160, 7.0)], id=12)
    # Launched from autograd's thread, inside the backward range's time: belongs to backward.
    trace.operator("aten::mm", 150, 160, [("sm90_xmma_gemm_a", 300, 80.0)], thread=2, id=13)
    # The GPU's own mirror of a range is a span, not work.
    trace.add("forward", 110, 167, "gpu_user_annotation", device=DeviceType.CUDA, linked=10)
    # Straddles the forward/backward boundary; its kernel is launched at 97.5, in forward.
    trace.operator("aten::mul", 90, 105, [("elementwise_mul", 170, 3.0)], id=14)
    # A host call of no operator whose CUPTI id equals the first operator's id: torch.profiler lists the
    # operator's kernels on it too, which counted them twice.
    sync = trace.add("cudaStreamSynchronize", 380, 390, "cuda_runtime", id=10)
    sync.append_kernel("sm90_xmma_gemm_a", 0, 40.0)
    tables = kernel_tables(trace.events, "cuda")
    assert set(tables) == {"step", "forward", "attention/softmax", "backward"}
    forward = {k.name: k for k in tables["forward"].kernels}
    assert forward["sm90_xmma_gemm_a"].calls == 1 and forward["sm90_xmma_gemm_a"].total_us == 40
    assert forward["elementwise_add"].calls == 2 and "softmax_warp_forward" in forward
    assert tables["forward"].work_us == 40 + 10 + 7 + 3  # nested softmax included, once
    assert tables["forward"].self_work_us == 40 + 10 + 3 and tables["attention/softmax"].self_work_us == 7
    assert tables["forward"].matmul_share == pytest.approx(40 / 60)
    assert [k.name for k in tables["backward"].kernels] == ["sm90_xmma_gemm_a"]
    assert tables["backward"].kernels[0].share == 1.0
    # The step holds every kernel once: its work is the profile's, and the self parts add up to it.
    assert tables["step"].work_us == 40 + 10 + 7 + 80 + 3 == sum(t.self_work_us for t in tables.values())
    assert tables["forward"].wall_us == 100 and tables["attention/softmax"].instances == 1
    assert kernel_tables(trace.events, "cuda", ranges=["forward"]).keys() == {"forward"}


@pytest.mark.parametrize("records_activity", [True, False], ids=["activity recorded", "torch 2.11 events"])
def test_device_timeline_is_busy_where_some_kernel_runs_and_idle_in_the_gaps(records_activity):
    trace = Trace(records_activity)
    # Two kernels overlap (110-150 and 140-160: busy 50), then a gap of 40, then one of 20.
    trace.operator("aten::mm", 0, 10, [("sm90_xmma_gemm_a", 110, 40.0)], id=1)
    trace.operator("aten::add", 20, 30, [("elementwise_add", 140, 20.0)], id=2)
    trace.operator("aten::mul", 40, 50, [("elementwise_mul", 200, 20.0)], id=3)
    # A GPU-side range spans kernels without being work of its own.
    trace.add("forward", 100, 300, "gpu_user_annotation", device=DeviceType.CUDA, linked=1)
    assert device_timeline(trace.events) == (110.0, 70.0)


def test_a_cuda_profile_without_kernels_is_an_error_not_an_empty_table():
    trace = Trace()
    trace.operator("aten::mm", 0, 1, id=1)
    with pytest.raises(RuntimeError, match="no CUDA kernels"):
        device_work(trace.events, "cuda")
    with pytest.raises(ValueError, match="cuda and cpu"):
        device_work([], "mps")


def test_profile_cell_rows_and_report():
    rows = profile_training_step(ProfileConfig("tiny", 16, batch_size=1, timed_steps=2), "cpu")
    cell = next(r for r in rows if r["table"] == "cell")
    assert cell["status"] == "ok" and cell["timer_forward_ms"] > 0
    ranges = {r["range"] for r in rows if r["table"] == "range"}
    assert {"step", "forward", "backward", "optimizer", "forward+backward", *ATTENTION_RANGES} <= ranges
    for name in ranges:
        shares = [r["share"] for r in rows if r["table"] == "kernel" and r["range"] == name]
        assert sum(shares) == pytest.approx(1.0)
    body = problems.report("nsys_profile").render(rows).body
    for heading in ("(a) Forward time", "(b) The top forward kernel", "(d) Matmul share", "(e) Softmax"):
        assert heading in body
    assert "Each kernel counts once" in body and "adds up to no more than the step's" in body
    assert "the profiler's overhead included" in body


def test_out_of_memory_cell_is_recorded(monkeypatch):
    from cs336_systems.benchmarks import nsys_profile

    def run_out(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(nsys_profile, "_timed_then_profiled", run_out)
    rows = profile_training_step(ProfileConfig("tiny", 16), "cpu")
    assert len(rows) == 1 and rows[0]["table"] == "cell" and rows[0]["status"] == OOM
    assert "No cell ran to completion" in problems.report("nsys_profile").render(rows).body


@pytest.mark.parametrize("kwargs, message", [
    (dict(size="huge"), "unknown model size"),
    (dict(precision="fp8"), "unknown precision"),
    (dict(timed_steps=0), "timed_steps >= 1"),
])
def test_profile_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ProfileConfig(**{"size": "tiny", "context_length": 16, **kwargs})


def test_a_cell_whose_state_exceeds_the_device_is_reported_oom_without_running(monkeypatch):
    from types import SimpleNamespace

    from cs336_systems.benchmarks import nsys_profile

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80e9))
    monkeypatch.setattr(nsys_profile, "_timed_then_profiled", lambda *args: pytest.fail("a cell that cannot fit was run"))
    rows = profile_training_step(ProfileConfig("10B", 128), "cuda")
    assert len(rows) == 1 and rows[0]["status"] == OOM and rows[0]["oom_predicted"]
    body = problems.report("nsys_profile").render(rows).body
    assert "Out of memory: 10B at context 128 (estimate 191.43 GiB; not run)." in body


def test_a_kernel_without_its_launch_call_is_placed_at_its_operator():
    trace = Trace()
    trace.range("forward", 0, 100, id=1)
    trace.range("backward", 100, 200, id=2)
    trace.add("aten::mm", 10, 20, "cpu_op", id=10)
    # Its launch call is missing; a host call with the kernel's id linked to another operator is not it.
    trace.add("cudaLaunchKernel", 150, 151, "cuda_runtime", id=77, linked=11)
    trace.add("sm90_xmma_gemm", 300, 340, "kernel", id=77, linked=10, device=DeviceType.CUDA)
    assert device_work(trace.events, "cuda") == [Work("sm90_xmma_gemm", 10, 40)]
    assert kernel_tables(trace.events, "cuda")["forward"].work_us == 40


def test_profiled_contexts_run_up_to_the_longest_that_fits_and_one_beyond():
    from cs336_systems.benchmarks.nsys_profile import ProfileConfig, profiled_contexts
    from cs336_systems.memory_guard import FIT_SHARE

    capacity = 80 * 2**30
    # The 2026 xl with the course's AdamW: 256 and 512 fit 80 GiB, 1024 does not (the model: 87.9 GiB).
    assert profiled_contexts("xl", capacity) == [256, 512, 1024]
    *fitting, beyond = profiled_contexts("small", capacity)
    assert fitting == [1024, 2048, 4096] and beyond == 8192  # the three longest above 128
    assert all(ProfileConfig("small", n).estimate().peak_bytes <= FIT_SHARE * capacity for n in fitting)
    assert ProfileConfig("small", beyond).estimate().peak_bytes > FIT_SHARE * capacity


def _fake_nsys(tmp_path, monkeypatch, script: str):
    from cs336_systems.benchmarks import nsys_profile

    nsys = tmp_path / "nsys"
    nsys.write_text("#!/bin/sh\n" + script)
    nsys.chmod(0o755)
    monkeypatch.setattr(nsys_profile.shutil, "which", lambda name: str(nsys))
    return nsys_profile.probe_nsys()


def test_nsys_probe_says_whether_nsys_wrote_a_report_and_why_not(tmp_path, monkeypatch):
    from cs336_systems.benchmarks import nsys_profile

    # The output file comes as --output=<path>; nsys adds .nsys-rep.
    wrote = _fake_nsys(tmp_path, monkeypatch, 'for a; do case "$a" in --output=*) touch "${a#--output=}.nsys-rep";; esac; done\n')
    assert wrote == {"nsys_found": True, "nsys_report": "written"}
    failed = _fake_nsys(tmp_path, monkeypatch, "echo 'ERROR: perf_event_paranoid is 4' >&2\nexit 1\n")
    assert failed == {"nsys_found": True, "nsys_report": "nsys profile exited 1: ERROR: perf_event_paranoid is 4"}
    monkeypatch.setattr(nsys_profile.shutil, "which", lambda name: None)
    assert nsys_profile.probe_nsys() == {"nsys_found": False, "nsys_report": "nsys is not installed"}


def test_report_says_nsight_cannot_make_reports_and_sets_variants_side_by_side():
    course = profile_training_step(ProfileConfig("tiny", 16, batch_size=1, timed_steps=2), "cpu")
    fast = profile_training_step(ProfileConfig("tiny", 16, batch_size=1, timed_steps=2, attention="sdpa",
                                               optimizer="fused"), "cpu")
    nsys = {"table": "nsys", "size": "tiny", "context_length": 16, "nsys_found": True,
            "nsys_report": "nsys profile exited 1: no permission", "command": "nsys profile python -m cs336_systems e2e"}
    body = problems.report("nsys_profile").render(fast + course + [nsys]).body
    assert "naive attention, the course's AdamW, fp32" in body  # the sections answer from the course's model
    assert "## Beside SDPA + fused AdamW" in body and "| SDPA + fused: step (ms)" in body
    assert "Nsight Systems cannot make reports on the measuring machine (nsys profile exited 1: no permission)" in body


def test_gpu_profiled_range_is_read_as_host_time():
    """On a GPU the forward range ends once its kernels are queued: the committed H100 ranges are shorter than the
    timer's forward, and the report says why instead of calling the difference profiler overhead."""
    rows = read_rows(Path(__file__).resolve().parents[1] / "reports" / "h100" / "nsys_profile.csv")
    cells = {(r["size"], r["context_length"]): r["timer_forward_ms"] for r in rows if r["table"] == "cell"
             and r["status"] == "ok"}
    ranges = [r for r in rows if r["table"] == "range" and r["range"] == "forward"]
    assert ranges and all(r["wall_ms"] < cells[r["size"], r["context_length"]] for r in ranges)
    body = problems.report("nsys_profile").render(rows).body
    assert "The profiled range is host time, ending once the kernels are queued" in body
    assert "profiler's overhead" not in body


@pytest.mark.gpu
def test_a_process_whose_last_call_was_a_cuda_profile_exits_with_every_core_busy():
    """Kineto detaches CUPTI (TEARDOWN_CUPTI=1) from a thread of its own, in the exit callback of a CUDA call
    made once that thread is ready. A process that made none after its last profile hung at exit; so, on an
    H200 with twice as many busy processes as cores, did every one of six whose profile ended with a single
    synchronisation, made before the thread was ready."""
    script = ("import torch\n"
              "from cs336_systems.profiling.kernels import device_profile\n"
              "x = torch.randn(512, 512, device='cuda')\n"
              "with device_profile('cuda') as profiler:\n"
              "    (x @ x).sum().item()\n"
              "print(len(profiler.events()))\n")
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * os.cpu_count())]
    try:
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180,
                                cwd=Path(__file__).resolve().parents[1])
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"the process had not exited 180 s after starting (its output: {hung.stdout!r})")
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) > 0


def test_call_until_finished_calls_until_the_threads_it_watches_have_ended():
    release = threading.Event()
    worker = threading.Thread(target=release.wait)
    before = thread_ids()
    worker.start()
    started = thread_ids() - before
    assert started == {worker.native_id}
    calls = []

    def call():  # the third call lets the thread end, as a runtime call lets Kineto's teardown finish
        calls.append(len(calls))
        if len(calls) == 3:
            release.set()
            worker.join()

    call_until_finished(started, call)
    # Not before the third call; after it, as long as the system still lists the thread (join returns as
    # Python's thread ends, a moment before the system's does).
    assert len(calls) >= 3 and not started & thread_ids()
    made = len(calls)
    call_until_finished(started, call)  # threads already gone: one call, then done
    assert len(calls) == made + 1


def test_call_until_finished_gives_up_with_a_warning_past_its_timeout(monkeypatch, caplog):
    release = threading.Event()
    worker = threading.Thread(target=release.wait)
    worker.start()
    monkeypatch.setattr(kernels, "CUPTI_TEARDOWN_TIMEOUT_S", 0.0)
    calls = []
    try:
        with caplog.at_level(logging.WARNING, logger=kernels.__name__):
            call_until_finished({worker.native_id}, lambda: calls.append(1))
    finally:
        release.set()
        worker.join()
    assert calls and "1 thread(s) the profiler started still run" in caplog.text


def test_a_cell_without_attention_matmul_time_is_left_out_of_the_report_and_the_answer_alike():
    """A zero attention-matmul time leaves no softmax-to-matmul ratio: the report's table marks the cell n/a, and
    the report's finding and the index's answer leave it out and say so, never "nan" or "nanx"."""
    from cs336_systems.reports.nsys_profile import answer_nsys_profile

    def without_matmul(rows, size, context):
        return [{**r, "matmul_ms": 0.0} if r.get("table") == "range" and r["range"].startswith("attention/")
                and (r["size"], r["context_length"]) == (size, context) else r for r in rows]

    committed = read_rows(Path(__file__).resolve().parents[1] / "reports" / "h100" / "nsys_profile.csv")
    rows = without_matmul(committed, "small", 1024)
    body = problems.report("nsys_profile").render(rows).body
    answer = " ".join(answer_nsys_profile({"nsys_profile": rows}))
    assert "nan" not in body and "nan" not in answer
    assert "| small | 1024 | 64 | 0 |" in " ".join(body.split()) and "| n/a | 0.0195 | n/a |" in " ".join(body.split())
    assert "its FLOP share (1 cell without matmul time in attention left out)" in body
    assert "over the cells; 1 cell without matmul time in attention left out)" in answer
    # The headline cell the answer quotes: both say it holds no matmul time.
    rows = without_matmul(committed, "xl", 512)
    answer = " ".join(answer_nsys_profile({"nsys_profile": rows}))
    assert ("Inside attention at xl, context 512, the profile holds no matmul time: there is no ratio of softmax's "
            "time to take.") in answer
    assert "nan" not in problems.report("nsys_profile").render(rows).body
