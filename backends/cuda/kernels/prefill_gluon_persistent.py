"""The persistent variant of the SM90 Gluon prefill (prefill_gluon.py; its `Tuning(persistent=True)`).
Timed on an H100 (2026-12-07, `--sweep prefill_gluon`): 0.93x SDPA at causal B4 x 4096, 16 heads, 192 / 128 (240 / 24
registers) against the default's 0.85x in the same run, outputs equal to the default's; its GPU tests and GPU
conformance have not run, so it stays off (docs/backends/cuda.md).

What it changes: prefill_gluon.py launches one program per (128-row query tile, head), so each program's prologue (the
Q tile and the first K tile from memory, the first QK^T and softmax with nothing beside them) and its epilogue (O / l
stored) run on an SM with no other work; a 4096-token causal request averages 16 key tiles a query tile, at 128 heads
and 2048 tokens 8, so those edges weigh. Here (FlashAttention-3's persistent scheduler) one program per SM loops over
work items (query tile, head), and the producer warpgroup runs ahead across item boundaries: it loads the next item's
Q as soon as both consumer warpgroups have issued their last QK^T of the current one (`q_empty`), and its K/V tiles
into the same ring (one counter over the program's life), while the consumers finish the current item's PV and store
its output. Each item's tile loop is prefill_gluon.py's (the same turns, waits, masks and softmax; `_scores` and
`_softmax` are its functions): an item's output is bit for bit the non-persistent kernel's.

Work order (a longest-processing-time-first list, shapes only on the host, no synchronisation):
- `_lpt_order_kernel` (a tl kernel, one program; the interpreter runs it in the CPU tests) sorts the Tq // 128 + B
  query-tile slots of prefill_gluon.py's grid by their key tiles, most first (ties: request order, a request's
  heaviest tile first), into order [slots, 2] = (request, query tile); count[0] = the slots that hold a tile.
- Items t = 0 .. count * H - 1 walk the heads in sections of `section_heads` (K/V of every request for that many heads
  stay within Tuning.section_bytes, so that the programs working at once share their key tiles in L2), and within a
  section the sorted slots, each over the section's heads: t -> (section, rank, head), the item (order[rank], head)
  (`item_sequence` is the same arithmetic in Python).
- Dynamic assignment (FlashAttention-3's for causal attention): program p takes item p first, then P + the launch's
  counter (an atomic add, the order kernel having set it to 0), fetched by the producer once it has issued every load of
  its current item, so a program that drew light items draws more (a static split of this order left some programs
  6-70% more key tiles than the mean on the sweep's shapes, by a Python model). The producer publishes each item to the
  consumers through a two-slot ring in shared memory (`item_ready` / `item_free` mbarriers): its fields, decoded by the
  producer, so a consumer's change of item waits on no global load; fields marked not live end the consumers' loops.

Shared memory: prefill_gluon.py's (Q once, the K/V ring), the item ring (2 x 8 int32) and five more mbarriers (`q_empty`,
`item_ready`, `item_free`).
Not a registration module: prefill_gluon.py registers the op and launches this kernel under its Tuning.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_cuda.kernels.common import num_sms, pdl_launch, pdl_prologue
from deepinfer_cuda.kernels.gluon_hopper import GLUON_IMPORT_ERROR
from deepinfer_cuda.kernels.prefill_gluon import BLOCK_M

if GLUON_IMPORT_ERROR is None:  # (prefill_gluon.launch_prefill_gluon declines every call otherwise)
    from deepinfer_cuda.kernels.gluon_hopper import fence_async_shared, gl, gluon, mbarrier, warpgroup_mma, warpgroup_mma_wait
    from deepinfer_cuda.kernels.gluon_hopper import sync_warps as _sync_warps
    from deepinfer_cuda.kernels.gluon_hopper import tma_load as _tma_load
    from deepinfer_cuda.kernels.prefill_gluon import _operand_smem, _scores, _softmax

MAX_SLOTS = 16384  # query-tile slots the one-program sort takes (2M new tokens at 128 a tile): more is a ValueError


@triton.jit
def _lpt_order_kernel(cu_q_ptr, cu_k_ptr, order_ptr, sched_ptr, num_requests, num_slots, search_steps,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SLOTS: tl.constexpr, PDL: tl.constexpr = False):
    """order[i] = (request, query tile) of the i-th slot by key tiles, most first; sched = (the slots holding a tile, 0:
    the persistent kernel's item counter, reset for its launch)."""
    pdl_prologue(PDL)
    s = tl.arange(0, SLOTS)
    valid = s < num_slots
    # each slot's request: the b with cu_q[b] // BLOCK_M + b <= slot (prefill_gluon.py's search, one a lane)
    lo = s * 0
    hi = lo + num_requests
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        go = tl.load(cu_q_ptr + mid) // BLOCK_M + mid <= s
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    q_start = tl.load(cu_q_ptr + lo)
    q_len = tl.load(cu_q_ptr + lo + 1) - q_start
    k_len = tl.load(cu_k_ptr + lo + 1) - tl.load(cu_k_ptr + lo)
    num_m = (q_len + BLOCK_M - 1) // BLOCK_M
    slot = s - (q_start // BLOCK_M + lo)
    live = valid & (slot < num_m)
    last_pos = k_len - q_len + tl.minimum((num_m - slot) * BLOCK_M, q_len) - 1  # m_blk = num_m - 1 - slot
    tiles = (last_pos + BLOCK_N) // BLOCK_N
    key = tl.where(live, (tiles.to(tl.int64) + 1) * 4294967296 + (4294967295 - s.to(tl.int64)), 0)
    key = tl.sort(key, descending=True)
    sorted_slot = (4294967295 - (key % 4294967296)).to(tl.int32)  # (a dead slot's key is 0: past count, never read)
    sorted_live = key > 0
    sorted_slot = tl.where(sorted_live, sorted_slot, 0)
    lo = s * 0
    hi = lo + num_requests
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        go = tl.load(cu_q_ptr + mid) // BLOCK_M + mid <= sorted_slot
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    q_start = tl.load(cu_q_ptr + lo)
    num_m = (tl.load(cu_q_ptr + lo + 1) - q_start + BLOCK_M - 1) // BLOCK_M
    m_blk = num_m - 1 - (sorted_slot - (q_start // BLOCK_M + lo))
    tl.store(order_ptr + 2 * s, lo, mask=valid)
    tl.store(order_ptr + 2 * s + 1, m_blk, mask=valid)
    tl.store(sched_ptr, tl.sum(live.to(tl.int32), axis=0))
    tl.store(sched_ptr + 1, 0)


if GLUON_IMPORT_ERROR is None:

    @gluon.jit
    def _item(order_ptr, cu_q_ptr, cu_k_ptr, t, num_real, section_heads, heads, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """Work item t (module docstring): its head, the request's first query and key rows and query count, the key
        position of its query 0, the tile's first row in the request, its key tiles and its mask-free ones."""
        per_section = num_real * section_heads
        section = t // per_section
        r = t - section * per_section
        in_section = gl.minimum(section_heads, heads - section * section_heads)
        rank = r // in_section
        head = section * section_heads + r - rank * in_section
        b = gl.load(order_ptr + 2 * rank)
        m_blk = gl.load(order_ptr + 2 * rank + 1)
        q_start = gl.load(cu_q_ptr + b)
        q_len = gl.load(cu_q_ptr + b + 1) - q_start
        k_start = gl.load(cu_k_ptr + b)
        pos0 = gl.load(cu_k_ptr + b + 1) - k_start - q_len
        first_row = m_blk * BLOCK_M
        last_pos = pos0 + gl.minimum(first_row + BLOCK_M, q_len) - 1
        return head, q_start, q_len, k_start, pos0, first_row, (last_pos + BLOCK_N) // BLOCK_N, (pos0 + first_row + 1) // BLOCK_N

    @gluon.jit
    def _publish(items, item_ready, item_free, n, live, head, q_start, q_len, pos0, first_row, num_tiles, n_full):
        """Item n's fields (live 0: past the last item) into slot n % 2 of the item ring, once both consumers have read
        what the slot held before. Each thread holds all 8 fields (a [8] tensor of one thread's registers, replicated)."""
        slot = n % 2
        mbarrier.wait(item_free.index(slot), ((n // 2) & 1) ^ 1)
        idx = gl.arange(0, 8, layout=gl.BlockedLayout([8], [32], [4], [0]))
        fields = gl.where(idx == 0, live, gl.where(idx == 1, head, gl.where(idx == 2, q_start, gl.where(idx == 3, q_len, gl.where(
            idx == 4, pos0, gl.where(idx == 5, first_row, gl.where(idx == 6, num_tiles, n_full)))))))
        items.index(slot).store(fields)
        _sync_warps()  # every thread's store before the arrival
        mbarrier.arrive(item_ready.index(slot))

    @gluon.jit
    def _field(fields, idx, k: gl.constexpr):
        return gl.sum(gl.where(idx == k, fields, 0), axis=0)  # (within each thread: it holds all 8)

    @gluon.jit
    def _read_item(items, item_ready, item_free, n):
        """The fields of the n-th item the producer published (waits for it); the slot released to the producer."""
        slot = n % 2
        mbarrier.wait(item_ready.index(slot), (n // 2) & 1)
        idx = gl.arange(0, 8, layout=gl.BlockedLayout([8], [32], [4], [0]))
        fields = items.index(slot).load(gl.BlockedLayout([8], [32], [4], [0]))
        _sync_warps()  # every thread has read them
        mbarrier.arrive(item_free.index(slot))
        return (_field(fields, idx, 0), _field(fields, idx, 1), _field(fields, idx, 2), _field(fields, idx, 3), _field(fields, idx, 4),
                _field(fields, idx, 5), _field(fields, idx, 6), _field(fields, idx, 7))

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, kv_empty, items, item_ready, item_free,
                  order_ptr, cu_q_ptr, cu_k_ptr, next_ptr, pid, programs, total, num_real, section_heads, heads,
                  D_QK: gl.constexpr, D_V: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  QK_CHUNKS: gl.constexpr, V_CHUNKS: gl.constexpr, NUM_STAGES: gl.constexpr):
        """The scheduler and loader: item pid first, then each next one from the launch's counter (atomically, once a
        program has issued every load of its current item), its fields published to the consumers (so their item
        changes wait on no global load); per item its Q tile once both consumers have released the previous item's
        (`q_empty`), then its K and V tiles into the ring, whose counter `it` runs on across items (so the next item's
        first tiles load while the consumers finish this one). Past the last item: fields with live 0, which end the
        consumers' loops."""
        CHUNK: gl.constexpr = 64
        it = pid * 0  # (int32 scalars: loop-carried)
        n = pid * 0
        t = pid
        while t < total:
            head, q_start, q_len, k_start, pos0, first_row, num_tiles, n_full = _item(order_ptr, cu_q_ptr, cu_k_ptr, t, num_real, section_heads,
                                                                                      heads, BLOCK_M, BLOCK_N)
            _publish(items, item_ready, item_free, n, 1, head, q_start, q_len, pos0, first_row, num_tiles, n_full)
            mbarrier.wait(q_empty, (n & 1) ^ 1)
            mbarrier.expect(q_bar, 2 * QK_CHUNKS * q_desc.block_type.nbytes)
            for w in gl.static_range(2):
                for c in gl.static_range(QK_CHUNKS):
                    _tma_load(q_desc, [q_start + first_row + w * 64, head * D_QK + c * CHUNK], q_bar, q_smem.index(w * QK_CHUNKS + c))
            for j in range(num_tiles):
                stage = it % NUM_STAGES
                mbarrier.wait(kv_empty.index(stage), ((it // NUM_STAGES) & 1) ^ 1)
                row = k_start + j * BLOCK_N
                kb = k_ready.index(stage)
                mbarrier.expect(kb, QK_CHUNKS * k_desc.block_type.nbytes)
                for c in gl.static_range(QK_CHUNKS):
                    _tma_load(k_desc, [row, head * D_QK + c * CHUNK], kb, k_smem.index(stage * QK_CHUNKS + c))
                vb = v_ready.index(stage)
                mbarrier.expect(vb, V_CHUNKS * v_desc.block_type.nbytes)
                for c in gl.static_range(V_CHUNKS):
                    _tma_load(v_desc, [row, head * D_V + c * CHUNK], vb, v_smem.index(stage * V_CHUNKS + c))
                it += 1
            n += 1
            t = programs + gl.atomic_add(next_ptr, 1)
        _publish(items, item_ready, item_free, n, 0, 0, 0, 0, 0, 0, 0, 0)

    @gluon.jit
    def _consumer(q_smem, k_smem, v_tiles, q_bar, q_empty, k_ready, v_ready, kv_empty, turn, items, item_ready, item_free,
                  out_ptr, stride_ot, stride_oh, pid, qk_scale,
                  W: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D_V: gl.constexpr, QK_CHUNKS: gl.constexpr, NUM_STAGES: gl.constexpr):
        """Consumer warpgroup W over the items the producer publishes, until one past the last: prefill_gluon.py's
        `_consumer` per item, with the ring position (`it`), the turn count (`turns`: this warpgroup's waits on turn[W]
        so far) and the items done (`done`) carried across items; Q released (`q_empty`) once this warpgroup's last QK^T
        of the item has completed."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D_V, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        ocols = gl.arange(0, D_V, layout=gl.SliceLayout(0, o_layout))
        it = pid * 0  # (int32 scalars: loop-carried)
        turns = pid * 0
        done = pid * 0
        live, head, q_start, q_len, pos0, first_row, num_tiles, n_full = _read_item(items, item_ready, item_free, done)
        while live != 0:
            pos = pos0 + first_row + W * 64 + gl.arange(0, 64, layout=row_layout)
            m_i = gl.full([64], float("-inf"), gl.float32, layout=row_layout)
            l_i = gl.zeros([64], gl.float32, layout=row_layout)
            acc = gl.zeros([64, D_V], gl.float32, layout=o_layout)
            # turn waits: the k-th (k = turns + 0, 1, ...) with parity (k & 1) ^ (1 - W), as prefill_gluon.py's
            mbarrier.wait(q_bar, done & 1)
            mbarrier.wait(k_ready.index(it % NUM_STAGES), (it // NUM_STAGES) & 1)
            mbarrier.wait(turn.index(W), (turns & 1) ^ (1 - W))
            s = _scores(q_smem, k_smem, it % NUM_STAGES, gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout), W, QK_CHUNKS)
            mbarrier.arrive(turn.index(1 - W))
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, 0, pos, cols, n_full == 0)
            p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
            for j in range(num_tiles):
                g = it + j
                stage = g % NUM_STAGES
                mbarrier.wait(turn.index(W), ((turns + j + 1) & 1) ^ (1 - W))
                if j + 1 < num_tiles:
                    nxt = (g + 1) % NUM_STAGES
                    mbarrier.wait(k_ready.index(nxt), ((g + 1) // NUM_STAGES) & 1)
                    s = _scores(q_smem, k_smem, nxt, gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout), W, QK_CHUNKS)
                    mbarrier.wait(v_ready.index(stage), (g // NUM_STAGES) & 1)
                    o = warpgroup_mma(p_op, v_tiles.index(stage), acc, is_async=True)
                    mbarrier.arrive(turn.index(1 - W))
                    s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
                    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, (j + 1) * BLOCK_N, pos, cols, j + 1 >= n_full)
                    acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_op))
                    _sync_warps()  # every warp's wgmmas on the stage (and, at j + 2 == num_tiles, on Q) are done
                    mbarrier.arrive(kv_empty.index(stage))
                    if j + 2 == num_tiles:
                        mbarrier.arrive(q_empty)  # the item's last QK^T has read Q: the producer may load the next
                    acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
                    p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
                else:
                    mbarrier.wait(v_ready.index(stage), (g // NUM_STAGES) & 1)
                    o = warpgroup_mma(p_op, v_tiles.index(stage), acc, is_async=True)
                    mbarrier.arrive(turn.index(1 - W))
                    acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_op))
                    _sync_warps()
                    mbarrier.arrive(kv_empty.index(stage))
                    if num_tiles == 1:
                        mbarrier.arrive(q_empty)
            it += num_tiles
            turns += num_tiles + 1
            done += 1
            # O / l (every row of an item sees key 0: l > 0); the request's rows only
            l_o = gl.convert_layout(l_i, o_rows)
            inv = 1.0 / gl.where(l_o > 0.0, l_o, 1.0)
            rows = first_row + W * 64 + gl.arange(0, 64, layout=o_rows)
            dst = out_ptr + gl.expand_dims((q_start + rows).to(gl.int64) * stride_ot + head * stride_oh, 1) + gl.expand_dims(ocols, 0)
            gl.store(dst, (acc * gl.expand_dims(inv, 1)).to(out_ptr.dtype.element_ty), mask=gl.expand_dims(rows < q_len, 1))
            live, head, q_start, q_len, pos0, first_row, num_tiles, n_full = _read_item(items, item_ready, item_free, done)

    @gluon.jit(do_not_specialize=["heads", "section_heads"])  # (one build for every head count and section size)
    def _prefill_ws_persistent_kernel(
        q_desc, k_desc, v_desc,  # prefill_gluon.py's TMA views
        out_ptr, cu_q_ptr, cu_k_ptr, order_ptr, sched_ptr,  # _lpt_order_kernel's order and (count, the item counter at 0)
        stride_ot, stride_oh,
        heads, section_heads,
        qk_scale,
        D_QK: gl.constexpr, D_V: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
        num_warps: gl.constexpr,  # 4: the default partition is the producer
    ):
        gl.static_assert(BLOCK_M == 128, "two consumer warpgroups of 64 rows")
        gl.static_assert(D_QK % 64 == 0 and D_V % 64 == 0, "64-column chunks")
        QK_CHUNKS: gl.constexpr = D_QK // 64
        V_CHUNKS: gl.constexpr = D_V // 64
        pid = gl.program_id(0)
        programs = gl.num_programs(0)
        num_real = gl.load(sched_ptr)
        total = num_real * heads

        q_smem, k_smem, v_smem, v_tiles = _operand_smem(q_desc, k_desc, v_desc, D_V, BLOCK_N, NUM_STAGES, QK_CHUNKS, V_CHUNKS)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        items = gl.allocate_shared_memory(gl.int32, [2, 8], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))  # the item ring: 8 fields a slot
        item_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        item_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        mbarrier.init(q_empty, count=2)  # both consumer warpgroups
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
            mbarrier.init(item_ready.index(i), count=1)
            mbarrier.init(item_free.index(i), count=2)  # both consumer warpgroups
        fence_async_shared()

        gl.warp_specialize(
            [
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_empty, k_ready, v_ready, kv_empty, items, item_ready, item_free,
                             order_ptr, cu_q_ptr, cu_k_ptr, sched_ptr + 1, pid, programs, total, num_real, section_heads, heads,
                             D_QK, D_V, BLOCK_M, BLOCK_N, QK_CHUNKS, V_CHUNKS, NUM_STAGES)),
                (_consumer, (q_smem, k_smem, v_tiles, q_bar, q_empty, k_ready, v_ready, kv_empty, turn, items, item_ready, item_free,
                             out_ptr, stride_ot, stride_oh, pid, qk_scale, 0, BLOCK_M, BLOCK_N, D_V, QK_CHUNKS, NUM_STAGES)),
                (_consumer, (q_smem, k_smem, v_tiles, q_bar, q_empty, k_ready, v_ready, kv_empty, turn, items, item_ready, item_free,
                             out_ptr, stride_ot, stride_oh, pid, qk_scale, 1, BLOCK_M, BLOCK_N, D_V, QK_CHUNKS, NUM_STAGES)),
            ],
            [4, 4],
            [CONSUMER_REGS, CONSUMER_REGS],
        )


# ---------------------------------------------------------------------------------------------
# Host side: the order, the sections, the launch; the same schedule in Python for the CPU tests


def num_slots(num_tokens: int, num_requests: int) -> int:
    """prefill_gluon.py's grid axis 0: every request's query tiles fit Tq // 128 + B slots."""
    return num_tokens // BLOCK_M + num_requests


def section_heads(num_keys: int, heads: int, d_qk: int, d_v: int, section_bytes: int) -> int:
    """Heads a section: as many as keep K and V of every request (num_keys rows, bf16) within section_bytes, at least
    one, at most all (section_bytes 0: all)."""
    per_head = max(num_keys, 1) * (d_qk + d_v) * 2
    return heads if section_bytes <= 0 else max(1, min(heads, section_bytes // per_head))


def lpt_order(cu_seqlens_q: list[int], cu_seqlens_k: list[int], block_n: int) -> list[tuple[int, int]]:
    """`_lpt_order_kernel`'s live entries in Python: (request, query tile) by key tiles, most first; ties by slot."""
    keyed = []
    slot = 0
    for b in range(len(cu_seqlens_q) - 1):
        q_len, k_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b], cu_seqlens_k[b + 1] - cu_seqlens_k[b]
        num_m = -(-q_len // BLOCK_M)
        slot = cu_seqlens_q[b] // BLOCK_M + b
        for i in range(num_m):
            m_blk = num_m - 1 - i
            last_pos = k_len - q_len + min((m_blk + 1) * BLOCK_M, q_len) - 1
            keyed.append(((last_pos + block_n) // block_n, -(slot + i), b, m_blk))
    return [(b, m) for _, _, b, m in sorted(keyed, reverse=True)]


def item_sequence(order: list[tuple[int, int]], heads: int, sections: int) -> list[tuple[int, int, int]]:
    """The items t = 0, 1, ... as (request, query tile, head): the kernel's `_item` arithmetic, for the CPU tests."""
    out = []
    per_section = len(order) * sections
    for t in range(len(order) * heads):
        section, rest = divmod(t, per_section)
        in_section = min(sections, heads - section * sections)
        rank, h = divmod(rest, in_section)
        out.append((*order[rank], section * sections + h))
    return out


def launch(descriptors, out: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, num_keys: int, qk_scale: float, d_qk: int, d_v: int, tuning) -> None:
    """The order, then the persistent kernel into out [Tq, H, Dv] (prefill_gluon.launch_prefill_gluon has checked the call
    and the tuning). A batch of more than MAX_SLOTS query-tile slots is a ValueError (prefill_gluon's launch sends those to
    its one-program-a-tile kernel)."""
    num_tokens, heads, _ = out.shape
    num_requests = cu_q.shape[0] - 1
    slots = num_slots(num_tokens, num_requests)
    if slots > MAX_SLOTS:
        raise ValueError(f"{slots} query-tile slots: the persistent order sorts at most {MAX_SLOTS} (use the non-persistent kernel)")
    order = torch.empty(slots, 2, dtype=torch.int32, device=out.device)
    sched = torch.empty(2, dtype=torch.int32, device=out.device)
    _lpt_order_kernel[(1,)](cu_q, cu_k, order, sched, num_requests, slots, max(num_requests - 1, 0).bit_length(),
                            BLOCK_M=BLOCK_M, BLOCK_N=tuning.block_n, SLOTS=triton.next_power_of_2(slots), num_warps=4, **pdl_launch(out.device))
    programs = max(1, min(num_sms(out.device), slots * heads))
    _prefill_ws_persistent_kernel[(programs,)](
        *descriptors,
        out, cu_q, cu_k, order, sched,
        out.stride(0), out.stride(1),
        heads, section_heads(num_keys, heads, d_qk, d_v, tuning.section_bytes),
        float(qk_scale),
        D_QK=d_qk, D_V=d_v, BLOCK_M=BLOCK_M, BLOCK_N=tuning.block_n, NUM_STAGES=tuning.num_stages,
        CONSUMER_REGS=tuning.consumer_regs,
        num_warps=4,
    )


__all__ = ["MAX_SLOTS", "item_sequence", "launch", "lpt_order", "num_slots", "section_heads"]
