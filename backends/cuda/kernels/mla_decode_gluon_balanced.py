"""The balanced persistent grid of the SM90 Gluon mla_decode over the bf16 cache: mla_decode_gluon.py's tuning switch
"balanced" (True: this module; off by default). Compiled for sm90 (`deepinfer bench compile --arch sm90 --case "bf16
gluon balanced"`); its schedule, its combine and a torch emulation of its segment loop are checked on the CPU
(tests/cuda/test_mla_decode_gluon_balanced.py); on an H100 (2026-12-07) its GPU tests and conformance passed, and the
sweep timed it slower than the split grid at every case (docs/backends/cuda.md): hence off. Not a registration module.

Why: the default grid (row tiles, B, splits) of 128-head B128 ctx4096 is 256 programs of 64 key tiles on 132 SMs, so
every SM runs two programs, 128 tiles, where an even division is 16384 / 132 = 124.1 tiles, and each program's
prologue (q staged, the stages filled) and epilogue (the output stored) overlap nothing. FlashMLA's answer (its tile
scheduler metadata, get_mla_metadata) is a persistent grid with a contiguous share of the flattened (request, key tile)
work per CTA, computed on the device from the lengths; this is that, for the seesaw schedule in its early-release
order (mla_decode_gluon_seesaw.py).

The unit of work: (row tile, request, key tile of 64 cache rows). The key tiles of all requests are flattened request
by request; `partitions` = SMs // row tiles contiguous shares of them are cut once, and CTA c takes share c %
partitions for row tile c // partitions (grid: row tiles x partitions, one CTA per SM). Both row tiles of a request
thus get the same shares: CTA c and c + partitions read the same pages at the same time (the second's reads hit L2, as
the default grid's two row-tile programs of a request do), and the balance is that of one row tile's work.

The schedule (`_balanced_schedule_kernel`, one tl program, from the device lengths: CUDA-graph safe, sized from host shapes):
request b costs cdiv(len_b, 64) tiles plus `overhead` (the tuning entry's "balanced_overhead_tiles": a segment's q
staging and epilogue, in tiles; 0 for an empty request, which has no segment); the costs are laid end to end, and share
p starts at position min(p * payload, total), payload = cdiv(total, partitions) (FlashMLA's cut, without its separate
per-CTA overhead). A start inside a request's overhead is its tile 0; inside its tiles, that tile. Share p covers from
its start to share p + 1's: every (request, tile) exactly once, at most `payload` tiles a share. It writes
- sched [partitions + 1, 3] int32: each share's start (request, tile, the index of that segment among the request's);
- num_splits [B]: the request's segments (0 for an empty request, 1 for a request inside one share);
- slot_start [B]: the first of the request's partial slots (slots only for requests of 2+ segments). Boundaries inside
  requests are at most partitions - 1, so at most 2 * (partitions - 1) slots: the partials' bound from host shapes.

The kernel (`_mla_decode_balanced_kernel`): each partition walks the CTA's segments (request b, tiles lo .. hi - 1) in
order, with a tile counter g over the whole CTA. g sets the stage (g % 2), the phases ((g // 2) & 1) and the seesaw's
ownership (warpgroup g % 2 scores tile g): across a segment boundary the loader keeps streaming and the handshakes
continue as within one (the owner of tile g + 1 has taken tile g in before it publishes, whichever segments they are
in). Per segment, each attention warpgroup
- stages its half of q's chunks (even / odd) of (row tile, b) from global memory, fences, and meets the other on
  `q_bar` (phase: the segment count): both have finished the previous segment's scores (its row sums exchange) before
  either writes q, and both see all of q before scoring. A full stall of the attention warpgroups per segment (the
  loader's two stages fill meanwhile); q is not double-buffered: the SM's shared memory has no room for a second q;
- runs the seesaw-early-release tiles with its online softmax restarted;
- exchanges row sums through slot [segment parity][warpgroup] on `sums_bar` (the next segment's q_bar meeting already
  keeps a warpgroup from rewriting a slot the other has not read: the handshake model's finding; the second slot costs
  256 bytes and keeps that true without q_bar);
- stores the normalised output directly when the request has one segment, else its partial (float32, normalised) and
  log2-domain lse (warpgroup 0) into the slot slot_start[b] + segment index.
`_balanced_combine_kernel` then merges, per request of != 1 segments, its slots in order (mla_decode.py's `_merge_splits`: the
split kernel's combine arithmetic, reading a slot range per request); an empty request gets zeros (no slot), as the
split kernel's output for a request of no key. The existing combine kernels are not used: they read a fixed split
count per request ([B, splits, rows, C]), and a request may be cut by any number of shares (one long request among
short ones: up to `partitions`), so that layout's bound would be B x partitions x rows x 512 float32 (2 GiB at B128).

Registers: the table's 232 / 40 split; the segment loop's counters are reloaded from global memory where needed rather
than kept live across the tile loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.triton_common import cdiv, next_power_of_2
from deepinfer_cuda.kernels.common import num_sms, pdl_launch, pdl_prologue
from deepinfer_cuda.kernels.gluon_hopper import GLUON_IMPORT_ERROR
from deepinfer_cuda.kernels.mla_decode import _merge_splits

SCHED_FIELDS = 3  # a share's start: request, tile, segment index within the request
SCHEDULE_BLOCK_B = 32  # requests a schedule-kernel step reads
COMBINE_BLOCK_M = 16  # rows a combine program merges

if GLUON_IMPORT_ERROR is None:  # (else mla_decode_gluon.py declines every call)
    from deepinfer_cuda.kernels.gluon_hopper import fence_async_shared, gl, gluon, mbarrier, reinterpret_shared, warpgroup_mma_wait
    from deepinfer_cuda.kernels.gluon_hopper import sync_warps as _sync_warps
    from deepinfer_cuda.kernels.mla_decode_gluon import _copy_tile, _zero_rows_from
    from deepinfer_cuda.kernels.mla_decode_gluon_parts import _fresh_state, _hidden_zero, _store_half, _swap_rows
    from deepinfer_cuda.kernels.mla_decode_gluon_seesaw import _online_softmax, _publish_and_own_pv, _scores_tile, _seesaw_smem, _take_in_whole


@triton.jit
def _balanced_schedule_kernel(seq_lens_ptr, sched_ptr, num_splits_ptr, slot_start_ptr, batch, partitions,
                     OVERHEAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr = False):
    """One program: the shares' starts, each request's segment count and first partial slot (the module docstring)."""
    pdl_prologue(PDL)
    offs_b = tl.arange(0, BLOCK_B)
    total = 0
    for b0 in range(0, batch, BLOCK_B):
        lens = tl.load(seq_lens_ptr + b0 + offs_b, mask=b0 + offs_b < batch, other=0).to(tl.int32)
        tiles = (tl.maximum(lens, 0) + BLOCK_N - 1) // BLOCK_N
        total += tl.sum(tl.where(tiles > 0, tiles + OVERHEAD, 0), axis=0)
    payload = tl.maximum((total + partitions - 1) // partitions, 1)
    offs_p = tl.arange(0, BLOCK_P)
    x = tl.minimum(offs_p * payload, total)  # share p's start (p = partitions: the end)
    found = tl.zeros([BLOCK_P], dtype=tl.int32)  # requests wholly before x
    before = tl.zeros([BLOCK_P], dtype=tl.int32)  # their cost
    carry = 0
    slots = 0
    for b0 in range(0, batch, BLOCK_B):
        ok = b0 + offs_b < batch
        lens = tl.load(seq_lens_ptr + b0 + offs_b, mask=ok, other=0).to(tl.int32)
        tiles = (tl.maximum(lens, 0) + BLOCK_N - 1) // BLOCK_N
        cost = tl.where(tiles > 0, tiles + OVERHEAD, 0)
        incl = carry + tl.cumsum(cost, axis=0)
        excl = incl - cost
        done = (incl[None, :] <= x[:, None]) & ok[None, :]
        found += tl.sum(done.to(tl.int32), axis=1)
        before += tl.sum(tl.where(done, cost[None, :], 0), axis=1)
        # shares starting inside the request's tiles (not its overhead): p * payload in (excl + OVERHEAD, incl)
        first = (excl + OVERHEAD) // payload + 1
        last = tl.minimum(partitions - 1, (incl - 1) // payload)
        splits = tl.where(tiles > 0, 1 + tl.maximum(last - first + 1, 0), 0)
        tl.store(num_splits_ptr + b0 + offs_b, splits, mask=ok)
        own = tl.where(splits > 1, splits, 0)
        tl.store(slot_start_ptr + b0 + offs_b, slots + tl.cumsum(own, axis=0) - own, mask=ok)
        slots += tl.sum(own, axis=0)
        carry += tl.sum(cost, axis=0)
    tile = tl.maximum(x - before - OVERHEAD, 0)
    # the segment's index: the shares q <= p starting inside the same request's tiles
    index = tl.where(tile > 0, offs_p - (before + OVERHEAD) // payload, 0)
    p_ok = offs_p <= partitions
    tl.store(sched_ptr + offs_p * 3 + 0, found, mask=p_ok)
    tl.store(sched_ptr + offs_p * 3 + 1, tile, mask=p_ok)
    tl.store(sched_ptr + offs_p * 3 + 2, index, mask=p_ok)


@triton.jit
def _balanced_combine_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits_ptr, slot_start_ptr, rows,
                    stride_ps, stride_pm, stride_ls, stride_o_b, stride_o_s, stride_o_h,
                    H: tl.constexpr, C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False):
    """One program per (BLOCK_M rows, request): a request of several segments gets its slots merged in order, an empty
    one zeros; a request of one segment was written by the kernel (nothing here)."""
    pdl_prologue(PDL)  # the partials are the previous launch's: wait for it (a PDL launch may start before it ends)
    b = tl.program_id(1)
    splits = tl.load(num_splits_ptr + b)
    if splits != 1:
        slot = tl.load(slot_start_ptr + b).to(tl.int64)
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_c = tl.arange(0, BLOCK_C)
        _merge_splits(part_out_ptr + slot * stride_ps, part_lse_ptr + slot * stride_ls, out_ptr + b.to(tl.int64) * stride_o_b, offs_m, offs_m < rows,
                      offs_m // H, offs_m % H, offs_c, offs_c < C, splits, stride_ps, stride_pm, stride_ls, stride_o_s, stride_o_h, BLOCK_M, BLOCK_C)


if GLUON_IMPORT_ERROR is None:

    @gluon.jit
    def _share(meta_ptr, partitions, batch, zero):
        """The CTA's row tile and its share from the schedule (meta: sched [partitions + 1, 3], then num_splits [B],
        slot_start [B]): the first request, tile and segment index, the end (request, tile; exclusive), and the requests
        to walk, first .. min(end request, B - 1). zero: a _hidden_zero, so that the loads are repeated where used (not
        kept live across the tile loop: the attention warpgroups spilled)."""
        c = gl.program_id(0)
        rt = c // partitions
        p = c - rt * partitions + zero
        b_first = gl.load(meta_ptr + p * 3 + 0)
        t_first = gl.load(meta_ptr + p * 3 + 1)
        k_first = gl.load(meta_ptr + p * 3 + 2)
        b_end = gl.load(meta_ptr + p * 3 + 3)
        t_end = gl.load(meta_ptr + p * 3 + 4)
        return rt, b_first, t_first, k_first, b_end, t_end, gl.minimum(b_end + 1, batch)

    @gluon.jit
    def _segment(meta_ptr, seq_lens_ptr, partitions, batch, b, BLOCK_N: gl.constexpr):
        """Request b's length and the CTA's tiles lo .. hi - 1 of it (none: hi <= lo)."""
        _rt, b_first, t_first, _k, b_end, t_end, _stop = _share(meta_ptr, partitions, batch, _hidden_zero(b))
        seq_len = gl.load(seq_lens_ptr + b).to(gl.int32)
        lo = gl.where(b == b_first, t_first, 0)
        hi = gl.where(b == b_end, t_end, (gl.maximum(seq_len, 0) + BLOCK_N - 1) // BLOCK_N)
        return seq_len, lo, hi

    @gluon.jit
    def _balanced_smem(BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_CHUNKS: gl.constexpr):
        """mla_decode_gluon_seesaw._seesaw_smem's buffers with the row sums in two slots of segment parity
        [parity * 2 + warpgroup, 64], and q_bar (both warpgroups arrive once a segment's q is stored)."""
        q_smem, bf_smem, p_smem, mx_smem, sum_smem, bf_ready, bf_empty, published, sums_bar = _seesaw_smem(BLOCK_M, BLOCK_N, NUM_CHUNKS, 4)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=2)
        return q_smem, bf_smem, p_smem, mx_smem, sum_smem, bf_ready, bf_empty, published, sums_bar, q_bar

    @gluon.jit
    def _stage_q_half(q_smem, q_nope_ptr, q_rope_ptr, b, rt, stride_qn_b, stride_qn_s, stride_qn_h, stride_qr_b, stride_qr_s, stride_qr_h,
                      S: gl.constexpr, H: gl.constexpr, C: gl.constexpr, R: gl.constexpr, BLOCK_M: gl.constexpr, W: gl.constexpr):
        """Warpgroup W's chunks (c % 2 == W) of q [64 rows of row tile rt, 576] of request b (rows past S*H zero)."""
        q_blocked: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        offs_m = rt * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_blocked))
        offs_c = gl.arange(0, 64, layout=gl.SliceLayout(0, q_blocked))
        m_ok = gl.expand_dims(offs_m < S * H, 1)
        b64 = b.to(gl.int64)
        qn_rows = gl.expand_dims(q_nope_ptr + b64 * stride_qn_b + (offs_m // H) * stride_qn_s + (offs_m % H) * stride_qn_h, 1)
        qr_rows = gl.expand_dims(q_rope_ptr + b64 * stride_qr_b + (offs_m // H) * stride_qr_s + (offs_m % H) * stride_qr_h, 1)
        for c in gl.static_range(C // 64):
            if c % 2 == W:
                q_smem.index(c).store(gl.load(qn_rows + c * 64 + gl.expand_dims(offs_c, 0), mask=m_ok, other=0.0).to(gl.bfloat16))
        for c in gl.static_range(R // 64):
            if (C // 64 + c) % 2 == W:
                q_smem.index(C // 64 + c).store(gl.load(qr_rows + c * 64 + gl.expand_dims(offs_c, 0), mask=m_ok, other=0.0).to(gl.bfloat16))

    @gluon.jit
    def _visible_at(key0, seq_len, split_end, rt, S: gl.constexpr, H: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    s_layout: gl.constexpr):
        """Which keys key0 .. key0 + 63 each row of row tile rt sees: those before split_end, and with S > 1 those <=
        its row's query position (mla_decode_gluon_seesaw._visible with the row tile an argument)."""
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        if S > 1:
            rows = rt * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            key_end = gl.minimum(seq_len - S + rows // H + 1, split_end)
            return gl.expand_dims(cols, 0) < gl.expand_dims(key_end - key0, 1)
        else:
            return gl.expand_dims(cols < split_end - key0, 0)

    @gluon.jit
    def _attend_balanced(q_smem, bf_smem, p_smem, mx_smem, sum_smem, bf_ready, bf_empty, published, sums_bar, q_bar,
                         q_nope_ptr, q_rope_ptr, seq_lens_ptr, meta_ptr, out_ptr, part_ptr, qk_scale, partitions, batch,
                         stride_qn_b, stride_qn_s, stride_qn_h, stride_qr_b, stride_qr_s, stride_qr_h,
                         S: gl.constexpr, H: gl.constexpr, C: gl.constexpr, R: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         NUM_CHUNKS: gl.constexpr, W: gl.constexpr):
        """Attention warpgroup W over the CTA's segments (the module docstring): per segment q staged, the seesaw's
        early-release tiles (warpgroup g % 2 scores the CTA's tile g), the row sums exchanged, the output or a partial."""
        O: gl.constexpr = 1 - W
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        V0: gl.constexpr = W * 4
        ROWS: gl.constexpr = S * H
        _rt, b_first, _t, _k, _b, _t_end, b_stop = _share(meta_ptr, partitions, batch, 0)
        g = 0  # the CTA's tiles before this segment
        seg = 0  # the CTA's segments before this one
        for b in range(b_first, b_stop):
            seq_len, lo, hi = _segment(meta_ptr, seq_lens_ptr, partitions, batch, b, BLOCK_N)
            if hi > lo:
                rt = gl.program_id(0) // partitions
                # both warpgroups are past the previous segment's scores (its sums exchange): q of (rt, b), then both meet
                _stage_q_half(q_smem, q_nope_ptr, q_rope_ptr, b, rt, stride_qn_b, stride_qn_s, stride_qn_h, stride_qr_b, stride_qr_s, stride_qr_h,
                              S, H, C, R, BLOCK_M, W)
                fence_async_shared()
                _sync_warps()
                mbarrier.arrive(q_bar)
                mbarrier.wait(q_bar, seg & 1)
                # tile j of the CTA starts at key (lo - g + j) * BLOCK_N: the masks' bounds relative to key (lo - g) * BLOCK_N
                split_lim = gl.minimum(hi * BLOCK_N, seq_len) - (lo - g) * BLOCK_N
                len_lim = seq_len - (lo - g) * BLOCK_N
                end = g + hi - lo
                m_i, l_i, acc0, acc1, acc2, acc3 = _fresh_state(BLOCK_M, row_layout, o_layout)
                if g % 2 == O:  # the segment's first tile is the other's: taken in before the own ones
                    m_i, l_i, acc0, acc1, acc2, acc3 = _take_in_whole(m_i, l_i, acc0, acc1, acc2, acc3, p_smem, mx_smem, bf_smem, bf_empty,
                                                                      published, g, V0, O, NUM_CHUNKS, row_layout, o_layout)
                for j in range(g + (g + W) % 2, end, 2):  # the own tiles (j % 2 == W)
                    t = j % 2
                    mbarrier.wait(bf_ready.index(t), (j // 2) & 1)
                    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
                    s = warpgroup_mma_wait(num_outstanding=0, deps=(_scores_tile(q_smem, bf_smem, t, j, NUM_CHUNKS, s),))
                    visible = _visible_at(j * BLOCK_N, len_lim, split_lim, rt, S, H, BLOCK_M, BLOCK_N, s_layout)
                    scores = gl.where(visible, s * qk_scale, float("-inf"))
                    m_i, l_i, alpha, p = _online_softmax(m_i, l_i, scores)
                    pv = p.to(gl.bfloat16)
                    acc0, acc1, acc2, acc3 = _publish_and_own_pv(pv, m_i, alpha, p_smem, mx_smem, bf_smem, bf_empty, published, t, _hidden_zero(j),
                                                                 W, V0, NUM_CHUNKS, acc0, acc1, acc2, acc3, o_layout, p_layout)
                    if j + 1 < end:  # the other's next tile, before this warpgroup waits for its own next stage
                        m_i, l_i, acc0, acc1, acc2, acc3 = _take_in_whole(m_i, l_i, acc0, acc1, acc2, acc3, p_smem, mx_smem, bf_smem, bf_empty,
                                                                          published, j + 1, V0, O, NUM_CHUNKS, row_layout, o_layout)
                # both end at the maxima of the segment's last tile: their row sums add (slots of this segment's parity)
                sp = seg % 2
                l_other = _swap_rows(l_i, sum_smem, sp * 2 + W, sp * 2 + O, sums_bar, seg & 1, row_layout)
                if W == 0:  # (the same operands in the same order in both warpgroups: the same bits)
                    l_sum = l_i + l_other
                else:
                    l_sum = l_other + l_i
                offs_m = rt * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)
                has = l_sum > 0.0
                l_safe = gl.where(has, l_sum, 1.0)
                inv = gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, o_layout))
                if gl.load(meta_ptr + 3 * (partitions + 1) + b) == 1:  # the request is this segment: the output [B, S, H, C]
                    _store_half(acc0, acc1, acc2, acc3, inv, out_ptr, b, 0, rt, W, ROWS * C, H * C, C, 0, 0, 0, S, H, BLOCK_M, True, o_layout)
                else:  # a partial, in the request's slot of this segment's index (part: [slots, rows, C], then lse [slots, rows])
                    _r, b_share, _t, k_share, _b, _t_end, _stop = _share(meta_ptr, partitions, batch, _hidden_zero(end))
                    slot = gl.load(meta_ptr + 3 * (partitions + 1) + batch + b) + gl.where(b == b_share, k_share, 0)
                    if W == 0:
                        lse = gl.where(has, m_i + gl.log2(l_safe), float("-inf"))
                        lse_ptr = part_ptr + gl.maximum(2 * partitions - 2, 1) * ROWS * C  # (max_slots)
                        gl.store(lse_ptr + slot.to(gl.int64) * ROWS + offs_m, lse, mask=offs_m < ROWS)
                    _store_half(acc0, acc1, acc2, acc3, inv, part_ptr, slot, 0, rt, W, 0, 0, 0, ROWS * C, 0, C, S, H, BLOCK_M, False, o_layout)
                g = end
                seg += 1

    @gluon.jit
    def _loader_balanced(kv_desc, block_table_ptr, stride_bt_b, seq_lens_ptr, meta_ptr, partitions, batch, bf_smem, bf_bands, bf_ready, bf_empty,
                         landed, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, NUM_CHUNKS: gl.constexpr):
        """One warp: the CTA's tiles in order across its segments, tile g into stage g % 2 once both attention
        warpgroups released it (mla_decode_gluon._loader's per tile; a request's partial last tile lands on `landed`,
        phase: the partial tiles so far, and gets its rows past the end zeroed)."""
        _rt, b_first, _t, _k, _b, _t_end, b_stop = _share(meta_ptr, partitions, batch, 0)
        g = 0
        partial = 0
        for b in range(b_first, b_stop):
            seq_len, lo, hi = _segment(meta_ptr, seq_lens_ptr, partitions, batch, b, BLOCK_N)
            bt_row = block_table_ptr + b.to(gl.int64) * stride_bt_b
            for tile in range(lo, hi):
                t = g % 2
                page = gl.load(bt_row + tile).to(gl.int32)
                live = seq_len - tile * BLOCK_N  # rows of the tile before the request's end
                mbarrier.wait(bf_empty.index(t), ((g // 2) & 1) ^ 1)
                if live >= BLOCK_N:
                    _copy_tile(kv_desc, page * PAGE, bf_smem, t, bf_ready.index(t), NUM_CHUNKS)
                else:
                    _copy_tile(kv_desc, page * PAGE, bf_smem, t, landed, NUM_CHUNKS)
                    mbarrier.wait(landed, partial & 1)
                    _zero_rows_from(bf_bands, t, live, BLOCK_N, NUM_CHUNKS)
                    fence_async_shared()  # the stores, before wgmma reads the stage (the async proxy)
                    _sync_warps()
                    mbarrier.arrive(bf_ready.index(t))
                    partial += 1
                g += 1

    @gluon.jit
    def _mla_decode_balanced_kernel(
        kv_desc,  # TMA over the cache as [pages * 64, 576] bf16, [64, 64] boxes
        q_nope_ptr, q_rope_ptr, block_table_ptr, seq_lens_ptr,
        meta_ptr,  # _balanced_schedule_kernel's: sched [partitions + 1, 3], num_splits [B], slot_start [B] int32
        out_ptr,  # [B, S, H, C], contiguous
        part_ptr,  # the slots' partials [max_slots, rows, C] float32, then their lse [max_slots, rows]
        qk_scale,  # softmax_scale * log2(e)
        partitions, batch,
        stride_qn_b, stride_qn_s, stride_qn_h,
        stride_qr_b, stride_qr_s, stride_qr_h,
        stride_bt_b,
        S: gl.constexpr, H: gl.constexpr, C: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        REGS_ATTEND: gl.constexpr, REGS_LOAD: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """Persistent: CTA c works share c % partitions of row tile c // partitions (the module docstring)."""
        gl.static_assert(PAGE == BLOCK_N, "a tile is one page")
        NUM_CHUNKS: gl.constexpr = (C + R) // 64
        q_smem, bf_smem, p_smem, mx_smem, sum_smem, bf_ready, bf_empty, published, sums_bar, q_bar = _balanced_smem(BLOCK_M, BLOCK_N, NUM_CHUNKS)
        chunk: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], gl.bfloat16)  # (the stages' layout)
        bf_bands = reinterpret_shared(bf_smem, gl.bfloat16, [2 * NUM_CHUNKS * (BLOCK_N // 8), 8, 64], chunk)
        landed = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(landed, count=1)
        fence_async_shared()  # the mbarriers' init, before TMA and the other partitions use them
        gl.warp_specialize(
            [
                (_attend_balanced, (q_smem, bf_smem, p_smem, mx_smem, sum_smem, bf_ready, bf_empty, published, sums_bar, q_bar,
                                    q_nope_ptr, q_rope_ptr, seq_lens_ptr, meta_ptr, out_ptr, part_ptr, qk_scale, partitions, batch,
                                    stride_qn_b, stride_qn_s, stride_qn_h, stride_qr_b, stride_qr_s, stride_qr_h, S, H, C, R, BLOCK_M, BLOCK_N, NUM_CHUNKS, 0)),
                (_attend_balanced, (q_smem, bf_smem, p_smem, mx_smem, sum_smem, bf_ready, bf_empty, published, sums_bar, q_bar,
                                    q_nope_ptr, q_rope_ptr, seq_lens_ptr, meta_ptr, out_ptr, part_ptr, qk_scale, partitions, batch,
                                    stride_qn_b, stride_qn_s, stride_qn_h, stride_qr_b, stride_qr_s, stride_qr_h, S, H, C, R, BLOCK_M, BLOCK_N, NUM_CHUNKS, 1)),
                (_loader_balanced, (kv_desc, block_table_ptr, stride_bt_b, seq_lens_ptr, meta_ptr, partitions, batch, bf_smem, bf_bands,
                                    bf_ready, bf_empty, landed, PAGE, BLOCK_N, NUM_CHUNKS)),
            ],
            [4, 1],
            [REGS_ATTEND, REGS_LOAD],
        )


# ---------------------------------------------------------------------------------------------
# Host side: the shares, the slots' bound, the launch with the combine


def max_slots(partitions: int) -> int:
    """The partial slots a schedule of `partitions` shares can use: each of the partitions - 1 inner boundaries cuts
    one request once more, a cut request takes as many slots as segments (at least 1: the buffers' first dimension)."""
    return max(1, 2 * (partitions - 1))


def schedule(seq_lens: torch.Tensor, partitions: int, overhead: int) -> torch.Tensor:
    """_balanced_schedule_kernel over the device lengths: one int32 buffer, sched [partitions + 1, 3] then num_splits [B]
    then slot_start [B] (`unpack`). One launch, no host synchronisation (CUDA-graph safe)."""
    batch = seq_lens.shape[0]
    meta = torch.empty(SCHED_FIELDS * (partitions + 1) + 2 * batch, dtype=torch.int32, device=seq_lens.device)
    sched, num_splits, slot_start = unpack(meta, partitions, batch)
    _balanced_schedule_kernel[(1,)](seq_lens, sched, num_splits, slot_start, batch, partitions, OVERHEAD=overhead, BLOCK_N=64,
                                    BLOCK_B=SCHEDULE_BLOCK_B, BLOCK_P=max(2, next_power_of_2(partitions + 1)), num_warps=4,
                                    **pdl_launch(seq_lens.device))
    return meta


def unpack(meta: torch.Tensor, partitions: int, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The schedule buffer's views: sched [partitions + 1, 3], num_splits [B], slot_start [B]."""
    n = SCHED_FIELDS * (partitions + 1)
    return meta[:n].view(partitions + 1, SCHED_FIELDS), meta[n : n + batch], meta[n + batch : n + 2 * batch]


def shares(sched: list, seq_lens: list, partitions: int) -> list[list[tuple[int, int, int, int]]]:
    """Each share's segments (request, lo, hi, segment index) as the kernel's partitions walk them (host lists: the
    tests' decoding of a schedule, and the torch emulation's)."""
    batch = len(seq_lens)
    out = []
    for p in range(partitions):
        (b_first, t_first, k_first), (b_end, t_end, _) = sched[p], sched[p + 1]
        segments = []
        for b in range(b_first, min(b_end + 1, batch)):
            lo = t_first if b == b_first else 0
            hi = t_end if b == b_end else cdiv(max(seq_lens[b], 0), 64)
            if hi > lo:
                segments.append((b, lo, hi, k_first if b == b_first else 0))
        out.append(segments)
    return out


def launch_balanced(kernel_desc, q_nope: torch.Tensor, q_rope: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    softmax_scale: float, regs_attend: int, regs_load: int, overhead: int) -> torch.Tensor:
    """The schedule, the persistent kernel (row tiles x partitions CTAs), the combine of the cut requests."""
    from deepinfer_cuda.kernels.mla_decode_gluon_parts import BLOCK_M, BLOCK_N, LATENT, LOG2E, PAGE, ROPE, output_and_block_table

    batch, num_queries, heads, latent_dim = q_nope.shape
    out, block_table, empty = output_and_block_table(q_nope, block_table)
    if empty:
        return out
    rows = num_queries * heads
    row_tiles = cdiv(rows, BLOCK_M)
    partitions = max(1, num_sms(q_nope.device) // row_tiles)
    meta = schedule(seq_lens, partitions, overhead)
    slots = max_slots(partitions)
    part = torch.empty(slots * rows * (latent_dim + 1), dtype=torch.float32, device=q_nope.device)
    _mla_decode_balanced_kernel[(row_tiles * partitions,)](
        kernel_desc, q_nope, q_rope, block_table, seq_lens, meta, out, part,
        float(softmax_scale) * LOG2E, partitions, batch,
        q_nope.stride(0), q_nope.stride(1), q_nope.stride(2),
        q_rope.stride(0), q_rope.stride(1), q_rope.stride(2),
        block_table.stride(0),
        S=num_queries, H=heads, C=LATENT, R=ROPE, PAGE=PAGE, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, REGS_ATTEND=regs_attend, REGS_LOAD=regs_load,
        num_warps=4,
    )
    _sched, num_splits, slot_start = unpack(meta, partitions, batch)
    part_out = part[: slots * rows * latent_dim].view(slots, rows, latent_dim)
    part_lse = part[slots * rows * latent_dim :].view(slots, rows)
    combine(part_out, part_lse, out, num_splits, slot_start)
    return out


def combine(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, num_splits: torch.Tensor, slot_start: torch.Tensor) -> None:
    """_balanced_combine_kernel: out's requests of != 1 segments from their slots (part_out [slots, rows, C], part_lse [slots, rows])."""
    batch, _, heads, latent_dim = out.shape
    rows = part_out.shape[1]
    _balanced_combine_kernel[(cdiv(rows, COMBINE_BLOCK_M), batch)](
        part_out, part_lse, out, num_splits, slot_start, rows, part_out.stride(0), part_out.stride(1), part_lse.stride(0),
        out.stride(0), out.stride(1), out.stride(2), H=heads, C=latent_dim, BLOCK_M=COMBINE_BLOCK_M, BLOCK_C=next_power_of_2(latent_dim), num_warps=4,
        **pdl_launch(out.device),
    )


__all__ = ["SCHED_FIELDS", "combine", "launch_balanced", "max_slots", "schedule", "shares", "unpack"]
