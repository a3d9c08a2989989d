"""Gluon kernel: fp8_block (DeepSeek-V3/V4 FP8) `linear` and `grouped_gemm` on SM90, warp-specialised, DeepGEMM's design.

Runs only under backend option fp8_path=gluon (`fp8_path=auto`: cuBLAS's block-scaled GEMM at prefill sizes of linear
and of few-group masked calls, the tl kernel for the rest). It passed `deepinfer conformance --backend cuda
--backend-option fp8_path=gluon --op linear --op grouped_gemm` on an H200 (29 cases, 2026-12-07) with its 128 x 128
prefill tile, then 768 against the tl kernel's 788 TFLOP/s at 8 experts x 4096 tokens, 7168 -> 4096. The schedule
options below were swept on an H100 (2026-12-07, `python -m deepinfer_cuda.bench.gemm --sweep fp8_gluon_large`, GEMM
alone): the 128 x 256 tile with TMA_STORE, the prefill entry since, 962-1091 TFLOP/s (1029 at that shape) against the
tl kernel's 716-869, outputs equal to the tl kernel's bit for bit at all seven shapes; the GPU tests
(tests/cuda/test_gemm_fp8_gluon.py) passed there with the other options (128 x 256 with the TMA store was added to them
after that run). The tl kernel (gemm.py) is what the interpreter checks in CI, and the calls this
kernel does not serve (below) go to it.

Why: the tl kernel's fp8 path waits for each 128-K group's MMA and promotes it in the same warps that issue the next
loads and MMAs (`tl` cannot put them in different warps), so the tensor cores idle while a group is promoted: 570-770
TFLOP/s on an H100 at prefill sizes (DeepGEMM reports about 1500 on an H800 with the schedule below). At 128-256 rows
its 128 x 128 tiles leave most SMs idle (the split-K pointer kernel then reads the weights at 0.35-0.76 TB/s).

Semantics (gemm.py's fp8_block path): x is quantised per token and 128 columns to e4m3 by gemm.py's quantiser (its
scales laid out with each group's rows contiguous: `quantize_act_fp8(scale_rows_contiguous=True)`); per 128-K group
the e4m3 product (wgmma, fp8 operands, float32 accumulation, no promotion inside the group) is multiplied by the rows'
activation scales times the weight block's scale and added to a float32 accumulator; the result is cast to the
output's dtype. The same arithmetic as the tl kernel's SCALAR_WS path (one weight scale per N block and K group).

Schedule: persistent (one program per SM, work units assigned round-robin), warp-specialised:
- producer partition (the default partition: a warpgroup, one thread issuing): for each unit, per 128-K group, the
  activation tile [BLOCK_M, 128] and the weight tile [BLOCK_N, 128] (e4m3, 128-byte swizzle) by TMA into a
  NUM_STAGES ring, each stage with a `ready` mbarrier (expect-tx bytes) and an `empty` one (one arrival per
  consumer). It runs ahead across unit boundaries, so the next unit's loads overlap the consumers' epilogue.
- consumer partitions (one or two warpgroups of 4 warps): warpgroup h owns rows 64h .. 64h + 63 of the tile (wgmma's
  M per warpgroup). Per group: wgmma of its 64 activation rows (shared memory) by the weight tile (shared memory,
  K-major through a permuted view) into a fresh float32 product (use_acc=False: the imprecise fp8 accumulation spans
  one group only, as DeepGEMM's), wait, release the stage, then acc += product * (x_scale[row] * w_scale) on the
  CUDA cores while the other warpgroup's wgmma runs. The scales are read from global memory a group ahead (a group's
  row scales are contiguous: a sector per 8 rows; the weight scale is one word). Epilogue: the accumulator (cast to
  the output's dtype, or float32 partials with split-K) stored with row and column masks straight from the wgmma
  layout (pairs of columns per store).
- registers (setmaxnreg): each consumer warpgroup 232 a thread (acc and product: 128 for a 128-wide tile), the
  producer what is left (40 with two consumers; 24 where the consumers take 240). The producer is the default
  partition so that values of the kernel's prologue stay live there: with the first consumer as the default
  partition it spilled ~0.8 KB more. Per-wave `if`s skipping rows past the expert spilled (every row is computed, the
  store masks them).
- Split-K (decode sizes: too few tiles to fill the SMs): a unit is (tile, K split); the partials go to a float32
  workspace [splits, *out] and gemm.py's `_split_k_reduce_kernel` sums them in split order (deterministic).

Schedule options (kernel constexprs, tuning keys; each keeps every output element's arithmetic, so the result equals
the default schedule's bit for bit: the same wgmma products, the same scale products, the same fma.rn.f32 promotions
in K order):
- OVERLAP ("overlap"): each group's wgmma issued before the previous group's promotion, into the other of two product
  register sets (wgmma wait with one group outstanding), so a warpgroup's promotion overlaps its own next wgmma, not
  only the other warpgroup's (`_mainloop_overlap`). Acc and two products are 192 registers: a 64 x 128 sub-tile only,
  with the consumers at 240 (at 232 Triton 3.6 spilled 12-28 bytes in the loop). Two things make ptxas keep the
  wgmmas asynchronous (without them it serialises every wgmma of the kernel, its warning C7514, "non wgmma
  instructions reading accumulator registers of a wgmma between start and end of the pipeline stage"): the loop
  takes groups in pairs so each product set stays in its registers across the loop edge (`p = q` copies an in-flight
  product), and the promotion is inline asm with side effects (`_promote_ordered`) so LLVM cannot sink it past the
  next wgmma into the same registers (that too needs a copy). The compile check reads ptxas's warning.
- wider tiles, one product register set (two accumulators and one product, 192 registers; `_mainloop_pair`): BLOCK_N
  256 as two column halves of 128, each with its own weight-scale block (SUB_N = 2), or BLOCK_M 256 as two 64-row
  waves per consumer warpgroup (WAVES = 2; DeepGEMM's 256-row tile): per group the two sub-tiles' wgmmas and
  promotions in turn. Either reads a third less of its operands from L2 per flop than 128 x 128. Their promotions are
  `_promote_ordered` too: a pure FMA sunk past the second wgmma kept two products live and spilled (76-104 bytes).
- TMA_STORE ("tma_store"): the epilogue of a sub-tile whose 64 rows lie in its expert goes through a shared-memory
  buffer per consumer sub-tile and one TMA store (16-bit outputs with 16-byte rows, no K splits; the buffers come out
  of the ring: 5 stages instead of 6 at 128 x 128); other sub-tiles keep the masked register stores.
Work units (`_unit_of`): the tiles of gemm.py's `_tile_of_program` (linear and contiguous: GROUP_M row tiles at a time,
the contiguous layout's expert found by a prefix sum over expert_offsets; masked: row tiles fastest, then N blocks,
then experts), times the K splits. A unit with no rows (past masked_m[e], past the last expert) is skipped by every
partition alike. Rows a tile reads beyond its expert (the next expert's, or TMA's zero fill past the tensor) only
feed outputs the store masks; a K tail past K reads zeros on both operands.

Served: bf16/fp16 x (float32 x keeps the tl kernel's bf16 MMA, which float32's tolerance needs), K a positive
multiple of 16 (TMA's 16-byte row stride), a contiguous weight with a 16-byte aligned base, not a masked x laid out
expert-minor (the tl kernel's output then follows that layout). The tile's N block must lie in one 128-row weight
scale block (BLOCK_N divides 128), or be 256 in two halves. Everything else runs the tl kernel.

Triton 3.6 (the GPU machine) and 3.9 name the TMA copies differently: `_tma_load` and `_tma_store` are gluon_hopper.py's shims.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from deepinfer.ops import gemm as gemm_ops
from deepinfer.triton_common import cdiv, next_power_of_2
from deepinfer_cuda.kernels import gemm
from deepinfer_cuda.kernels.common import Registration, num_sms, pdl_launch
from deepinfer_cuda.kernels.gemm_mxfp4_gluon import grouped_tile, is_sm90
from deepinfer_cuda.kernels.gluon_hopper import GLUON_IMPORT_ERROR, gluon_unusable
from deepinfer_cuda.options import FP8_PATH
from deepinfer_cuda.tuning import config

if GLUON_IMPORT_ERROR is None:  # (else the registration says why it cannot run)
    from deepinfer_cuda.kernels.gluon_hopper import (
        TensorDescriptor,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        sync_warps,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from deepinfer_cuda.kernels.gluon_hopper import tma_load as _tma_load
    from deepinfer_cuda.kernels.gluon_hopper import tma_store as _tma_store

BLOCK_K = gemm.FP8_GROUP  # 128: one activation scale group and one weight scale block per step
_LINEAR, _CONTIGUOUS, _MASKED = 0, 1, 2


if GLUON_IMPORT_ERROR is None:

    @gluon.jit
    def _unit_of(u, offs_ptr, mm_ptr, N, E, num_m_tiles, MAX_M, split, kb_per_split, total_kb,
                 LAYOUT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, E_POW2: gl.constexpr,
                 WARPS: gl.constexpr):
        """Work unit u: (expert, first row, row bound, N block, K split, first and end 128-K group). gemm.py's
        `_tile_of_program` for tile u // split; a unit with no work gets row_start >= row_end. WARPS: the calling
        partition's warps (the contiguous layout's prefix sum is laid out over them)."""
        tile = u // split
        s = u - tile * split
        kb0 = s * kb_per_split
        kb1 = gl.minimum(kb0 + kb_per_split, total_kb)
        if LAYOUT == 2:
            pid_m = tile % num_m_tiles
            rest = tile // num_m_tiles
            num_n = gl.cdiv(N, BLOCK_N)
            pid_n = rest % num_n
            e = rest // num_n
            row_end = gl.minimum(gl.load(mm_ptr + e).to(gl.int32), MAX_M)
            row_start = pid_m * BLOCK_M
        else:  # linear: MAX_M carries the row count
            e, row_start, row_end, pid_n = grouped_tile(tile, offs_ptr, MAX_M, N, E, num_m_tiles, LAYOUT, BLOCK_M, BLOCK_N, GROUP_M, E_POW2, WARPS)
        return e, row_start, row_end, pid_n, s, kb0, kb1

    @gluon.jit
    def _producer(x_desc, w_desc, x_smem, w_smem, ready, empty, offs_ptr, mm_ptr,
                  N, E, num_m_tiles, MAX_M, total_units, split, kb_per_split, total_kb,
                  LAYOUT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, E_POW2: gl.constexpr,
                  NUM_STAGES: gl.constexpr):
        """The producer warpgroup: every unit's activation and weight tiles, one 128-K group per stage. A stage's `empty` barrier
        has completed phase p - 1 when every consumer released its previous use (a fresh barrier counts as having
        completed the phase before 0); `it` counts stages across units, as each consumer does."""
        it = 0
        for u in range(gl.program_id(0), total_units, gl.num_programs(0)):
            e, row_start, row_end, pid_n, s, kb0, kb1 = _unit_of(u, offs_ptr, mm_ptr, N, E, num_m_tiles, MAX_M, split, kb_per_split, total_kb,
                                                               LAYOUT, BLOCK_M, BLOCK_N, GROUP_M, E_POW2, 4)
            if row_start < row_end:
                x_row = row_start
                if LAYOUT == 2:
                    x_row = e * MAX_M + row_start
                w_row = e * N + pid_n * BLOCK_N
                for kb in range(kb0, kb1):
                    stage = it % NUM_STAGES
                    mbarrier.wait(empty.index(stage), ((it // NUM_STAGES) & 1) ^ 1)
                    bar = ready.index(stage)
                    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
                    _tma_load(x_desc, [x_row, kb * 128], bar, x_smem.index(stage))
                    _tma_load(w_desc, [w_row, kb * 128], bar, w_smem.index(stage))
                    it += 1

    @gluon.jit
    def _issue(x_smem, w_smem, stage, part, ROW0: gl.constexpr, COL0: gl.constexpr, WIDTH: gl.constexpr):
        """One 128-K group's wgmma, issued asynchronously: tile rows ROW0 .. ROW0 + 63 of `stage` (shared memory) by its
        weight rows COL0 .. COL0 + WIDTH - 1 (K-major through a permuted view), into a fresh float32 product in the
        registers of `part` (use_acc=False: never read; the imprecise fp8 accumulation spans one group only, as DeepGEMM's)."""
        a = x_smem.index(stage).slice(ROW0, 64, dim=0)
        b = w_smem.index(stage).slice(COL0, WIDTH, dim=0).permute((1, 0))
        return warpgroup_mma(a, b, part, use_acc=False, is_async=True)

    @gluon.jit
    def _issue_group(x_smem, w_smem, ready, xs_ptr, xs_off, ws_ptr, ws_off, stride_xsg, stride_wsk, kb, it, part,
                     ROW0: gl.constexpr, WIDTH: gl.constexpr, NUM_STAGES: gl.constexpr):
        """Group kb (the it-th stage use): its scales loaded (their product, x_scale[row] * w_scale, is used at its
        promotion, a group later), its stage waited for, its wgmma issued into the registers of `part`. Returns the
        product (in flight), the scales' product and it + 1. (The scales are addressed by 32-bit offsets from their
        bases: fewer registers than 64-bit pointers, where two products and the accumulator leave few.)"""
        stage = it % NUM_STAGES
        scale = gl.load(xs_ptr + (xs_off + kb * stride_xsg)) * gl.load(ws_ptr + (ws_off + kb * stride_wsk))
        mbarrier.wait(ready.index(stage), (it // NUM_STAGES) & 1)
        part = _issue(x_smem, w_smem, stage, part, ROW0, 0, WIDTH)
        return part, scale, it + 1

    @gluon.jit
    def _mainloop(x_smem, w_smem, ready, empty, xs_rows, ws_row, stride_xsg, stride_wsk, kb0, kb1, it,
                  ROW0: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, layout: gl.constexpr):
        """The K loop of one sub-tile (64 rows x BLOCK_N <= 128), each group's wgmma waited for before its promotion
        (acc += product * (x_scale[row] * w_scale)): returns the accumulator and the stage counter."""
        xs = gl.load(xs_rows + kb0 * stride_xsg)
        wsv = gl.load(ws_row + kb0 * stride_wsk)
        acc = gl.zeros([64, BLOCK_N], gl.float32, layout=layout)
        for kb in range(kb0, kb1):
            stage = it % NUM_STAGES
            # the next group's scales, loaded a group ahead (the last group reloads its own)
            nk = gl.minimum(kb + 1, kb1 - 1)
            xs_next = gl.load(xs_rows + nk * stride_xsg)
            ws_next = gl.load(ws_row + nk * stride_wsk)
            mbarrier.wait(ready.index(stage), (it // NUM_STAGES) & 1)
            part = gl.zeros([64, BLOCK_N], gl.float32, layout=layout)  # (use_acc=False: never read)
            part = _issue(x_smem, w_smem, stage, part, ROW0, 0, BLOCK_N)
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
            mbarrier.arrive(empty.index(stage))  # the wgmma that read the stage has completed
            acc += part * gl.expand_dims(xs * wsv, 1)
            xs, wsv = xs_next, ws_next
            it += 1
        return acc, it

    @gluon.jit
    def _promote_ordered(acc, part, scale):
        """acc + part * scale[:, None] (scale: x_scale[row] * w_scale) as `_mainloop`'s promotion computes it (the same
        fma.rn.f32 per element, so the same bits), written as inline asm with side effects so that LLVM keeps it ahead
        of the next wgmma into part's registers: a pure FMA sunk past that wgmma would need a copy of the product, in
        flight by then, and ptxas serialises every wgmma of a kernel that reads an in-flight accumulator."""
        scale, part = gl.broadcast(gl.expand_dims(scale, 1), part)
        return gl.inline_asm_elementwise("fma.rn.f32 $0, $1, $2, $3;", "=r,r,r,r", [scale, part, acc], dtype=gl.float32, is_pure=False, pack=1)

    @gluon.jit
    def _mainloop_overlap(x_smem, w_smem, ready, empty, xs_ptr, xs_off, ws_ptr, ws_off, stride_xsg, stride_wsk, kb0, kb1, it,
                          ROW0: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, layout: gl.constexpr):
        """`_mainloop` with each group's wgmma issued before the previous group's promotion, into the other of two
        product register sets p and q (wgmma wait with one group outstanding), so the warpgroup's tensor-core work
        overlaps its promotion. The same products, scales and promotion order as `_mainloop`: the same accumulator bit
        for bit. The loop takes groups in pairs, p's then q's, so each set's registers carry over the loop edge unmoved
        (a copy of an in-flight product, as `p = q` would make, has ptxas serialise every wgmma)."""
        acc = gl.zeros([64, BLOCK_N], gl.float32, layout=layout)
        p = gl.zeros([64, BLOCK_N], gl.float32, layout=layout)  # (use_acc=False: never read)
        q = gl.zeros([64, BLOCK_N], gl.float32, layout=layout)
        p, s_p, it = _issue_group(x_smem, w_smem, ready, xs_ptr, xs_off, ws_ptr, ws_off, stride_xsg, stride_wsk, kb0, it, p,
                                  ROW0, BLOCK_N, NUM_STAGES)
        p = warpgroup_mma_wait(num_outstanding=1, deps=(p,))  # (returns at once: the product as a tensor, still in flight)
        for kb in range(kb0 + 1, kb1 - 1, 2):  # groups kb (into q) and kb + 1 (into p)
            q, s_q, it = _issue_group(x_smem, w_smem, ready, xs_ptr, xs_off, ws_ptr, ws_off, stride_xsg, stride_wsk, kb, it, q,
                                      ROW0, BLOCK_N, NUM_STAGES)
            p, q = warpgroup_mma_wait(num_outstanding=1, deps=(p, q))  # p's group has completed; q's runs on
            mbarrier.arrive(empty.index((it - 2) % NUM_STAGES))  # p's stage (p, then q, issued since)
            acc = _promote_ordered(acc, p, s_p)
            p, s_p, it = _issue_group(x_smem, w_smem, ready, xs_ptr, xs_off, ws_ptr, ws_off, stride_xsg, stride_wsk, kb + 1, it, p,
                                      ROW0, BLOCK_N, NUM_STAGES)
            q, p = warpgroup_mma_wait(num_outstanding=1, deps=(q, p))
            mbarrier.arrive(empty.index((it - 2) % NUM_STAGES))  # q's
            acc = _promote_ordered(acc, q, s_q)
        if (kb1 - kb0) % 2 == 0:  # one group left after the pairs: into q, then both drained
            q, s_q, it = _issue_group(x_smem, w_smem, ready, xs_ptr, xs_off, ws_ptr, ws_off, stride_xsg, stride_wsk, kb1 - 1, it, q,
                                      ROW0, BLOCK_N, NUM_STAGES)
            p, q = warpgroup_mma_wait(num_outstanding=1, deps=(p, q))
            mbarrier.arrive(empty.index((it - 2) % NUM_STAGES))
            acc = _promote_ordered(acc, p, s_p)
            q = warpgroup_mma_wait(num_outstanding=0, deps=(q,))
            mbarrier.arrive(empty.index((it - 1) % NUM_STAGES))
            acc = _promote_ordered(acc, q, s_q)
        else:
            p = warpgroup_mma_wait(num_outstanding=0, deps=(p,))
            mbarrier.arrive(empty.index((it - 1) % NUM_STAGES))
            acc = _promote_ordered(acc, p, s_p)
        return acc, it

    @gluon.jit
    def _mainloop_pair(x_smem, w_smem, ready, empty, xs_ptr, xs_off0, xs_last, ws_ptr, ws_off0, ws_off1, stride_xsg, stride_wsk, kb0, kb1, it,
                       ROW0: gl.constexpr, ROW1: gl.constexpr, COL1: gl.constexpr, WIDTH: gl.constexpr, NUM_STAGES: gl.constexpr,
                       layout: gl.constexpr):
        """The K loop of two sub-tiles of 64 rows x WIDTH (two row waves: ROW1 = ROW0 + 64, COL1 = 0; or two column halves
        of a 256-wide tile: ROW1 = ROW0, COL1 = 128), each with its own row scales and weight scale: per group, the
        first sub-tile's wgmma, wait, promotion, then the second's (one product register set: two accumulators and two
        products would not fit). Per sub-tile the arithmetic of `_mainloop`. The second sub-tile's rows' scales are at
        xs_off0 + ROW1 - ROW0 clamped to xs_last (the expert's last row's), as xs_off0's are."""
        acc0 = gl.zeros([64, WIDTH], gl.float32, layout=layout)
        acc1 = gl.zeros([64, WIDTH], gl.float32, layout=layout)
        for kb in range(kb0, kb1):
            stage = it % NUM_STAGES
            # the group's scales' products, x_scale[row] * w_scale, loaded ahead of its two wgmmas (32-bit offsets from
            # the bases, as `_issue_group`'s; not a group ahead as `_mainloop`'s: four more registers)
            xs0 = gl.load(xs_ptr + (xs_off0 + kb * stride_xsg))
            if ROW1 == ROW0:  # two column halves: the same rows
                xs1 = xs0
            else:
                xs1 = gl.load(xs_ptr + (gl.minimum(xs_off0 + (ROW1 - ROW0), xs_last) + kb * stride_xsg))
            s0 = xs0 * gl.load(ws_ptr + (ws_off0 + kb * stride_wsk))
            s1 = xs1 * gl.load(ws_ptr + (ws_off1 + kb * stride_wsk))
            mbarrier.wait(ready.index(stage), (it // NUM_STAGES) & 1)
            part = gl.zeros([64, WIDTH], gl.float32, layout=layout)  # (use_acc=False: never read)
            part = _issue(x_smem, w_smem, stage, part, ROW0, 0, WIDTH)
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
            acc0 = _promote_ordered(acc0, part, s0)  # (before the next wgmma reuses part's registers)
            part = _issue(x_smem, w_smem, stage, part, ROW1, COL1, WIDTH)
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
            mbarrier.arrive(empty.index(stage))
            acc1 = _promote_ordered(acc1, part, s1)
            it += 1
        return acc0, acc1, it

    @gluon.jit
    def _store(acc, out_ptr, out_desc, out_smem, BUF: gl.constexpr, e, s, row0, col0, row_end, N, stride_os, stride_oe, stride_om,
               PARTIAL: gl.constexpr, TMA_STORE: gl.constexpr, layout: gl.constexpr):
        """One sub-tile's epilogue (rows row0 .. row0 + 63 relative to the expert, columns col0 ..): with TMA_STORE, a
        sub-tile whose rows all lie in the expert goes out through this warpgroup's shared-memory buffer by a TMA store
        (the columns past N clipped by the descriptor); else rows past the expert and columns past N are masked and
        the values stored straight from the wgmma layout (pairs of columns per store)."""
        if TMA_STORE:
            if row0 + 64 <= row_end:
                tma.store_wait(0)  # the previous store has read the buffer (the issuing thread waits, then the warps meet)
                sync_warps()
                buf = out_smem.index(BUF)
                buf.store(acc.to(out_desc.dtype))
                fence_async_shared()
                sync_warps()
                _tma_store(out_desc, [e * (stride_oe // stride_om) + row0, col0], buf)
            else:
                _store_masked(acc, out_ptr, e, s, row0, col0, row_end, N, stride_os, stride_oe, stride_om, PARTIAL, layout)
        else:
            _store_masked(acc, out_ptr, e, s, row0, col0, row_end, N, stride_os, stride_oe, stride_om, PARTIAL, layout)

    @gluon.jit
    def _store_masked(acc, out_ptr, e, s, row0, col0, row_end, N, stride_os, stride_oe, stride_om, PARTIAL: gl.constexpr, layout: gl.constexpr):
        rows = row0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
        cols = col0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
        base = out_ptr + e.to(gl.int64) * stride_oe + gl.expand_dims(cols, 0)  # (the output is contiguous)
        if PARTIAL:
            base += s.to(gl.int64) * stride_os
        ptrs = base + gl.expand_dims(rows.to(gl.int64) * stride_om, 1)
        mask = gl.expand_dims(rows < row_end, 1) & gl.expand_dims(cols < N, 0)
        gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _consumer(x_smem, w_smem, ready, empty, out_ptr, out_desc, out_smem, xs_ptr, ws_ptr, offs_ptr, mm_ptr,
                  N, E, num_m_tiles, MAX_M, total_units, split, kb_per_split, total_kb,
                  stride_xsg, stride_wse, stride_wsn, stride_wsk, stride_os, stride_oe, stride_om,
                  HALF: gl.constexpr, LAYOUT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
                  E_POW2: gl.constexpr, NUM_STAGES: gl.constexpr, CONSUMERS: gl.constexpr, PARTIAL: gl.constexpr,
                  WAVES: gl.constexpr, SUB_N: gl.constexpr, OVERLAP: gl.constexpr, TMA_STORE: gl.constexpr):
        """One warpgroup: rows HALF * 64 * WAVES .. of each unit's tile, in WAVES sub-tiles of 64 rows, or SUB_N of
        BLOCK_N // SUB_N columns (module docstring)."""
        WIDTH: gl.constexpr = BLOCK_N // SUB_N
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, WIDTH, 32])
        ROW0: gl.constexpr = HALF * 64 * WAVES
        offs_r = gl.arange(0, 64, layout=gl.SliceLayout(1, mma_layout))
        n_scale_blocks = gl.cdiv(N, 128)
        it = 0
        for u in range(gl.program_id(0), total_units, gl.num_programs(0)):
            e, row_start, row_end, pid_n, s, kb0, kb1 = _unit_of(u, offs_ptr, mm_ptr, N, E, num_m_tiles, MAX_M, split, kb_per_split, total_kb,
                                                               LAYOUT, BLOCK_M, BLOCK_N, GROUP_M, E_POW2, 4)
            if row_start < row_end:
                rows = row_start + ROW0 + offs_r  # this warpgroup's (first) rows (relative to the expert)
                x_base = row_start * 0
                if LAYOUT == 2:
                    x_base = e * MAX_M
                # the rows' activation scales (rows past the expert, clamped into it, feed masked outputs only) and the
                # N block's weight scales
                xs_off = gl.minimum(rows, row_end - 1) + x_base
                ws_blk = (pid_n * BLOCK_N) // 128
                ws_off = e * stride_wse + ws_blk * stride_wsn
                if WAVES == 2:
                    acc, acc1, it = _mainloop_pair(x_smem, w_smem, ready, empty, xs_ptr, xs_off, row_end - 1 + x_base,
                                                   ws_ptr, ws_off, ws_off, stride_xsg, stride_wsk, kb0, kb1, it,
                                                   ROW0, ROW0 + 64, 0, WIDTH, NUM_STAGES, mma_layout)
                    _store(acc1, out_ptr, out_desc, out_smem, 2 * HALF + 1, e, s, row_start + ROW0 + 64, pid_n * BLOCK_N,
                           row_end, N, stride_os, stride_oe, stride_om, PARTIAL, TMA_STORE, mma_layout)
                elif SUB_N == 2:
                    # the second half's weight scale block (clamped into the scales where it lies past N: its columns are masked)
                    ws_off1 = e * stride_wse + gl.minimum(ws_blk + 1, n_scale_blocks - 1) * stride_wsn
                    acc, acc1, it = _mainloop_pair(x_smem, w_smem, ready, empty, xs_ptr, xs_off, row_end - 1 + x_base, ws_ptr, ws_off, ws_off1,
                                                   stride_xsg, stride_wsk,
                                                   kb0, kb1, it, ROW0, ROW0, WIDTH, WIDTH, NUM_STAGES, mma_layout)
                    _store(acc1, out_ptr, out_desc, out_smem, 2 * HALF + 1, e, s, row_start + ROW0, pid_n * BLOCK_N + WIDTH,
                           row_end, N, stride_os, stride_oe, stride_om, PARTIAL, TMA_STORE, mma_layout)
                elif OVERLAP:
                    acc, it = _mainloop_overlap(x_smem, w_smem, ready, empty, xs_ptr, xs_off, ws_ptr, ws_off, stride_xsg, stride_wsk, kb0, kb1, it,
                                                ROW0, BLOCK_N, NUM_STAGES, mma_layout)
                else:
                    ws_row = ws_ptr + e.to(gl.int64) * stride_wse + ws_blk * stride_wsn
                    acc, it = _mainloop(x_smem, w_smem, ready, empty, xs_ptr + xs_off, ws_row, stride_xsg, stride_wsk, kb0, kb1, it,
                                        ROW0, BLOCK_N, NUM_STAGES, mma_layout)
                _store(acc, out_ptr, out_desc, out_smem, (WAVES * SUB_N) * HALF, e, s, row_start + ROW0, pid_n * BLOCK_N,
                       row_end, N, stride_os, stride_oe, stride_om, PARTIAL, TMA_STORE, mma_layout)
        if TMA_STORE:
            tma.store_wait(0)  # the last store has read its buffer before the program ends

    @gluon.jit(do_not_specialize=["num_m_tiles", "MAX_M", "total_units", "split", "kb_per_split", "stride_xsg"])
    def _fp8_gemm_ws_kernel(
        x_desc, w_desc, out_ptr,
        out_desc,  # TMA_STORE: the output as [rows, N] in [64, BLOCK_N // SUB_N] boxes; else None
        xs_ptr, ws_ptr, offs_ptr, mm_ptr,
        N, E, num_m_tiles,
        MAX_M,  # masked: rows per expert of x [E, max_m, K]; else the rows of x
        total_units, split, kb_per_split, total_kb,
        stride_xsg,  # x_scale's group stride (its rows are contiguous)
        stride_wse, stride_wsn, stride_wsk,
        stride_os, stride_oe, stride_om,  # the output's (or the partials') split, expert and row strides; its columns are contiguous
        LAYOUT: gl.constexpr,  # 0 linear, 1 contiguous, 2 masked (gemm.py's)
        BLOCK_M: gl.constexpr,  # 64 * WAVES * CONSUMERS
        BLOCK_N: gl.constexpr,  # divides 128 (one weight scale per N block and K group), or 256 in SUB_N = 2 halves
        GROUP_M: gl.constexpr,
        E_POW2: gl.constexpr,
        NUM_STAGES: gl.constexpr,
        CONSUMERS: gl.constexpr,  # consumer warpgroups: 1 or 2
        PARTIAL: gl.constexpr,  # split-K: out_ptr is the float32 workspace [splits, *out]
        CONSUMER_REGS: gl.constexpr,  # registers per thread of each consumer warpgroup (the producer gets what is left)
        WAVES: gl.constexpr = 1,  # 64-row sub-tiles per consumer warpgroup: 1 or 2
        SUB_N: gl.constexpr = 1,  # column sub-tiles per consumer warpgroup: 1, or 2 (BLOCK_N 256: one weight scale block each)
        OVERLAP: gl.constexpr = False,  # the next group's wgmma issued before this group's promotion (one sub-tile only)
        TMA_STORE: gl.constexpr = False,  # the epilogue through shared memory and TMA stores (not with PARTIAL)
        num_warps: gl.constexpr = 4,  # 4: the default partition is the producer
    ):
        x_smem = gl.allocate_shared_memory(x_desc.dtype, [NUM_STAGES] + x_desc.block_type.shape, x_desc.layout)
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES] + w_desc.block_type.shape, w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        if TMA_STORE:  # one buffer per consumer sub-tile
            out_smem = gl.allocate_shared_memory(out_desc.dtype, [CONSUMERS * WAVES * SUB_N] + out_desc.block_type.shape, out_desc.layout)
        else:
            out_smem = ready  # (unused)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=CONSUMERS)
        fence_async_shared()
        # The default partition is the producer (the kernel's num_warps = 4: a warpgroup, as setmaxnreg allocates by
        # warpgroup; one thread issues its copies): values of this region stay live in it, and the consumers, as workers,
        # each get their full register budget (the first consumer as the default partition spilled ~0.8 KB more).
        if CONSUMERS == 2:
            gl.warp_specialize(
                [
                    (_producer, (x_desc, w_desc, x_smem, w_smem, ready, empty, offs_ptr, mm_ptr,
                                 N, E, num_m_tiles, MAX_M, total_units, split, kb_per_split, total_kb,
                                 LAYOUT, BLOCK_M, BLOCK_N, GROUP_M, E_POW2, NUM_STAGES)),
                    (_consumer, (x_smem, w_smem, ready, empty, out_ptr, out_desc, out_smem, xs_ptr, ws_ptr, offs_ptr, mm_ptr,
                                 N, E, num_m_tiles, MAX_M, total_units, split, kb_per_split, total_kb,
                                 stride_xsg, stride_wse, stride_wsn, stride_wsk, stride_os, stride_oe, stride_om,
                                 0, LAYOUT, BLOCK_M, BLOCK_N, GROUP_M, E_POW2, NUM_STAGES, CONSUMERS, PARTIAL, WAVES, SUB_N, OVERLAP, TMA_STORE)),
                    (_consumer, (x_smem, w_smem, ready, empty, out_ptr, out_desc, out_smem, xs_ptr, ws_ptr, offs_ptr, mm_ptr,
                                 N, E, num_m_tiles, MAX_M, total_units, split, kb_per_split, total_kb,
                                 stride_xsg, stride_wse, stride_wsn, stride_wsk, stride_os, stride_oe, stride_om,
                                 1, LAYOUT, BLOCK_M, BLOCK_N, GROUP_M, E_POW2, NUM_STAGES, CONSUMERS, PARTIAL, WAVES, SUB_N, OVERLAP, TMA_STORE)),
                ],
                [4, 4],
                [CONSUMER_REGS, CONSUMER_REGS],
            )
        else:
            gl.warp_specialize(
                [
                    (_producer, (x_desc, w_desc, x_smem, w_smem, ready, empty, offs_ptr, mm_ptr,
                                 N, E, num_m_tiles, MAX_M, total_units, split, kb_per_split, total_kb,
                                 LAYOUT, BLOCK_M, BLOCK_N, GROUP_M, E_POW2, NUM_STAGES)),
                    (_consumer, (x_smem, w_smem, ready, empty, out_ptr, out_desc, out_smem, xs_ptr, ws_ptr, offs_ptr, mm_ptr,
                                 N, E, num_m_tiles, MAX_M, total_units, split, kb_per_split, total_kb,
                                 stride_xsg, stride_wse, stride_wsn, stride_wsk, stride_os, stride_oe, stride_om,
                                 0, LAYOUT, BLOCK_M, BLOCK_N, GROUP_M, E_POW2, NUM_STAGES, CONSUMERS, PARTIAL, WAVES, SUB_N, OVERLAP, TMA_STORE)),
                ],
                [4],
                [CONSUMER_REGS],
            )


# ---------------------------------------------------------------------------------------------
# Host side: which calls the kernel serves, its tiles and K splits, its descriptors


SHARED_MEMORY_BUDGET = 220 * 1024  # SM90 gives a block 227 KiB; the rest is the barriers
SMALL_ROWS_PER_EXPERT = 64  # as gemm.py's tuning variants: "_small" up to this many rows per expert,
MEDIUM_ROWS_PER_EXPERT = gemm.MEDIUM_ROWS  # "_medium" up to this many (large decode batches), "_large" above
MAX_SPLIT = 16


@dataclass(frozen=True)
class GluonPlan:
    """One launch of `_fp8_gemm_ws_kernel`, made by `plan_gluon` from shapes and the tuning entry only."""

    layout: int  # _LINEAR, _CONTIGUOUS or _MASKED
    experts: int
    n: int
    k: int
    max_m: int  # masked: rows per expert of x [E, max_m, K]; else 0
    rows_total: int
    block_m: int
    block_n: int
    group_m: int
    consumers: int  # consumer warpgroups, 64 * waves rows each
    waves: int  # 64-row sub-tiles per consumer warpgroup (1 or 2)
    sub_n: int  # column sub-tiles per consumer warpgroup (2: BLOCK_N 256 as two halves of 128)
    overlap: bool  # the next group's wgmma issued before this group's promotion
    tma_store: bool  # the epilogue through shared memory and TMA stores
    num_stages: int
    consumer_regs: int  # registers per thread of each consumer warpgroup (the producer warpgroup gets what is left)
    maxnreg: int | None  # the launch's register cap per thread (None: Triton's)
    num_m_tiles: int  # row tiles (contiguous: an upper bound, as gemm.plan_gemm's)
    num_n: int
    total_kb: int  # 128-K groups
    split: int  # K splits; 1: none
    kb_per_split: int
    programs: int  # the persistent grid: at most one program per SM (times ctas_per_sm)

    @property
    def tiles(self) -> int:
        return self.num_m_tiles * self.num_n * (self.experts if self.layout == _MASKED else 1)

    @property
    def units(self) -> int:
        return self.tiles * self.split

    @property
    def grid(self) -> tuple[int]:
        return (self.programs,)


def not_served(x: torch.Tensor, weight: torch.Tensor, layout: int) -> str | None:
    """Why the Gluon kernel does not serve this call (None: it does). Dtypes, shapes, strides and alignment only;
    those calls run the tl kernel (module docstring)."""
    k = x.shape[-1]
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"x is {x.dtype}, not bfloat16/float16 (float32 x takes the tl kernel's bf16 MMA)"
    if k == 0 or k % 16:
        return f"K={k} is not a positive multiple of 16 (TMA row strides)"
    if not weight.is_contiguous() or weight.data_ptr() % 16:
        return "the weight is not contiguous with a 16-byte aligned base"
    if layout == _MASKED and x.stride(0) < x.stride(1):
        return "a masked x laid out expert-minor (the tl kernel's output follows that layout)"
    return None


def variant(rows_per_expert: float) -> str:
    """The tuning entry: fp8_gluon_small (decode), _medium (large decode batches) or _large (prefill), bucketed as gemm.py's."""
    if rows_per_expert <= SMALL_ROWS_PER_EXPERT:
        return "fp8_gluon_small"
    return "fp8_gluon_medium" if rows_per_expert <= MEDIUM_ROWS_PER_EXPERT else "fp8_gluon_large"


def fit_stages(block_m: int, block_n: int, stages: int, ctas_per_sm: int = 1, epilogue_bytes: int = 0) -> int:
    """The tuning entry's stages, fewer while the ring (and the TMA store's output buffers, epilogue_bytes) exceeds the
    shared-memory budget (at least 2)."""
    per_stage = (block_m + block_n) * BLOCK_K
    while stages > 2 and stages * per_stage + epilogue_bytes > SHARED_MEMORY_BUDGET // ctas_per_sm:
        stages -= 1
    return stages


def choose_split(tiles: int, total_kb: int, programs: int, cfg: dict) -> int:
    """K splits for a launch of `tiles` output tiles on `programs` persistent programs: 1 when the tiles fill them
    (or the entry has "split_k" off); else, among 1..MAX_SPLIT splits of at least "min_kb_per_split" groups each, the
    least modelled time: rounds of units per program times groups per unit, plus "split_cost" groups per split (the
    float32 partials written and summed); of equal costs the most splits (more SMs streaming the weight)."""
    if not cfg.get("split_k", False) or tiles >= programs:
        return 1
    best, best_cost = 1, None
    most = min(MAX_SPLIT, max(1, total_kb // cfg.get("min_kb_per_split", 2)))
    for want in range(1, most + 1):
        kps = cdiv(total_kb, want)
        split = cdiv(total_kb, kps)
        cost = cdiv(tiles * split, programs) * kps + (cfg.get("split_cost", 1) * split if split > 1 else 0)
        if best_cost is None or cost <= best_cost:
            best, best_cost = split, cost
    return best


def plan_gluon(x: torch.Tensor, weight: torch.Tensor, layout: int, cfg_for=None, sms: int | None = None) -> GluonPlan:
    """Tiles, K splits and grid from shapes and the tuning entry (cfg_for(variant); default: this device's "gemm"
    table; the compile check passes the target arch's). As gemm.plan_gemm, the entry and the split are chosen for the
    row count's power-of-two bucket (the kernel's constexprs, PARTIAL among them, stay the same across a bucket: a
    warm-up of power-of-two batches compiles what serving meets); the grid and the row arguments see the exact rows."""
    k = x.shape[-1]
    experts, n, max_m, rows_total, rows_per_expert = gemm.row_buckets(x, weight, layout)
    name = variant(rows_per_expert)
    cfg = cfg_for(name) if cfg_for is not None else config("gemm", name, x.device)
    consumers, block_m, block_n, waves = cfg["consumers"], cfg["BLOCK_M"], cfg["BLOCK_N"], cfg.get("waves", 1)
    sub_n = 2 if block_n == 2 * BLOCK_K else 1
    overlap = bool(cfg.get("overlap", False))
    if consumers not in (1, 2) or waves not in (1, 2) or block_m != 64 * waves * consumers:
        raise ValueError(f"{name}: BLOCK_M {block_m} must be 64 rows per wave (1 or 2: {waves}) per consumer warpgroup (1 or 2: {consumers})")
    if sub_n == 1 and (BLOCK_K % block_n or block_n % 16):
        raise ValueError(f"{name}: BLOCK_N {block_n} must divide 128 (one weight scale per N block) and be a multiple of 16, or be 256 (two halves)")
    if waves * sub_n > 2:
        raise ValueError(f"{name}: two row waves and two column halves are four sub-tiles a warpgroup; the registers hold two")
    if overlap and waves * sub_n > 1:
        raise ValueError(f"{name}: overlap keeps two products beside the accumulator: one sub-tile a warpgroup only (waves 1, BLOCK_N <= 128)")
    ctas_per_sm = cfg.get("ctas_per_sm", 1)
    programs = (sms if sms is not None else num_sms(x.device)) * ctas_per_sm
    num_n = cdiv(n, block_n)
    total_kb = cdiv(k, BLOCK_K)
    if layout == _MASKED:
        num_m_tiles = bucket_m_tiles = cdiv(max_m, block_m)
        bucket_tiles = bucket_m_tiles * num_n * experts
    else:
        rows_bucket = next_power_of_2(rows_total)
        num_m_tiles, bucket_m_tiles = cdiv(rows_total, block_m), cdiv(rows_bucket, block_m)
        if layout == _CONTIGUOUS:  # each expert's last tile may be partial; no more tiles than rows (gemm.plan_gemm's bound)
            num_m_tiles = min(num_m_tiles + experts, rows_total)
            bucket_m_tiles = min(bucket_m_tiles + experts, rows_bucket)
        bucket_tiles = bucket_m_tiles * num_n
    split = choose_split(bucket_tiles, total_kb, programs, cfg)
    kb_per_split = cdiv(total_kb, split)
    tiles = num_m_tiles * num_n * (experts if layout == _MASKED else 1)
    tma_store = bool(cfg.get("tma_store", False)) and split == 1 and n % 8 == 0  # (16-byte rows of a 16-bit output; not the partials)
    epilogue_bytes = consumers * waves * sub_n * 64 * (block_n // sub_n) * 2 if tma_store else 0
    return GluonPlan(
        layout=layout, experts=experts, n=n, k=k, max_m=max_m, rows_total=rows_total,
        block_m=block_m, block_n=block_n, group_m=cfg.get("GROUP_M", 8), consumers=consumers,
        waves=waves, sub_n=sub_n, overlap=overlap, tma_store=tma_store,
        num_stages=fit_stages(block_m, block_n, cfg["num_stages"], ctas_per_sm, epilogue_bytes),
        consumer_regs=cfg["consumer_regs"], maxnreg=cfg.get("maxnreg"),
        num_m_tiles=num_m_tiles, num_n=num_n, total_kb=total_kb, split=split, kb_per_split=kb_per_split,
        programs=max(1, min(tiles * split, programs)),
    )


def descriptors(plan: GluonPlan, xq: torch.Tensor, weight: torch.Tensor):
    """TMA descriptors: the quantised x as [rows, K] in [BLOCK_M, 128] boxes, the weight as [E*N, K] in [BLOCK_N, 128]
    boxes (e4m3, 128-byte swizzle: wgmma's K-major operands)."""
    k = plan.k
    x2 = xq.reshape(-1, k)
    w2 = weight.reshape(-1, k)
    x_box, w_box = [plan.block_m, BLOCK_K], [plan.block_n, BLOCK_K]
    return (
        TensorDescriptor(x2, list(x2.shape), list(x2.stride()), x_box, gl.NVMMASharedLayout.get_default_for(x_box, gl.float8e4nv)),
        TensorDescriptor(w2, list(w2.shape), list(w2.stride()), w_box, gl.NVMMASharedLayout.get_default_for(w_box, gl.float8e4nv)),
    )


_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def output_descriptor(plan: GluonPlan, out: torch.Tensor):
    """With plan.tma_store: the output (contiguous, 16-bit) as [rows, N] (masked: [E * max_m, N]) in boxes of one
    consumer sub-tile, [64, BLOCK_N // sub_n]; else None."""
    if not plan.tma_store:
        return None
    o2 = out.reshape(-1, plan.n)
    box = [64, plan.block_n // plan.sub_n]
    layout = gl.NVMMASharedLayout.get_default_for(box, getattr(gl, _GL_DTYPES[out.dtype]))
    return TensorDescriptor(o2, list(o2.shape), list(o2.stride()), box, layout)


def launch(plan: GluonPlan, xq, xs, weight, weight_scale, out, offs_arg, mm_arg) -> None:
    """The kernel (and with K splits gemm.py's split-K sum) into `out` (contiguous). xq, xs: `quantize_act_fp8(x,
    scale_rows_contiguous=True)`; offs_arg / mm_arg: expert_offsets / masked_m, or any device tensor where the layout
    has none."""
    p = plan
    if p.tma_store and (out.dtype not in _GL_DTYPES or out.data_ptr() % 16):
        p = dataclasses.replace(p, tma_store=False)  # (a float32 output, or an unaligned one: the register stores)
    x_desc, w_desc = descriptors(p, xq, weight)
    dest = out if p.split == 1 else torch.empty(p.split, *out.shape, dtype=torch.float32, device=out.device)
    out_strides = tuple(out.stride()[:2]) if p.layout == _MASKED else (0, out.stride(0))
    ws_strides = (0, *weight_scale.stride()) if p.layout == _LINEAR else tuple(weight_scale.stride())
    _fp8_gemm_ws_kernel[p.grid](
        x_desc, w_desc, dest, output_descriptor(p, out), xs, weight_scale, offs_arg, mm_arg,
        p.n, p.experts, p.num_m_tiles, p.max_m if p.layout == _MASKED else p.rows_total,
        p.units, p.split, p.kb_per_split, p.total_kb,
        xs.stride(-1), *ws_strides,
        dest.stride(0) if p.split > 1 else 0, *out_strides,
        LAYOUT=p.layout, BLOCK_M=p.block_m, BLOCK_N=p.block_n, GROUP_M=p.group_m, E_POW2=next_power_of_2(p.experts),
        NUM_STAGES=p.num_stages, CONSUMERS=p.consumers, PARTIAL=p.split > 1, CONSUMER_REGS=p.consumer_regs,
        WAVES=p.waves, SUB_N=p.sub_n, OVERLAP=p.overlap, TMA_STORE=p.tma_store, num_warps=4, **({"maxnreg": p.maxnreg} if p.maxnreg else {}),
    )
    if p.split > 1:
        numel, block = out.numel(), 1024
        gemm._split_k_reduce_kernel[(cdiv(numel, block),)](dest, out, numel, dest.stride(0), SPLIT_K=p.split, BLOCK=block, num_warps=4,
                                                           **pdl_launch(out.device))


def _run(x, weight, weight_scale, layout, *, offsets=None, masked_m=None, out_dtype=None, prequantised=None) -> torch.Tensor:
    """The Gluon kernel where it serves the call (`not_served`), else gemm.py's tl kernel (every format choice the same).
    prequantised: (xq, xs) from `gemm.quantize_act_fp8(x, scale_rows_contiguous=True)` (benchmarks of the GEMM alone;
    a call the Gluon kernel does not serve quantises x itself)."""
    weight, weight_scale = gemm._weight_operands(weight, weight_scale, "fp8_block")
    n = weight.shape[-2]
    if not_served(x, weight, layout) is not None or x.numel() == 0 or n == 0:
        return gemm.launch_gemm(x, weight, weight_scale, "fp8_block", layout, offsets=offsets, masked_m=masked_m, out_dtype=out_dtype)
    plan = plan_gluon(x, weight, layout)
    shape = (weight.shape[0], x.shape[1], n) if layout == _MASKED else (x.shape[0], n)
    out = torch.empty(shape, dtype=out_dtype or x.dtype, device=x.device)
    xq, xs = prequantised if prequantised is not None else gemm.quantize_act_fp8(x, scale_rows_contiguous=True)
    launch(plan, xq, xs, weight, weight_scale, out, offsets if offsets is not None else weight, masked_m if masked_m is not None else weight)
    return out


# ---------------------------------------------------------------------------------------------
# The ops and their registration


def linear(
    x: torch.Tensor, weight: torch.Tensor, *, weight_scale: torch.Tensor | None = None, fmt: str = "dense", out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    gemm_ops.check_linear_args(x, weight, weight_scale, fmt, out_dtype)
    return _run(x, weight, weight_scale, _LINEAR, out_dtype=out_dtype)


def grouped_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    expert_offsets: torch.Tensor | None = None,
    masked_m: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    fmt: str = "dense",
) -> torch.Tensor:
    experts = gemm_ops.check_grouped_args(x, weight, weight_scale, fmt, expert_offsets, masked_m)
    if expert_offsets is not None:
        gemm_ops.check_index_vector("expert_offsets", expert_offsets, experts + 1, x.device)
        return _run(x, weight, weight_scale, _CONTIGUOUS, offsets=expert_offsets)
    gemm_ops.check_index_vector("masked_m", masked_m, experts, x.device)
    return _run(x, weight, weight_scale, _MASKED, masked_m=masked_m)


linear.__qualname__, grouped_gemm.__qualname__ = "linear_fp8_gluon", "grouped_gemm_fp8_gluon"


def _chosen(ctx) -> bool:
    """fp8_path=gluon on an SM90 device (elsewhere that option leaves fp8_block to the tl kernel)."""
    return FP8_PATH.value(ctx) == "gluon" and is_sm90(ctx.device)


def _unusable(ctx) -> str | None:
    return gluon_unusable("fp8_path=gluon", GLUON_IMPORT_ERROR)


_NOTE = ("Gluon (SM90): persistent, warp-specialised (a TMA producer filling an mbarrier ring, consumer warpgroups issuing "
         "fp8 wgmma per 128-K group and promoting it with the activation x weight scales, DeepGEMM's schedule); bf16/fp16 x, "
         "K a multiple of 16, else the tl kernel (fp8_path=gluon)")
_FP8 = dict(formats=("fp8_block",), dtypes=(torch.bfloat16, torch.float16))
REGISTRATIONS = [
    Registration(op="linear", fn=linear, **_FP8, when=_chosen, priority=2, unusable=_unusable, note=_NOTE),
    Registration(op="grouped_gemm", fn=grouped_gemm, **_FP8, when=_chosen, priority=2, unusable=_unusable, note=_NOTE),
]
