"""Gluon kernel (SM90): `sparse_attention` over bf16 caches, warp-specialised (DeepSeek-V4's decode attention).

Chosen by sparse_attention_path.py (on SM90 GPUs whose Triton has Gluon for Hopper): by the default, auto, for the
bf16-cache calls of at least AUTO_MIN_QUERIES queries it serves, by sparse_attention_path=gluon for every one. It passed
`deepinfer conformance --backend cuda --op sparse_attention --backend-option sparse_attention_path=gluon` on an H100
(2026-12-07, Triton 3.6: 27 cases, docs/measurements/2026-12-07/h100_round14/a/) and its GPU tests on an H200
(tests/cuda/test_sparse_attention_gluon.py, 50 cases against the reference op). Compiled by `deepinfer bench compile --case "bf16 gluon"` (sm90,
Triton 3.6 and 3.9: wgmma, no spills).

Semantics: the op's (deepinfer/ops/sparse_attention.py) for bf16 q [T, H, 512] over bf16 caches kv [N, 512] (and
extra_kv): each query attends to the rows its window list (`indices` over kv) and its second list (`extra_indices` over
extra_kv, the first extra_lengths[t] ids when given) name, -1 for none, in one online softmax (log2 domain, float32),
the sink in the final normaliser; one split writes the output itself (with out_positions, the tail rotated in the
epilogue), several write the tl kernel's split partials, merged by sparse_attention.py's `combine_splits`.

Why: the tl kernel reads a bf16 cache at a third to a half of copy bandwidth in V4 decode (docs/performance.md): the
same warps gather the rows, run both products and the softmax, and the gathers wait behind the products. Here, as in
the FP8 kernel (sparse_attention_fp8_gluon.py), the rows are gathered by a warpgroup of their own while two others run
the tensor cores; with a bf16 cache there is nothing to convert, so the gathering warpgroup only issues copies.

Schedule: sparse_attention_gluon_common.py's (the FP8 kernel's), the converting warpgroup replaced by a loader:
- loader (a worker, 4 warps): per tile, its BLOCK_N row ids (loaded two tiles ahead), then the rows copied straight
  into one of STAGES NVMMA-swizzled stages by cp.async (16-byte copies; a warp copies 4 rows x 128 bytes a chunk, one
  swizzle row each; rows not read (id -1, past their list or the split's end) are zero-filled, no memory read), the
  stage's row marks beside it (1.0, -1 for a row not read: the softmax warpgroup masks by them). SM90 has no TMA
  gather, and a row of 1 KiB is 64 cp.async of 16 bytes: 4 warps issue a 64-row tile with 32 a thread. The stage is
  ready when every loader thread's copies have landed (cp.async.mbarrier.arrive.noinc: 128 arrivals) and the marks
  are stored (one more); the loader never waits for its own copies, only for a free stage, so every free stage is in
  flight.
- softmax and value warpgroups: as in the FP8 kernel, with the row marks for scales (1.0: the products' values are
  the tl kernel's) and the proxy fence after each stage wait (the stage was written through the generic proxy,
  wgmma reads it through the async proxy). By default (EARLY_RELEASE) the softmax warpgroup releases a stage once
  its value product is done, before it waits for the next tile: with two stages the loader then has the next tile
  and the one after in flight, where the FP8 kernel's order (the next scores issued behind the value product, the
  stage released after the next tile has landed) would leave it the next tile alone.
Tiles: a stage of 64 rows is 64 KiB, and q takes 64 KiB: two stages of 64 rows or four of 32 rows fit the 227 KiB an
SM90 block may have (214624 / 206464 bytes with p, the marks and the barriers). TILES lists both and TILE_ROWS picks
the default (`plan`; a launch's tile_rows the other): four stages keep as much in flight in smaller steps, two halve
the handshakes per row. On an H200 and an H100 (2026-12-07, `bench ops`: the `_bf16_gluon`, `_r32` and `_late` rows)
64-row tiles with the early release were as fast as any (the late release within 1%), so they are the defaults.
Registers (setmaxnreg, `PARTITION_REGS`): the FP8 kernel's split (value 160, loader 104, softmax 240); the loader holds
a few row pointers and ids.

Variants (each behind a switch that is off, and a launch argument
that the sweep, `python -m deepinfer_cuda.bench.sparse_attention_sweep --sweep sparse_gluon_bf16`, and the GPU tests
pass): FUSED_COMBINE (fused_combine), several splits' partials merged inside the kernel by each query's last split
(common.merge_splits_if_last: an atomic counter per query, head tile and half; no combine launch, the partials read
back from L2); PERSISTENT (persistent), sparse_attention_gluon_persistent.py's kernel, a program an SM looping over the
(query, split) items. Where B64's time goes, by the plan alone: 64 queries x 1 head tile split 2 ways (pick_splits
fills 128 of 132 SMs, 5 tiles of 64 rows a program), each program writing a [64, 512] float32 partial (128 KiB beside
its 320 KiB of rows) that the combine launch reads back: the fused combine keeps that traffic in L2 and drops the
launch; one split (num_splits=1) drops the partials but leaves half the SMs idle. On an H100 the one split won (31.1
against 37.4 us; fused combine 37.2, persistent 38.0): hence `plan`'s ONE_SPLIT_FROM. Two programs an SM do not fit: the
three warpgroups' setmaxnreg budgets (softmax 240, value 160, loader 104) take the whole register file, besides q's
64 KiB of shared memory.

Served (`not_served`, and `launch_sparse_attention_gluon` returns None so callers fall back): bf16 q [T, H, 512] with H
<= 64 or a multiple of 64, bf16 kv (and bf16 extra_kv when given) [rows, 512] with contiguous rows, 16-byte aligned
base and row stride, int32 lists, an output rotation of at most 256 channels, at most 65535 queries. Splits as the tl
kernel splits below ONE_SPLIT_FROM of the SMs' worth of programs, one split from there (host shapes only, CUDA-graph
safe); a forced num_splits is honoured.
Not a registration module: sparse_attention_path.py registers the op.
"""

from __future__ import annotations

import torch

from deepinfer.ops import sparse_attention as sparse_ops
from deepinfer_cuda.kernels import sparse_attention_gluon_common as common
from deepinfer_cuda.kernels.common import num_sms
from deepinfer_cuda.kernels.gluon_hopper import GLUON_IMPORT_ERROR
from deepinfer_cuda.kernels.sparse_attention_gluon_common import DIM, SparseGluonPlan

if GLUON_IMPORT_ERROR is None:  # (else the launch declines every call)
    from deepinfer_cuda.kernels.gluon_hopper import async_copy, cp_async_load, gl, gluon, mbarrier
    from deepinfer_cuda.kernels.gluon_hopper import sync_warps as _sync_warps
    from deepinfer_cuda.kernels.sparse_attention_gluon_common import allocate_shared, query_tiles, row_pointers, softmax_partition, value_partition

TILES = {64: 2, 32: 4}  # rows a tile -> the stages that fit beside q (a bf16 row is 1 KiB)
TILE_ROWS = 64  # the default tile: the FP8 kernel's
# The softmax warpgroup releases a stage once its value product is done, before it waits for the next tile (the FP8
# kernel overlaps that product with the next scores instead, and releases the stage after): the loader, which only
# issues copies, then has every stage but the one being multiplied in flight (with two stages: the next tile and the
# one after, not the next alone)
EARLY_RELEASE = True
# Split partials merged inside the kernel by the last split of each query (common.merge_splits_if_last: an atomic
# counter per query, head tile and half; no combine launch, the partials read back through L2). Not yet run on a GPU:
# off until `python -m deepinfer_cuda.bench.sparse_gluon_sweep` and the GPU tests have run it.
FUSED_COMBINE = False
# The persistent variant (sparse_attention_gluon_persistent.py: min(items, SMs) programs, each looping over its items, its
# loader running on into the next item's rows). Not yet run on a GPU: off until the sweep and the GPU tests have run it.
PERSISTENT = False
# The loader asks L2 for the rows of the tile two ahead of the one it copies (cp.async.bulk.prefetch.L2): beside the
# stages' copies, more of the gather in flight. Off: on an H100 (2026-12-07, `--sweep sparse_gluon_l2`, its GPU tests
# passed) it was slower, B64 / B256 34.3 / 104.3 against 31.6 / 88.8 us (each row asked for by the 8 lanes holding it).
L2_PREFETCH = False
LOADER_WARPS = 4
PARTITION_REGS = (160, 104)  # setmaxnreg of the value warpgroup and of the loader (the softmax warpgroup: 504 less both)


if GLUON_IMPORT_ERROR is None:

    @gluon.jit
    def _loader(kv_ptr, xkv_ptr, idx_row, xidx_row, bf_smem, scale_smem, bf_ready, bf_empty, lo, num_tiles, nb1, width, width2, stride_kv, stride_xkv,
                D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_EXTRA: gl.constexpr, L2_PREFETCH: gl.constexpr):
        """One warpgroup: the program's tiles through `load_tiles`; no copy outstanding when its warps exit."""
        load_tiles(kv_ptr, xkv_ptr, idx_row, xidx_row, bf_smem, scale_smem, bf_ready, bf_empty, 0, lo, num_tiles, nb1, width, width2, stride_kv, stride_xkv,
                   D, BLOCK_N, STAGES, HAS_EXTRA, L2_PREFETCH)
        async_copy.commit_group()
        async_copy.wait_group(0)

    @gluon.jit
    def load_tiles(kv_ptr, xkv_ptr, idx_row, xidx_row, bf_smem, scale_smem, bf_ready, bf_empty, g0, lo, num_tiles, nb1, width, width2, stride_kv,
                   stride_xkv, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_EXTRA: gl.constexpr,
                   L2_PREFETCH: gl.constexpr = False):
        """The loader's num_tiles tiles (row blocks lo ..), the program's tiles g0 .. in its sequence: tile g's rows copied
        by cp.async into stage g % STAGES once both attention warpgroups are done with tile g - STAGES; the row ids of the
        tile two ahead loaded while a tile is issued (with L2_PREFETCH its rows asked of L2 then: `prefetch_rows`). A
        stage is ready after every thread's copies have landed (one cp.async arrival a thread) and its row marks are
        stored (one arrival)."""
        NUM_CHUNKS: gl.constexpr = D // 64
        # [BLOCK_N, 64] bf16 (a chunk): a thread copies 16 bytes (8 values) of a row, a warp 4 rows x 128 bytes: each row
        # of the warp's is one 128-byte swizzle row of the chunk (no bank conflicts), whole 128-byte lines of the cache
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        cols = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, layout)), 0)
        end = lo + num_tiles
        # (element pointers: row offsets id * stride, multiples of 8 values: 16 bytes)
        ptrs, ok = row_pointers(kv_ptr, xkv_ptr, idx_row, xidx_row, lo, end, nb1, width, width2, stride_kv, stride_xkv, rows, BLOCK_N, HAS_EXTRA, 0, 8)
        ptrs1, ok1 = row_pointers(kv_ptr, xkv_ptr, idx_row, xidx_row, lo + 1, end, nb1, width, width2, stride_kv, stride_xkv, rows,
                                  BLOCK_N, HAS_EXTRA, 0, 8)
        for j in range(num_tiles):
            g = g0 + j
            t = g % STAGES
            ptrs2, ok2 = row_pointers(kv_ptr, xkv_ptr, idx_row, xidx_row, lo + j + 2, end, nb1, width, width2, stride_kv, stride_xkv, rows,
                                      BLOCK_N, HAS_EXTRA, 0, 8)
            if L2_PREFETCH:
                common.prefetch_rows(ptrs2, ok2, D * 2)
            src = gl.expand_dims(ptrs, 1) + cols
            m = gl.expand_dims(ok, 1)  # (broadcast along the row by the copy: one predicate a 16-byte copy)
            mbarrier.wait(bf_empty.index(t), ((g // STAGES) & 1) ^ 1)  # both attention warpgroups are done with tile g - STAGES
            for c in gl.static_range(NUM_CHUNKS):
                cp_async_load(bf_smem.index(t * NUM_CHUNKS + c), src + c * 64, mask=m)
            async_copy.mbarrier_arrive(bf_ready.index(t), increment_count=False)  # once this thread's copies have landed
            scale_smem.index(t).store(gl.where(ok, 1.0, -1.0))  # the row marks: 1.0 read, -1 not (a zero-filled row)
            _sync_warps()  # every warp's marks are stored
            mbarrier.arrive(bf_ready.index(t))
            ptrs, ok, ptrs1, ok1 = ptrs1, ok1, ptrs2, ok2

    @gluon.jit
    def _sparse_attention_ws_kernel(
        q_ptr,
        kv_ptr, idx_ptr,  # the window cache [N, D] bf16
        xkv_ptr, xidx_ptr, xlen_ptr,  # the extra list's (placeholders without HAS_EXTRA / HAS_LENGTHS)
        sinks_ptr,
        dst_ptr,  # DIRECT: the output [T, H, D]; else the split partials [T, splits, H, D] float32
        part_lse_ptr, opos_ptr, ocs_ptr,
        qk_scale,  # softmax_scale * log2(e)
        K, K2,  # the lists' widths
        stride_q_t, stride_q_h,
        stride_kv, stride_idx_t,  # the cache's row stride in elements
        stride_xkv, stride_xidx_t,
        stride_o_t, stride_o_h, stride_po_split,  # dst's (stride_po_split: 0 when DIRECT)
        stride_pl_t, stride_pl_split,
        stride_ocs,
        H: gl.constexpr, D: gl.constexpr, R: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        HAS_EXTRA: gl.constexpr, HAS_LENGTHS: gl.constexpr,
        ROPE: gl.constexpr,  # DIRECT with out_positions: the output's last R channels rotated back
        DIRECT: gl.constexpr,
        REGS_VALUE: gl.constexpr, REGS_LOADER: gl.constexpr, LOADER_WARPS: gl.constexpr,
        EARLY_RELEASE: gl.constexpr,  # the softmax warpgroup releases a stage before it waits for the next (common.softmax_partition)
        L2_PREFETCH: gl.constexpr,  # the loader asks L2 for the rows of the tile two ahead (common.prefetch_rows)
        num_warps: gl.constexpr,
        cnt_ptr, out_ptr, stride_out_t, stride_out_h,  # FUSED_COMBINE's counters and output (placeholders without)
        FUSED_COMBINE: gl.constexpr,  # split partials merged by the last split of each query (common.merge_splits_if_last)
    ):
        gl.static_assert(D % 64 == 0, "the stages are 64-column chunks")
        gl.static_assert(BLOCK_N % 16 == 0, "the value products' K")
        t = gl.program_id(1)
        nb1, width2, lo, num_tiles = query_tiles(xlen_ptr, K, K2, BLOCK_N, HAS_LENGTHS)
        t64 = t.to(gl.int64)

        # the scales: the row marks (1.0; -1: not read); a stage is ready after every loader thread's copies and the marks
        q_smem, bf_smem, bf_halves, p_smem, scale_smem, alpha_smem, fin_smem, bf_ready, bf_empty, p_ready, p_free, fin_bar = allocate_shared(
            D, BLOCK_M, BLOCK_N, STAGES, LOADER_WARPS * 32 + 1)

        gl.warp_specialize(
            [
                (softmax_partition, (q_ptr, q_smem, bf_smem, bf_halves, scale_smem, p_smem, alpha_smem, fin_smem, bf_ready, bf_empty, p_ready, p_free,
                                     fin_bar, sinks_ptr, dst_ptr, part_lse_ptr, num_tiles, qk_scale,
                                     stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_po_split, stride_pl_t, stride_pl_split,
                                     H, D, BLOCK_M, BLOCK_N, STAGES, DIRECT, True, EARLY_RELEASE,
                                     cnt_ptr, out_ptr, stride_out_t, stride_out_h, FUSED_COMBINE)),
                (value_partition, (bf_halves, p_smem, alpha_smem, fin_smem, bf_ready, bf_empty, p_ready, p_free, fin_bar,
                                   dst_ptr, opos_ptr, ocs_ptr, num_tiles, stride_o_t, stride_o_h, stride_po_split, stride_ocs,
                                   H, D, R, BLOCK_M, STAGES, ROPE, True,
                                   sinks_ptr, part_lse_ptr, cnt_ptr, out_ptr, stride_pl_t, stride_pl_split, stride_out_t, stride_out_h, FUSED_COMBINE)),
                (_loader, (kv_ptr, xkv_ptr, idx_ptr + t64 * stride_idx_t, xidx_ptr + t64 * stride_xidx_t, bf_smem, scale_smem,
                           bf_ready, bf_empty, lo, num_tiles, nb1, K, width2, stride_kv, stride_xkv, D, BLOCK_N, STAGES, HAS_EXTRA, L2_PREFETCH)),
            ],
            [4, LOADER_WARPS],
            [REGS_VALUE, REGS_LOADER],
        )


# ---------------------------------------------------------------------------------------------
# Host side: which calls the kernel serves, its plan and launch


def _cache_not_served(name: str, cache: torch.Tensor) -> str | None:
    if cache.dtype != torch.bfloat16:
        return f"{name} is {cache.dtype}, not a bfloat16 cache"
    if cache.dim() != 2 or cache.shape[1] != DIM:
        return f"{name} {tuple(cache.shape)}: wants [rows, {DIM}]"
    if cache.stride(1) != 1 or cache.stride(0) % 8 or cache.data_ptr() % 16:
        return f"{name}'s rows are not contiguous 16-byte aligned rows"
    return None


def not_served(q, kv, indices, extra_kv=None, extra_indices=None, out_cos_sin_cache=None) -> str | None:
    """Why this kernel does not serve a call (None: it does). Devices, shapes, dtypes, strides and alignment only."""
    if (why := common.call_not_served(q, indices, extra_indices, out_cos_sin_cache)) is not None:
        return why
    for name, cache in (("kv", kv), ("extra_kv", extra_kv)):
        if cache is not None and (why := _cache_not_served(name, cache)) is not None:
            return why
    return None


# One split from this fraction of the SMs' worth of (query, head tile) programs: at decode B64 (64 programs on an H100's
# 132 SMs, ctx 32k, window 128 + top 512) one split took 31.1 us (54.0% of copy) against the tl rule's two splits' 37.4
# (44.9%): the partials' writes and the combine launch cost more than the idle SMs (`--sweep sparse_gluon_bf16`,
# docs/measurements/2026-12-07/h100_round14/d/); B256 took one split under either rule.
ONE_SPLIT_FROM = 0.48


def plan(tokens: int, heads: int, width: int, extra_width: int, device: torch.device, num_splits: int | None = None,
         tile_rows: int | None = None) -> SparseGluonPlan:
    """Head tiles and splits from host-known shapes (width, extra_width: the lists' K, K2): one split once the programs of
    one split fill ONE_SPLIT_FROM of this GPU's SMs, else common.split_plan's rule over them; tiles of
    tile_rows rows (TILE_ROWS unless given: a key of TILES) through the stages that fit."""
    rows = TILE_ROWS if tile_rows is None else tile_rows
    if rows not in TILES:
        raise ValueError(f"tile_rows={rows}: wants one of {sorted(TILES)}")
    return common.split_plan(tokens, heads, width, extra_width, num_sms(device), num_splits, rows, TILES[rows], one_split_from=ONE_SPLIT_FROM)


def _cache_rows(cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A bf16 cache as the kernel reads it: itself, the row stride in elements."""
    return cache, cache.stride(0)


def launch_sparse_attention_gluon(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sinks: torch.Tensor,
    softmax_scale: float,
    extra_kv: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_lengths: torch.Tensor | None = None,
    out_positions: torch.Tensor | None = None,
    out_cos_sin_cache: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    tile_rows: int | None = None,
    early_release: bool | None = None,
    fused_combine: bool | None = None,
    persistent: bool | None = None,
    l2_prefetch: bool | None = None,
) -> torch.Tensor | None:
    """sparse_attention.launch_sparse_attention's arguments; None for a call this kernel does not serve (`not_served`:
    the caller falls back). tile_rows: the plan's tile (TILES), early_release: the softmax warpgroup's stage release
    (EARLY_RELEASE unless given), fused_combine: who merges several splits' partials (FUSED_COMBINE unless given: the
    kernel's last split of each query, else sparse_attention.py's combine kernel), persistent: the persistent variant
    (PERSISTENT unless given), l2_prefetch: the loader's L2 prefetch (L2_PREFETCH unless given; not the persistent
    variant's); the benchmarks and tests compare them."""
    sparse_ops.check_sparse_attention_shapes(q, kv, indices, sinks, extra_kv, extra_indices, extra_lengths, out_positions, out_cos_sin_cache)
    if not_served(q, kv, indices, extra_kv, extra_indices, out_cos_sin_cache) is not None:
        return None
    kernel, programs = _sparse_attention_ws_kernel, None
    if PERSISTENT if persistent is None else persistent:
        from deepinfer_cuda.kernels.sparse_attention_gluon_persistent import sparse_attention_persistent_kernel

        kernel, programs = sparse_attention_persistent_kernel, num_sms(q.device)  # (one program an SM: its shared memory)
    return common.launch(
        kernel, _cache_rows,
        lambda tokens, heads, width, width2, device: plan(tokens, heads, width, width2, device, num_splits, tile_rows),
        q, kv, indices, sinks, softmax_scale, extra_kv, extra_indices, extra_lengths, out_positions, out_cos_sin_cache,
        REGS_VALUE=PARTITION_REGS[0], REGS_LOADER=PARTITION_REGS[1], LOADER_WARPS=LOADER_WARPS,
        EARLY_RELEASE=EARLY_RELEASE if early_release is None else bool(early_release),
        **({} if programs is not None else {"L2_PREFETCH": L2_PREFETCH if l2_prefetch is None else bool(l2_prefetch)}),
        fused_combine=FUSED_COMBINE if fused_combine is None else bool(fused_combine), persistent_programs=programs,
    )  # fmt: skip
