"""Launch shapes of the FlashAttention-2 kernels: how a head dim's columns lie on chip (head_dim_chunks),
which tiles, warps and pipeline stages each kernel takes per head dim and dtype (TILE_TABLE, measured by
scripts/tune_flash.py), the narrower tiles of grids too small to fill the GPU, and how the split forward
cuts a query tile's keys into runs."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


def cdiv(a: int, b: int) -> int:
    """Ceiling division of two ints."""
    return -(-a // b)


# tl.dot needs every dimension to be at least 16; smaller head dims are zero-padded on chip.
MIN_DOT_DIM = 16


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def head_dim_chunks(head_dim: int) -> tuple[int, int]:
    """(BLOCK_D, TAIL_D): the columns of a row on chip, one power-of-two chunk of at least MIN_DOT_DIM,
    and a tail chunk (0: none) where the two together pad less than one chunk would: d 80 is 64 + 16
    rather than 128, d 96 64 + 32, d 40 32 + 16. Every dot over the head dim runs over those columns."""
    whole = max(MIN_DOT_DIM, _power_of_two_at_least(head_dim))
    chunk = whole // 2
    if chunk < MIN_DOT_DIM:
        return whole, 0
    tail = max(MIN_DOT_DIM, _power_of_two_at_least(head_dim - chunk))
    return (chunk, tail) if chunk + tail < whole else (whole, 0)


@dataclass(frozen=True)
class Tiles:
    """One kernel's launch shape: its main tile (rows per program) and the step of its loop."""

    block_m: int  # queries per tile
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class TileSet:
    forward: Tiles  # forward and dQ: a program owns block_m queries and steps over block_n keys
    dkdv: Tiles  # dK/dV: a program owns block_n keys and steps over block_m queries
    dq: Tiles
    # Each kernel's tiles for grids too small to fill the GPU (short sequences, few heads): then a
    # program's latency, one tile after another, is the time, and smaller tiles shorten it. None
    # where the wide tiles are the fastest there too.
    narrow_forward: Tiles | None = None
    narrow_dkdv: Tiles | None = None
    narrow_dq: Tiles | None = None
    # Each wide kernel's tiles where it streams its looped tiles through tensor descriptors (TMA), which
    # inputs whose strides allow take on a GPU that has TMA (launch.py). None where not measured faster.
    tma_forward: Tiles | None = None
    tma_dkdv: Tiles | None = None
    tma_dq: Tiles | None = None


# Measured on an H100 by scripts/tune_flash.py, keyed on (head dim class, bytes per element): the class is
# the least key of that element size at or above the columns on chip (head_dim_chunks).
# docs/flash_tuning.md has each version's figures. Wide tiles: causal, batch 1 x 16 heads, N 16384 in bf16 and 8192 in
# fp32; the 80 class (d 72 to 80: 64 + 16 columns) at the 2026 xl's attention, batch 4 x 32 heads, N 512 and 2048.
# Narrow tiles: the shape fastest over N 1024, 4096 and 16384 at batch 1 x 1 head (the 80 class takes the 128
# class's, not tuned there). TMA tiles: the fastest of those tried with descriptor loads at the 2026 xl's
# attention, N 2048 (docs/flash_tuning.md v18 and v19).
# Invariants the causal loop split relies on: forward/dq block_m % block_n == 0, dkdv block_n %
# block_m == 0. fp32 runs tf32 dots on tiles of half the bf16 ones' bytes, within shared memory.
TILE_TABLE: dict[tuple[int, int], TileSet] = {
    (64, 2): TileSet(forward=Tiles(128, 128, 4, 3), dkdv=Tiles(64, 64, 4, 3), dq=Tiles(128, 64, 4, 3),
                     narrow_forward=Tiles(64, 64, 4, 4), narrow_dq=Tiles(64, 64, 4, 4)),
    (80, 2): TileSet(forward=Tiles(128, 64, 4, 3), dkdv=Tiles(64, 64, 4, 3), dq=Tiles(128, 32, 4, 3),
                     narrow_forward=Tiles(64, 64, 4, 3), narrow_dkdv=Tiles(64, 64, 4, 3),
                     narrow_dq=Tiles(64, 64, 4, 3),
                     tma_forward=Tiles(128, 64, 4, 3), tma_dkdv=Tiles(64, 64, 4, 3), tma_dq=Tiles(128, 64, 4, 3)),
    (128, 2): TileSet(forward=Tiles(128, 64, 8, 4), dkdv=Tiles(64, 128, 8, 4), dq=Tiles(128, 64, 8, 4),
                      narrow_forward=Tiles(64, 64, 4, 3), narrow_dkdv=Tiles(64, 64, 4, 3),
                      narrow_dq=Tiles(64, 64, 4, 3)),
    (64, 4): TileSet(forward=Tiles(128, 32, 4, 3), dkdv=Tiles(32, 128, 8, 3), dq=Tiles(128, 32, 8, 2),
                     narrow_forward=Tiles(64, 64, 4, 4), narrow_dkdv=Tiles(64, 64, 4, 4),
                     narrow_dq=Tiles(64, 64, 4, 4)),
    (128, 4): TileSet(forward=Tiles(128, 32, 8, 3), dkdv=Tiles(32, 128, 8, 2), dq=Tiles(128, 32, 8, 2),
                      narrow_forward=Tiles(32, 32, 4, 3), narrow_dkdv=Tiles(32, 32, 4, 4),
                      narrow_dq=Tiles(32, 32, 4, 4)),
}
# The interpreter runs programs one after another in Python: tiles small enough that tests with
# a few dozen tokens cover several tiles, unequal so the diagonal logic is exercised. It runs descriptor
# loads too, on the same tiles, so that CPU tests cover both kinds of load.
INTERPRETER_TILES = TileSet(forward=Tiles(32, 16, 1, 1), dkdv=Tiles(16, 32, 1, 1), dq=Tiles(32, 16, 1, 1),
                            tma_forward=Tiles(32, 16, 1, 1), tma_dkdv=Tiles(16, 32, 1, 1),
                            tma_dq=Tiles(32, 16, 1, 1))


def tiles_for(head_dim: int, dtype: torch.dtype, interpreted: bool = False) -> TileSet:
    """The tile set for a head dim and dtype on a GPU (per head-dim class and element size), or the
    interpreter's."""
    if interpreted:
        return INTERPRETER_TILES
    element_bytes = torch.finfo(dtype).bits // 8
    columns = sum(head_dim_chunks(head_dim))
    head_dim_class = min(c for c, size in TILE_TABLE if size == element_bytes and c >= columns)
    return TILE_TABLE[(head_dim_class, element_bytes)]


# Below this many programs per SM a kernel's wide tiles leave the GPU short of work. Measured on an
# H100 at batch x heads 1: at N 16384 (128 wide programs of 128 rows, on 132 SMs) every kernel's
# narrow tiles were 1.1-1.6x faster; at N 32768 (256 programs) narrow tiles were up to 2x slower.
NARROW_GRID_PROGRAMS_PER_SM = 1


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def tma_tiles(tile_set: TileSet, kernel: str, tiles: Tiles) -> Tiles | None:
    """A kernel's tiles with descriptor loads, where it takes its wide `tiles` and its tile set has them."""
    return getattr(tile_set, f"tma_{kernel}") if tiles is getattr(tile_set, kernel) else None


def kernel_tiles(tile_set: TileSet, kernel: str, batch_heads: int, n_rows: int, device: torch.device) -> Tiles:
    """One kernel's tiles for this grid ("forward", "dkdv" or "dq"; n_rows are the queries, or the
    keys for dK/dV): its narrow tiles when its wide ones would not fill the GPU."""
    wide = getattr(tile_set, kernel)
    narrow = getattr(tile_set, f"narrow_{kernel}")
    if narrow is None or device.type != "cuda":
        return wide
    owned_rows = wide.block_n if kernel == "dkdv" else wide.block_m
    if batch_heads * cdiv(n_rows, owned_rows) < NARROW_GRID_PROGRAMS_PER_SM * sm_count(device.index or 0):
        return narrow
    return wide


# The kernels take the batch x heads in groups (kernels._program_tile), a group's programs about this
# many per SM: a group then spans about two waves of the wide tiles' programs (two resident per SM), few
# enough heads that their programs share the K and V (or Q and dO) they stream in L2. Measured on an H100
# at batch 4 x 32 heads, d 80, each kernel alone in a CUDA graph (docs/flash_tuning.md, v22): at N 2048,
# groups of 16 to 33 heads took the forward from 0.276 to 0.253 ms, dQ from 0.332 to 0.311 and dK/dV from
# 0.472 to 0.462 against every head in one group (the forward's and dQ's order before) and one head at a
# time (dK/dV's); at N 512 all 128 heads in one group stayed the fastest for the forward and dQ. The
# heads are then shared evenly among the groups: at the leaderboard's 1 x 16 heads, N 16384, d 64, groups
# of 5, 5, 5 and a leftover 1 left that head's longest programs to start last and set the tail (forward
# 1.520 ms, dQ 1.603, dK/dV 2.510); groups of 6, 6 and 4 took 1.380, 1.446 and 2.433 (v23).
HEAD_GROUP_PROGRAMS_PER_SM = 4
# The interpreter's group: a few programs, so that CPU tests run several groups and a partial last one.
INTERPRETER_HEAD_GROUP_PROGRAMS = 4


def head_group(batch_heads, n_tiles, device: torch.device):
    """How many of the batch x heads a kernel takes together (kernels._program_tile), given each head's
    tiles: as many groups as hold HEAD_GROUP_PROGRAMS_PER_SM programs per SM each (at least one), the
    heads shared among them as evenly as whole groups allow, so that no short group is left over.
    Sizes may be symbolic under torch.compile."""
    if device.type == "cuda":
        programs = HEAD_GROUP_PROGRAMS_PER_SM * sm_count(device.index or 0)
    else:
        programs = INTERPRETER_HEAD_GROUP_PROGRAMS
    fewest_heads = torch.sym_min(batch_heads, torch.sym_max(1, cdiv(programs, n_tiles)))
    return cdiv(batch_heads, torch.sym_max(1, batch_heads // fewest_heads))


# On grids that take the narrow tiles the forward also splits keys (split_forward_kernel): the longest
# query tile's keys in this many runs. Measured on an H100 at batch x heads 1, causal, runs of 128 to
# 4096 keys: a quarter of N was the fastest or within noise of it at N 1024 to 8192 (bf16 N 8192:
# 72 -> 42 us at d 64, 99 -> 68 us at d 128); docs/flash_tuning.md has the table.
SPLIT_RUNS = 4


def longest_tile_keys(block_m: int, n_queries: int, n_keys: int, is_causal: bool) -> int:
    """How many keys the query tile that sees the most of them sees: under a causal mask, the last tile's."""
    return min(cdiv(n_queries, block_m) * block_m, n_keys) if is_causal else n_keys


def forward_split_keys(tiles: Tiles, n_queries: int, n_keys: int, is_causal: bool) -> int | None:
    """Keys per run for the split forward on narrow tiles, or None where the longest query tile's
    keys make a single run."""
    longest = longest_tile_keys(tiles.block_m, n_queries, n_keys, is_causal)
    split_keys = cdiv(longest, SPLIT_RUNS * tiles.block_m) * tiles.block_m
    return split_keys if split_keys < longest else None
