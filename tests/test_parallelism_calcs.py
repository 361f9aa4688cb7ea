"""The Spring 2026 parallelism calculations: each closed form against a brute-force count (FLOPs
counted by torch.utils.flop_counter on the sharded layer, bytes by a step-by-step simulation of the
ring algorithms on small N, bounds by searching over device counts) and the reports written from them."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from cs336_systems.accounting import ffn_parallelism as ffn
from cs336_systems.accounting.communication import (
    all_gather_s,
    all_reduce_s,
    alternate_all_reduce_s,
    reduce_scatter_s,
)
from cs336_systems.accounting.parallelism_calcs import PROBLEMS, ROWS
from cs336_systems.runs import read_rows
from cs336_systems.reports.parallelism_calcs import write_parallelism_calcs
from cs336_systems.reports.problems import report

W = 450e9  # bytes/s
C = 989.4e12  # FLOP/s


# ------------------------------------------------------------------------------ ring simulations

class Ring:
    """N devices; in each step every device sends one message to its successor, all at once. A step
    lasts as long as its largest message takes at W: the handout's model, step by step."""

    def __init__(self, n: int):
        self.n, self.elapsed_s = n, 0.0

    def step(self, messages: list[torch.Tensor]) -> list[torch.Tensor]:
        """messages[i] goes from device i to device i + 1; returns what each device receives."""
        self.elapsed_s += max(m.numel() * m.element_size() for m in messages) / W
        return [messages[(i - 1) % self.n] for i in range(self.n)]


def ring_reduce_scatter(ring: Ring, arrays: list[torch.Tensor]) -> list[torch.Tensor]:
    """Device i ends with chunk (i + 1) mod N of the sum."""
    n = ring.n
    chunks = [list(a.chunk(n)) for a in arrays]
    for step in range(n - 1):
        sent = [chunks[i][(i - step) % n] for i in range(n)]
        for i, received in enumerate(ring.step(sent)):
            index = (i - step - 1) % n
            chunks[i][index] = chunks[i][index] + received
    return [chunks[i][(i + 1) % n] for i in range(n)]


def ring_all_gather(ring: Ring, shards: list[torch.Tensor], owned: list[int]) -> list[torch.Tensor]:
    """Device i starts with chunk owned[i]; every device ends with all chunks in order."""
    n = ring.n
    have = [{owned[i]: shards[i]} for i in range(n)]
    last = [(owned[i], shards[i]) for i in range(n)]
    for _ in range(n - 1):
        received = ring.step([chunk for _, chunk in last])
        last = [(last[(i - 1) % n][0], received[i]) for i in range(n)]
        for i, (index, chunk) in enumerate(last):
            have[i][index] = chunk
    return [torch.cat([have[i][k] for k in range(n)]) for i in range(n)]


def alternate_all_reduce(ring: Ring, arrays: list[torch.Tensor]) -> list[torch.Tensor]:
    """The handout's algorithm: step t, device i sends x((i - t + 1) mod N) and adds x((i - t) mod N)."""
    n = ring.n
    totals = list(arrays)
    forwarding = list(arrays)  # x((i - t + 1) mod N): what device i sends in step t
    for _ in range(1, n):
        forwarding = ring.step(forwarding)
        totals = [y + x for y, x in zip(totals, forwarding)]
    return totals


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_simulated_ring_collectives_take_the_closed_form_times(n):
    generator = torch.Generator().manual_seed(n)
    arrays = [torch.randn(n * 6, generator=generator, dtype=torch.float64) for _ in range(n)]
    total = sum(arrays)
    size_bytes = arrays[0].numel() * arrays[0].element_size()

    ring = Ring(n)
    shards = ring_reduce_scatter(ring, arrays)
    assert all(torch.allclose(shards[i], total.chunk(n)[(i + 1) % n]) for i in range(n))
    assert ring.elapsed_s == pytest.approx(reduce_scatter_s(size_bytes, n, W))
    gathered = ring_all_gather(ring, shards, [(i + 1) % n for i in range(n)])
    assert all(torch.allclose(g, total) for g in gathered)
    assert ring.elapsed_s == pytest.approx(all_reduce_s(size_bytes, n, W))
    assert Ring(n).elapsed_s == 0 and all_gather_s(size_bytes, n, W) == pytest.approx(ring.elapsed_s / 2)

    ring = Ring(n)
    assert all(torch.allclose(y, total) for y in alternate_all_reduce(ring, arrays))
    # (N - 1) S / W: N / 2 times the ring all-reduce.
    assert ring.elapsed_s == pytest.approx(alternate_all_reduce_s(size_bytes, n, W)) == pytest.approx(
        (n - 1) * size_bytes / W)
    assert ring.elapsed_s / all_reduce_s(size_bytes, n, W) == pytest.approx(n / 2)


# -------------------------------------------------------------------- the FFN layer, counted by torch

B, D, D_FF = 24, 16, 48


def _layer(generator: torch.Generator):
    x = torch.randn(B, D, generator=generator, dtype=torch.float64)
    w1, w2 = (torch.randn(D, D_FF, generator=generator, dtype=torch.float64) for _ in range(2))
    w3 = torch.randn(D_FF, D, generator=generator, dtype=torch.float64)
    return x, w1, w2, w3


def _ffn(x, w1, w2, w3):
    x1, x2 = x @ w1, x @ w2
    z = F.silu(x1) * x2
    return x1, x2, z, z @ w3


def _counted(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _forward_backward_flops(x, w1, w2, w3) -> tuple[int, int]:
    """FLOPs torch counts for the layer's forward, then for its backward into x and every weight."""
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3)]
    out: list = []
    forward = _counted(lambda: out.append(_ffn(*leaves)[-1]))
    backward = _counted(lambda: out[0].backward(torch.ones_like(out[0])))
    return forward, backward


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_flops_per_device_match_torch_counts_of_the_sharded_layer(n):
    x, w1, w2, w3 = _layer(torch.Generator().manual_seed(0))
    # DP and FSDP: a device runs the whole layer on B / N tokens.
    batch_forward, batch_backward = _forward_backward_flops(x[: B // n], w1, w2, w3)
    # TP: a device runs every token through its D_FF / N columns.
    columns = slice(0, D_FF // n)
    tp_forward, tp_backward_flops = _forward_backward_flops(x, w1[:, columns], w2[:, columns], w3[columns])
    for phase, batch, tp in (("forward", batch_forward, tp_forward), ("backward", batch_backward, tp_backward_flops)):
        assert batch == tp == ffn.flops_per_device(B, D, D_FF, n, phase)
    # FSDP + TP: both at once, N_FSDP = n, N_TP = 2.
    grid_forward, _ = _forward_backward_flops(x[: B // n], w1[:, : D_FF // 2], w2[:, : D_FF // 2], w3[: D_FF // 2])
    assert grid_forward == ffn.flops_per_device(B, D, D_FF, 2 * n, "forward")


def test_ffn_accounting_refuses_nonsense_sizes_naming_them():
    with pytest.raises(ValueError, match="B must be positive"):
        ffn.ffn_flops(-1, 4, 8, "forward")
    with pytest.raises(TypeError, match="N must be an int"):
        ffn.flops_per_device(16, 4, 8, 2.5, "forward")
    with pytest.raises(ValueError, match="D must be positive"):
        ffn.dp_backward_comm_s(-4, 8, 2, 1e9)
    with pytest.raises(ValueError, match="B must be positive"):
        ffn.tp_comm_s(0, 4, 2, 1e9)


def test_tp_backward_equations_give_autograds_gradients():
    generator = torch.Generator().manual_seed(1)
    x, w1, w2, w3 = _layer(generator)
    dY = torch.randn(B, D, generator=generator, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2, w3)]
    _ffn(*leaves)[-1].backward(dY)
    n = 4
    columns = [slice(i * D_FF // n, (i + 1) * D_FF // n) for i in range(n)]
    shards = [(w1[:, c], w2[:, c], w3[c]) for c in columns]
    saved = [ffn.TPActivations(x, *_ffn(x, *shard)[:3]) for shard in shards]
    gradients, dx = ffn.tp_backward(dY, shards, saved)
    assert torch.allclose(dx, leaves[0].grad)
    for i, c in enumerate(columns):
        dw1, dw2, dw3 = gradients[i]
        assert torch.allclose(dw1, leaves[1].grad[:, c]) and torch.allclose(dw2, leaves[2].grad[:, c])
        assert torch.allclose(dw3, leaves[3].grad[c])


# ----------------------------------------------------------- communication: bytes of the real tensors

@pytest.mark.parametrize("n", [2, 4, 8])
def test_communication_times_are_the_ring_times_of_the_tensors_moved(n):
    x, w1, w2, w3 = (t.half() for t in _layer(torch.Generator().manual_seed(2)))
    weight_bytes = sum(w.numel() * w.element_size() for w in (w1, w2, w3))
    assert weight_bytes == 3 * ffn.FP16_BYTES * D * D_FF
    assert ffn.dp_backward_comm_s(D, D_FF, n, W) == pytest.approx(all_reduce_s(weight_bytes, n, W))
    assert ffn.fsdp_comm_s(D, D_FF, n, W, "forward") == pytest.approx(all_gather_s(weight_bytes, n, W))
    assert ffn.fsdp_comm_s(D, D_FF, n, W, "backward") == pytest.approx(2 * all_gather_s(weight_bytes, n, W))
    y_bytes = x.numel() * x.element_size()  # y and dx are (B, D), like x
    assert ffn.tp_comm_s(B, D, n, W) == pytest.approx(all_reduce_s(y_bytes, n, W))
    times = ffn.fsdp_tp_forward_comm(B, D, D_FF, n, 2, W)
    assert times.fsdp_s == pytest.approx(all_gather_s(weight_bytes / 2, n, W))
    assert times.tp_s == pytest.approx(all_reduce_s(y_bytes / n, 2, W))
    assert times.total_s(overlapped=True) == max(times.fsdp_s, times.tp_s)
    assert times.total_s(overlapped=False) == times.fsdp_s + times.tp_s


# ------------------------------------------------------------------ bounds, against a search over N

def _largest_compute_bound(compute_s, comm_s, limit: int = 5000) -> int:
    return max(n for n in range(1, limit) if comm_s(n) <= compute_s(n) * (1 + 1e-12))


tokens = st.integers(min_value=256, max_value=2**20)
widths = st.integers(min_value=64, max_value=65536)
bandwidths = st.floats(min_value=1e10, max_value=1e12)


@settings(max_examples=25, deadline=None)
@given(tokens, widths, bandwidths)
def test_single_axis_bounds_are_the_largest_compute_bound_device_counts(b, d_ff, w):
    d = 1024
    dp = _largest_compute_bound(lambda n: ffn.flops_per_device(b, d, d_ff, n, "backward") / C,
                                lambda n: ffn.dp_backward_comm_s(d, d_ff, n, w))
    assert dp == math.floor(ffn.dp_max_devices(b, C, w) + 1e-9)
    for phase in ("forward", "backward"):
        fsdp = _largest_compute_bound(lambda n: ffn.flops_per_device(b, d, d_ff, n, phase) / C,
                                      lambda n: ffn.fsdp_comm_s(d, d_ff, n, w, phase))
        assert fsdp == math.floor(ffn.fsdp_max_devices(b, C, w, phase) + 1e-9)
        tp = _largest_compute_bound(lambda n: ffn.flops_per_device(b, d, d_ff, n, phase) / C,
                                    lambda n: ffn.tp_comm_s(b, d, n, w))
        assert tp == math.floor(ffn.tp_max_devices(d_ff, C, w, phase) + 1e-9)


def _grid_search(b, d_ff, w, overlapped: bool) -> float:
    """The largest N_FSDP N_TP over a fine grid of real degrees >= 1 whose forward is compute bound."""
    a, h = ffn.fsdp_tp_headroom(b, d_ff, C, w)
    best = 0.0
    for f, t in itertools.product(torch.linspace(1, 1 + a, 400).tolist(), torch.linspace(1, 1 + h, 400).tolist()):
        fsdp_term, tp_term = (f - 1) / a, (t - 1) / h  # each collective over the compute
        if (max(fsdp_term, tp_term) if overlapped else fsdp_term + tp_term) <= 1 + 1e-12:
            best = max(best, f * t)
    return best


@settings(max_examples=10, deadline=None)
@given(st.integers(min_value=16, max_value=2**16), st.integers(min_value=16, max_value=65536), bandwidths)
def test_fsdp_tp_bounds_are_the_grid_optimum(b, d_ff, w):
    for overlapped, bound in ((True, ffn.fsdp_tp_max_devices_overlapped(b, d_ff, C, w)),
                              (False, ffn.fsdp_tp_max_devices_shared(b, d_ff, C, w))):
        assert bound.N == pytest.approx(bound.N_FSDP * bound.N_TP)
        assert bound.N_FSDP >= 1 and bound.N_TP >= 1
        searched = _grid_search(b, d_ff, w, overlapped)
        assert searched <= bound.N * (1 + 1e-9)
        assert searched >= bound.N * 0.99  # the grid's spacing


def test_fsdp_tp_axis_conditions_are_the_collective_times_over_the_compute():
    b, d, d_ff, n_fsdp, n_tp = 16384, 2560, 10240, 4, 2
    a, h = ffn.fsdp_tp_headroom(b, d_ff, C, W)
    compute_s = ffn.flops_per_device(b, d, d_ff, n_fsdp * n_tp, "forward") / C
    times = ffn.fsdp_tp_forward_comm(b, d, d_ff, n_fsdp, n_tp, W)
    assert times.fsdp_s / compute_s == pytest.approx((n_fsdp - 1) / a)
    assert times.tp_s / compute_s == pytest.approx((n_tp - 1) / h)


def test_shared_network_optimum_falls_back_to_one_axis():
    # A tiny batch leaves FSDP no room (a << 1): the best mesh is TP alone.
    bound = ffn.fsdp_tp_max_devices_shared(16, 65536, C, W)
    assert bound.N_FSDP == 1 and bound.N == pytest.approx(1 + ffn.fsdp_tp_headroom(16, 65536, C, W)[1])


# ------------------------------------------------------------------------------------------ reports

def test_reports_answer_every_part_and_are_the_same_on_every_run(tmp_path):
    paths = write_parallelism_calcs(tmp_path)
    first = [p.read_bytes() for p in paths]
    assert [p.read_bytes() for p in write_parallelism_calcs(tmp_path)] == first
    parts = {"alternate_ring_all_reduce": ["**Answer.** T = (N - 1) S / W"],
             "data_parallel_calcs": ["**(a)** 12 B D D_FF / N_DP", "**(b)** 12 (N_DP - 1) D D_FF / (N_DP W)",
                                     "**(c)** N_DP <= 1 + B W / C"],
             "fsdp_calcs": ["**(a)**", "**(b)**", "**(c)** Backward: N_FSDP <= 1 + B W / C"],
             "tp_calcs": ["**(a)**", "dx      = all-reduce", "**(b)**", "**(c)**",
                          "**(d)** Backward: N_TP <= 1 + 3 D_FF W / C; forward: N_TP <= 1 + 3 D_FF W / (2 C)"],
             "fsdp_tp_calcs": ["**(a)**", "**(b)** max(", "**(c)** N <= (1 + B W / C)(1 + 3 D_FF W / (2 C))",
                               "**(d)** N <= (a b + a + b)^2 / (4 a b)"]}
    for problem, path in zip(PROBLEMS, paths):
        text = path.read_text()
        assert all(part in text for part in parts[problem]), problem
        assert "Worked figure: one node of 8 GPUs" in text and "H100" in text and "H200" in text
        # Generated from its rows: the CSV renders the same report.
        assert report(problem).render(read_rows(tmp_path / f"{problem}.csv")).body in text
    alternate = [r for r in ROWS["alternate_ring_all_reduce"]() if r["table"] == "node"]
    assert [round(r["alternate_over_ring"], 9) for r in alternate] == [r["N"] / 2 for r in alternate]
    tp = {(r["phase"], r["N_TP"]): r for r in ROWS["tp_calcs"]() if r["table"] == "node"}
    # The xl FFN on 8 NVLink GPUs: TP 8 is just past the forward's 1 + 3 D_FF W / (2 C) = 7.99.
    assert tp[("forward", 8)]["comm_bottlenecked"] and not tp[("backward", 8)]["comm_bottlenecked"]


def test_analysis_command_writes_every_closed_form_report(tmp_path, capsys):
    from cs336_systems.__main__ import main

    assert main(["analysis", "--reports", str(tmp_path)]) == 0
    written = {line.rsplit("/", 1)[-1] for line in capsys.readouterr().out.split()}
    assert written == {"communication_accounting.md", *(f"{problem}.md" for problem in PROBLEMS)}
    assert f"- command: `python -m cs336_systems analysis --reports {tmp_path}`" in (
        tmp_path / "tp_calcs.md").read_text()


def test_analysis_command_writes_into_the_repository_root_from_any_folder(tmp_path, monkeypatch, capsys):
    from cs336_systems import reports
    from cs336_systems.__main__ import main

    clone = tmp_path / "clone"
    (clone / "cs336_systems").mkdir(parents=True)
    (clone / "pyproject.toml").write_text("[project]\nname = 'cs336-systems'\n")
    monkeypatch.setattr(reports, "PACKAGE_ROOT", clone / "cs336_systems")
    monkeypatch.chdir(clone / "cs336_systems")
    assert main(["analysis"]) == 0
    assert {path.parent for path in map(Path, capsys.readouterr().out.split())} == {clone / "reports"}
    assert "- command: `python -m cs336_systems analysis`" in (clone / "reports" / "tp_calcs.md").read_text()
    assert not (clone / "cs336_systems" / "reports").exists()
