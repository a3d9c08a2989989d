"""What the two SM90 Gluon mla_decode kernels share: mla_decode_fp8_gluon.py (FP8 cache, a converting warpgroup) and
mla_decode_gluon.py (bf16 cache, a TMA loader warp). Not a registration module: those two register their kernels.

Both run FlashMLA's SM90 decode schedule over 64-row tiles of the cache (one page) held as nine swizzled [64, 64] bf16
chunks in two stages; they differ only in who fills the stages. What is here:
- the shape constants and the split plan (`plan`: mla_decode.plan's rule, splits of whole pages);
- `_split_range`, `_attention_smem`, `_attention_barriers`, `_stage_q`: the kernels' prologue before the partitions
  fork (the program's split of the context, the shared memory and mbarriers of the attention warpgroups, q staged into
  shared memory by the default warps);
- `_attend`: the two attention warpgroups (the schedule is mla_decode_fp8_gluon.py's docstring), with per-key scales
  (SCALED: FP8 rows; a scale of -1 marks a key past the split) or without (bf16 rows: the keys past the split are
  masked by their column index);
- the host side: the checks of a call's q (`q_not_served`), the launch with mla_decode.py's combine (`launch`) and the
  op that falls back to the tl kernel (`op_with_fallback`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.triton_common import cdiv, pick_splits
from deepinfer_cuda.kernels.common import capability, num_sms
from deepinfer_cuda.kernels.gluon_hopper import GLUON_IMPORT_ERROR

if GLUON_IMPORT_ERROR is None:  # (else the kernel modules decline every call)
    from deepinfer_cuda.kernels.gluon_hopper import fence_async_shared, gl, gluon, mbarrier, warpgroup_mma, warpgroup_mma_wait
    from deepinfer_cuda.kernels.gluon_hopper import sync_warps as _sync_warps

LOG2E = 1.4426950408889634
LATENT = 512  # C
ROPE = 64  # R
PAGE = 64
BLOCK_M = 64  # query rows per program: one wgmma M
BLOCK_N = 64  # cache rows per tile (one page); each attention warpgroup scores half of them
SPLIT_GRANULE = 64  # tokens: a split is whole pages (and whole tiles)
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64


if GLUON_IMPORT_ERROR is None:

    @gluon.jit
    def _hidden_zero(x):
        """0 for an int32 x >= 0 (x >> 31), in PTX: neither LLVM nor ptxas sees it is 0, so a value computed from it is
        not hoisted out of a loop (or kept live across one) but recomputed where it is used."""
        return gl.inline_asm_elementwise("shr.u32 $0, $1, 31;", "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _fresh_state(BLOCK_M: gl.constexpr, row_layout: gl.constexpr, o_layout: gl.constexpr):
        """An attention warpgroup's online softmax before its first key: the row maxima (-inf), row sums (0) and its four
        [BLOCK_M, 64] float32 output accumulators (0)."""
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_layout)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_layout)
        acc0 = gl.zeros([BLOCK_M, 64], gl.float32, layout=o_layout)
        acc1 = gl.zeros([BLOCK_M, 64], gl.float32, layout=o_layout)
        acc2 = gl.zeros([BLOCK_M, 64], gl.float32, layout=o_layout)
        acc3 = gl.zeros([BLOCK_M, 64], gl.float32, layout=o_layout)
        return m_i, l_i, acc0, acc1, acc2, acc3

    @gluon.jit
    def _split_range(seq_lens_ptr, tokens_per_split, BLOCK_N: gl.constexpr):
        """The program's request length and its split's tokens lo .. split_end - 1 (num_tiles tiles of BLOCK_N rows;
        none for a split past the request's end)."""
        seq_len = gl.load(seq_lens_ptr + gl.program_id(1)).to(gl.int32)
        lo = gl.program_id(2) * tokens_per_split
        split_end = gl.minimum(lo + tokens_per_split, seq_len)
        num_tiles = gl.maximum(split_end - lo + BLOCK_N - 1, 0) // BLOCK_N
        return seq_len, lo, split_end, num_tiles

    @gluon.jit
    def _attention_smem(BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_CHUNKS: gl.constexpr):
        """q [9 chunks, 64, 64] and the two bf16 stages [2 * 9 chunks, 64, 64] (128-byte swizzle: wgmma's operand
        layout, and TMA's), and p [warpgroup, 64, 32]."""
        HALF: gl.constexpr = BLOCK_N // 2
        chunk_bf16: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], gl.bfloat16)
        q_layout_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 64], gl.bfloat16)
        p_layout_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF], gl.bfloat16)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_CHUNKS, BLOCK_M, 64], q_layout_s)
        bf_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * NUM_CHUNKS, BLOCK_N, 64], chunk_bf16)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, HALF], p_layout_s)  # [warpgroup]: its keys' p
        return q_smem, bf_smem, p_smem

    @gluon.jit
    def _attention_barriers(BLOCK_M: gl.constexpr):
        """The row maxima / sums exchange [tile parity * 2 + warpgroup, 64] and the mbarriers: bf_ready / bf_empty per
        stage (filled; released by both attention warpgroups), p_ready / p_free per warpgroup, mx_bar (both arrive)."""
        vec_s: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        mx_smem = gl.allocate_shared_memory(gl.float32, [4, BLOCK_M], vec_s)
        bf_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        bf_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mx_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(bf_ready.index(i), count=1)
            mbarrier.init(bf_empty.index(i), count=2)  # both attention warpgroups
            mbarrier.init(p_ready.index(i), count=1)
            mbarrier.init(p_free.index(i), count=1)
        mbarrier.init(mx_bar, count=2)
        return mx_smem, bf_ready, bf_empty, p_ready, p_free, mx_bar

    @gluon.jit
    def _stage_q(q_smem, q_nope_ptr, q_rope_ptr, stride_qn_b, stride_qn_s, stride_qn_h, stride_qr_b, stride_qr_s, stride_qr_h,
                 S: gl.constexpr, H: gl.constexpr, C: gl.constexpr, R: gl.constexpr, BLOCK_M: gl.constexpr, num_warps: gl.constexpr):
        """q [64 rows, 576] of the program's row tile -> 9 swizzled [64, 64] chunks (rows past S*H zero), by the default
        warps before the fork; then the fence that shows them (and the mbarriers' init) to wgmma and TMA."""
        q_blocked: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [num_warps, 1], [1, 0])
        offs_m = gl.program_id(0) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_blocked))
        offs_c = gl.arange(0, 64, layout=gl.SliceLayout(0, q_blocked))
        m_ok = gl.expand_dims(offs_m < S * H, 1)
        b64 = gl.program_id(1).to(gl.int64)
        qn_rows = gl.expand_dims(q_nope_ptr + b64 * stride_qn_b + (offs_m // H) * stride_qn_s + (offs_m % H) * stride_qn_h, 1)
        for c in gl.static_range(C // 64):
            q_smem.index(c).store(gl.load(qn_rows + c * 64 + gl.expand_dims(offs_c, 0), mask=m_ok, other=0.0).to(gl.bfloat16))
        qr_rows = gl.expand_dims(q_rope_ptr + b64 * stride_qr_b + (offs_m // H) * stride_qr_s + (offs_m % H) * stride_qr_h, 1)
        for c in gl.static_range(R // 64):
            q_smem.index(C // 64 + c).store(gl.load(qr_rows + c * 64 + gl.expand_dims(offs_c, 0), mask=m_ok, other=0.0).to(gl.bfloat16))
        fence_async_shared()

    @gluon.jit
    def _store_half(acc0, acc1, acc2, acc3, inv, dst_ptr, b, split, pid_m, half,
                    stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m,
                    S: gl.constexpr, H: gl.constexpr, BLOCK_M: gl.constexpr, DIRECT: gl.constexpr, mma_layout: gl.constexpr):
        """Columns half*256 .. half*256 + 255 of the program's rows: acc * inv, in dst's dtype (DIRECT: dst is the
        output [B, S, H, C]; else the split partials [B, splits, rows, C], float32). """
        offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout))
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, mma_layout))
        row_ok = gl.expand_dims(offs_m < S * H, 1)
        inv2 = gl.expand_dims(inv, 1)
        b64 = b.to(gl.int64)
        if DIRECT:
            base = dst_ptr + b64 * stride_o_b + (offs_m // H) * stride_o_s + (offs_m % H) * stride_o_h
        else:
            base = dst_ptr + b64 * stride_po_b + split * stride_po_split + offs_m * stride_po_m
        ptrs = gl.expand_dims(base + half * 256, 1) + gl.expand_dims(cols, 0)
        mask = row_ok & gl.expand_dims(cols < 64, 0)
        gl.store(ptrs, (acc0 * inv2).to(dst_ptr.dtype.element_ty), mask=mask)
        gl.store(ptrs + 64, (acc1 * inv2).to(dst_ptr.dtype.element_ty), mask=mask)
        gl.store(ptrs + 128, (acc2 * inv2).to(dst_ptr.dtype.element_ty), mask=mask)
        gl.store(ptrs + 192, (acc3 * inv2).to(dst_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _swap_rows(x, slots, mine, other, bar, phase, row_layout: gl.constexpr):
        """A per-row vector x handed to the other attention warpgroup and its own taken: x stored in slot `mine` of
        `slots`, both warpgroups' arrivals on `bar` (its phase `phase`) waited for, the other's slot read."""
        slots.index(mine).store(x)
        _sync_warps()
        mbarrier.arrive(bar)
        mbarrier.wait(bar, phase)
        return slots.index(other).load(row_layout)

    @gluon.jit
    def _add_sums_and_store(l_i, l_other, m_i, acc0, acc1, acc2, acc3, dst_ptr, part_lse_ptr, stride_o_b, stride_o_s, stride_o_h, stride_po_b,
                            stride_po_split, stride_po_m, stride_pl_b, stride_pl_split, S: gl.constexpr, H: gl.constexpr, BLOCK_M: gl.constexpr,
                            DIRECT: gl.constexpr, W: gl.constexpr, row_layout: gl.constexpr, o_layout: gl.constexpr):
        """Attention warpgroup W's epilogue: the row sums of both warpgroups added (the same operands in the same order in
        both: the same bits), then mla_decode.py's split_partial: 1/l (1 for a row that saw no key: its acc is 0) and lse
        (-inf there, stored by warpgroup 0 for split partials), and W's 256 output columns stored. The program's ids are
        read here, not captured: nothing but the loop's state is live across the loop (the worker warpgroup spilled when
        they were)."""
        if W == 0:
            l_sum = l_i + l_other
        else:
            l_sum = l_other + l_i
        pid_m = gl.program_id(0)
        b = gl.program_id(1)
        split = gl.program_id(2)
        offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)
        has = l_sum > 0.0
        l_safe = gl.where(has, l_sum, 1.0)
        inv = 1.0 / l_safe
        if not DIRECT:
            if W == 0:
                lse = gl.where(has, m_i + gl.log2(l_safe), float("-inf"))
                gl.store(part_lse_ptr + b.to(gl.int64) * stride_pl_b + split * stride_pl_split + offs_m, lse, mask=offs_m < S * H)
        _store_half(acc0, acc1, acc2, acc3, gl.convert_layout(inv, gl.SliceLayout(1, o_layout)), dst_ptr, b, split, pid_m, W,
                    stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m, S, H, BLOCK_M, DIRECT, o_layout)

    @gluon.jit
    def _scores(q_smem, bf_smem, t, j, W: gl.constexpr, HALF: gl.constexpr, NUM_CHUNKS: gl.constexpr, s):
        """Warpgroup W's scores of stage t (tile j): q . c[W*HALF : W*HALF + HALF]^T over the 9 chunks (9 async wgmma
        groups; s: zeros of the accumulator's layout, not accumulated)."""
        # q's chunks are indexed through a zero the compilers cannot see: else LLVM hoists the 36 loop-invariant q
        # descriptors out of the loop, 72 registers the attention warpgroups lack (they spilled)
        zero = _hidden_zero(j)
        for c in gl.static_range(NUM_CHUNKS):
            s = warpgroup_mma(q_smem.index(zero + c), bf_smem.index(t * NUM_CHUNKS + c).slice(W * HALF, HALF).permute((1, 0)), s,
                              use_acc=c > 0, is_async=True)
        return s

    @gluon.jit
    def _attend(q_smem, bf_smem, scale_smem, p_smem, mx_smem, bf_ready, bf_empty, p_ready, p_free, mx_bar,
                dst_ptr, part_lse_ptr, seq_len, lo, split_end, num_tiles, qk_scale,
                stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m, stride_pl_b, stride_pl_split,
                S: gl.constexpr, H: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_CHUNKS: gl.constexpr,
                DIRECT: gl.constexpr, W: gl.constexpr, SCALED: gl.constexpr):
        """Attention warpgroup W (0: the default partition, 1: a worker): scores of keys W*32 .. W*32+31 of each tile,
        the shared online softmax, output columns W*256 .. W*256+255 over all of the tile's keys. SCALED (FP8 rows):
        scale_smem [stage, 64] holds the rows' scales, -1 past the split's end; else (bf16 rows) scale_smem is unused
        and the keys past split_end are masked by their index."""
        HALF: gl.constexpr = BLOCK_N // 2
        O: gl.constexpr = 1 - W  # the other warpgroup
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        V0: gl.constexpr = W * 4  # the first of this warpgroup's four value chunks
        # SCALED: the keys past the split's end have scale -1 (the converter's mark); with S > 1, row m also sees only
        # keys <= its query position (seq_len - S + m // H); with S = 1 that is every key before seq_len. Unscaled:
        # row m sees the keys before min(its key_end, split_end), key_end = seq_len with S = 1
        if S > 1:
            key_end = seq_len - S + (gl.program_id(0) * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)) // H + 1
            if not SCALED:
                key_end = gl.minimum(key_end, split_end)
        if S > 1 or not SCALED:
            cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, s_layout))
        m_i, l_i, acc0, acc1, acc2, acc3 = _fresh_state(BLOCK_M, row_layout, o_layout)
        p_op = gl.zeros([BLOCK_M, HALF], gl.bfloat16, layout=p_layout)
        # tile 0's scores. A tile's PV wgmmas and the next tile's QK^T ones are issued in the same iteration and all are
        # waited for in it: no wgmma in flight across the loop's back edge (ptxas then cannot prove the accumulators
        # idle and serialises every wgmma: FlashMLA's note)
        s = gl.zeros([BLOCK_M, HALF], gl.float32, layout=s_layout)
        if num_tiles > 0:
            mbarrier.wait(bf_ready.index(0), 0)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(_scores(q_smem, bf_smem, 0, num_tiles, W, HALF, NUM_CHUNKS, s),))
        for j in range(num_tiles):
            t = j % 2
            if SCALED:
                sc = scale_smem.index(t).slice(W * HALF, HALF).load(gl.SliceLayout(0, s_layout))
                visible = gl.expand_dims(sc >= 0.0, 0)
                if S > 1:
                    visible = visible & (gl.expand_dims(cols, 0) < gl.expand_dims(key_end - (lo + j * BLOCK_N + W * HALF), 1))
                scores = gl.where(visible, s * gl.expand_dims(sc * qk_scale, 0), float("-inf"))
            else:
                if S > 1:
                    visible = gl.expand_dims(cols, 0) < gl.expand_dims(key_end - (lo + j * BLOCK_N + W * HALF), 1)
                else:
                    visible = gl.expand_dims(cols < split_end - (lo + j * BLOCK_N + W * HALF), 0)
                scores = gl.where(visible, s * qk_scale, float("-inf"))
            # 2. the row maxima of both halves (slot j % 2: the other may still read slot (j - 1) % 2)
            m_mine = gl.max(scores, axis=1)
            m_other = _swap_rows(m_mine, mx_smem, t * 2 + W, t * 2 + O, mx_bar, j & 1, row_layout)
            if W == 0:  # (the same operands in the same order in both warpgroups: the same bits)
                m_tile = gl.maximum(m_mine, m_other)
            else:
                m_tile = gl.maximum(m_other, m_mine)
            # 3. mla_decode.py's softmax_block (base 2): a row that has seen only -inf keeps m = -inf and weights 0
            m_new = gl.maximum(m_i, m_tile)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(scores - gl.expand_dims(m_safe, 1))
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            if SCALED:
                pv = (p * gl.expand_dims(sc, 0)).to(gl.bfloat16)  # the weight times the key's scale: (p * s) . v (p = 0 where masked)
            else:
                pv = p.to(gl.bfloat16)
            a2 = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
            # 4. this half of p for the other warpgroup, once it has read the previous one
            mbarrier.wait(p_free.index(W), (j & 1) ^ 1)
            p_smem.index(W).store(pv)
            fence_async_shared()
            _sync_warps()
            mbarrier.arrive(p_ready.index(W))
            # 5. acc[:, W*256 : W*256+256] = acc * alpha + p . c over the tile: own keys (p in registers), then the
            # other's (p from shared memory)
            p_op = gl.convert_layout(pv, p_layout)
            o0 = warpgroup_mma(p_op, bf_smem.index(t * NUM_CHUNKS + V0 + 0).slice(W * HALF, HALF), acc0 * a2, is_async=True)
            o1 = warpgroup_mma(p_op, bf_smem.index(t * NUM_CHUNKS + V0 + 1).slice(W * HALF, HALF), acc1 * a2, is_async=True)
            o2 = warpgroup_mma(p_op, bf_smem.index(t * NUM_CHUNKS + V0 + 2).slice(W * HALF, HALF), acc2 * a2, is_async=True)
            o3 = warpgroup_mma(p_op, bf_smem.index(t * NUM_CHUNKS + V0 + 3).slice(W * HALF, HALF), acc3 * a2, is_async=True)
            mbarrier.wait(p_ready.index(O), j & 1)
            p_other = p_smem.index(O)
            o0 = warpgroup_mma(p_other, bf_smem.index(t * NUM_CHUNKS + V0 + 0).slice(O * HALF, HALF), o0, is_async=True)
            o1 = warpgroup_mma(p_other, bf_smem.index(t * NUM_CHUNKS + V0 + 1).slice(O * HALF, HALF), o1, is_async=True)
            o2 = warpgroup_mma(p_other, bf_smem.index(t * NUM_CHUNKS + V0 + 2).slice(O * HALF, HALF), o2, is_async=True)
            o3 = warpgroup_mma(p_other, bf_smem.index(t * NUM_CHUNKS + V0 + 3).slice(O * HALF, HALF), o3, is_async=True)
            if j + 1 < num_tiles:
                # 1. the next tile's scores, issued behind this PV; once this PV is done (all groups but the
                # NUM_CHUNKS just issued) its stage and the other's p are free
                mbarrier.wait(bf_ready.index(1 - t), ((j + 1) // 2) & 1)
                s_next = _scores(q_smem, bf_smem, 1 - t, j + 1, W, HALF, NUM_CHUNKS, gl.zeros([BLOCK_M, HALF], gl.float32, layout=s_layout))
                acc0, acc1, acc2, acc3, p_op = warpgroup_mma_wait(num_outstanding=NUM_CHUNKS, deps=(o0, o1, o2, o3, p_op))
                _sync_warps()
                mbarrier.arrive(bf_empty.index(t))
                mbarrier.arrive(p_free.index(O))
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s_next,))
            else:
                acc0, acc1, acc2, acc3, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1, o2, o3, p_op))
        # the row sums of both halves, each rescaled by the same alphas: through the maxima's slots (tile parity
        # num_tiles: the other read its last maxima from the other parity) and barrier (phase num_tiles)
        tf = num_tiles % 2
        l_other = _swap_rows(l_i, mx_smem, tf * 2 + W, tf * 2 + O, mx_bar, tf, row_layout)
        _add_sums_and_store(l_i, l_other, m_i, acc0, acc1, acc2, acc3, dst_ptr, part_lse_ptr, stride_o_b, stride_o_s, stride_o_h, stride_po_b,
                            stride_po_split, stride_po_m, stride_pl_b, stride_pl_split, S, H, BLOCK_M, DIRECT, W, row_layout, o_layout)


# ---------------------------------------------------------------------------------------------
# Host side: the plan, the checks of a call's q, the launch with the combine


@dataclass(frozen=True)
class GluonPlan:
    """One launch of a Gluon mla_decode kernel (host shapes only)."""

    rows: int  # S * H
    row_tiles: int
    tokens_per_split: int
    num_splits: int

    @property
    def direct(self) -> bool:
        return self.num_splits == 1


def plan(batch: int, rows: int, capacity: int, device: torch.device, num_splits: int | None = None, tokens_per_split: int | None = None,
         min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT, max_splits: int = MAX_SPLITS) -> GluonPlan:
    """Row tiles and splits from host-known shapes (mla_decode.plan's rule: pick_splits over the SMs, at most
    max_splits and capacity / min_tokens_per_split, splits of whole pages); one CTA per SM (shared memory)."""
    row_tiles = cdiv(rows, BLOCK_M)
    granules = max(1, cdiv(capacity, SPLIT_GRANULE))
    if tokens_per_split is not None:
        per_split = max(1, cdiv(tokens_per_split, SPLIT_GRANULE))
    else:
        if num_splits is None:
            limit = min(max_splits, granules, max(1, capacity // min_tokens_per_split))
            num_splits = pick_splits(batch * row_tiles, num_sms(device), limit)
        num_splits = max(1, min(num_splits, granules))
        per_split = cdiv(granules, num_splits)
    return GluonPlan(rows=rows, row_tiles=row_tiles, tokens_per_split=per_split * SPLIT_GRANULE, num_splits=cdiv(granules, per_split))


def q_not_served(q_nope, q_rope, sliding_window, overrides=None, tiles_of_one_query=False) -> str | None:
    """Why neither Gluon kernel serves a call, from everything but its cache (None: the cache decides). Devices, shapes,
    dtypes and strides only."""
    if GLUON_IMPORT_ERROR is not None:
        return f"no Gluon for Hopper in this Triton ({GLUON_IMPORT_ERROR})"
    if q_nope.device.type not in ("cuda", "meta"):  # ("meta" tensors pass: the compile check)
        return f"not on a GPU ({q_nope.device.type}: the interpreter runs the tl kernel)"
    if q_nope.device.type == "cuda" and capability(q_nope.device)[0] != 9:
        return f"not an SM90 GPU (capability {capability(q_nope.device)})"
    if q_nope.dtype != torch.bfloat16 or q_rope.dtype != torch.bfloat16:
        return f"q is {q_nope.dtype}/{q_rope.dtype}, not bfloat16"
    if sliding_window is not None:
        return "sliding window"
    if overrides:
        return "tuning overrides (the tl kernel's)"
    _, s, h, c = q_nope.shape
    if tiles_of_one_query and s != 1:
        return "tiles_of_one_query with S > 1 (deterministic mode keeps the tl kernel)"
    if c != LATENT or q_rope.shape[-1] != ROPE:
        return f"C={c}, R={q_rope.shape[-1]}: wants {LATENT} + {ROPE}"
    rows = s * h
    if not (1 <= rows <= BLOCK_M or rows == 2 * BLOCK_M):
        return f"S*H = {rows}: wants <= {BLOCK_M} or {2 * BLOCK_M}"
    if q_nope.stride(-1) != 1 or q_rope.stride(-1) != 1:
        return "q rows are not contiguous"
    return None


def output_and_block_table(q_nope: torch.Tensor, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """A launch's output [B, S, H, C] in q's dtype, the block table with contiguous rows, and whether the call is empty
    (no request, query or head: nothing to launch)."""
    batch, num_queries, heads, latent_dim = q_nope.shape
    out = torch.empty(batch, num_queries, heads, latent_dim, dtype=q_nope.dtype, device=q_nope.device)
    return out, (block_table if block_table.stride(-1) == 1 else block_table.contiguous()), batch == 0 or num_queries == 0 or heads == 0


def launch(kernel, cache, cache_strides: tuple, q_nope, q_rope, block_table, seq_lens, softmax_scale: float,
           num_splits: int | None, tokens_per_split: int | None, split_limits: dict | None = None, **constexprs) -> torch.Tensor:
    """One launch of a Gluon mla_decode kernel (its arguments: the cache, q, the block table, the lengths, the output
    or partials, the lse, qk_scale, tokens_per_split, then `cache_strides` and the strides of q, the block table, the
    output and partials; its constexprs S, H, C, R, PAGE, BLOCK_M, BLOCK_N, DIRECT and `constexprs`) over a call it
    serves, then, with several splits, mla_decode.py's combine kernel (the wide one for few (row tile, request) groups
    and many splits, as its plan does). split_limits: `plan`'s min_tokens_per_split / max_splits where not its defaults."""
    from deepinfer_cuda.kernels import mla_decode as tl_mla

    batch, num_queries, heads, latent_dim = q_nope.shape
    out, block_table, empty = output_and_block_table(q_nope, block_table)
    if empty:
        return out
    p = plan(batch, num_queries * heads, block_table.shape[1] * PAGE, q_nope.device, num_splits, tokens_per_split, **(split_limits or {}))
    if p.direct:
        part_out, part_lse = out, out  # unused
        po_strides, pl_strides = (0, 0, 0), (0, 0)
    else:
        part_out = torch.empty(batch, p.num_splits, p.rows, latent_dim, dtype=torch.float32, device=q_nope.device)
        part_lse = torch.empty(batch, p.num_splits, p.rows, dtype=torch.float32, device=q_nope.device)
        po_strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2))
        pl_strides = (part_lse.stride(0), part_lse.stride(1))
    kernel[(p.row_tiles, batch, p.num_splits)](
        cache, q_nope, q_rope, block_table, seq_lens,
        out if p.direct else part_out, part_lse,
        float(softmax_scale) * LOG2E,
        p.tokens_per_split,
        *cache_strides,
        q_nope.stride(0), q_nope.stride(1), q_nope.stride(2),
        q_rope.stride(0), q_rope.stride(1), q_rope.stride(2),
        block_table.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        *po_strides,
        *pl_strides,
        S=num_queries, H=heads, C=LATENT, R=ROPE, PAGE=PAGE, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, DIRECT=p.direct,
        **constexprs,
        num_warps=4,
    )
    if p.direct:
        return out
    tl_cfg = tl_mla._config(q_nope.device, tl_mla._variant(p.rows))  # the tl kernel's merge choice for these rows
    tl_mla.merge_splits(part_out, part_lse, out, p.num_splits, tl_mla.merges_wide(tl_cfg, p.num_splits, p.row_tiles * batch, q_nope.device))
    return out


def op_with_fallback(launch_gluon, module: str, min_rows: int = 1):
    """The mla_decode op (named as defined in `module`) on `launch_gluon` (a Gluon kernel's launch: None for a call it
    does not serve) for the calls of at least `min_rows` query rows (S * H), else on mla_decode.py's tl kernel."""

    def mla_decode(
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        softmax_scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        from deepinfer_cuda.kernels import mla_decode as tl_mla

        args = (q_nope, q_rope, kv_cache, block_table, seq_lens, softmax_scale, sliding_window)
        out = launch_gluon(*args) if q_nope.shape[1] * q_nope.shape[2] >= min_rows else None
        return out if out is not None else tl_mla.launch_mla_decode(*args)

    mla_decode.__module__, mla_decode.__qualname__ = module, "mla_decode"
    return mla_decode


__all__ = ["BLOCK_M", "BLOCK_N", "GluonPlan", "LATENT", "LOG2E", "MAX_SPLITS", "MIN_TOKENS_PER_SPLIT", "PAGE", "ROPE", "SPLIT_GRANULE",
           "launch", "op_with_fallback", "output_and_block_table", "plan", "q_not_served"]  # fmt: skip
