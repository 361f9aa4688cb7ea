"""Kernel tables per profiler range: a real CPU profile of the tiny model, and synthetic CUDA-style
events for the kernel path (launching operator -> kernels, ranges on another thread)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import DeviceType

from cs336_systems.benchmarks.profiling import ATTENTION_RANGES, ProfileConfig, profile_training_step
from cs336_systems.model import ModelConfig, TransformerLM
from cs336_systems.profiling.kernels import (
    device_work,
    is_matmul,
    kernel_tables,
    merge_tables,
    profiler_activities,
    short_name,
)
from cs336_systems.profiling.ranges import annotate
from cs336_systems.reports import OOM, get_renderer

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


def _event(name, start, end, kernels=(), thread=1, annotation=False, device=DeviceType.CPU, self_us=0.0):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), thread=thread,
                           is_user_annotation=annotation, is_async=False, device_type=device,
                           kernels=[SimpleNamespace(name=k, duration=d) for k, d in kernels],
                           self_cpu_time_total=self_us)


def test_cuda_kernels_go_to_the_range_containing_their_launching_operator():
    events = [
        _event("forward", 0, 100, annotation=True),
        _event("backward", 100, 300, annotation=True),
        # The GPU mirrors each range as a device-side annotation: a span, not a kernel.
        _event("forward", 5, 150, annotation=True, device=DeviceType.CUDA),
        _event("aten::mm", 10, 20, kernels=[("sm90_xmma_gemm_a", 40.0)]),
        _event("aten::add", 30, 35, kernels=[("elementwise_add", 5.0), ("elementwise_add", 5.0)]),
        # Launched from autograd's thread, inside the backward range's time: belongs to backward.
        _event("aten::mm", 150, 160, kernels=[("sm90_xmma_gemm_a", 80.0)], thread=2),
        # A range's mirror on the GPU timeline, linked to an operator: a span, not a kernel.
        _event("aten::copy_", 40, 45, kernels=[("forward", 60.0)]),
        # Straddles the boundary: in no range.
        _event("aten::mul", 95, 105, kernels=[("elementwise_mul", 3.0)]),
    ]
    tables = kernel_tables(events, "cuda")
    assert set(tables) == {"forward", "backward"}
    forward = {k.name: k for k in tables["forward"].kernels}
    assert forward["sm90_xmma_gemm_a"].total_us == 40 and forward["elementwise_add"].calls == 2
    assert tables["forward"].work_us == 50 and tables["forward"].matmul_share == pytest.approx(0.8)
    assert [k.name for k in tables["backward"].kernels] == ["sm90_xmma_gemm_a"]
    assert tables["backward"].kernels[0].share == 1.0
    assert tables["forward"].wall_us == 100


def test_a_cuda_profile_without_kernels_is_an_error_not_an_empty_table():
    with pytest.raises(RuntimeError, match="no CUDA kernels"):
        device_work([_event("aten::mm", 0, 1, self_us=1.0)], "cuda")
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
    body = get_renderer("nsys_profile")(rows).body
    for heading in ("(a) Forward time", "(b) The top forward kernel", "(d) Matmul share", "(e) Softmax"):
        assert heading in body


def test_out_of_memory_cell_is_recorded(monkeypatch):
    from cs336_systems.benchmarks import profiling

    def run_out(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(profiling, "_timed_then_profiled", run_out)
    rows = profile_training_step(ProfileConfig("tiny", 16), "cpu")
    assert len(rows) == 1 and rows[0]["table"] == "cell" and rows[0]["status"] == OOM
    assert "No cell ran to completion" in get_renderer("nsys_profile")(rows).body


@pytest.mark.parametrize("kwargs, message", [
    (dict(size="huge"), "unknown model size"),
    (dict(precision="fp8"), "unknown precision"),
    (dict(timed_steps=0), "timed_steps >= 1"),
])
def test_profile_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ProfileConfig(**{"size": "tiny", "context_length": 16, **kwargs})
