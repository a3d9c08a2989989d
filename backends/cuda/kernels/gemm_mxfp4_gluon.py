"""Gluon kernel: mxfp4 (W4A16) `grouped_gemm` and `linear` on SM90, warp-specialised.

Verified on an H100 (2026-12-06: `deepinfer conformance --backend cuda --backend-option mxfp4_path=gluon`, its
mxfp4 cases exact) and measured there against the `tl` kernel at V4-Flash's expert shapes (docs/performance.md):
1.41-1.50x faster at prefill (8192 tokens x top-6) and, with its decode entry (one consumer warpgroup under a register
cap, `maxnreg`, that fits two CTAs per SM; 8-row tiles at <= 2 rows per expert; tuning/sm90.py says why), 1.05-1.20x
at decode (64 and 256 tokens x top-6, outputs equal). So on SM90 backend option mxfp4_path=auto takes it for every
call it serves (the decode entry's "auto" flag, `decode_on_gluon`, says so for decode-sized calls), as does
mxfp4_path=gluon. The `tl` kernel is what the interpreter checks in CI; calls this kernel does not serve (below) go to
it.

Why: on SM90 the `tl` register-dequant kernel is load-bound (a probe removed its dequantisation and the
rate stayed), and `tl` cannot split the loads from the dequantisation and the MMA into different warps.

Schedule (one program per output tile, the grid and tile -> (expert, rows, N block) map of gemm.py's
`_tile_of_program`, no split-K; the persistent form below walks the same tiles):
- producer partition (1 warp): first the tile's whole scale strip ([BLOCK_N, K/32] e8m0 bytes, seen as int32 words of
  four, as K/512 TMA boxes of [BLOCK_N, 4] words, TMA's narrowest, on their own mbarrier), then per K step of BLOCK_K the packed weight tile ([BLOCK_N, 32]
  bytes per 64 K) and the activation tile ([BLOCK_M, 64] bf16 per 64 K) by TMA into a NUM_STAGES ring
  of shared-memory stages, each with a `ready` mbarrier (expect-tx bytes) and an `empty` one.
- consumer partition (the default one, num_warps warps = 1 or 2 warpgroups): per stage, the packed
  bytes are read from shared memory straight into the layout of wgmma's register A
  operand (`_packed_layout`: the bf16 operand's layout with each k pair as one element), dequantised
  by bit placement (gemm.py's `_e2m1_bf16_pairs` trick and one `fma.rn.bf16x2` per pair, the same bits
  as MX_MODE 3 with MX_DQ 0; the factors made from one scale word per row and 128 K, `_scale_factors`), and
  multiplied by `warpgroup_mma` (A = the weight tile in registers,
  B = x^T, the activation tile's shared-memory view transposed), accumulating float32 [BLOCK_N, BLOCK_M]
  (swapped as in MX_MODE 3: weight rows are wgmma's M, so 16-token decode tiles still fill it). One
  wgmma group stays in flight; a stage is released (its `empty` arrive) once the wgmma that read it is done.
- epilogue (consumer): times 2^64 (the dequantisation's shift), cast to x's dtype, stored transposed with
  row and column masks, as gemm.py's.

Tail tiles (the prefill entry's tuning flag `tail_tiles`, on in the SM90 table: measured there):
a contiguous call is two launches of this kernel over disjoint rows (`plan_launches`, `grouped_tile`'s TILES). The body
launch takes each expert's full BLOCK_M-row tiles and, where the remainder is over BLOCK_M / 2 rows, one padded tile;
the tail launch one tile of BLOCK_M / 2 rows for each remainder of 1 to BLOCK_M / 2 rows. Why: at V4-Flash's prefill
(about 192 rows an expert) the second 128-row tile of an expert is about half padding, and by the prefill entry's sweep
(tuning/sm90.py: whole-call times, not a tile timed alone) a 64-row tile costs about 0.7 of a 128-row one. Both grids are
bounded from the row and expert counts alone (no device sync: CUDA-graph safe); programs past the launch's tiles exit.

Persistent form (the prefill entry's tuning flag `persistent`, off: on an H100, 2026-12-07, its outputs equalled the
table's in `python -m deepinfer_cuda.bench.gemm --sweep mxfp4_gluon_large` and grouped_gemm's conformance passed with
it, but it was no faster there: tuning/sm90.py has the figures; its tile walk is tested on the CPU). Why it was tried:
one program per tile at about 176 KiB of shared memory is one CTA per SM, and each program's prologue (barrier init,
the scale strip, the ring's fill) and epilogue (the accumulator through shared memory to a 128 x 256 store) leave the
tensor cores idle: 487 TFLOP/s at V4-Flash's prefill w13 on an H100, about 62% of its bf16 matmul rate.
`_mxfp4_gemm_persistent_kernel` launches at most one program per SM (`plan_gluon`'s `max_programs`); program p walks
tiles p, p + programs, ... through the same tile map (masked: the grid's program order; contiguous: `grouped_tile`
over the exact row tiles, their count summed on the device from the expert offsets, so no program walks tiles past
every expert's), as gemm_fp8_gluon.py's persistent schedule. Tail tiles stay two launches (their tiles differ in
BLOCK_M: the accumulator's and the activation box's shape), each persistent. Both partitions walk the same tiles; the
ring's fill counter `it` and the scale-box counter run on across tiles (phases from them, never reset), and the
consumer releases a tile's last stage and scale slot before its epilogue, so the producer loads the next tile while
the consumer converts and stores this one. The scale strip becomes SCALE_SLOTS (2) slots of one [BLOCK_N, 512 K] box
each with their own ready / empty barriers: the producer loads a span's box before the span's first ring fill, the
consumer releases it at the next span's first step (its words were read before the wgmmas that step waits for): 8 KiB
in place of the 32 KiB strip at K 4096 (4 stages would fit; the sweep has them). The K steps are `_mma_step`, the
one-program-a-tile kernel's, in the same order: outputs equal bit for bit. Its producer warp maps every tile itself (a
prefix sum over the experts): 64 registers where the other form's producer takes 40.

Served: bf16 x, mxfp4 weights, K a multiple of 512 (the scale boxes) with the strip's BLOCK_N * K/32 bytes
and the ring within shared memory, contiguous operands with 16-byte aligned rows (x flattens to [rows, K]; the
masked layout's rows past masked_m read the next expert's rows, the last tiles read TMA's zero fill:
they only feed outputs the store masks). Everything else (fp16/float32 x, other formats, other shapes,
a transposed masked x, a `linear` out_dtype other than x's) runs the `tl` kernel with mxfp4_path=register.

Triton 3.6 (the GPU machine) and 3.9 name the TMA load differently: `_tma_load` is gluon_hopper.py's shim.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from deepinfer.ops import gemm as gemm_ops
from deepinfer.triton_common import cdiv, next_power_of_2
from deepinfer_cuda.kernels import gemm
from deepinfer_cuda.kernels.common import Registration, capability, num_sms
from deepinfer_cuda.kernels.gluon_hopper import GLUON_IMPORT_ERROR, gluon_unusable
from deepinfer_cuda.options import MXFP4_PATH
from deepinfer_cuda.tuning import config

if GLUON_IMPORT_ERROR is None:  # (else the registration says why it cannot run)
    from deepinfer_cuda.kernels.gluon_hopper import TensorDescriptor, fence_async_shared, gl, gluon, mbarrier, warpgroup_mma, warpgroup_mma_wait
    from deepinfer_cuda.kernels.gluon_hopper import tma_load as _tma_load

SCALE_BOX_K = 512  # K per row of the scale strip's TMA box: 16 e8m0 bytes, TMA's minimum inner box width
SUB_K = 64  # K per TMA box and per wgmma: 128 bytes of bf16 x (the 128-byte swizzle's span), 32 bytes of packed weight
_LINEAR, _CONTIGUOUS, _MASKED = 0, 1, 2
_ALL_TILES, _BODY_TILES, _TAIL_TILES = 0, 1, 2  # grouped_tile's TILES: which of each expert's row tiles a launch computes
SCALE_SLOTS = 2  # the persistent form's scale boxes in shared memory ([BLOCK_N, 512 K] each): one read, the next loading


if GLUON_IMPORT_ERROR is None:

    @gluon.constexpr_function
    def _packed_layout(block_n, sub_k, num_warps, grouped):
        """The layout of the packed bytes [BLOCK_N, SUB_K/2] (grouped: [BLOCK_N, SUB_K/32, 16], row, scale
        group, k pair in the group) in
        which each thread holds exactly the k pairs that it holds of wgmma's bf16 register A operand
        (DotOperandLayout(0, mma, k_width=2): lane 4g + t has rows g and g + 8 of its warp's 16 and, per 16 k,
        the pairs t and t + 4), so that joining the two halves of each dequantised word gives that operand
        without moving data between threads."""
        reg = [[8, 0, 0], [0, 0, 4], [0, 0, 8]]
        pairs = sub_k // 2
        p = 16
        while p < pairs:
            reg.append([0, p // 16, 0])
            p *= 2
        rows = 16 * num_warps
        while rows < block_n:
            reg.append([rows, 0, 0])
            rows *= 2
        lane = [[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
        warp = []
        w = 1
        while w < num_warps:
            warp.append([16 * w, 0, 0])
            w *= 2
        if grouped:
            return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=warp, block_bases=[], shape=[block_n, sub_k // 32, 16])
        flat = lambda bases: [[n, 16 * g + i] for n, g, i in bases]  # noqa: E731
        return gl.DistributedLinearLayout(reg_bases=flat(reg), lane_bases=flat(lane), warp_bases=flat(warp), block_bases=[], shape=[block_n, sub_k // 2])

    @gluon.jit
    def _tile_of_program(offs_ptr, mm_ptr, M, N, E, num_m_tiles,
                         LAYOUT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, E_POW2: gl.constexpr,
                         TILES: gl.constexpr, FULL_M: gl.constexpr, TAIL_M: gl.constexpr, num_warps: gl.constexpr):
        """gemm.py's `_tile_of_program` without split-K: (expert, first row, row bound, N block); a program
        with no work gets row_start >= row_end. TILES, FULL_M, TAIL_M: `grouped_tile`'s (the contiguous layout only)."""
        if LAYOUT == 2:
            pid_m = gl.program_id(0)
            pid_n = gl.program_id(1)
            e = gl.program_id(2)
            row_end = gl.load(mm_ptr + e).to(gl.int32)
            row_start = pid_m * BLOCK_M
        else:
            e, row_start, row_end, pid_n = grouped_tile(gl.program_id(0), offs_ptr, M, N, E, num_m_tiles, LAYOUT, BLOCK_M, BLOCK_N, GROUP_M,
                                                        E_POW2, num_warps, TILES, FULL_M, TAIL_M)
        return e, row_start, row_end, pid_n

    @gluon.jit
    def grouped_tile(tile, offs_ptr, M, N, E, num_m_tiles,
                     LAYOUT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, E_POW2: gl.constexpr,
                     WARPS: gl.constexpr, TILES: gl.constexpr = 0, FULL_M: gl.constexpr = 0, TAIL_M: gl.constexpr = 0):
        """Tile `tile` of the linear (LAYOUT 0) or contiguous (LAYOUT 1) layout, GROUP_M row tiles at a time: (expert,
        first row, row bound, N block). Contiguous: the expert whose rows hold the tile, by a prefix sum of each expert's
        row tiles laid out over the calling partition's WARPS; past every expert's tiles, expert E with no rows. Linear:
        M is the row count. (The SM90 Gluon fp8_block GEMM's work units use it too, with the default TILES.)

        TILES picks which of an expert's row tiles the launch computes (the contiguous layout; tail tiles, module
        docstring): 0 all of them, BLOCK_M rows each; 1 the body: its rows // FULL_M full tiles, and one more (padded)
        when the remainder is over TAIL_M rows (BLOCK_M == FULL_M); 2 the tail: one TAIL_M-row tile where the remainder
        is 1 to TAIL_M rows, at the expert's first row past its full tiles (BLOCK_M == TAIL_M). A launch of each
        computes every row once."""
        num_n = gl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_n
        first_m = (tile // per_group) * GROUP_M
        group_m = gl.minimum(num_m_tiles - first_m, GROUP_M)
        t = first_m + (tile % per_group) % group_m
        pid_n = (tile % per_group) // group_m
        if LAYOUT == 1:
            idx, tiles, first, hi = _expert_row_tiles(offs_ptr, E, BLOCK_M, E_POW2, WARPS, TILES, FULL_M, TAIL_M)
            ends = gl.associative_scan(tiles, 0, _add)  # tile index one past each expert's last tile
            e = gl.sum((ends <= t).to(gl.int32), axis=0)  # E when t is past every expert's tiles
            sel = idx == e
            row_start = gl.sum(gl.where(sel, first + (t - (ends - tiles)) * BLOCK_M, 0), axis=0)
            row_end = gl.sum(gl.where(sel, hi, 0), axis=0)
        else:
            e = tile * 0
            row_start = t * BLOCK_M
            row_end = M
        return e, row_start, row_end, pid_n

    @gluon.jit
    def _expert_row_tiles(offs_ptr, E, BLOCK_M: gl.constexpr, E_POW2: gl.constexpr, WARPS: gl.constexpr,
                          TILES: gl.constexpr, FULL_M: gl.constexpr, TAIL_M: gl.constexpr):
        """The contiguous layout's experts laid out over WARPS warps: (expert index, its row tiles that TILES picks
        (`grouped_tile`), its first tile's first row, its row bound); experts E .. E_POW2 - 1 have none."""
        vec: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        idx = gl.arange(0, E_POW2, layout=vec)
        lo = gl.load(offs_ptr + idx, mask=idx < E, other=0).to(gl.int32)
        hi = gl.load(offs_ptr + idx + 1, mask=idx < E, other=0).to(gl.int32)
        if TILES == 0:
            tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
            first = lo
        elif TILES == 1:
            gl.static_assert(BLOCK_M == FULL_M, "the body's tiles are FULL_M rows")
            remainder = (hi - lo) % FULL_M
            tiles = (hi - lo) // FULL_M + (remainder > TAIL_M).to(gl.int32)
            first = lo
        else:
            gl.static_assert(BLOCK_M == TAIL_M, "the tail's tiles are TAIL_M rows")
            remainder = (hi - lo) % FULL_M
            tiles = ((remainder > 0) & (remainder <= TAIL_M)).to(gl.int32)
            first = hi - remainder
        return idx, tiles, first, hi

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _producer(x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, empty, scales_ready, x_row, w_row, num_steps,
                  BLOCK_K: gl.constexpr, NUM_STAGES: gl.constexpr):
        """One warp: the scale strip, then the ring. A stage's `empty` barrier has completed phase p - 1 when
        the consumer released its previous use; a fresh barrier counts as having completed the phase before 0."""
        SCALE_BOXES: gl.constexpr = s_smem.shape[0]
        mbarrier.expect(scales_ready, SCALE_BOXES * s_desc.block_type.nbytes)
        for box in gl.static_range(SCALE_BOXES):
            _tma_load(s_desc, [w_row, box * 4], scales_ready, s_smem.index(box))
        for step in range(num_steps):
            _fill_stage(x_desc, w_desc, x_smem, w_smem, ready, empty, step, x_row, w_row, step * BLOCK_K, BLOCK_K, NUM_STAGES)

    @gluon.jit
    def _fill_stage(x_desc, w_desc, x_smem, w_smem, ready, empty, it, x_row, w_row, k0, BLOCK_K: gl.constexpr, NUM_STAGES: gl.constexpr):
        """The ring's fill number `it` (stage it % NUM_STAGES): once the consumer released the stage's previous use,
        the activation and packed weight tiles of K k0 .. k0 + BLOCK_K by TMA, on the stage's `ready` barrier."""
        SUBS: gl.constexpr = BLOCK_K // 64
        stage = it % NUM_STAGES
        mbarrier.wait(empty.index(stage), ((it // NUM_STAGES) & 1) ^ 1)
        bar = ready.index(stage)
        mbarrier.expect(bar, SUBS * (x_desc.block_type.nbytes + w_desc.block_type.nbytes))
        for sub in gl.static_range(SUBS):
            k = k0 + sub * 64
            _tma_load(x_desc, [x_row, k], bar, x_smem.index(stage * SUBS + sub))
            _tma_load(w_desc, [w_row, k // 2], bar, w_smem.index(stage * SUBS + sub))

    # Four e8m0 scale bytes (one int32 word of the strip: the 32-K groups 4j..4j+3 of a row, little-endian) -> the four
    # groups' factors, each a bf16x2 word of 2^(s - 127 + 126 - 64) in both halves (the exponent field min(s, 193) + 62,
    # saturating at inf): the bytes as u16 lanes (s0, s2) and (s1, s3), min and field << 7 two lanes at a time, then each
    # lane copied to both halves. 13 instructions for 4 factors (the byte-wise form took about 6 per factor).
    _SCALE_WORD_TO_FACTORS: gl.constexpr = gl.constexpr("""{
    .reg .b32 lo, hi, c;
    mov.b32 c, 0x00C100C1;
    and.b32 lo, $4, 0x00FF00FF;
    shr.b32 hi, $4, 8;
    and.b32 hi, hi, 0x00FF00FF;
    min.u16x2 lo, lo, c;
    min.u16x2 hi, hi, c;
    mad.lo.u32 lo, lo, 128, 0x1F001F00;
    mad.lo.u32 hi, hi, 128, 0x1F001F00;
    prmt.b32 $0, lo, 0, 0x1010;
    prmt.b32 $1, hi, 0, 0x1010;
    prmt.b32 $2, lo, 0, 0x3232;
    prmt.b32 $3, hi, 0, 0x3232;
    }""")

    @gluon.jit
    def _scale_factors(words):
        """int32 scale words [BLOCK_N, 1] -> the factors of their four 32-K groups (four [BLOCK_N, 1] int32 tensors)."""
        return gl.inline_asm_elementwise(_SCALE_WORD_TO_FACTORS, "=r,=r,=r,=r,r", [words],
                                         dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)

    @gluon.jit
    def _dequantised_operand(packed_smem, f0, f1, a_layout: gl.constexpr, BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
        """The [BLOCK_N, 64] bf16 weight tile, shifted by 2^-64 (gemm.py's MX_SHIFT), in wgmma's register A
        layout: packed e2m1 bytes [BLOCK_N, 32] and the factors of its two 32-K groups (`_scale_factors`)."""
        flat_layout: gl.constexpr = _packed_layout(BLOCK_N, 64, num_warps, False)
        p_layout: gl.constexpr = _packed_layout(BLOCK_N, 64, num_warps, True)
        s_layout: gl.constexpr = gl.SliceLayout(2, p_layout)
        b = gl.convert_layout(gl.reshape(packed_smem.load(flat_layout), [BLOCK_N, 2, 16]), p_layout).to(gl.int32)
        a = b * 0x40040  # gemm.py's _e2m1_bf16_pairs: codes' bits 2:0 at 8:6 and 24:22, signs at 9 and 25
        words = (a & 0x01C001C0) | ((a << 6) & -0x7FFF8000)  # the signs at 15 and 31
        factor = gl.convert_layout(gl.join(gl.reshape(f0, [BLOCK_N]), gl.reshape(f1, [BLOCK_N])), s_layout)  # [BLOCK_N, 2]
        factor = gl.expand_dims(factor, 2)
        words, factor = gl.broadcast(words, factor)
        prod = gl.inline_asm_elementwise(
            "{ .reg .b32 z; mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, $1, $2, z; }",
            "=r,r,r", [words, factor], dtype=gl.int32, is_pure=True, pack=1,
        )
        pairs = gl.join(prod.to(gl.int16), (prod >> 16).to(gl.int16))  # [BLOCK_N, 2, 16, 2]: low half = even k
        tile = gl.reshape(pairs, [BLOCK_N, 64]).to(gl.bfloat16, bitcast=True)
        return gl.convert_layout(tile, a_layout)

    @gluon.constexpr_function
    def _mma_layout(block_m, num_warps):
        """The accumulator's layout: [BLOCK_N, BLOCK_M] float32, weight rows as wgmma's M over the consumer warps."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_m, 16])

    @gluon.jit
    def _consumer(x_smem, w_smem, s_smem, ready, empty, scales_ready, out_ptr, row_start, row_end, pid_n, e, N, num_steps,
                  stride_oe, stride_om, stride_on,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr):
        STEPS_PER_BOX: gl.constexpr = 512 // BLOCK_K
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=_mma_layout(BLOCK_M, num_warps))
        mbarrier.wait(scales_ready, 0)
        for box in range(num_steps // STEPS_PER_BOX):
            scales = s_smem.index(box)  # [BLOCK_N, 4] int32: this 512-K span's e8m0 bytes
            for j in gl.static_range(STEPS_PER_BOX):
                step = box * STEPS_PER_BOX + j
                stage = step % NUM_STAGES
                mbarrier.wait(ready.index(stage), (step // NUM_STAGES) & 1)
                acc = _mma_step(x_smem, w_smem, stage, scales, j, acc, BLOCK_M, BLOCK_N, BLOCK_K, num_warps)
                # the wgmma groups of the previous step are complete: release its stage
                mbarrier.arrive(empty.index((step + NUM_STAGES - 1) % NUM_STAGES), pred=step > 0)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _epilogue(acc, out_ptr, row_start, row_end, pid_n, e, N, stride_oe, stride_om, stride_on, BLOCK_M, BLOCK_N, num_warps)

    @gluon.jit
    def _mma_step(x_smem, w_smem, stage, scales, j, acc,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, num_warps: gl.constexpr):
        """One ring stage's K step into acc: per 128 K the rows' scale word (column j * WORDS + w of `scales`, the
        step's 512-K span of words) as four factors, per 64 K the weight tile dequantised into wgmma's register A
        operand times x^T (the stage's activation tile, shared memory); one wgmma group left in flight."""
        SUBS: gl.constexpr = BLOCK_K // 64
        WORDS: gl.constexpr = BLOCK_K // 128  # scale words per row per step (4 groups each)
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_mma_layout(BLOCK_M, num_warps), k_width=2)
        # a [BLOCK_N, 1] word per row, in the rows' distribution of _packed_layout (its group-and-pair dims sliced off)
        w_layout: gl.constexpr = gl.SliceLayout(2, _packed_layout(BLOCK_N, 32, num_warps, True))
        for w in gl.static_range(WORDS):
            f0, f1, f2, f3 = _scale_factors(scales.slice(j * WORDS + w, 1, dim=1).load(w_layout))
            for half in gl.static_range(2):
                sub = 2 * w + half
                if half == 0:
                    a = _dequantised_operand(w_smem.index(stage * SUBS + sub), f0, f1, a_layout, BLOCK_N, num_warps)
                else:
                    a = _dequantised_operand(w_smem.index(stage * SUBS + sub), f2, f3, a_layout, BLOCK_N, num_warps)
                acc = warpgroup_mma(a, x_smem.index(stage * SUBS + sub).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        return acc

    @gluon.jit
    def _epilogue(acc, out_ptr, row_start, row_end, pid_n, e, N, stride_oe, stride_om, stride_on,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
        """Undo the 2^-64 shift, store out[row, col] = acc[col, row] with N contiguous per thread."""
        out_layout: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, num_warps], [0, 1])
        res = gl.convert_layout((acc * 18446744073709551616.0).to(out_ptr.dtype.element_ty), out_layout)
        cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out_layout))
        rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, out_layout))
        mask = (cols < N)[:, None] & (rows < row_end)[None, :]
        offs = e.to(gl.int64) * stride_oe + rows.to(gl.int64)[None, :] * stride_om + cols[:, None] * stride_on
        gl.store(out_ptr + offs, res, mask=mask)

    @gluon.jit(do_not_specialize=["M", "num_m_tiles", "MAX_M"])
    def _mxfp4_gemm_ws_kernel(
        x_desc, w_desc, s_desc, out_ptr, offs_ptr, mm_ptr,
        M, N, E, num_m_tiles, MAX_M,
        stride_oe, stride_om, stride_on,
        K: gl.constexpr,  # a multiple of 512: the scale strip's shared-memory shape depends on it
        LAYOUT: gl.constexpr,  # 0 linear, 1 contiguous, 2 masked (gemm.py's)
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,  # K per ring stage: 64, 128 or 256 (SUB_K boxes per stage)
        GROUP_M: gl.constexpr,
        E_POW2: gl.constexpr,
        NUM_STAGES: gl.constexpr,
        PRODUCER_REGS: gl.constexpr,
        TILES: gl.constexpr,  # the contiguous layout's row tiles: 0 all, 1 body, 2 tail (`grouped_tile`)
        FULL_M: gl.constexpr,  # tail tiles: the body's BLOCK_M (else 0)
        TAIL_M: gl.constexpr,  # tail tiles: the tail's BLOCK_M (else 0)
        num_warps: gl.constexpr,
    ):
        e, row_start, row_end, pid_n = _tile_of_program(offs_ptr, mm_ptr, M, N, E, num_m_tiles, LAYOUT, BLOCK_M, BLOCK_N, GROUP_M, E_POW2,
                                                        TILES, FULL_M, TAIL_M, num_warps)
        if row_start < row_end:
            SUBS: gl.constexpr = BLOCK_K // 64
            x_row = row_start
            if LAYOUT == 2:
                x_row = e * MAX_M + row_start
            w_row = e * N + pid_n * BLOCK_N
            x_smem = gl.allocate_shared_memory(x_desc.dtype, [NUM_STAGES * SUBS] + x_desc.block_type.shape, x_desc.layout)
            w_smem = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES * SUBS] + w_desc.block_type.shape, w_desc.layout)
            s_smem = gl.allocate_shared_memory(s_desc.dtype, [K // 512] + s_desc.block_type.shape, s_desc.layout)
            ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
            scales_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            for i in gl.static_range(NUM_STAGES):
                mbarrier.init(ready.index(i), count=1)
                mbarrier.init(empty.index(i), count=1)
            mbarrier.init(scales_ready, count=1)
            fence_async_shared()
            num_steps = K // BLOCK_K
            gl.warp_specialize(
                [
                    (_consumer, (x_smem, w_smem, s_smem, ready, empty, scales_ready, out_ptr, row_start, row_end, pid_n, e, N, num_steps,
                                 stride_oe, stride_om, stride_on, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, num_warps)),
                    (_producer, (x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, empty, scales_ready, x_row, w_row, num_steps,
                                 BLOCK_K, NUM_STAGES)),
                ],
                [1],
                [PRODUCER_REGS],
            )

    # -----------------------------------------------------------------------------------------
    # The persistent form (the prefill entry's "persistent" flag, off: measured no faster; module docstring)

    @gluon.jit
    def _tile_of(tile, offs_ptr, mm_ptr, M, N, E, num_m_tiles,
                 LAYOUT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, E_POW2: gl.constexpr,
                 TILES: gl.constexpr, FULL_M: gl.constexpr, TAIL_M: gl.constexpr, WARPS: gl.constexpr):
        """`_tile_of_program`'s map with the tile as an index: masked, row tiles fastest, then N blocks, then experts (the
        order of that grid's program ids); else `grouped_tile`. WARPS: the calling partition's."""
        if LAYOUT == 2:
            pid_m = tile % num_m_tiles
            rest = tile // num_m_tiles
            num_n = gl.cdiv(N, BLOCK_N)
            pid_n = rest % num_n
            e = rest // num_n
            row_end = gl.load(mm_ptr + e).to(gl.int32)
            row_start = pid_m * BLOCK_M
        else:
            e, row_start, row_end, pid_n = grouped_tile(tile, offs_ptr, M, N, E, num_m_tiles, LAYOUT, BLOCK_M, BLOCK_N, GROUP_M, E_POW2,
                                                        WARPS, TILES, FULL_M, TAIL_M)
        return e, row_start, row_end, pid_n

    @gluon.jit
    def _persistent_producer(x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, empty, scales_ready, scales_empty,
                             offs_ptr, mm_ptr, M, N, E, num_m_tiles, MAX_M, total_tiles,
                             K: gl.constexpr, LAYOUT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                             GROUP_M: gl.constexpr, E_POW2: gl.constexpr, NUM_STAGES: gl.constexpr,
                             TILES: gl.constexpr, FULL_M: gl.constexpr, TAIL_M: gl.constexpr):
        """One warp: for each of the program's tiles, per 512-K span its scale box into the next scale slot, then the
        span's ring fills. `it` (ring fills) and `box` (scale boxes) count across tiles, as the consumer's do, so the
        ring runs on into the next tile while the consumer stores this one."""
        STEPS_PER_BOX: gl.constexpr = 512 // BLOCK_K
        SLOTS: gl.constexpr = s_smem.shape[0]
        it = 0
        box = 0
        for tile in range(gl.program_id(0), total_tiles, gl.num_programs(0)):
            e, row_start, row_end, pid_n = _tile_of(tile, offs_ptr, mm_ptr, M, N, E, num_m_tiles, LAYOUT, BLOCK_M, BLOCK_N, GROUP_M, E_POW2,
                                                    TILES, FULL_M, TAIL_M, 1)
            if row_start < row_end:
                x_row = row_start
                if LAYOUT == 2:
                    x_row = e * MAX_M + row_start
                w_row = e * N + pid_n * BLOCK_N
                for span in range(K // 512):
                    slot = box % SLOTS
                    mbarrier.wait(scales_empty.index(slot), ((box // SLOTS) & 1) ^ 1)
                    mbarrier.expect(scales_ready.index(slot), s_desc.block_type.nbytes)
                    _tma_load(s_desc, [w_row, span * 4], scales_ready.index(slot), s_smem.index(slot))
                    box += 1
                    for j in gl.static_range(STEPS_PER_BOX):
                        _fill_stage(x_desc, w_desc, x_smem, w_smem, ready, empty, it, x_row, w_row, span * 512 + j * BLOCK_K, BLOCK_K, NUM_STAGES)
                        it += 1

    @gluon.jit
    def _persistent_consumer(x_smem, w_smem, s_smem, ready, empty, scales_ready, scales_empty, out_ptr,
                             offs_ptr, mm_ptr, M, N, E, num_m_tiles, total_tiles, stride_oe, stride_om, stride_on,
                             K: gl.constexpr, LAYOUT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                             GROUP_M: gl.constexpr, E_POW2: gl.constexpr, NUM_STAGES: gl.constexpr,
                             TILES: gl.constexpr, FULL_M: gl.constexpr, TAIL_M: gl.constexpr, num_warps: gl.constexpr):
        """`_consumer` over the program's tiles: the same K steps in the same order (`_mma_step`), the ring and the
        scale slots counted across tiles. A tile's last stage and scale slot are released before its epilogue, so the
        producer fills them with the next tile's loads meanwhile."""
        STEPS_PER_BOX: gl.constexpr = 512 // BLOCK_K
        SLOTS: gl.constexpr = s_smem.shape[0]
        it = 0
        box = 0
        for tile in range(gl.program_id(0), total_tiles, gl.num_programs(0)):
            e, row_start, row_end, pid_n = _tile_of(tile, offs_ptr, mm_ptr, M, N, E, num_m_tiles, LAYOUT, BLOCK_M, BLOCK_N, GROUP_M, E_POW2,
                                                    TILES, FULL_M, TAIL_M, num_warps)
            if row_start < row_end:
                acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=_mma_layout(BLOCK_M, num_warps))
                for span in range(K // 512):
                    slot = box % SLOTS
                    mbarrier.wait(scales_ready.index(slot), (box // SLOTS) & 1)
                    for j in gl.static_range(STEPS_PER_BOX):
                        stage = it % NUM_STAGES
                        mbarrier.wait(ready.index(stage), (it // NUM_STAGES) & 1)
                        acc = _mma_step(x_smem, w_smem, stage, s_smem.index(slot), j, acc, BLOCK_M, BLOCK_N, BLOCK_K, num_warps)
                        # the wgmma groups of the previous step are complete: release its stage and, at a span's first
                        # step, the previous span's scale slot (its words were read before those wgmmas were issued)
                        mbarrier.arrive(empty.index((it + NUM_STAGES - 1) % NUM_STAGES), pred=span * STEPS_PER_BOX + j > 0)
                        if j == 0:
                            mbarrier.arrive(scales_empty.index((box + SLOTS - 1) % SLOTS), pred=span > 0)
                        it += 1
                    box += 1
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index((it + NUM_STAGES - 1) % NUM_STAGES))
                mbarrier.arrive(scales_empty.index((box + SLOTS - 1) % SLOTS))
                _epilogue(acc, out_ptr, row_start, row_end, pid_n, e, N, stride_oe, stride_om, stride_on, BLOCK_M, BLOCK_N, num_warps)

    @gluon.jit(do_not_specialize=["M", "num_m_tiles", "MAX_M"])
    def _mxfp4_gemm_persistent_kernel(
        x_desc, w_desc, s_desc, out_ptr, offs_ptr, mm_ptr,
        M, N, E, num_m_tiles, MAX_M,
        stride_oe, stride_om, stride_on,
        K: gl.constexpr,  # a multiple of 512 (whole scale boxes)
        LAYOUT: gl.constexpr,  # 0 linear, 1 contiguous, 2 masked (gemm.py's)
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,  # K per ring stage: 128, 256 or 512
        GROUP_M: gl.constexpr,
        E_POW2: gl.constexpr,
        NUM_STAGES: gl.constexpr,
        SCALE_SLOTS: gl.constexpr,  # scale boxes in flight: the next span's loads while the consumer reads this one's
        PRODUCER_REGS: gl.constexpr,
        TILES: gl.constexpr,  # the contiguous layout's row tiles: 0 all, 1 body, 2 tail (`grouped_tile`)
        FULL_M: gl.constexpr,  # tail tiles: the body's BLOCK_M (else 0)
        TAIL_M: gl.constexpr,  # tail tiles: the tail's BLOCK_M (else 0)
        num_warps: gl.constexpr,
    ):
        """`_mxfp4_gemm_ws_kernel`'s tiles, each program walking tiles pid, pid + programs, ... (module docstring)."""
        SUBS: gl.constexpr = BLOCK_K // 64
        num_n = gl.cdiv(N, BLOCK_N)
        m_tiles = num_m_tiles
        if LAYOUT == 1:
            # the contiguous layout's exact row tiles (num_m_tiles bounds them from the row and expert counts): the walk
            # then holds no tile past every expert's, and `grouped_tile` maps 0 .. m_tiles * num_n - 1 onto them all
            _, row_tiles, _, _ = _expert_row_tiles(offs_ptr, E, BLOCK_M, E_POW2, num_warps, TILES, FULL_M, TAIL_M)
            m_tiles = gl.sum(row_tiles, axis=0)
        total_tiles = m_tiles * num_n
        if LAYOUT == 2:
            total_tiles = total_tiles * E
        x_smem = gl.allocate_shared_memory(x_desc.dtype, [NUM_STAGES * SUBS] + x_desc.block_type.shape, x_desc.layout)
        w_smem = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES * SUBS] + w_desc.block_type.shape, w_desc.layout)
        s_smem = gl.allocate_shared_memory(s_desc.dtype, [SCALE_SLOTS] + s_desc.block_type.shape, s_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        scales_ready = gl.allocate_shared_memory(gl.int64, [SCALE_SLOTS, 1], mbarrier.MBarrierLayout())
        scales_empty = gl.allocate_shared_memory(gl.int64, [SCALE_SLOTS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(SCALE_SLOTS):
            mbarrier.init(scales_ready.index(i), count=1)
            mbarrier.init(scales_empty.index(i), count=1)
        fence_async_shared()
        gl.warp_specialize(
            [
                (_persistent_consumer, (x_smem, w_smem, s_smem, ready, empty, scales_ready, scales_empty, out_ptr,
                                        offs_ptr, mm_ptr, M, N, E, m_tiles, total_tiles, stride_oe, stride_om, stride_on,
                                        K, LAYOUT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, E_POW2, NUM_STAGES, TILES, FULL_M, TAIL_M, num_warps)),
                (_persistent_producer, (x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, empty, scales_ready, scales_empty,
                                        offs_ptr, mm_ptr, M, N, E, m_tiles, MAX_M, total_tiles,
                                        K, LAYOUT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, E_POW2, NUM_STAGES, TILES, FULL_M, TAIL_M)),
            ],
            [1],
            [PRODUCER_REGS],
        )

# ---------------------------------------------------------------------------------------------
# Host side: which calls the kernel serves, its tiles, its descriptors


SHARED_MEMORY_BUDGET = 220 * 1024  # SM90 gives a block 227 KiB; the rest is barriers and the epilogue's conversion


@dataclass(frozen=True)
class GluonPlan:
    """One launch of `_mxfp4_gemm_ws_kernel` (or, persistent, `_mxfp4_gemm_persistent_kernel`), made by `plan_gluon`
    from shapes and the tuning entry only."""

    layout: int  # _LINEAR, _CONTIGUOUS or _MASKED
    experts: int
    n: int
    k: int
    max_m: int  # masked: rows per expert of x [E, max_m, K]; else 0
    rows_total: int
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    producer_regs: int
    maxnreg: int | None  # the launch's register cap per thread (None: Triton's, which fits one CTA per SM)
    num_m_tiles: int
    num_n: int
    tiles: int = _ALL_TILES  # which of each expert's row tiles: all, or tail tiles' body or tail (`grouped_tile`'s TILES)
    full_m: int = 0  # tail tiles: the body's BLOCK_M (else 0)
    tail_m: int = 0  # tail tiles: the tail's BLOCK_M (else 0)
    max_programs: int = 0  # the persistent form (the entry's "persistent" flag): at most this many programs (SMs x CTAs per SM); 0: one a tile

    @property
    def persistent(self) -> bool:
        return self.max_programs > 0

    @property
    def tiles_bound(self) -> int:
        """The launch's tiles (the contiguous layout's: a bound from the row and expert counts)."""
        return self.num_m_tiles * self.num_n * (self.experts if self.layout == _MASKED else 1)

    @property
    def grid(self) -> tuple[int, ...]:
        if self.persistent:
            return (max(1, min(self.tiles_bound, self.max_programs)),)
        if self.layout == _MASKED:
            return (self.num_m_tiles, self.num_n, self.experts)
        return (self.num_m_tiles * self.num_n,)


def not_served(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, layout: int) -> str | None:
    """Why the Gluon kernel does not serve this call (None: it does). Shapes, dtypes, strides and
    alignment only; those calls run the tl kernel (module docstring)."""
    k = x.shape[-1]
    if x.dtype != torch.bfloat16:
        return f"x is {x.dtype}, not bfloat16"
    if k == 0 or k % SCALE_BOX_K:
        return f"K={k} is not a positive multiple of {SCALE_BOX_K}"
    if not (x.is_contiguous() and weight.is_contiguous() and weight_scale.is_contiguous()):
        return "an operand is not contiguous"
    if any(t.data_ptr() % 16 for t in (x, weight, weight_scale)):
        return "an operand's base is not 16-byte aligned"
    return None


def _fit_stages(block_m: int, block_n: int, block_k: int, k: int, stages: int, ctas_per_sm: int = 1, persistent: bool = False) -> int:
    """The tuning entry's stages, fewer while the ring and the scale strip exceed the budget (at least 2); with
    ctas_per_sm > 1 (the decode entry: that many programs resident per SM, so one's prologue and epilogue overlap
    another's loads), the budget is shared by them. Persistent: SCALE_SLOTS scale boxes in place of the strip."""
    strip = block_n * (SCALE_SLOTS * SCALE_BOX_K if persistent else k) // 32
    per_stage = block_m * block_k * 2 + block_n * block_k // 2
    budget = SHARED_MEMORY_BUDGET // ctas_per_sm
    while stages > 2 and strip + stages * per_stage > budget:
        stages -= 1
    return stages


def plan_gluon(x: torch.Tensor, weight: torch.Tensor, layout: int, cfg_for=None, sms: int | None = None) -> GluonPlan:
    """Tiles and grid of one launch over all of the call's tiles, as gemm.plan_gemm makes them for the tl kernel (the
    same bucketing of rows per expert into the decode "_small" and prefill "_large" entries, a power-of-two BLOCK_M of
    at least 16 and at most the entry's), without split-K. cfg_for(variant): the tuning entry (default: this device's
    "gemm" table; the compile check passes the target arch's). sms: the persistent form's SMs (default: the device's).
    A call's launches are `plan_launches`'."""
    return _plan_and_entry(x, weight, layout, cfg_for, sms)[0]


def plan_launches(x: torch.Tensor, weight: torch.Tensor, layout: int, cfg_for=None, sms: int | None = None) -> tuple[GluonPlan, ...]:
    """The launches of one call: plan_gluon's, or, for a contiguous call whose entry has "tail_tiles" on (the prefill
    entry's flag, on in the SM90 table), tail tiles' body and tail launches (`tail_tile_plans`)."""
    plan, cfg = _plan_and_entry(x, weight, layout, cfg_for, sms)
    if layout == _CONTIGUOUS and cfg.get("tail_tiles", False) and plan.block_m >= 16:  # (a tail tile of at least 8 rows: wgmma's N)
        return tail_tile_plans(plan, cfg)
    return (plan,)


def tail_tile_plans(plan: GluonPlan, cfg: dict) -> tuple[GluonPlan, ...]:
    """An all-tiles contiguous plan as tail tiles' two launches (module docstring): the body, plan's BLOCK_M rows a
    tile, and the tail, tiles of half as many rows with the same BLOCK_N and warps, its stages refitted to shared
    memory. Their grids are bounded from the row and expert counts alone (no device sync); a launch that no split of
    the rows can give work is left out."""
    full_m, tail_m = plan.block_m, plan.block_m // 2
    body = replace(plan, tiles=_BODY_TILES, full_m=full_m, tail_m=tail_m, num_m_tiles=body_tile_bound(plan.rows_total, plan.experts, full_m, tail_m))
    tail = replace(body, tiles=_TAIL_TILES, block_m=tail_m, num_m_tiles=tail_tile_bound(plan.rows_total, plan.experts),
                   num_stages=_fit_stages(tail_m, plan.block_n, plan.block_k, plan.k, cfg["num_stages"], cfg.get("ctas_per_sm", 1), plan.persistent))
    return tuple(p for p in (body, tail) if p.num_m_tiles > 0)


def body_tile_bound(rows: int, experts: int, full_m: int, tail_m: int) -> int:
    """The most body tiles `rows` rows over `experts` experts can make, however they are split: an expert of r rows has
    (r + full_m - tail_m - 1) // full_m of them (its full tiles, and one more where the remainder is over tail_m rows),
    and each holds more than tail_m rows."""
    return min((rows + experts * (full_m - tail_m - 1)) // full_m, rows // (tail_m + 1))


def tail_tile_bound(rows: int, experts: int) -> int:
    """The most tail tiles: at most one an expert, each of at least one row."""
    return min(experts, rows)


def _plan_and_entry(x: torch.Tensor, weight: torch.Tensor, layout: int, cfg_for=None, sms: int | None = None) -> tuple[GluonPlan, dict]:
    """plan_gluon's plan and the tuning entry it was made from."""
    k = x.shape[-1]
    experts, n, max_m, rows_total, rows_per_expert = gemm.row_buckets(x, weight, layout)
    variant = "mxfp4_gluon_small" if rows_per_expert <= SMALL_ROWS_PER_EXPERT else "mxfp4_gluon_large"
    cfg = cfg_for(variant) if cfg_for is not None else config("gemm", variant, x.device)
    block_m = max(16, min(cfg["BLOCK_M"], next_power_of_2(int(rows_per_expert) if rows_per_expert >= 1 else 1)))
    block_k = cfg["BLOCK_K"]
    if 4 * rows_per_expert <= cfg.get("min_block_m", 16):
        # few rows per expert (decode batch 64 x top-6 over 256 experts: 1.5): an 8-row tile (wgmma N = 8) halves the x
        # bytes each weight tile pulls through TMA; the 4x headroom keeps an expert's rows in one tile (else its weight
        # would be read twice), the contiguous layout's counts varying about the bucket's mean
        block_m = cfg["min_block_m"]
        block_k = cfg.get("min_block_m_BLOCK_K", block_k)  # (the entry's K step for these tiles, where it has its own)
    block_n = cfg["BLOCK_N"]
    if block_k % 128 or 512 % block_k:
        raise ValueError(f"{variant}: BLOCK_K {block_k} must be 128, 256 or 512 (whole scale words per step, whole steps per scale box)")
    num_n = cdiv(n, block_n)
    if layout == _MASKED:
        num_m_tiles = cdiv(max_m, block_m)
    else:
        num_m_tiles = cdiv(rows_total, block_m)
        if layout == _CONTIGUOUS:
            num_m_tiles = min(num_m_tiles + experts, rows_total)  # gemm.plan_gemm's bound
    ctas_per_sm, persistent = cfg.get("ctas_per_sm", 1), bool(cfg.get("persistent", False))
    plan = GluonPlan(
        layout=layout, experts=experts, n=n, k=k, max_m=max_m, rows_total=rows_total,
        block_m=block_m, block_n=block_n, block_k=block_k, group_m=cfg.get("GROUP_M", 8),
        num_warps=cfg["num_warps"], num_stages=_fit_stages(block_m, block_n, block_k, k, cfg["num_stages"], ctas_per_sm, persistent),
        producer_regs=cfg.get("persistent_producer_regs", 64) if persistent else cfg.get("producer_regs", 40),
        maxnreg=cfg.get("maxnreg"), num_m_tiles=num_m_tiles, num_n=num_n,
        max_programs=(sms if sms is not None else num_sms(x.device)) * ctas_per_sm if persistent else 0,
    )
    return plan, cfg


def descriptors(plan: GluonPlan, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor):
    """TMA descriptors: x as [rows, K] in [BLOCK_M, 64] boxes (128-byte swizzle), the packed weight as
    [E*N, K/2] in [BLOCK_N, 32] boxes, the scales as [E*N, K/32] in [BLOCK_N, 16] boxes (unswizzled)."""
    k = plan.k
    x2 = x.reshape(-1, k)
    w2 = weight.reshape(-1, k // 2)
    s2 = weight_scale.reshape(-1, k // 32).view(torch.int32)  # four e8m0 bytes a word: the consumer reads words
    x_box, w_box, s_box = [plan.block_m, SUB_K], [plan.block_n, SUB_K // 2], [plan.block_n, 4]
    return (
        TensorDescriptor(x2, list(x2.shape), list(x2.stride()), x_box, gl.NVMMASharedLayout.get_default_for(x_box, gl.bfloat16)),
        TensorDescriptor(w2, list(w2.shape), list(w2.stride()), w_box, gl.NVMMASharedLayout.get_default_for(w_box, gl.uint8)),
        TensorDescriptor(s2, list(s2.shape), list(s2.stride()), s_box, gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)),
    )


def launch(plan: GluonPlan, x, weight, weight_scale, out, offs_arg, mm_arg) -> None:
    x_desc, w_desc, s_desc = descriptors(plan, x, weight, weight_scale)
    strides = tuple(out.stride()) if plan.layout == _MASKED else (0, *out.stride())
    kernel, slots = (_mxfp4_gemm_persistent_kernel, {"SCALE_SLOTS": SCALE_SLOTS}) if plan.persistent else (_mxfp4_gemm_ws_kernel, {})
    kernel[plan.grid](
        x_desc, w_desc, s_desc, out, offs_arg, mm_arg,
        plan.max_m if plan.layout == _MASKED else plan.rows_total, plan.n, plan.experts, plan.num_m_tiles, plan.max_m,
        *strides,
        K=plan.k, LAYOUT=plan.layout, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, GROUP_M=plan.group_m,
        E_POW2=next_power_of_2(plan.experts), NUM_STAGES=plan.num_stages, PRODUCER_REGS=plan.producer_regs, **slots,
        TILES=plan.tiles, FULL_M=plan.full_m, TAIL_M=plan.tail_m, num_warps=plan.num_warps, **({"maxnreg": plan.maxnreg} if plan.maxnreg else {}),
    )


SMALL_ROWS_PER_EXPERT = 64  # gemm.py's tuning variants: "_small" up to this many rows per expert, "_large" above


def prefill_sized(x: torch.Tensor, weight: torch.Tensor, layout: int) -> bool:
    """Whether a call's rows per expert take gemm.py's prefill ("_large") tiles: where this kernel measured faster."""
    return gemm.row_buckets(x, weight, layout)[4] > SMALL_ROWS_PER_EXPERT


def decode_on_gluon(device) -> bool:
    """Whether mxfp4_path=auto takes this kernel for decode-sized calls too: the SM90 decode entry's "auto" flag
    (set since it measured 1.05-1.20x the tl kernel on an H100: tuning/sm90.py)."""
    return is_sm90(device) and bool(config("gemm", "mxfp4_gluon_small", device).get("auto", False))


def _run(x, weight, weight_scale, layout, *, offsets=None, masked_m=None, prefill_only=False, out_dtype=None) -> torch.Tensor:
    """The Gluon kernel where it serves the call (`not_served`; with prefill_only, prefill-sized calls only), else the
    tl kernel's register path. out_dtype (linear's) other than x's: the tl kernel too (this epilogue was measured
    storing x's dtype only)."""
    n = weight.shape[-2]
    reason = not_served(x, weight, weight_scale, layout)
    empty = x.numel() == 0 or n == 0
    small = prefill_only and not prefill_sized(x, weight, layout) and not decode_on_gluon(x.device)
    other_out = out_dtype not in (None, x.dtype)
    if reason is not None or empty or small or other_out or (layout == _MASKED and x.stride(0) < x.stride(1)):
        return gemm.launch_gemm(x, weight, weight_scale, "mxfp4", layout, offsets=offsets, masked_m=masked_m, mx_path="register", out_dtype=out_dtype)
    shape = (weight.shape[0], x.shape[1], n) if layout == _MASKED else (x.shape[0], n)
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    for plan in plan_launches(x, weight, layout):  # (tail tiles: two launches writing disjoint rows)
        launch(plan, x, weight, weight_scale, out, offsets if offsets is not None else weight, masked_m if masked_m is not None else weight)
    return out


# ---------------------------------------------------------------------------------------------
# The ops and their registration


def _gluon_ops(prefill_only: bool):
    """`linear` and `grouped_gemm` on this kernel: for every call it serves, or (prefill_only) for prefill-sized ones."""

    def linear(
        x: torch.Tensor, weight: torch.Tensor, *, weight_scale: torch.Tensor | None = None, fmt: str = "dense", out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        gemm_ops.check_linear_args(x, weight, weight_scale, fmt, out_dtype)
        return _run(x, weight, weight_scale, _LINEAR, prefill_only=prefill_only, out_dtype=out_dtype)

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
            return _run(x, weight, weight_scale, _CONTIGUOUS, offsets=expert_offsets, prefill_only=prefill_only)
        gemm_ops.check_index_vector("masked_m", masked_m, experts, x.device)
        return _run(x, weight, weight_scale, _MASKED, masked_m=masked_m, prefill_only=prefill_only)

    suffix = "_gluon_prefill" if prefill_only else "_gluon"
    linear.__qualname__, grouped_gemm.__qualname__ = f"linear{suffix}", f"grouped_gemm{suffix}"
    return linear, grouped_gemm


linear, grouped_gemm = _gluon_ops(prefill_only=False)


def is_sm90(device) -> bool:
    """Whether `device` is a Hopper GPU (never starts a device that is not there)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and capability(device)[0] == 9


def _chosen(ctx) -> bool:
    """mxfp4_path=gluon on an SM90 device (elsewhere that option leaves mxfp4 to the default kernels)."""
    return MXFP4_PATH.value(ctx) == "gluon" and is_sm90(ctx.device)


def _chosen_for_prefill(ctx) -> bool:
    """mxfp4_path=auto on an SM90 device whose Triton has Gluon for Hopper (else auto is the tl kernels' alone)."""
    return MXFP4_PATH.value(ctx) == "auto" and GLUON_IMPORT_ERROR is None and is_sm90(ctx.device)


def _unusable(ctx) -> str | None:
    return gluon_unusable("mxfp4_path=gluon", GLUON_IMPORT_ERROR)


_NOTE = ("Gluon (SM90): warp-specialised, a TMA producer warp filling an mbarrier ring, consumer warpgroups dequantising e2m1 in "
         "registers into wgmma's A operand; bf16 x, K a multiple of 512, else the tl register path")
_prefill_linear, _prefill_grouped_gemm = _gluon_ops(prefill_only=True)
_MXFP4_BF16 = dict(formats=("mxfp4",), dtypes=(torch.bfloat16,))
REGISTRATIONS = [
    Registration(op="linear", fn=linear, **_MXFP4_BF16, when=_chosen, priority=2, unusable=_unusable, note=_NOTE + " (mxfp4_path=gluon)"),
    Registration(op="grouped_gemm", fn=grouped_gemm, **_MXFP4_BF16, when=_chosen, priority=2, unusable=_unusable, note=_NOTE + " (mxfp4_path=gluon)"),
]
# mxfp4_path=auto on SM90: prefill-sized calls on this kernel, the rest on the tl kernel (above the default registrations)
REGISTRATIONS += [
    Registration(op=op, fn=fn, **_MXFP4_BF16, when=_chosen_for_prefill, priority=1,
                 note=_NOTE + f"; mxfp4_path=auto: more than {SMALL_ROWS_PER_EXPERT} rows per expert only, fewer on the tl register path")
    for op, fn in (("linear", _prefill_linear), ("grouped_gemm", _prefill_grouped_gemm))
]
