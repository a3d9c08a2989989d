"""The seesaw schedule of the SM90 Gluon mla_decode over the bf16 cache (mla_decode_gluon.py's tuning switch
"schedule": "seesaw" or "seesaw_early_release", the table's since 2026-12-07). On an H100 (2026-12-07, `python -m
deepinfer_cuda.bench.gemm --sweep mla_gluon_bf16`) seesaw_early_release, in this form without spills, took 284.5 us at 128
heads B128 ctx4096 against split_keys' 330.7 (seesaw: 378.7), and passed `deepinfer conformance --backend cuda --op
mla_decode` (16) and the GPU tests (78) as the table's schedule (docs/measurements/2026-12-07/h100_round15/a/).
Not a registration module.

What differs from the split-keys schedule (mla_decode_gluon_parts._attend, "split_keys"): there both attention warpgroups
score half of every 64-row tile (wgmma N = 32), agree on the tile's row maxima through shared memory (one handshake,
both wait) and swap their halves of p (a second one). A [64, 32] score wgmma reads q's 2 KiB [64, 16] slice and 1 KiB of
keys from shared memory per 16 cycles of tensor work, 192 bytes a cycle against the SM's 128: the scores, 53% of the
FLOPs, cannot run at the tensor rate. Here each warpgroup scores whole tiles, alternately (warpgroup 0 the even tiles
of the split, warpgroup 1 the odd ones: with two stages, each warpgroup's tiles land in a stage of its own): [64, 64]
score wgmmas read 4 KiB per 32 cycles, the SM's rate. The running row maximum passes from one warpgroup to the other
with p, once a tile (FlashMLA's SM90 "seesaw" division of the work, from its public design notes):

- warpgroup W, own tile j (stage j % 2): the scores q . k_j^T are issued, then the other's tile j - 1 is taken in (its
  publication waited for: p_{j-1} and its row maxima m_{j-1}; acc and the row sum rescaled to m_{j-1}; acc += p_{j-1} .
  v_{j-1} over W's output columns, p from shared memory), the online softmax of tile j runs from m_{j-1} while that
  wgmma does, then, once it is done (its stage released and the p buffer free), p_j and m_j are published, acc is
  rescaled to m_j and acc += p_j . v_j (p from registers), its stage released once done;
- after its last own tile a warpgroup takes in the other's last tile, if the split's last tile is the other's;
- the row sums (each warpgroup sums its own tiles' p, rescaled at every maximum both saw) are added at the end.
Every step of the chain orders the next: a warpgroup publishes tile j + 2 only after it took in tile j + 1, which the
other published only after it had finished reading p_j: one p buffer [64, 64] and one maxima slot serve both, and one
mbarrier a warpgroup (`published`) is the only handshake of a tile. The loader (mla_decode_gluon._loader) is the
default schedule's: tile j into stage j % 2 once both warpgroups released it (each does, after its p . v of the tile).

The risk this order carries (to be measured): a warpgroup waits for its own next tile's stage before it takes in the
other's tile, and only then releases the other's stage, so each stage's reload starts only once the other stage's
reload has landed and been scored: with two stages, the loads may queue behind each other (a tile every score + softmax
+ load latency, where the default schedule hides the load behind a whole tile). Hence "seesaw_early_release"
(EARLY_RELEASE): after each own tile's p . v, the other's next tile is taken in whole and its stage released, before
the warpgroup waits for its own next stage (warpgroup 1 takes in tile 0 first; warpgroup 0 starts at tile 0 in the
loop); its softmax then overlaps no wgmma of its own. Written with the take-in at the top of the loop (before the
scores), ptxas serialised every wgmma (C7512, "insufficient register resources") at 232 and 240 registers; at the
loop's end it keeps them asynchronous. A first form spilled (24-32 bytes under Triton 3.9, 112-268 under 3.6; timed
293.6 us on an H100 that day); the form here, without spills ("Registers" below), is the one timed above.

Shared memory: q 72 KiB + two stages 144 KiB + p 8 KiB + maxima and sums 0.75 KiB + 7 mbarriers (as the default's).
Registers: acc 4 x [64, 64] float32 (128 a thread), the scores [64, 64] (32), p in registers [64, 64] bf16 (16). Each
warpgroup's loop reads fixed shared-memory chunks (its own stage's 9 for the scores, 4 value chunks of each stage), so
the compilers hoisted their wgmma descriptors out of the loop into registers (a dozen and more with Triton 3.9, 64-bit
ones with 3.6), and ptxas spilled (nvdisasm, early release: with Triton 3.9 two thread-index values of the output rows,
stored before the loop and reloaded after it; with 3.6 also values reloaded in the loop, the keys' column indices of
the mask among them). The chunk indices are offset by a zero the compilers cannot see (mla_decode_gluon_parts.
_hidden_zero of the tile index), as q's already were: the descriptors are recomputed in uniform registers where the
wgmmas issue, and neither schedule spills at the table's 232 / 40 registers, S = 1 or 2, one split or split partials,
Triton 3.9 or 3.6 (`deepinfer bench compile --arch sm90 --case "mla_decode bf16 gluon"`: the table's cases and seesaw's).
The arithmetic is unchanged (the same addresses).
"""

from __future__ import annotations

from deepinfer_cuda.kernels.gluon_hopper import GLUON_IMPORT_ERROR

if GLUON_IMPORT_ERROR is None:  # (else mla_decode_gluon.py declines every call)
    from deepinfer_cuda.kernels.gluon_hopper import fence_async_shared, gl, gluon, mbarrier, warpgroup_mma, warpgroup_mma_wait
    from deepinfer_cuda.kernels.gluon_hopper import sync_warps as _sync_warps
    from deepinfer_cuda.kernels.mla_decode_gluon_parts import _add_sums_and_store, _fresh_state, _hidden_zero, _swap_rows

    @gluon.jit
    def _seesaw_smem(BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_CHUNKS: gl.constexpr, SUM_SLOTS: gl.constexpr = 2):
        """q [9 chunks, 64, 64], the two stages [2 * 9 chunks, 64, 64] (128-byte swizzle), one p buffer [64, 64], one
        row maxima slot [64], the row sums [SUM_SLOTS, 64] (a warpgroup's each; the balanced grid's two per warpgroup);
        mbarriers bf_ready / bf_empty per stage (empty: both warpgroups release), `published` per warpgroup (its tile's p
        and maxima), `sums_bar` (both arrive)."""
        chunk_bf16: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], gl.bfloat16)
        q_layout_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 64], gl.bfloat16)
        p_layout_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.bfloat16)
        vec_s: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_CHUNKS, BLOCK_M, 64], q_layout_s)
        bf_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * NUM_CHUNKS, BLOCK_N, 64], chunk_bf16)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_N], p_layout_s)
        mx_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec_s)
        sum_smem = gl.allocate_shared_memory(gl.float32, [SUM_SLOTS, BLOCK_M], vec_s)
        bf_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        bf_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        published = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        sums_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(bf_ready.index(i), count=1)
            mbarrier.init(bf_empty.index(i), count=2)  # both attention warpgroups
            mbarrier.init(published.index(i), count=1)
        mbarrier.init(sums_bar, count=2)
        return q_smem, bf_smem, p_smem, mx_smem, sum_smem, bf_ready, bf_empty, published, sums_bar

    @gluon.jit
    def _scores_tile(q_smem, bf_smem, t, j, NUM_CHUNKS: gl.constexpr, s):
        """The scores of stage t (tile j): q . k^T over the 9 chunks, all 64 keys (9 async wgmma groups; s: zeros of
        the accumulator's layout, not accumulated). q's chunks and the stage's through a zero the compilers cannot see,
        as mla_decode_gluon_parts._scores: their descriptors are recomputed each tile, not hoisted out of the loop into
        registers (the module docstring, "Registers")."""
        zero = _hidden_zero(j)
        for c in gl.static_range(NUM_CHUNKS):
            s = warpgroup_mma(q_smem.index(zero + c), bf_smem.index(zero + t * NUM_CHUNKS + c).permute((1, 0)), s, use_acc=c > 0, is_async=True)
        return s

    @gluon.jit
    def _pv_issue(p, bf_smem, t, zero, V0: gl.constexpr, NUM_CHUNKS: gl.constexpr, acc0, acc1, acc2, acc3, a2):
        """acc_c * a2 + p . v over stage t's 64 keys, for value chunks V0 .. V0 + 3 (4 async wgmma groups). zero: a
        _hidden_zero, added to the chunks' indices so that their descriptors are recomputed, not kept live (as _scores_tile)."""
        o0 = warpgroup_mma(p, bf_smem.index(zero + t * NUM_CHUNKS + V0 + 0), acc0 * a2, is_async=True)
        o1 = warpgroup_mma(p, bf_smem.index(zero + t * NUM_CHUNKS + V0 + 1), acc1 * a2, is_async=True)
        o2 = warpgroup_mma(p, bf_smem.index(zero + t * NUM_CHUNKS + V0 + 2), acc2 * a2, is_async=True)
        o3 = warpgroup_mma(p, bf_smem.index(zero + t * NUM_CHUNKS + V0 + 3), acc3 * a2, is_async=True)
        return o0, o1, o2, o3

    @gluon.jit
    def _visible(j, seq_len, lo, split_end, S: gl.constexpr, H: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 s_layout: gl.constexpr):
        """Which of tile j's keys each row sees: those before the split's end, and with S > 1 those <= its row's query
        position (seq_len - S + m // H), computed here each tile (kept live across the loop, the rows' bounds spilled)."""
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        if S > 1:
            rows = gl.program_id(0) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            key_end = gl.minimum(seq_len - S + rows // H + 1, split_end)
            return gl.expand_dims(cols, 0) < gl.expand_dims(key_end - (lo + j * BLOCK_N), 1)
        else:
            return gl.expand_dims(cols < split_end - (lo + j * BLOCK_N), 0)

    @gluon.jit
    def _take_in(m_i, l_i, acc0, acc1, acc2, acc3, p_smem, mx_smem, bf_smem, published, k,
                 V0: gl.constexpr, O: gl.constexpr, NUM_CHUNKS: gl.constexpr, row_layout: gl.constexpr, o_layout: gl.constexpr):
        """The other warpgroup's tile k: its publication waited for, acc and l rescaled to its maxima, p_k . v_k issued
        over this warpgroup's value chunks (p from shared memory). Returns the new maxima, l and the 4 in-flight groups."""
        mbarrier.wait(published.index(O), (k // 2) & 1)
        m_pub = mx_smem.load(row_layout)
        m_safe = gl.where(m_pub == float("-inf"), 0.0, m_pub)
        alpha = gl.exp2(m_i - m_safe)
        a2 = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        o0, o1, o2, o3 = _pv_issue(p_smem, bf_smem, k % 2, _hidden_zero(k), V0, NUM_CHUNKS, acc0, acc1, acc2, acc3, a2)
        return m_pub, l_i * alpha, o0, o1, o2, o3

    @gluon.jit
    def _take_in_whole(m_i, l_i, acc0, acc1, acc2, acc3, p_smem, mx_smem, bf_smem, bf_empty, published, k,
                       V0: gl.constexpr, O: gl.constexpr, NUM_CHUNKS: gl.constexpr, row_layout: gl.constexpr, o_layout: gl.constexpr):
        """_take_in of the other's tile k, its p . v waited for, the stage released by this warpgroup."""
        m_i, l_i, o0, o1, o2, o3 = _take_in(m_i, l_i, acc0, acc1, acc2, acc3, p_smem, mx_smem, bf_smem, published, k, V0, O, NUM_CHUNKS,
                                            row_layout, o_layout)
        acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1, o2, o3))
        _sync_warps()
        mbarrier.arrive(bf_empty.index(k % 2))
        return m_i, l_i, acc0, acc1, acc2, acc3

    @gluon.jit
    def _online_softmax(m_i, l_i, scores):
        """mla_decode.py's softmax_block (base 2) over a tile's masked scores [BLOCK_M, BLOCK_N] from the running maxima
        m_i and row sums l_i: a row that has seen only -inf keeps m = -inf and weights 0. Returns the new maxima, the
        new row sums, the rescale alpha of what came before and p."""
        m_new = gl.maximum(m_i, gl.max(scores, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(scores - gl.expand_dims(m_safe, 1))
        return m_new, l_i * alpha + gl.sum(p, axis=1), alpha, p

    @gluon.jit
    def _publish_and_own_pv(pv, m_i, alpha, p_smem, mx_smem, bf_smem, bf_empty, published, t, zero, W: gl.constexpr, V0: gl.constexpr,
                            NUM_CHUNKS: gl.constexpr, acc0, acc1, acc2, acc3, o_layout: gl.constexpr, p_layout: gl.constexpr):
        """An own tile's p (bf16) and maxima published to the other warpgroup, then acc = acc * alpha + p . v over this
        warpgroup's value chunks of stage t (p from registers), waited for, the stage released by this warpgroup. alpha:
        the rows' rescale [BLOCK_M] (1.0: none). zero: a _hidden_zero (as _pv_issue)."""
        p_smem.store(pv)
        mx_smem.store(m_i)
        fence_async_shared()
        _sync_warps()
        mbarrier.arrive(published.index(W))
        a2 = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        o0, o1, o2, o3 = _pv_issue(gl.convert_layout(pv, p_layout), bf_smem, t, zero, V0, NUM_CHUNKS, acc0, acc1, acc2, acc3, a2)
        acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1, o2, o3))
        _sync_warps()
        mbarrier.arrive(bf_empty.index(t))
        return acc0, acc1, acc2, acc3

    @gluon.jit
    def _attend_seesaw(q_smem, bf_smem, p_smem, mx_smem, sum_smem, bf_ready, bf_empty, published, sums_bar,
                       dst_ptr, part_lse_ptr, seq_len, lo, split_end, num_tiles, qk_scale,
                       stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m, stride_pl_b, stride_pl_split,
                       S: gl.constexpr, H: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_CHUNKS: gl.constexpr,
                       DIRECT: gl.constexpr, W: gl.constexpr, EARLY_RELEASE: gl.constexpr):
        """Attention warpgroup W (0: the default partition, 1: a worker) of the seesaw schedule (the module docstring):
        scores of tiles W, W + 2, ..., output columns W*256 .. W*256+255 over every tile. EARLY_RELEASE: the other's tile
        after each own tile taken in whole, its stage released, before the warpgroup waits for its next own stage."""
        O: gl.constexpr = 1 - W  # the other warpgroup
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        V0: gl.constexpr = W * 4  # the first of this warpgroup's four value chunks
        m_i, l_i, acc0, acc1, acc2, acc3 = _fresh_state(BLOCK_M, row_layout, o_layout)
        zeros_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        if W == 0 and not EARLY_RELEASE:
            # tile 0: nothing of the other's before it
            if num_tiles > 0:
                mbarrier.wait(bf_ready.index(0), 0)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(_scores_tile(q_smem, bf_smem, 0, num_tiles, NUM_CHUNKS, zeros_s),))
                scores = gl.where(_visible(0, seq_len, lo, split_end, S, H, BLOCK_M, BLOCK_N, s_layout), s * qk_scale, float("-inf"))
                m_new = gl.max(scores, axis=1)
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
                p = gl.exp2(scores - gl.expand_dims(m_safe, 1))
                l_i = gl.sum(p, axis=1)
                m_i = m_new
                pv = p.to(gl.bfloat16)
                p_smem.store(pv)
                mx_smem.store(m_i)
                fence_async_shared()
                _sync_warps()
                mbarrier.arrive(published.index(W))
                o0, o1, o2, o3 = _pv_issue(gl.convert_layout(pv, p_layout), bf_smem, 0, _hidden_zero(num_tiles), V0, NUM_CHUNKS, acc0, acc1, acc2, acc3, 1.0)
                acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1, o2, o3))
                _sync_warps()
                mbarrier.arrive(bf_empty.index(0))
        if W == 1 and EARLY_RELEASE:  # (warpgroup 0 starts its loop at tile 0: nothing taken in before it)
            if num_tiles > 0:
                m_i, l_i, acc0, acc1, acc2, acc3 = _take_in_whole(m_i, l_i, acc0, acc1, acc2, acc3, p_smem, mx_smem, bf_smem, bf_empty,
                                                                  published, 0, V0, O, NUM_CHUNKS, row_layout, o_layout)
        FIRST: gl.constexpr = W if EARLY_RELEASE else 2 - W  # (the default order: warpgroup 0's tile 0 above)
        for j in range(FIRST, num_tiles, 2):
            t = j % 2  # (= W)
            if EARLY_RELEASE:
                # the other's preceding tile was taken in whole, its stage released, at the end of the previous own tile
                mbarrier.wait(bf_ready.index(t), (j // 2) & 1)
                s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)  # (made here: not kept live across the loop)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(_scores_tile(q_smem, bf_smem, t, j, NUM_CHUNKS, s),))
            else:
                # the scores first, the other's tile j - 1 behind them (its p . v in flight during the softmax)
                mbarrier.wait(bf_ready.index(t), (j // 2) & 1)
                s = _scores_tile(q_smem, bf_smem, t, j, NUM_CHUNKS, zeros_s)
                m_i, l_i, o0, o1, o2, o3 = _take_in(m_i, l_i, acc0, acc1, acc2, acc3, p_smem, mx_smem, bf_smem, published, j - 1,
                                                    V0, O, NUM_CHUNKS, row_layout, o_layout)
                s = warpgroup_mma_wait(num_outstanding=4, deps=(s,))
            scores = gl.where(_visible(j, seq_len, lo, split_end, S, H, BLOCK_M, BLOCK_N, s_layout), s * qk_scale, float("-inf"))
            m_i, l_i, alpha, p = _online_softmax(m_i, l_i, scores)  # (from the other's maxima)
            pv = p.to(gl.bfloat16)
            if not EARLY_RELEASE:
                # the other's tile done: its stage released by this warpgroup, the p buffer free for this tile's
                acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=(o0, o1, o2, o3))
                _sync_warps()
                mbarrier.arrive(bf_empty.index(1 - t))
            acc0, acc1, acc2, acc3 = _publish_and_own_pv(pv, m_i, alpha, p_smem, mx_smem, bf_smem, bf_empty, published, t, _hidden_zero(j), W, V0,
                                                         NUM_CHUNKS, acc0, acc1, acc2, acc3, o_layout, p_layout)
            if EARLY_RELEASE:
                if j + 1 < num_tiles:  # the other's next tile, before this warpgroup waits for its own next stage
                    m_i, l_i, acc0, acc1, acc2, acc3 = _take_in_whole(m_i, l_i, acc0, acc1, acc2, acc3, p_smem, mx_smem, bf_smem, bf_empty,
                                                                      published, j + 1, V0, O, NUM_CHUNKS, row_layout, o_layout)
        if not EARLY_RELEASE:
            # the split's last tile when it is the other's (for warpgroup 1 with one tile: its only one)
            if num_tiles > 0:
                if (num_tiles - 1) % 2 == O:
                    m_i, l_i, acc0, acc1, acc2, acc3 = _take_in_whole(m_i, l_i, acc0, acc1, acc2, acc3, p_smem, mx_smem, bf_smem, bf_empty,
                                                                      published, num_tiles - 1, V0, O, NUM_CHUNKS, row_layout, o_layout)
        # both warpgroups end at the maxima of the split's last tile: their row sums add
        l_other = _swap_rows(l_i, sum_smem, W, O, sums_bar, 0, row_layout)
        _add_sums_and_store(l_i, l_other, m_i, acc0, acc1, acc2, acc3, dst_ptr, part_lse_ptr, stride_o_b, stride_o_s, stride_o_h, stride_po_b,
                            stride_po_split, stride_po_m, stride_pl_b, stride_pl_split, S, H, BLOCK_M, DIRECT, W, row_layout, o_layout)
