"""What is particular to the Triton FlashAttention-2: its tile tables and launch plans, how launches
keep every tensor on a 16-byte boundary and reuse compiled kernels, every launch path on every head
dim, dtype, causality, alignment and layout (the split forward included), the torch.library op under
torch.compile and CUDA graphs, and long sequences on a GPU.

Without a GPU the kernels run in the Triton interpreter, which neither models shared memory nor
alignment, and every grid takes the wide path: the launch-path tests that matter are the `gpu` ones,
run on a GPU with compute-sanitizer too (`make gpu-check`).
"""

import contextlib
import ctypes
import itertools
import math
import os
import shutil
import struct
import threading

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cs336_systems.attention.flash_triton import (
    INTERPRETED,
    FlashAttentionTriton,
    flash_attention_forward,
    flash_attention_triton,
    plan_for,
)
from cs336_systems.attention.flash_triton import kernels, launch, native, op, tiles
from cs336_systems.model import ModelConfig, TransformerLM
from cs336_systems.precision import PRECISIONS
from cs336_systems.conformance.attention_reference import causal_future, discrepancies, tolerance_for
from cs336_systems.conformance.launches import recorded
from tests.flash_reference import (
    LAYOUTS,
    assert_close_to_reference,
    assert_matches_reference,
    leaf_inputs,
    make_tensor,
    misaligned,
    reference_attention,
    run,
    seed_from,
)

# The Triton interpreter turns loop bounds into ints through a NumPy conversion that NumPy deprecates;
# the warning is the interpreter's, once per loop, and says nothing about these kernels.
pytestmark = [pytest.mark.flash,
              pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")]

PATHS = ("wide", "narrow", "split")
# Every head dim class the contract accepts, powers of two or not (those are padded on chip, and 8 is
# below a dot's 16).
HEAD_DIMS = (8, 24, 40, 64, 80, 96, 112, 128)
GPU_DTYPES = {name: spec.dtype for name, spec in PRECISIONS.items()}


def _sm_count(device: torch.device) -> int:
    return tiles.sm_count(device.index or 0)


def path_case(path: str, device: torch.device, is_causal: bool) -> tuple[tuple[int, ...], int, int]:
    """(leading dims, n_queries, n_keys) whose forward takes `path` on `device`: `wide` fills the SMs
    with (batch x heads) alone; `narrow` is a few heads whose query tiles each see one run of keys;
    `split` is a few heads with more keys than one run."""
    if path == "wide":
        return (2, _sm_count(device) // 2 + 3), 70, 100
    if path == "narrow":
        return (2,), 30, (100 if is_causal else 30)
    return (1, 3), 300, 260


# ------------------------------------------------------------------------------- tiles and plans

@pytest.mark.parametrize("key", sorted(tiles.TILE_TABLE) + ["interpreter"])
def test_every_tile_set_keeps_the_divisibility_the_causal_loop_split_relies_on(key):
    tile_set = tiles.INTERPRETER_TILES if key == "interpreter" else tiles.TILE_TABLE[key]
    # A program that owns a query tile steps over key tiles, and the other way round for dK/dV.
    query_owners = [tile_set.forward, tile_set.dq, tile_set.narrow_forward, tile_set.narrow_dq, tile_set.tma_forward,
                    tile_set.tma_dq]
    assert all(t.block_m % t.block_n == 0 for t in query_owners if t is not None)
    key_owners = (tile_set.dkdv, tile_set.narrow_dkdv, tile_set.tma_dkdv)
    assert all(t.block_n % t.block_m == 0 for t in key_owners if t is not None)


@pytest.mark.parametrize(("kernel", "owned"), [("forward", "block_m"), ("dq", "block_m"), ("dkdv", "block_n")])
def test_narrow_tiles_are_taken_only_for_grids_below_the_programs_per_sm_threshold(kernel, owned, monkeypatch):
    monkeypatch.setattr(tiles, "sm_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    wide = {"forward": tiles.Tiles(128, 64, 4, 3), "dkdv": tiles.Tiles(64, 128, 4, 3), "dq": tiles.Tiles(128, 64, 4, 3)}
    narrow = {f"narrow_{name}": tiles.Tiles(64, 64, 4, 3) for name in wide}
    tile_set = tiles.TileSet(**wide, **narrow)
    rows = getattr(wide[kernel], owned)  # rows one wide program owns
    threshold = tiles.NARROW_GRID_PROGRAMS_PER_SM * 132
    pick = tiles.kernel_tiles
    # batch x heads x tiles: one program short of the threshold, then exactly at it.
    assert pick(tile_set, kernel, 1, rows * (threshold - 1), gpu) == narrow[f"narrow_{kernel}"]
    assert pick(tile_set, kernel, 1, rows * (threshold - 1) - 1, gpu) == narrow[f"narrow_{kernel}"]
    assert pick(tile_set, kernel, threshold, rows, gpu) == wide[kernel]
    assert pick(tile_set, kernel, 16, 16384, gpu) == wide[kernel]  # the leaderboard's grid
    assert pick(tiles.TileSet(**wide), kernel, 1, 1024, gpu) == wide[kernel]
    assert pick(tile_set, kernel, 1, 1024, torch.device("cpu")) == wide[kernel]


def test_split_forward_runs_are_a_quarter_of_the_longest_tile_in_query_tile_multiples():
    tile_shape = tiles.Tiles(64, 64, 4, 3)
    split = tiles.forward_split_keys
    assert split(tile_shape, 8192, 8192, is_causal=True) == 2048
    assert split(tile_shape, 1000, 1000, is_causal=True) == 256  # the longest tile ends at 1000: runs of 250 -> 256
    assert split(tile_shape, 100, 8192, is_causal=True) == 64  # causal: the queries' last tile ends at 128
    assert split(tile_shape, 100, 8192, is_causal=False) == 2048
    assert split(tile_shape, 64, 64, is_causal=True) is None  # one run: the whole forward


def test_head_groups_span_four_programs_per_sm_and_share_the_heads_evenly(monkeypatch):
    monkeypatch.setattr(tiles, "sm_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    group = tiles.head_group
    # The 2026 xl's attention, batch 4 x 32 heads, d 80 (forward and dQ: 128-row tiles; dK/dV: 64).
    assert group(128, 2048 // 128, gpu) == 43  # 528 programs over 16 tiles: 33 heads' worth; 43, 43, 42
    assert group(128, 2048 // 64, gpu) == 19  # 528 over 32: 17 heads' worth; 7 groups, the last of 14
    assert group(128, 512 // 128, gpu) == 128  # 132 heads' worth: all of them
    assert group(128, 512 // 64, gpu) == 128  # 66 heads' worth: one group, not 66 and a leftover 62
    assert group(16, 16384 // 128, gpu) == 6  # the leaderboard's forward: 6, 6, 4, not 5, 5, 5, 1
    assert group(16, 16384 // 64, gpu) == 4  # its dK/dV: 3 heads' worth; 4 groups of 4, not 3, 3, 3, 3, 3, 1
    assert group(3, 1000, gpu) == 1  # more tiles a head than the group's programs
    assert group(5, 2, torch.device("cpu")) == 3  # the interpreter's four programs: 2 heads' worth, 3 and 2
    assert group(5, 8, torch.device("cpu")) == 1


@triton.jit
def _launch_order(Out, n_rows, n_heads, group_heads, BLOCK: tl.constexpr, LONGEST_LAST: tl.constexpr):
    """Each program's (batch x head, batch x heads + head, tile) as the kernels' _program_tile gives them."""
    pid_bh, batch, head, tile = kernels._program_tile(n_rows, n_heads, group_heads, BLOCK, LONGEST_LAST)
    pid = tl.program_id(0)
    tl.store(Out + 3 * pid, pid_bh)
    tl.store(Out + 3 * pid + 1, (batch * n_heads + head).to(tl.int32))
    tl.store(Out + 3 * pid + 2, tile)


@pytest.mark.parametrize("longest_last", [True, False])
@pytest.mark.parametrize(("batch_heads", "n_tiles", "group_heads"), [(7, 3, 3), (6, 4, 2), (5, 2, 5), (4, 5, 1)])
def test_the_launch_order_takes_every_tile_once_by_head_groups_longest_first(batch_heads, n_tiles, group_heads,
                                                                              longest_last, device):
    block, n_heads = 16, 2
    out = torch.full((batch_heads * n_tiles, 3), -1, dtype=torch.int32, device=device)
    # The last tile partial, as in a sequence that is not a multiple of the tile.
    _launch_order[(batch_heads * n_tiles,)](out, n_tiles * block - 3, n_heads, group_heads, BLOCK=block,
                                            LONGEST_LAST=longest_last)
    launched = [tuple(row) for row in out.tolist()]
    assert all(pid_bh == batch_head for pid_bh, batch_head, _ in launched)
    expected = []
    for first in range(0, batch_heads, group_heads):
        heads = range(first, min(first + group_heads, batch_heads))
        # Longest first: the last query tile for the forward and dQ, the first key tile for dK/dV.
        ranked = reversed(range(n_tiles)) if longest_last else range(n_tiles)
        expected += [(head, tile) for tile in ranked for head in heads]
    assert [(pid_bh, tile) for pid_bh, _, tile in launched] == expected


@pytest.mark.parametrize(("head_dim", "chunks"), [
    (8, (16, 0)), (16, (16, 0)), (24, (32, 0)), (32, (32, 0)), (40, (32, 16)), (48, (32, 16)), (64, (64, 0)),
    (72, (64, 16)), (80, (64, 16)), (96, (64, 32)), (100, (128, 0)), (112, (128, 0)), (128, (128, 0))])
def test_a_head_dim_is_one_chunk_or_a_chunk_and_a_tail_whichever_pads_less(head_dim, chunks):
    assert tiles.head_dim_chunks(head_dim) == chunks
    block_d, tail_d = chunks
    assert block_d + tail_d >= head_dim and (tail_d == 0 or block_d < head_dim)


@pytest.mark.parametrize(("head_dim", "dtype", "table_key"), [
    (64, torch.bfloat16, (64, 2)), (72, torch.bfloat16, (80, 2)), (80, torch.bfloat16, (80, 2)),
    (96, torch.bfloat16, (128, 2)), (80, torch.float32, (128, 4)), (40, torch.float32, (64, 4))])
def test_a_head_dim_takes_the_tiles_of_the_least_class_that_holds_its_columns(head_dim, dtype, table_key):
    assert tiles.tiles_for(head_dim, dtype) is tiles.TILE_TABLE[table_key]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("path", PATHS)
def test_path_cases_take_their_path_on_an_h100_sized_gpu(path, is_causal, monkeypatch):
    # The shapes the GPU tests use to reach each path, planned as on an H100 (132 SMs) for every
    # head dim and dtype class, so that a change to the tile table cannot quietly skip a path.
    monkeypatch.setattr(tiles, "sm_count", lambda index: 132)
    monkeypatch.setattr(launch, "INTERPRETED", False)
    gpu = torch.device("cuda", 0)
    lead, n_queries, n_keys = path_case(path, gpu, is_causal)
    for head_dim in HEAD_DIMS:
        for dtype in GPU_DTYPES.values():
            plan = launch.launch_plan(int(torch.tensor(lead).prod()), n_queries, n_keys, head_dim, dtype, is_causal,
                                      gpu)
            assert plan.paths["forward"] == path, (head_dim, dtype)
            if path == "wide":
                assert plan.paths["dq"] == plan.paths["dkdv"] == "wide"


# -------------------------------------------------------------------- alignment and kept kernels

@pytest.mark.parametrize("layout", LAYOUTS)
def test_inputs_off_a_16_byte_boundary_are_copied_and_aligned_views_are_read_in_place(layout):
    # The kernels are only ever compiled for tensors on 16-byte boundaries (as_batch_heads says why).
    for aligned in (True, False):
        t = make_tensor((2, 3), 40, 32, layout, torch.float32, "cpu", aligned)
        t4 = launch.as_batch_heads(t)
        assert t4.data_ptr() % launch.ALIGNMENT_BYTES == 0 and t4.stride(-1) == 1
        torch.testing.assert_close(t4, t, rtol=0, atol=0)
        in_place = aligned and layout != "strided"
        assert (t4.data_ptr() == t.data_ptr()) == in_place, (layout, aligned)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_outputs_and_gradients_take_their_input_s_layout_where_the_kernels_read_it_in_place(layout, device):
    # (batch, seq, heads, d) memory viewed as (batch, heads, seq, d), as a model's attention passes it: o comes
    # back in that memory order, so that merging its heads for the output projection is a view, not a copy;
    # so does each gradient, for the projection's backward. A slice of a fused projection is not dense, and
    # a strided last dim is copied first (as_batch_heads): both give dense (batch, heads, seq, d) outputs.
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    q, k, v, do = (make_tensor((2, 3), n, 32, layout, dtype, device) for n in (40, 56, 56, 40))
    o, lse = launch.forward(q, k, v, True)
    dq, dk, dv = launch.backward(q, k, v, o, lse, do, True)
    for out, t in ((o, q), (dq, q), (dk, k), (dv, v)):
        assert (out.shape, out.dtype) == (t.shape, t.dtype)
        assert out.stride() == (t.stride() if layout == "transposed" else t.contiguous().stride()), layout
    assert lse.is_contiguous()
    assert o.transpose(1, 2).is_contiguous() == (layout == "transposed")


def test_a_kernel_launched_with_a_tensor_off_a_16_byte_boundary_is_refused(device):
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    q, k, v, _ = leaf_inputs((2, 3), 40, 40, 32, dtype, device)
    tile_set = tiles.tiles_for(32, dtype, INTERPRETED)
    with pytest.raises(ValueError, match="off a 16-byte boundary"):
        launch.launch_forward(misaligned(q), k, v, True, tile_set.forward)


def test_every_launch_reuses_a_kept_kernel_only_where_triton_would_compile_the_same_one(monkeypatch):
    # Stand-ins for a JIT kernel and the compiled kernel its launch returns record how each launch ran:
    # through Triton's JIT (which compiles and specialises) or straight to the kept compiled kernel.
    launches = []

    class Compiled:
        def __getitem__(self, grid):
            return lambda *args: launches.append(("kept", grid, args))

    class Jit:
        arg_names = ["X", "stride", "n", "IS_CAUSAL", "BLOCK"]

        def __getitem__(self, grid):
            def run(*args, **options):
                launches.append(("jit", grid, args, options))
                return Compiled()
            return run

    monkeypatch.setattr(launch, "INTERPRETED", False)
    monkeypatch.setattr(launch, "_kept_kernels", {})
    call = launch.KernelCall(Jit(), (("IS_CAUSAL", True), ("BLOCK", 32)), num_warps=4, num_stages=3)
    grid = (3, 1, 1)
    x, y = torch.zeros(64), torch.zeros(64)
    launch._launch(call, grid, (x,), (16, 100))
    launch._launch(call, grid, (y,), (16, 100))  # other tensor, same ints: the kept kernel
    launch._launch(call, grid, (x,), (16, 101))  # a size Triton would specialise otherwise: JIT again
    launch._launch(call, grid, (x,), (1, 100))  # a stride of 1 is compiled in as a constant: JIT again
    launch._launch(call, grid, (x.half(),), (16, 100))  # another element type: another compilation
    assert [entry[0] for entry in launches] == ["jit", "kept", "jit", "jit", "jit"]
    assert launches[0][3] == {"IS_CAUSAL": True, "BLOCK": 32, "num_warps": 4, "num_stages": 3}
    # A compiled kernel takes the tensors' addresses, and the constants last, in order.
    assert launches[1][2] == (y.data_ptr(), 16, 100, True, 32)
    with pytest.raises(ValueError, match="off a 16-byte boundary"):
        launch._launch(call, grid, (torch.zeros(65)[1:],), (16, 100))


class _Recorded:
    """Stands in for a compiled kernel: records each kept launch's grid and addresses."""

    def __init__(self, launches):
        self.launches = launches

    def __getitem__(self, grid):
        return lambda *args: self.launches.append(("kept", grid, args))


@pytest.fixture
def launches_recorded(monkeypatch):
    """Compiled launches without a GPU: the whole path's launches are recorded (and kept, as on a GPU),
    and so are the kept launches of later calls; the kept signatures start empty."""
    launches = []

    def whole_path_launch(call, grid, tensors, scalars, kept=None, described=None):
        descriptors = call.no_descriptors if described is None else described
        launches.append(("whole", grid, (*(t.data_ptr() for t in tensors), *scalars, *descriptors,
                                         *call.constant_values)))
        kept.append(launch.KeptLaunch(_Recorded(launches), grid, scalars, descriptors, call.constant_values, 0))

    monkeypatch.setattr(launch, "INTERPRETED", False)
    monkeypatch.setattr(launch, "_launch", whole_path_launch)
    monkeypatch.setattr(launch, "check_device", lambda q: None)
    monkeypatch.setattr(launch, "_on_device", lambda t: contextlib.nullcontext())
    monkeypatch.setattr(launch, "_kept_forwards", {})
    monkeypatch.setattr(launch, "_kept_backwards", {})
    monkeypatch.setattr(native, "module", lambda: None)  # stand-in kernels: nothing to launch from C++
    monkeypatch.setattr(launch, "_native", None)
    return launches


@pytest.mark.parametrize("lead", [(2, 3), (3,)])
def test_a_call_whose_signature_ran_before_launches_what_that_call_kept_with_its_own_addresses(lead,
                                                                                               launches_recorded):
    q, k, v, do = leaf_inputs(lead, 40, 24, 80, torch.float16, "cpu")
    o, lse = launch.forward(q, k, v, True)
    launch.backward(q, k, v, o, lse, do, True)
    whole = list(launches_recorded)
    assert [entry[0] for entry in whole] == ["whole"] * 3
    launches_recorded.clear()
    q2, k2, v2, do2 = leaf_inputs(lead, 40, 24, 80, torch.float16, "cpu", seed=1)
    o2, lse2 = launch.forward(q2, k2, v2, True)
    dq, dk, dv = launch.backward(q2, k2, v2, o2, lse2, do2, True)
    assert (o2.shape, lse2.shape, lse2.dtype, dq.shape, dk.shape, dv.shape) == (
        q.shape, q.shape[:-1], torch.float32, q.shape, k.shape, v.shape)
    assert all(t.is_contiguous() for t in (o2, lse2, dq, dk, dv))
    kept = list(launches_recorded)
    assert [entry[0] for entry in kept] == ["kept"] * 3
    assert [entry[1] for entry in kept] == [entry[1] for entry in whole]
    # The addresses in the kernels' order (forward: q, k, v, o, L), then the whole path's ints, floats
    # and constants.
    assert kept[0][2][:5] == tuple(t.data_ptr() for t in (q2, k2, v2, o2, lse2))
    assert kept[2][2][6:8] == (dk.data_ptr(), dv.data_ptr())
    assert kept[0][2][5:] == whole[0][2][5:]  # the whole path's ints, floats and constants


# Where each launch of a forward+backward takes the caller's tensors (q, k, v, dO), and where it takes the
# outputs of an earlier launch of the same forward+backward, by pointer position: forward (q, k, v, o, L),
# dQ (q, k, v, o, dO, L, D, dQ), dK/dV (q, k, v, dO, L, D, dK, dV).
CALLER_POINTERS = ((0, 1, 2), (0, 1, 2, 4), (0, 1, 2, 3))
POINTERS = (5, 8, 8)  # the rest of a launch's arguments are ints, floats and constants
WIRING = {"o": ((0, 3), (1, 3)), "L": ((0, 4), (1, 5), (2, 4)), "D": ((1, 6), (2, 5))}


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("lead", [(), (3,), (2, 3), (2, 2, 1)], ids=["2-D", "3-D", "4-D", "5-D"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_kept_call_launches_what_the_whole_path_launches_for_the_same_inputs(layout, lead, is_causal,
                                                                                launches_recorded):
    q, k, v = (make_tensor(lead, n, 40, layout, torch.float16, "cpu") for n in (33, 50, 50))
    do = make_tensor(lead, 33, 40, layout, torch.float16, "cpu")
    # Inputs copied first (a strided last dim) are never kept: their copies' strides are not the inputs'.
    copied = q.stride(-1) != 1
    calls, layouts = [], []
    for _ in range(2):
        launches_recorded.clear()
        o, lse = launch.forward(q, k, v, is_causal)
        gradients = launch.backward(q, k, v, o, lse, do, is_causal)
        calls.append([entry[2] for entry in launches_recorded])
        layouts.append([t.stride() for t in (o, lse, *gradients)])
        kept = not copied and len(calls) == 2
        assert [entry[0] for entry in launches_recorded] == ["kept" if kept else "whole"] * 3
    whole, again = calls
    assert layouts[1] == layouts[0], "a kept call lays its outputs out as the whole path did"
    for first, second, caller, pointers in zip(whole, again, CALLER_POINTERS, POINTERS, strict=True):
        assert second[pointers:] == first[pointers:], "ints, floats and constants"
        if not copied:
            assert [second[i] for i in caller] == [first[i] for i in caller], "the caller's tensors"
    for launches in calls:
        for name, uses in WIRING.items():
            assert len({launches[kernel][position] for kernel, position in uses}) == 1, name


def test_a_call_is_worked_out_afresh_where_its_inputs_or_their_alignment_differ_from_a_kept_one(
        launches_recorded):
    q, k, v, do = leaf_inputs((2, 3), 40, 40, 80, torch.float16, "cpu")
    launch.forward(q, k, v, True)
    for args in ((misaligned(q), k, v, True),  # the same signature, off a 16-byte boundary: copied first
                 (q.transpose(1, 2).contiguous().transpose(1, 2), k, v, True),  # other strides
                 (q, k, v, False)):  # other causality
        launches_recorded.clear()
        launch.forward(*args)
        assert [entry[0] for entry in launches_recorded] == ["whole"]
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        launch.forward(q, k, v, 1)  # equal to True as a dict key, and still refused


# ------------------------------------------------------------------------------ launches from C++

def _extension():
    """The C++ extension of kept launches, built; skipped where it is switched off or no C++ compiler is on
    the PATH (such a machine launches kept calls from Python)."""
    if os.environ.get(native.SWITCH) == "0":
        pytest.skip(f"{native.SWITCH}=0")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler on the PATH")
    extension = native.module()
    assert extension is not None, f"{native.SOURCE.name} did not build: see the warning"
    return extension


def test_native_parameters_follow_the_compiled_signature_and_skip_what_was_compiled_in():
    # Pointers by their position in the call's addresses, ints as Triton typed them, floats; constants
    # and ints specialised on (constexpr in the compiled signature) are not passed.
    signature = {"Q": "*bf16", "L": "*fp32", "stride": "i32", "heads": "constexpr", "offset": "i64",
                 "scale": "fp32", "IS_CAUSAL": "constexpr"}
    found = native.parameters(signature, (0, 1, 64, 1, 2**40, 0.125, True), n_addresses=2)
    assert found == ([0, 0, 1, 2, 3], [0, 1, 64, 2**40, 0], [0.0, 0.0, 0.0, 0.0, 0.125], [])
    # Launched from Python instead: a pointer past the addresses, a scalar among them, a type without a
    # native kind.
    assert native.parameters({"Q": "*bf16", "K": "*bf16"}, (0, 1), n_addresses=1) is None
    assert native.parameters({"Q": "*bf16", "n": "i32"}, (0, 5), n_addresses=2) is None
    assert native.parameters({"Q": "*bf16", "flag": "i1"}, (0, True), n_addresses=1) is None
    with pytest.raises(ValueError, match="signature of 2 arguments for 3 values"):
        native.parameters({"Q": "*bf16", "n": "i32"}, (0, 5, 6), n_addresses=1)


def test_native_parameters_pass_a_descriptor_as_a_tensor_map_then_its_shape_and_strides():
    # As Triton's launcher passes a descriptor it lowered to a CUtensorMap: the map (encoded per call over
    # the address it names), then the shape as i32s and the strides as i64s. A descriptor compiled in
    # (None: pointer loads) is not passed.
    tail = launch.Described(position=1, offset_bytes=128, dtype=torch.bfloat16, shape=(2, 3, 50, 16),
                            strides=(12000, 80, 240, 1), block=(1, 1, 64, 16))
    meta = {"swizzle": 1, "elem_size": 2, "elem_type": 10, "block_size": [1, 1, 64, 16], "fp4_padded": False}
    signature = {"Q": "*bf16", "K": "*bf16", "n": "i32", "KT": "tensordesc<bf16[1, 1, 64, 16]>", "VD": "constexpr"}
    kinds, ints, floats, maps = native.parameters(signature, (0, 1, 50, tail, None), 2, [meta])
    assert kinds == [0, 0, 1, native.TENSOR_MAP] + [1] * 4 + [2] * 4
    assert ints == [0, 1, 50, 0, 2, 3, 50, 16, 12000, 80, 240, 1]
    assert floats == [0.0] * 12
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
    assert maps == [[1, 128, TMA_DTYPE_DEVICE_TO_HOST[10], 4, 1, 2, 2, 3, 50, 16, 12000, 80, 240, 1, 1, 1, 64, 16]]
    # A descriptor lowered without a CUtensorMap is launched from Python.
    assert native.parameters(signature, (0, 1, 50, tail, None), 2, None) is None


def test_a_native_launch_packs_each_parameter_in_an_8_byte_slot_as_cuLaunchKernel_reads_it():
    extension = _extension()
    kernel = extension.Launch(function=1, grid=[3, 2, 1], threads=128, shared_bytes=1024, null_pointers=2,
                              kinds=[0, 0, 1, 2, 3], integers=[1, 0, -7, 2**40, 0], reals=[0, 0, 0, 0, 0.1])
    # Address 1, address 0, an i32, an i64, an f32, then Triton's two null scratch pointers.
    assert kernel.packed([0x1000, 0x2000]) == struct.pack("<QQi4xqf4xQQ", 0x2000, 0x1000, -7, 2**40, 0.1, 0, 0)
    with pytest.raises(ValueError, match="takes address 1 of 1"):
        kernel.packed([0x1000])
    # A tensor map is encoded by the driver at each launch: no packing without it.
    described = extension.Launch(function=1, grid=[1, 1, 1], threads=128, shared_bytes=0, null_pointers=2,
                                 kinds=[4], integers=[0], reals=[0.0],
                                 tensor_maps=[[0, 0, 10, 2, 1, 2, 8, 64, 64, 1, 8, 64]])
    with pytest.raises(ValueError, match="packs only where the driver encodes them"):
        described.packed([0x1000])


@pytest.mark.parametrize(("change", "message"), [
    ({"function": 0}, "needs a loaded kernel"),
    ({"grid": [1, 0, 1]}, "grid dim 1 is 0"),
    ({"grid": [1, 1]}, "grid has 3 dims"),
    ({"threads": 100}, "a block of 100 threads"),
    ({"kinds": [1], "integers": [2**31], "reals": [0.0]}, "i32 but 2147483648 does not fit"),
    ({"kinds": [0], "integers": [8], "reals": [0.0]}, "takes address 8"),
    ({"kinds": [7], "integers": [0], "reals": [0.0]}, "has kind 7"),
    ({"kinds": [1] * 95, "integers": [0] * 95, "reals": [0.0] * 95}, "more than 96"),
    ({"kinds": [4], "integers": [0], "reals": [0.0]}, "takes tensor map 0 of 0"),
    ({"tensor_maps": [[0, 0, 10, 6, 1, 2]]}, "has rank 6"),
    ({"tensor_maps": [[0, 8, 10, 1, 1, 2, 64, 1, 64]]}, "starts 8 bytes in"),
    ({"tensor_maps": [[9, 0, 10, 1, 1, 2, 64, 1, 64]]}, "over address 9"),
    ({"tensor_maps": [[0, 0, 10, 2, 1, 2, 8, 64, 36, 1, 8, 64]]}, "stride of 36 elements in dim 0"),
    ({"tensor_maps": [[0, 0, 10, 2, 1, 2, 8, 64, 64, 1, 8, 512]]}, "block dim 1 of 512"),
    ({"tensor_maps": [[0, 0, 10, 2, 1, 2, 8, 64, 64, 2, 8, 64]]}, "innermost stride is 2"),
])
def test_a_native_launch_refuses_what_no_kernel_launch_takes_naming_it(change, message):
    extension = _extension()
    arguments = dict(function=1, grid=[1, 1, 1], threads=128, shared_bytes=0, null_pointers=2, kinds=[],
                     integers=[], reals=[]) | change
    with pytest.raises(ValueError, match=message):
        extension.Launch(**arguments)


def test_the_extension_keeps_only_cuda_calls_and_finds_no_call_it_did_not_keep():
    extension = _extension()
    q = torch.randn(2, 8, 16)
    assert extension.forward(q, q, q, True) is None
    assert extension.backward(q, q, q, q, q[..., 0], q, True) is None
    kernel = extension.Launch(function=1, grid=[1, 1, 1], threads=128, shared_bytes=0, null_pointers=2, kinds=[],
                              integers=[], reals=[])
    with pytest.raises(ValueError, match="only dense CUDA tensors"):
        extension.keep_forward(q, q, q, True, kernel, q.stride(), -1, 0, launch.SIGNATURES_KEPT)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [40, 80])  # bf16 d 80's wide kernels load through descriptors: tensor maps
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("path", PATHS)
def test_kept_launches_from_cpp_give_what_the_whole_path_gives(path, dtype, layout, head_dim, device, monkeypatch):
    # A signature's first call takes the whole path and hands its launches to the extension; later calls
    # are the extension's alone, and give the whole path's outputs bit for bit (the kernels are
    # deterministic). Inputs of the signature off a 16-byte boundary, and layouts that are copied first,
    # take the Python path again.
    extension = _extension()
    monkeypatch.setattr(launch, "_kept_forwards", {})  # nothing kept, so that the first call is the whole path
    monkeypatch.setattr(launch, "_kept_backwards", {})
    extension.clear()
    lead, n_queries, n_keys = path_case(path, device, is_causal=True)
    q, k, v, do = (make_tensor(lead, n, head_dim, layout, GPU_DTYPES[dtype], device)
                   for n in (n_queries, n_keys, n_keys, n_queries))
    whole = launch.forward(q, k, v, True)
    whole += launch.backward(q, k, v, *whole, do, True)
    kept = extension.forward(q, k, v, True)
    if layout == "strided":  # copied first, so never kept
        assert kept is None
        return
    assert kept is not None and launch._native is extension
    kept += extension.backward(q, k, v, *kept, do, True)
    for name, got, expected in zip(("o", "L", "dq", "dk", "dv"), kept, whole, strict=True):
        assert (got.shape, got.stride()) == (expected.shape, expected.stride()), name
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)
    # Through launch.forward and launch.backward, the Python kept launches are not reached.
    with monkeypatch.context() as python_launches:
        python_launches.setattr(launch.KeptForward, "__call__", lambda *args: pytest.fail("launched from Python"))
        python_launches.setattr(launch.KeptBackward, "__call__", lambda *args: pytest.fail("launched from Python"))
        again = launch.forward(q, k, v, True)
        again += launch.backward(q, k, v, *again, do, True)
    for name, got, expected in zip(("o", "L", "dq", "dk", "dv"), again, whole, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)
    if layout == "contiguous":  # the same signature, one element past a 16-byte boundary: copied, not kept
        shifted_inputs = [misaligned(t) for t in (q, k, v)]
        assert extension.forward(*shifted_inputs, True) is None
        for name, got, expected in zip(("o", "L"), launch.forward(*shifted_inputs, True), whole):
            torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_kept_launches_from_python_make_their_descriptors_again_over_each_call_s_tensors(layout, device,
                                                                                       monkeypatch):
    # Without the extension a kept call launches from Python: its descriptors are made again over the new
    # call's addresses, and its outputs are the whole path's for those inputs, bit for bit.
    monkeypatch.setattr(native, "module", lambda: None)
    monkeypatch.setattr(launch, "_native", None)
    monkeypatch.setattr(launch, "_kept_forwards", {})
    monkeypatch.setattr(launch, "_kept_backwards", {})
    lead, n_queries, n_keys = path_case("wide", device, is_causal=True)
    calls = [[make_tensor(lead, n, 80, layout, torch.bfloat16, device) for n in (n_queries, n_keys, n_keys, n_queries)]
             for _ in range(2)]
    outputs = []
    for q, k, v, do in calls:
        o, lse = launch.forward(q, k, v, True)
        outputs.append((o, lse, *launch.backward(q, k, v, o, lse, do, True)))
    kept = launch._kept_forwards[launch._signature(True, *calls[0][:3])]
    assert kept.launch.described
    monkeypatch.setattr(launch, "_kept_forwards", {})  # the second inputs through the whole path
    monkeypatch.setattr(launch, "_kept_backwards", {})
    q, k, v, do = calls[1]
    o, lse = launch.forward(q, k, v, True)
    whole = (o, lse, *launch.backward(q, k, v, o, lse, do, True))
    for name, got, expected in zip(("o", "L", "dq", "dk", "dv"), outputs[1], whole, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)


def test_a_kept_descriptor_is_made_again_over_the_address_it_names():
    tail = launch.Described(position=1, offset_bytes=128, dtype=torch.bfloat16, shape=(2, 3, 50, 16),
                            strides=(12000, 80, 240, 1), block=(1, 1, 64, 16))
    made = tail.at((0x10000, 0x20000))
    assert made.base.data_ptr() == 0x20000 + 128 and made.base.dtype == torch.bfloat16
    assert (made.shape, made.strides, made.block_shape) == ([2, 3, 50, 16], [12000, 80, 240, 1], [1, 1, 64, 16])


@pytest.mark.gpu
def test_a_kept_call_that_runs_out_of_memory_in_cpp_raises_torch_out_of_memory_error(device):
    # A benchmark records an out-of-memory cell and goes on: the extension's allocations must raise
    # torch.OutOfMemoryError like the Python path's, not end the process. (Not in the sanitizer's subset:
    # the allocator limit it sets says nothing of memory safety.)
    extension = _extension()
    index = torch.device(device).index or torch.cuda.current_device()

    def free_cached_bytes() -> int:  # what the allocator holds without handing out, in every free block
        torch.cuda.synchronize(index)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)

    # o larger than all the allocator's free blocks together, so that it needs memory of its own.
    head_bytes = 512 * 64 * 2
    heads = (free_cached_bytes() + (8 << 20)) // head_bytes + 1
    if 4 * heads * head_bytes > torch.cuda.mem_get_info(index)[0] // 2:
        pytest.skip("the allocator holds more free memory than this test can outgrow")
    q, k, v, _ = leaf_inputs((1, heads), 512, 512, 64, torch.bfloat16, device)
    launch.forward(q, k, v, True)  # the whole path, which keeps the call; its o and L are freed
    assert free_cached_bytes() < q.nbytes
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved(index) + (1 << 20)) / total, index)
    try:
        with pytest.raises(torch.OutOfMemoryError):
            extension.forward(q, k, v, True)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
    assert extension.forward(q, k, v, True) is not None


@pytest.mark.gpu
def test_kept_calls_launch_through_triton_while_its_launches_are_hooked(device, monkeypatch):
    # A profiler's launch hook must see kept calls too: while one is set they take the Python path.
    from triton import knobs

    extension = _extension()
    q, k, v, _ = leaf_inputs((1, 2), 200, 200, 32, torch.bfloat16, device)
    launch.forward(q, k, v, True)
    assert extension.forward(q, k, v, True) is not None and not launch._launches_hooked()
    monkeypatch.setattr(extension, "forward", lambda *args: pytest.fail("launched from C++ while hooked"))
    seen = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        assert launch._launches_hooked()
        launch.forward(q, k, v, True)
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    assert len(seen) == 1 and not launch._launches_hooked()


def _on_a_new_thread(call):
    """call() on a thread that has done no CUDA work (checked: no current context), its result or its error."""
    outcome = {}

    def run():
        try:
            outcome["had_context"] = launch.context_current()
            outcome["result"] = call()
        except BaseException as error:  # raised again on the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    assert not outcome["had_context"], "the new thread had a context: the test shows nothing"
    return outcome["result"]


@pytest.mark.gpu
def test_a_failed_driver_call_names_the_call_and_the_driver_s_error(device):
    if INTERPRETED:
        pytest.skip("the interpreter makes no driver calls")
    torch.cuda.init()  # the driver answers calls only once initialised
    with pytest.raises(RuntimeError, match=r"cuDeviceGet failed: CUDA_ERROR_INVALID_DEVICE \(CUDA driver error 101\)"):
        launch._driver_call("cuDeviceGet", ctypes.byref(ctypes.c_int()), torch.cuda.device_count())


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 80])  # bf16 d 80's wide kernels load through descriptors
@pytest.mark.parametrize("route", ["whole", "cpp", "python"])
def test_calls_from_a_thread_that_has_done_no_cuda_work_give_what_the_caller_s_thread_gives(route, head_dim, device,
                                                                                           monkeypatch):
    # Autograd runs the backward on a thread of its own, and callers run threads of theirs: until such a
    # thread does CUDA work the runtime has made no context current there, and the driver refuses to encode
    # a tensor map or launch without one. `whole`: a signature's first call, through Triton's launcher;
    # `cpp` and `python`: a kept signature's calls, launched from C++ or from Python.
    monkeypatch.setattr(launch, "_kept_forwards", {})
    monkeypatch.setattr(launch, "_kept_backwards", {})
    if route == "cpp":
        _extension().clear()
    else:
        monkeypatch.setattr(native, "module", lambda: None)
        monkeypatch.setattr(launch, "_native", None)
    lead, n_queries, n_keys = path_case("wide", device, is_causal=True)
    q, k, v, do = (make_tensor(lead, n, head_dim, "contiguous", torch.bfloat16, device)
                   for n in (n_queries, n_keys, n_keys, n_queries))

    def call():
        o, lse = launch.forward(q, k, v, True)
        return (o, lse, *launch.backward(q, k, v, o, lse, do, True))

    if route == "whole":
        monkeypatch.setattr(launch, "_kept_kernels", {})  # Triton's JIT launch, not a kept kernel's
        got = _on_a_new_thread(call)
        expected = call()
    else:
        expected = call()  # the whole path, which keeps the signature
        assert (launch._native is not None) == (route == "cpp")
        got = _on_a_new_thread(call)
    for name, a, b in zip(("o", "L", "dq", "dk", "dv"), got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------------------------- every path

@pytest.mark.skipif(not INTERPRETED, reason="the Triton interpreter is not in use")
def test_interpreter_refuses_bf16_whose_dots_it_computes_wrongly():
    q, k, v, _ = leaf_inputs((2,), 8, 8, 16, torch.bfloat16, "cpu")
    with pytest.raises(TypeError, match="bf16 is not supported under TRITON_INTERPRET=1"):
        FlashAttentionTriton.apply(q, k, v)


def _launch_path_cases():
    """Every (path, dtype, causality, alignment) on every head dim, each case with one input layout: the
    layouts take turns along the head dims, starting one further in each (path, dtype, causality,
    alignment), so that every layout meets each of those twice and each head dim in several of them.
    fp16 shares bf16's tiles and code; the drawn test has it."""
    cells = itertools.product(PATHS, ("bf16", "fp32"), (False, True), (True, False))
    for turn, (path, dtype, is_causal, aligned) in enumerate(cells):
        for i, head_dim in enumerate(HEAD_DIMS):
            layout = LAYOUTS[(turn + i) % len(LAYOUTS)]
            name = f"{path}-{dtype}-{'causal' if is_causal else 'full'}-{'aligned' if aligned else 'misaligned'}"
            yield pytest.param(path, dtype, is_causal, aligned, head_dim, layout, id=f"{name}-d{head_dim}-{layout}")


@pytest.mark.gpu
@pytest.mark.parametrize(("path", "dtype", "is_causal", "aligned", "head_dim", "layout"), list(_launch_path_cases()))
def test_every_launch_path_on_every_head_dim_and_alignment(path, dtype, is_causal, aligned, head_dim, layout, device):
    # The subset compute-sanitizer runs: every kernel on each of its tile widths, the split forward
    # with its merge, head dims padded on chip, inputs in memory that starts off a 16-byte boundary, and
    # each layout, every one of these with and without the causal mask.
    lead, n_queries, n_keys = path_case(path, device, is_causal)
    q, k, v = (make_tensor(lead, n, head_dim, layout, GPU_DTYPES[dtype], device, aligned)
               for n in (n_queries, n_keys, n_keys))
    do = make_tensor(lead, n_queries, head_dim, "contiguous", GPU_DTYPES[dtype], device, aligned)
    assert plan_for(q, k, is_causal).paths["forward"] == path
    assert_matches_reference("triton", q, k, v, do, is_causal)


def test_launch_path_cases_pair_every_path_dtype_causality_alignment_and_layout():
    cases = [case.values for case in _launch_path_cases()]
    cells = {case[:4] for case in cases}
    assert len(cells) == len(PATHS) * 2 * 2 * 2
    for cell in cells:
        assert {case[4] for case in cases if case[:4] == cell} == set(HEAD_DIMS)
        assert {case[5] for case in cases if case[:4] == cell} == set(LAYOUTS)


# Examples of the GPU property test per (path, dtype): every head dim class, alignment and layout
# appears many times over. Each example can compile kernels (seconds each on a cold cache), so the
# draws are split by path and dtype into tests of their own, which pytest-xdist runs side by side.
GPU_PATH_EXAMPLES = 25


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("path", PATHS)
def test_drawn_inputs_on_every_launch_path_match_the_float64_reference(path, dtype, device):
    reached = set()

    @given(data=st.data())
    @settings(max_examples=GPU_PATH_EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    def check(data):
        is_causal = data.draw(st.booleans(), label="is_causal")
        batch_heads = {"wide": st.integers(_sm_count(device), 2 * _sm_count(device)),
                       "narrow": st.integers(1, 8), "split": st.integers(1, 8)}[path]
        lead = (1, data.draw(batch_heads, label="batch x heads"))
        if path == "narrow":  # one run of keys for every query tile: the narrow query tile is at least 32
            n_queries = data.draw(st.integers(1, 32 if is_causal else 600), label="n_queries")
            n_keys = data.draw(st.integers(1, 600 if is_causal else 32), label="n_keys")
        else:
            n_queries = data.draw(st.integers(1 if path == "wide" else 129, 1100), label="n_queries")
            n_keys = data.draw(st.integers(1 if path == "wide" else 129, 1100), label="n_keys")
        head_dim = data.draw(st.sampled_from(HEAD_DIMS), label="head dim")
        aligned = data.draw(st.booleans(), label="aligned")
        layouts = [data.draw(st.sampled_from(LAYOUTS), label=f"{name} layout") for name in "qkv"]
        seed_from(data)
        q, k, v = (make_tensor(lead, n, head_dim, layout, GPU_DTYPES[dtype], device, aligned)
                   for n, layout in zip((n_queries, n_keys, n_keys), layouts))
        do = make_tensor(lead, n_queries, head_dim, "contiguous", GPU_DTYPES[dtype], device, aligned)
        paths = plan_for(q, k, is_causal).paths
        assert paths["forward"] == path
        reached.update({("dq", paths["dq"]), ("dkdv", paths["dkdv"]), ("aligned", aligned), ("causal", is_causal),
                        ("head dim padded", head_dim & (head_dim - 1) != 0)})
        assert_matches_reference("triton", q, k, v, do, is_causal)

    check()
    # What every (path, dtype) must have drawn; narrow dK/dV tiles exist only for some tile classes.
    expected = {(name, value) for name in ("aligned", "causal", "head dim padded") for value in (True, False)}
    expected |= {("dq", "wide" if path == "wide" else "narrow")}
    assert expected <= reached, f"never reached: {sorted(map(str, expected - reached))}"


def test_misaligned_inputs_through_the_split_forward_match_the_reference(device):
    # Once an illegal memory access on an H100: batch 2, 1 head, N 80, d 32, bf16, causal, every input
    # one element past a 16-byte boundary, through the split forward when its output's columns were
    # shared between programs.
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    q, k, v, do = (misaligned(t) for t in leaf_inputs((2, 1), 80, 80, 32, dtype, device, seed=2))
    assert_matches_reference("triton", q, k, v, do, is_causal=True)


def test_calls_that_differ_in_rank_layout_or_alignment_each_match_the_reference(device):
    # Triton specialises compiled kernels on pointer alignment and strides: a call must never run a
    # kernel compiled for another call's.
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    n, d = 80, 32
    for lead in ((2,), (), (2, 2, 1)):  # 3-D, 2-D and 5-D inputs, each viewed as 4-D differently
        assert_matches_reference("triton", *leaf_inputs(lead, n, n, d, dtype, device), is_causal=True)
    for layout in LAYOUTS:
        inputs = [make_tensor((2,), n, d, layout, dtype, device) for _ in range(4)]
        assert_matches_reference("triton", *inputs, is_causal=True)
        assert_matches_reference("triton", *(misaligned(t) for t in inputs), is_causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_calls_that_repeat_a_signature_through_its_kept_launches_match_the_reference(path, device):
    # A signature's first call keeps its launches; later ones reuse them with their own tensors, in each
    # layout, through the Function and through the op.
    lead, n_queries, n_keys = path_case(path, device, is_causal=True)
    for layout, through_op in zip(LAYOUTS, (False, True) * 2):
        calls = [[make_tensor(lead, n, 40, layout, torch.bfloat16, device) for n in (n_queries, n_keys, n_keys)]
                 for _ in range(3)]
        for q, k, v in calls:
            do = make_tensor(lead, n_queries, 40, "contiguous", torch.bfloat16, device)
            if through_op:
                inputs = [t.requires_grad_() for t in (q, k, v)]
                o, lse = flash_attention_forward(*inputs, True)
                got = (o, lse, *torch.autograd.grad(o, inputs, do))
                assert_close_to_reference(got, reference_attention(q, k, v, do, True), torch.bfloat16)
            else:
                assert_matches_reference("triton", q, k, v, do, is_causal=True)
        if layout != "strided":  # copied first, so never kept
            assert launch._signature(True, *calls[0]) in launch._kept_forwards


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("head_dim", [8, 40, 64, 80, 128])  # one chunk padded, chunk and tail, whole chunks
@pytest.mark.parametrize(("n_queries", "n_keys", "is_causal"), [(70, 50, True), (33, 90, False), (16, 16, True)])
def test_descriptor_loads_and_pointer_loads_both_match_the_float64_reference(n_queries, n_keys, is_causal, head_dim,
                                                                             layout, device):
    # Each wide kernel both ways: its loop's tiles through tensor descriptors (rows past n and columns past
    # the head dim read as zero by the copy, not masked) and through pointers. On a GPU, descriptors also
    # run on tile sets that have no TMA tiles of their own, on their wide tiles.
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    q, k, v = (make_tensor((2, 3), n, head_dim, layout, dtype, device) for n in (n_queries, n_keys, n_keys))
    do = make_tensor((2, 3), n_queries, head_dim, "contiguous", dtype, device)
    q4, k4, v4, do4 = (launch.as_batch_heads(t) for t in (q, k, v, do))
    assert launch._describable(q4, k4, v4, do4)
    tile_set = tiles.tiles_for(head_dim, dtype, INTERPRETED)
    reference = reference_attention(q, k, v, do, is_causal)
    for described in (False, True):
        tma = {kernel: (getattr(tile_set, f"tma_{kernel}") or getattr(tile_set, kernel)) if described else None
               for kernel in ("forward", "dq", "dkdv")}
        o, lse = launch.launch_forward(q4, k4, v4, is_causal, tile_set.forward, tma=tma["forward"])
        dq, delta = launch.launch_dq(q4, k4, v4, o, do4, lse, is_causal, tile_set.dq, tma=tma["dq"])
        dk, dv = launch.launch_dkdv(q4, k4, v4, do4, lse, delta, is_causal, tile_set.dkdv, tma=tma["dkdv"])
        assert_close_to_reference((o, lse, dq, dk, dv), reference, dtype)


@pytest.mark.parametrize("head_dim", [16, 80])
@pytest.mark.parametrize("is_causal", [False, True])
def test_scores_that_grow_along_the_keys_match_the_float64_reference(is_causal, head_dim, device):
    # The forward's online softmax rescales a row's output and sum whenever a key tile raises its max. Keys
    # scaled up along the sequence (to 12 times the first one's size) raise every row's max by far, tile
    # after tile, where random ones barely move it after the first tile.
    # On a GPU, enough heads for the wide kernels, which at bf16 d 80 load through descriptors.
    lead, dtype = ((2, 3), torch.float32) if device.type == "cpu" else (path_case("wide", device, is_causal)[0],
                                                                        torch.bfloat16)
    q, k, v, do = leaf_inputs(lead, 200, 200, head_dim, dtype, device)
    k = k * torch.linspace(1.0, 12.0, k.shape[-2], device=device, dtype=dtype)[:, None]
    assert_matches_reference("triton", q, k, v, do, is_causal)


@pytest.mark.parametrize("head_dim", [24, 80])  # padded on chip: masked columns in the merge too
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(("n_queries", "n_keys"), [(80, 80), (100, 70), (50, 130), (16, 16)])
def test_split_forward_matches_the_whole_forward(n_queries, n_keys, is_causal, head_dim, device):
    # Runs of one query tile up to more keys than any tile sees; the merge must give the whole forward's
    # o and L (to rounding: the runs sum in another order).
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    q, k, v, _ = leaf_inputs((2, 3), n_queries, n_keys, head_dim, dtype, device)
    tile_set = tiles.tiles_for(head_dim, dtype, INTERPRETED)
    forward_tiles = tile_set.narrow_forward or tile_set.forward
    o, lse = launch.launch_forward(q, k, v, is_causal, forward_tiles)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for runs_of in (1, 2):
        split_o, split_lse = launch.launch_split_forward(q, k, v, is_causal, forward_tiles,
                                                         runs_of * forward_tiles.block_m)
        torch.testing.assert_close(split_o, o, atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(split_lse, lse, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="multiple of the query tile"):
        launch.launch_split_forward(q, k, v, is_causal, forward_tiles, forward_tiles.block_m + 1)


@pytest.mark.gpu
def test_triton_refuses_cpu_tensors_when_compiled_for_the_gpu():
    if INTERPRETED:
        pytest.skip("the Triton interpreter runs CPU tensors")
    q, k, v, _ = leaf_inputs((2,), 8, 8, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="needs CUDA tensors, got cpu"):
        FlashAttentionTriton.apply(q, k, v)


@pytest.mark.gpu
def test_triton_launch_hooks_see_every_launch(device):
    # Profilers (Proton) hook Triton's launches: forward (one kernel) and backward (two) must reach them.
    if INTERPRETED:
        pytest.skip("the Triton interpreter does not launch kernels")
    from triton import knobs

    launches = []

    def hook(metadata):
        launches.append(metadata)

    q, k, v, do = leaf_inputs((1, 2), 200, 200, 32, torch.bfloat16, device)
    inputs = [t.requires_grad_() for t in (q, k, v)]
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        for _ in range(3):
            torch.autograd.grad(FlashAttentionTriton.apply(*inputs, True), inputs, do)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(launches) == 9


# ------------------------------------------------------------------------------- a planted scale error

# A softmax scale this far off must fail the error model (cs336_systems.conformance.attention_reference) on every
# launch path, in every dtype, causal or not: planted by scaling what the launch code passes the kernels as
# the scale of q k^T (the forward's and the backward's) and the gradients' 1/sqrt(d).
PLANTED_SCALE_ERROR = 1.01
# The interpreter's stand-ins for the GPU's launch paths: its wide tiles with descriptor loads (as the GPU's
# wide kernels on Hopper) and with pointer loads, narrower tiles for every kernel (the GPU's narrow path), and
# those with the forward's keys split into runs of one query tile (the split forward and its merge).
INTERPRETER_NARROW_TILES = tiles.Tiles(16, 16, 1, 1)
INTERPRETER_PATHS = ("wide", "wide_pointer_loads", "narrow", "split")


def _interpreter_plan(path: str) -> launch.LaunchPlan:
    wide = tiles.INTERPRETER_TILES
    kernels_of = ("forward", "dq", "dkdv")
    if path.startswith("wide"):
        tma = {kernel: None if path == "wide_pointer_loads" else getattr(wide, f"tma_{kernel}")
               for kernel in kernels_of}
        return launch.LaunchPlan(launch.ForwardPlan(wide.forward, None), wide.dq, wide.dkdv,
                                 dict.fromkeys(kernels_of, False), tma)
    narrow = INTERPRETER_NARROW_TILES
    split_keys = narrow.block_m if path == "split" else None
    return launch.LaunchPlan(launch.ForwardPlan(narrow, split_keys), narrow, narrow, dict.fromkeys(kernels_of, True),
                             dict.fromkeys(kernels_of))


def _plant_scale_error(monkeypatch) -> None:
    """Scale every launch's softmax scales by PLANTED_SCALE_ERROR, and keep no launch kept with the true ones."""
    true_scales = launch._scales
    monkeypatch.setattr(launch, "_scales",
                        lambda head_dim: tuple(PLANTED_SCALE_ERROR * s for s in true_scales(head_dim)))
    monkeypatch.setattr(launch, "_kept_forwards", {})
    monkeypatch.setattr(launch, "_kept_backwards", {})
    monkeypatch.setattr(launch, "_native", None)
    monkeypatch.setattr(native, "module", lambda: None)


def _failures_with_and_without_the_planted_error(q, k, v, do, is_causal, monkeypatch) -> tuple[list[str], list[str]]:
    reference = reference_attention(q, k, v, do, is_causal)
    tolerance = tolerance_for(q.device, q.dtype)
    correct = discrepancies(run("triton", q, k, v, do, is_causal), reference, tolerance, q.dtype)
    _plant_scale_error(monkeypatch)
    planted = discrepancies(run("triton", q, k, v, do, is_causal), reference, tolerance, q.dtype)
    return correct, planted


def _assert_caught_in_forward_and_backward(correct: list[str], planted: list[str]) -> None:
    assert not correct, "\n".join(correct)
    failed = {sentence.split(" ")[0] if not sentence.startswith("the saved") else "L" for sentence in planted}
    assert "L" in failed and failed & {"dq", "dk"}, f"the planted scale error passed as {sorted(failed)}: {planted}"


@pytest.mark.skipif(not INTERPRETED, reason="the Triton interpreter is not in use")
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("path", INTERPRETER_PATHS)
def test_a_softmax_scale_one_percent_off_fails_on_every_launch_path(path, is_causal, monkeypatch):
    # fp16, whose dots the interpreter computes exactly: its bounds are the kernels' on a GPU.
    monkeypatch.setattr(launch, "plan_for", lambda q, k, is_causal: _interpreter_plan(path))
    # d 40 runs as a chunk and a tail; a query tile's keys (40 of 56) span several key tiles.
    q, k, v, do = (make_tensor((2,), n, 40, layout, torch.float16, "cpu")
                   for n, layout in ((40, "transposed"), (56, "sliced"), (56, "contiguous"), (40, "contiguous")))
    with recorded() as calls:
        correct, planted = _failures_with_and_without_the_planted_error(q, k, v, do, is_causal, monkeypatch)
    forward_kernel = "split_forward_kernel" if path == "split" else "forward_kernel"
    assert set(calls.kernels) == {forward_kernel, "dq_kernel", "dkdv_kernel"}, calls.kernels
    _assert_caught_in_forward_and_backward(correct, planted)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("path", PATHS)
def test_a_softmax_scale_one_percent_off_fails_on_every_launch_path_on_a_gpu(path, is_causal, dtype, device,
                                                                            monkeypatch):
    lead, n_queries, n_keys = path_case(path, device, is_causal)
    q, k, v, do = (make_tensor(lead, n, 80, "contiguous", GPU_DTYPES[dtype], device)
                   for n in (n_queries, n_keys, n_keys, n_queries))
    assert plan_for(q, k, is_causal).paths["forward"] == path
    _assert_caught_in_forward_and_backward(*_failures_with_and_without_the_planted_error(q, k, v, do, is_causal,
                                                                                         monkeypatch))


def _tf32(x: torch.Tensor) -> torch.Tensor:
    """An fp32 operand as Hopper's tensor cores read it for a tf32 dot: its low 13 mantissa bits dropped."""
    return (x.float().view(torch.int32) & ~0x1FFF).view(torch.float32).double()


def _tf32_kernel(q, k, v, do, is_causal: bool, scale_error: float = 1.0) -> dict[str, torch.Tensor]:
    """o, L, dq, dk, dv as the kernels compute them in fp32 on a GPU: each dot's operands truncated to tf32, the
    rest exact (float64); the softmax scale times `scale_error`."""
    q, k, v, do = (t.double() for t in (q, k, v, do))
    scale = scale_error / q.shape[-1] ** 0.5
    s = _tf32(q) @ _tf32(k).transpose(-2, -1) * scale
    if is_causal:
        s = s.masked_fill(causal_future(0, q.shape[-2], k.shape[-2], q.device), -math.inf)
    L = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - L[..., None])
    o = _tf32(p) @ _tf32(v)
    ds = p * (_tf32(do) @ _tf32(v).transpose(-2, -1) - (do * o).sum(dim=-1, keepdim=True))
    return {"o": o.float(), "L": L.float(), "dq": (_tf32(ds) @ _tf32(k) * scale).float(),
            "dk": (_tf32(ds).transpose(-2, -1) @ _tf32(q) * scale).float(),
            "dv": (_tf32(p).transpose(-2, -1) @ _tf32(do)).float()}


def _tf32_failures(lead, n_queries, n_keys, head_dim, is_causal, spread) -> tuple[list[str], list[str]]:
    """What the GPU fp32 bounds find in _tf32_kernel's results, as they are and with a softmax scale 1% off."""
    torch.manual_seed(n_queries + head_dim)
    q, do = (torch.randn(*lead, n_queries, head_dim) for _ in range(2))
    k, v = (torch.randn(*lead, n_keys, head_dim) for _ in range(2))
    q = q * spread
    reference = reference_attention(q, k, v, do, is_causal)
    tolerance = tolerance_for("cuda", torch.float32)
    return tuple(discrepancies(_tf32_kernel(q, k, v, do, is_causal, scale_error), reference, tolerance,
                               torch.float32) for scale_error in (1.0, PLANTED_SCALE_ERROR))


@pytest.mark.parametrize(("lead", "n_queries", "n_keys", "head_dim", "is_causal"), [
    ((2,), 251, 263, 96, False), ((2,), 291, 249, 128, False), ((2, 2), 100, 284, 40, False),
    ((2,), 150, 150, 80, True), ((3,), 8, 230, 16, False),
])
def test_the_gpu_fp32_bounds_hold_tf32_truncation_and_catch_a_softmax_scale_one_percent_off(
        lead, n_queries, n_keys, head_dim, is_causal):
    # Truncation, not rounding, makes dQ and dK about 0.998 times the reference: a bias that the projection
    # bound must allow (the kernels reached it on an H100), and still tell from a scale error of 1%.
    _assert_caught_in_forward_and_backward(*_tf32_failures(lead, n_queries, n_keys, head_dim, is_causal, 1.0))


@pytest.mark.parametrize(("lead", "n_queries", "n_keys", "head_dim", "is_causal", "spread"), [
    ((64,), 294, 1, 40, False, 1.0), ((2,), 500, 500, 64, True, 8.0), ((4,), 300, 300, 40, False, 4.0),
])
def test_the_gpu_fp32_logsumexp_bound_holds_tf32_truncation_and_catches_a_softmax_scale_one_percent_off(
        lead, n_queries, n_keys, head_dim, is_causal, spread):
    # Every score about 0.999 times itself leaves L too small by about 1e-3 of the scores' size, which the
    # kernels reached on an H100 with a single key (L is that key's score) and with large scores; a scale 1% off
    # moves L by ten times as much. (A single key's gradients are 0, and large scores' nearly so: L alone tells.)
    correct, planted = _tf32_failures(lead, n_queries, n_keys, head_dim, is_causal, spread)
    assert not correct, "\n".join(correct)
    assert any(sentence.startswith("the saved logsumexp L") for sentence in planted), planted


# ------------------------------------------------------------------------------ the torch.library op

def test_the_op_passes_torch_library_opcheck(device):
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    for lead, n_queries, n_keys, head_dim in (((2, 3), 45, 70, 24), ((3,), 33, 33, 16)):
        q, k, v, _ = leaf_inputs(lead, n_queries, n_keys, head_dim, dtype, device)
        for is_causal in (False, True):
            torch.library.opcheck(flash_attention_forward, (q.requires_grad_(), k.requires_grad_(),
                                                            v.requires_grad_(), is_causal))


def test_the_op_gives_the_function_s_output_and_gradients(device):
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    q, k, v, do = leaf_inputs((2, 3), 45, 70, 40, dtype, device)
    results = []
    for attend in (lambda *inputs: flash_attention_forward(*inputs)[0], FlashAttentionTriton.apply):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*inputs, True)
        results.append((out, *torch.autograd.grad(out, inputs, do)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.gpu
def test_the_op_on_cuda_tensors_takes_its_own_autograd_and_without_autograd_its_body(device):
    # The autograd register_autograd makes redispatches every call through torch.library's Python layers
    # (op.py): CUDA tensors take the op's own, which launches as the Function does. Where autograd is off
    # altogether (inference mode) the dispatcher goes past it, to the triton_op's body.
    if INTERPRETED:
        pytest.skip("the interpreter's CPU tensors take the autograd register_autograd makes")
    q, k, v, _ = leaf_inputs((2, 3), 45, 70, 40, torch.bfloat16, device)
    o, lse = flash_attention_forward(*(t.requires_grad_() for t in (q, k, v)), True)
    assert type(o.grad_fn) is op._CudaAutograd._backward_cls
    with torch.inference_mode():
        inferred = flash_attention_forward(q, k, v, True)
    for got, want in zip(inferred, (o, lse)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_op_s_log_sum_exp_is_not_differentiable(device):
    q, k, v, _ = leaf_inputs((2,), 20, 20, 16, torch.float32, device)
    o, lse = flash_attention_forward(*(t.requires_grad_() for t in (q, k, v)), True)
    assert o.requires_grad and not lse.requires_grad


@pytest.mark.gpu
def test_a_compiled_graph_launches_the_kernels_itself(device):
    # The op is a triton_op: inductor traces into it and launches its kernels from its own code, with
    # no call back into the op's Python. Its kernels are registered, so that editing them invalidates
    # torch.compile's on-disk cache.
    if INTERPRETED:
        pytest.skip("interpreted kernels stay inside an opaque op")
    from torch._inductor.utils import run_and_get_code

    assert torch._library.triton.get_triton_kernels_for_op(op.FORWARD_OP) == list(launch.KERNELS.values())
    q, k, v, do = leaf_inputs((2, 4), 256, 256, 64, torch.bfloat16, device)
    inputs = [t.requires_grad_() for t in (q, k, v)]

    torch.compiler.reset()
    compiled = torch.compile(lambda q, k, v: flash_attention_triton(q, k, v, True), fullgraph=True)
    # The backward compiles at its first call: both graphs' code is collected.
    gradients, code = run_and_get_code(lambda: torch.autograd.grad(compiled(*inputs), inputs, do))
    source = "\n".join(code)
    for kernel in ("forward_kernel", "dq_kernel", "dkdv_kernel"):
        assert kernel in source, f"{kernel} is not launched by the compiled code"
    assert "cs336_systems.flash_attention" not in source, "the compiled code calls back into the op"
    expected = torch.autograd.grad(FlashAttentionTriton.apply(*inputs, True), inputs, do)
    for got, want in zip(gradients, expected):
        torch.testing.assert_close(got, want)


def _model_step(run, model, tokens):
    """Logits and `model`'s parameter gradients of one forward and backward through `run` (the model or
    a compiled wrapper of it)."""
    model.zero_grad(set_to_none=True)
    logits = run(tokens)
    logits.float().logsumexp(-1).mean().backward()
    return logits, {name: p.grad.clone() for name, p in model.named_parameters()}


def test_the_whole_model_compiles_to_one_graph_with_the_op(device):
    # fullgraph=True fails on any graph break; the compiled step must give the eager one's results.
    # On CPU the aot_eager backend keeps inductor's C++ compiler out of the test; a GPU uses inductor.
    torch.manual_seed(0)
    dtype_context = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                     else torch.autocast("cpu", enabled=False))
    model = TransformerLM(ModelConfig.for_size("tiny", context_length=48), attention="flash_triton").to(device)
    tokens = torch.randint(1000, (2, 48), device=device)
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    torch.compiler.reset()
    explanation = torch._dynamo.explain(model)(tokens)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with dtype_context:
        eager_logits, eager_grads = _model_step(model, model, tokens)
        compiled_logits, compiled_grads = _model_step(compiled, model, tokens)
    tolerance = 2e-2 if device.type == "cuda" else 1e-5
    torch.testing.assert_close(compiled_logits, eager_logits, rtol=tolerance, atol=tolerance)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=tolerance, atol=tolerance, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_the_op_replays_in_a_cuda_graph(path, device):
    # Every allocation of a launch comes from torch's allocator, so a captured forward and backward
    # replay on fresh inputs copied into the captured ones; the split forward's workspace included.
    if INTERPRETED:
        pytest.skip("the Triton interpreter does not capture CUDA graphs")
    lead, n_queries, n_keys = path_case(path, device, True)
    static = [t.requires_grad_() for t in leaf_inputs(lead, n_queries, n_keys, 64, torch.bfloat16, device)[:3]]
    static_do = torch.randn(*lead, n_queries, 64, dtype=torch.bfloat16, device=device)

    def step():
        out = flash_attention_triton(*static, True)
        return (out, *torch.autograd.grad(out, static, static_do))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (1, 2):
        fresh = leaf_inputs(lead, n_queries, n_keys, 64, torch.bfloat16, device, seed=seed)
        with torch.no_grad():
            for t, value in zip((*static, static_do), fresh):
                t.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_reference(captured, reference_attention(*fresh, True), torch.bfloat16,
                                  names=("o", "dq", "dk", "dv"))


@pytest.mark.gpu
def test_the_model_compiled_with_cuda_graphs_matches_eager(device):
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.for_size("tiny", context_length=64), attention="flash_triton").to(device)
    tokens = torch.randint(1000, (2, 64), device=device)
    torch.compiler.reset()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager_logits, eager_grads = _model_step(model, model, tokens)
        for _ in range(3):  # warm-up, record, replay
            compiled_logits, compiled_grads = _model_step(compiled, model, tokens)
    torch.testing.assert_close(compiled_logits, eager_logits, rtol=2e-2, atol=2e-2)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=2e-2, atol=2e-2, msg=name)


# ---------------------------------------------------------------------------------------- GPU scale

LONG_SEQUENCE = 16_384
LONG_HEAD_DIM = 128
MEMORY_SEQUENCE = 65_536
# Forward + backward keep q, k, v, o, dO, dq, dk, dv (8 tensors like q) and L, D; 16 x the bytes of
# q is generous for that and for allocator rounding, and 1/16 of one n x n bf16 score matrix.
MEMORY_BOUND_IN_Q_SIZES = 16


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_triton_is_accurate_at_16k_tokens_and_head_dim_128(dtype, is_causal, device):
    q, k, v, do = leaf_inputs((1, 2), LONG_SEQUENCE, LONG_SEQUENCE, LONG_HEAD_DIM, dtype, device)
    assert_matches_reference("triton", q, k, v, do, is_causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_wide_tiles_are_accurate_at_the_leaderboard_s_grid(dtype, head_dim, device):
    heads, n = 16, 4096
    q, k, v, do = leaf_inputs((1, heads), n, n, head_dim, dtype, device)
    assert plan_for(q, k, True).paths == {"forward": "wide", "dq": "wide", "dkdv": "wide"}
    assert_matches_reference("triton", q, k, v, do, is_causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_triton_forward_and_backward_at_64k_tokens_never_allocate_n_by_n(dtype, device):
    q, k, v, do = leaf_inputs((1, 2), MEMORY_SEQUENCE, MEMORY_SEQUENCE, LONG_HEAD_DIM, dtype, device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    dq, dk, dv = torch.autograd.grad(FlashAttentionTriton.apply(*(t.requires_grad_() for t in (q, k, v)), True),
                                     (q, k, v), do)
    torch.cuda.synchronize()
    peak_extra_bytes = torch.cuda.max_memory_allocated() - before
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert peak_extra_bytes <= MEMORY_BOUND_IN_Q_SIZES * q.nbytes, (
        f"peak {peak_extra_bytes / 2**20:.0f} MiB above the inputs; one n x n score matrix would be "
        f"{MEMORY_SEQUENCE**2 * q.element_size() / 2**20:.0f} MiB")
