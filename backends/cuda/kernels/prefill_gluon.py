"""Gluon kernel (SM90): `prefill`, var-len causal attention with FlashAttention-3's schedule (DeepSeek MLA's 192/128 heads).

Chosen by backend option prefill_path (auto, the default, where Triton has Gluon for Hopper, or gluon) on SM90 GPUs, for
the calls it serves (`not_served`); the rest run prefill.py's tl kernel, which stays what the interpreter checks in CI
and what deterministic mode runs. It passed `deepinfer conformance --backend cuda --op prefill --backend-option
prefill_path=gluon` on an H100 (2026-12-07, Triton 3.6: 8 cases, docs/measurements/2026-12-07/h100_round14/a/).
Compiled for sm90 by `deepinfer bench compile --case "prefill gluon"` (Triton 3.9 and 3.6:
wgmma, TMA, no spills). Its GPU tests passed on an H200 (2026-12-07, Triton 3.6: tests/cuda/test_prefill_gluon.py).
Measured there (`deepinfer bench ops --op prefill`, against the tl kernel and torch SDPA in the same run): causal B4 x 4096,
16 heads, qk 192 / v 128 718.5 us (69.6% of the bf16 matmul rate, 0.92x SDPA) against 802.2 (0.81x); B2 x 2048, 128
heads 788.7 (0.90x) against 900.0 (0.78x); 1024 new tokens after 3072 cached 322.9 against 344.1; head dim 128, 16 /
128 heads 606.7 / 693.5 against 626.6 / 678.8.

Semantics: the op's (deepinfer/ops/attention.py `prefill`) for bf16 q [Tq, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv],
no sliding window: request b's queries (rows cu_seqlens_q[b] ..) sit at the end of its keys (a cached prefix, when
k_len > q_len, comes first), query i sees keys j <= k_len - q_len + i; scores in the log2 domain (qk_scale =
softmax_scale * log2(e), p = exp2(s * qk_scale - m): one FMA, so softmax_scale > 0), online softmax in float32, the
output O / l in bf16. prefill.py's tl kernel computes the same function.

Why: prefill.py's tl kernel runs QK^T, the online softmax and PV in order in the same warps, so the tensor cores wait
on each tile's softmax (docs/performance.md: 0.81x torch SDPA at B4 x 4096 causal, 16 heads, 62% of the bf16 matmul
rate); Triton 3.6's tl warp_specialize does not compile that loop. FlashAttention-3 (Shah et al., 2024) overlaps them with
warp specialisation and two consumer warpgroups that take turns on the tensor cores; this kernel follows its design.

Schedule: one program per (128-row query tile of one request, head), grid (Tq // 128 + B, H) from shapes only, as
the tl kernel's (the request found by a binary search over cu_seqlens_q, the heaviest tile of a request first; the
slots past a request's tiles do nothing). Key tiles of BLOCK_N = 128 rows from key 0 up to the tile's last query
position; the tiles wholly visible to every row of the 128-row tile run without a mask, the others (the diagonal's)
mask keys past each row's position; tiles past the diagonal are never loaded. Three partitions, 12 warps:
- producer (the default partition, a warpgroup, one thread issuing): the Q tile once ([128, Dqk] as [64, 64] TMA
  boxes, one mbarrier), then per key tile K [BLOCK_N, Dqk] and V [BLOCK_N, Dv] by TMA into a NUM_STAGES ring
  ([BLOCK_N, 64] boxes, 128-byte swizzle; K and V each with its own `ready` mbarrier, so QK^T starts before V lands;
  one `empty` mbarrier a stage, released by both consumers). TMA reads the [T, H * D] views of the packed tensors:
  rows past a request's keys (the next request's, zeros past Tk) only meet scores the causal mask removes, Q rows past
  the request feed rows that are never stored.
- two consumer warpgroups (workers; W = 0, 1: query rows 64W .. 64W + 63 of the tile), the same code. Per key tile j,
  with p_j (bf16, registers, the wgmma A operand) from the previous step:
  1. wait for its turn (`turn[W]`), issue S_{j+1} = Q_W K_{j+1}^T (Dqk / 64 wgmma groups, Q from shared memory) and
     O += p_j V_j (one m64n{Dv} group, A in registers), hand the turn to the other warpgroup (`turn[1 - W]`);
  2. wait for S_{j+1} only (PV_j still running): the online softmax of tile j + 1 (the diagonal's mask), p_{j+1};
  3. wait for PV_j, release stage j, rescale O by alpha_{j+1}.
  The turn makes the warpgroups alternate on the tensor cores: one's softmax runs while the other's GEMMs do
  (FA3's ping-pong), and within a warpgroup the softmax of tile j + 1 overlaps its own PV_j (FA3's intra-warpgroup
  overlap). Every wgmma is waited for in the iteration that issued it (none in flight across the loop's back edge:
  ptxas serialises every wgmma otherwise). The turn is a scheduling hint only: each warpgroup's data dependencies are
  its own waits. Epilogue: O / l in bf16, stored from the wgmma registers with the request's row mask.
Shared memory (Dqk 192, Dv 128, BLOCK_N 128, 2 stages): Q 48 KiB + 2 x (K 48 + V 32) KiB = 208 KiB + 9 mbarriers (one
CTA per SM). Registers (setmaxnreg): each consumer warpgroup CONSUMER_REGS (O [64, 128] and S [64, 128] float32 are
64 a thread each, p 32), the producer what is left of 504 (40).

Tuning switches (`Tuning`, `launch_prefill_gluon(tuning=...)`; the defaults: the schedule above, persistent): the key tile and
ring depth, the consumer / producer register split, and a persistent kernel (prefill_gluon_persistent.py: one program
per SM, a longest-first work order over query tiles and heads handed out by an atomic counter, the producer loading the
next item while the consumers finish the last). `python -m deepinfer_cuda.bench.attention_prefill --sweep
prefill_gluon` times them all beside the default and torch SDPA; `Tuning` says which have run on a GPU and what they gave.

Served (`not_served` says why not; `launch_prefill_gluon` returns None): bf16 q, k, v with Dqk in (128, 192) and
Dv = 128, no sliding window, softmax_scale > 0, heads packed (each tensor a [T, H * D] matrix of 16-byte aligned
rows: the TMA views), at most 65535 heads. Deterministic mode keeps prefill.py's invariant kernel.

Triton 3.6 (the GPU machine) and 3.9 differ in names used here: the TMA load and the partition-wide barrier
(gluon_hopper.py's shims, the shared-memory reinterpretation (3.6 `_reinterpret`, 3.9 `reinterpret`) among them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.ops import attention as attention_ops
from deepinfer_cuda.kernels.common import Registration, capability
from deepinfer_cuda.kernels.gluon_hopper import GLUON_IMPORT_ERROR, gluon_unusable
from deepinfer_cuda.options import PREFILL_PATH

if GLUON_IMPORT_ERROR is None:  # (else the launch declines every call)
    from deepinfer_cuda.kernels.gluon_hopper import (
        TensorDescriptor,
        fence_async_shared,
        gl,
        gluon,
        mbarrier,
        reinterpret_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from deepinfer_cuda.kernels.gluon_hopper import sync_warps as _sync_warps
    from deepinfer_cuda.kernels.gluon_hopper import tma_load as _tma_load

LOG2E = 1.4426950408889634
BLOCK_M = 128  # query rows per program: two consumer warpgroups of 64 (wgmma's M)
BLOCK_N = 128  # key rows per tile
CHUNK = 64  # columns per TMA box and shared-memory chunk (128 bytes of bf16: the swizzle's width)
NUM_STAGES = 2
HEAD_DIMS = ((192, 128), (128, 128))  # (Dqk, Dv) served
CONSUMER_REGS = 232  # setmaxnreg of each consumer warpgroup; the producer warpgroup gets 504 - 2 * 232 = 40
MAX_GRID_Y = 65535  # heads: the grid's second dimension
SHARED_MEMORY_BUDGET = 227 * 1024  # an SM90 CTA's opt-in shared memory
BARRIER_BYTES = 256  # the mbarriers beside the tiles (a margin)


@dataclass(frozen=True)
class Tuning:
    """The kernel's tuning switches (`launch_prefill_gluon(tuning=...)`); the defaults are the schedule the module
    docstring describes, the one GPU-tested and conformance-checked. The others are variants (timed and their outputs
    compared with the default's on an H100, 2026-12-07: docs/backends/cuda.md; the default, `persistent`, passed GPU
    conformance and its GPU tests, and runs 0.96x SDPA against the one-program-a-tile kernel's 0.90x; the GPU tests of the
    others passed too, num_stages=3's after its ptxas 12.8 workaround, `_ring_stage`) that `python -m
    deepinfer_cuda.bench.attention_prefill --sweep prefill_gluon` times on a GPU and tests/cuda/test_prefill_gluon.py's GPU
    tests check:
    - block_n, num_stages: the key tile's rows (a power of two: the score tile's column range; 16 .. 256: PV's K step,
      QK^T's wgmma N) and the K/V ring's depth, within the shared-memory budget (`shared_bytes`); a depth that is not a
      power of two has the consumers carry the stage and phase from tile to tile instead of dividing (`_ring_stage`).
    - consumer_regs: setmaxnreg of each consumer warpgroup (the producer warpgroup gets what is left of 504: 240 leaves
      it 24, FlashAttention-3's split).
    - persistent: prefill_gluon_persistent.py's kernel: one program per SM looping over (query tile, head) work items in a
      longest-first order across requests and heads, the producer loading the next item's Q and K/V while the consumers
      finish the last one's PV and store it.
    - section_bytes (persistent only): the order goes through the heads in sections whose K/V (every request's) stay
      within about this many bytes, so the programs working at once share their key tiles in L2; 0: one section.
    """

    block_n: int = BLOCK_N
    num_stages: int = NUM_STAGES
    consumer_regs: int = CONSUMER_REGS
    persistent: bool = True
    section_bytes: int = 24 << 20

    def shared_bytes(self, d_qk: int, d_v: int) -> int:
        """Shared memory of a program: Q [128, Dqk] once, num_stages x (K [block_n, Dqk] + V [block_n, Dv]), bf16."""
        return 2 * (BLOCK_M * d_qk + self.num_stages * self.block_n * (d_qk + d_v)) + BARRIER_BYTES

    def problem(self, d_qk: int, d_v: int) -> str | None:
        """Why this tuning cannot run heads of Dqk / Dv (None: it can)."""
        if self.block_n & (self.block_n - 1) or not 16 <= self.block_n <= 256:
            return f"block_n {self.block_n}: wants a power of two in 16 .. 256 (the score tile's column range; PV's K step, QK^T's wgmma N)"
        if self.num_stages < 2:
            return f"num_stages {self.num_stages}: wants >= 2 (a stage loads while one is read)"
        if self.consumer_regs % 8 or not 128 <= self.consumer_regs <= 240:
            return f"consumer_regs {self.consumer_regs}: wants a multiple of 8 in 128 .. 240 (the producer keeps at least 24 of 504)"
        if self.shared_bytes(d_qk, d_v) > SHARED_MEMORY_BUDGET:
            return f"{self.shared_bytes(d_qk, d_v)} bytes of shared memory at Dqk {d_qk} / Dv {d_v}: over {SHARED_MEMORY_BUDGET}"
        return None


DEFAULT_TUNING = Tuning()


if GLUON_IMPORT_ERROR is None:

    @gluon.jit
    def _operand_smem(q_desc, k_desc, v_desc, D_V: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, QK_CHUNKS: gl.constexpr,
                      V_CHUNKS: gl.constexpr):
        """The operands' shared memory: q (two warpgroups' [64, 64] chunks), the K and V rings ([BLOCK_N, 64] chunks,
        TMA's boxes), and V's ring seen as one [BLOCK_N, D_V] tile a stage (its chunks, one after the other, are one
        128-byte-swizzled tile: PV's B operand)."""
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * QK_CHUNKS, 64, 64], q_desc.layout)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES * QK_CHUNKS, BLOCK_N, 64], k_desc.layout)
        v_smem = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES * V_CHUNKS, BLOCK_N, 64], v_desc.layout)
        v_tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_V], gl.bfloat16)
        return q_smem, k_smem, v_smem, reinterpret_shared(v_smem, gl.bfloat16, [NUM_STAGES, BLOCK_N, D_V], v_tile_layout)

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                  q_row, k_row, qk_col, v_col, num_tiles,
                  BLOCK_N: gl.constexpr, QK_CHUNKS: gl.constexpr, V_CHUNKS: gl.constexpr, NUM_STAGES: gl.constexpr):
        """The Q tile once, then each key tile's K and V chunks into stage j % NUM_STAGES once both consumers have
        released its previous tile (a fresh `empty` barrier counts as having completed the phase before 0)."""
        CHUNK: gl.constexpr = 64
        if num_tiles > 0:
            mbarrier.expect(q_bar, 2 * QK_CHUNKS * q_desc.block_type.nbytes)
            for w in gl.static_range(2):
                for c in gl.static_range(QK_CHUNKS):
                    _tma_load(q_desc, [q_row + w * 64, qk_col + c * CHUNK], q_bar, q_smem.index(w * QK_CHUNKS + c))
        for j in range(num_tiles):
            stage = j % NUM_STAGES
            mbarrier.wait(kv_empty.index(stage), ((j // NUM_STAGES) & 1) ^ 1)
            row = k_row + j * BLOCK_N
            kb = k_ready.index(stage)
            mbarrier.expect(kb, QK_CHUNKS * k_desc.block_type.nbytes)
            for c in gl.static_range(QK_CHUNKS):
                _tma_load(k_desc, [row, qk_col + c * CHUNK], kb, k_smem.index(stage * QK_CHUNKS + c))
            vb = v_ready.index(stage)
            mbarrier.expect(vb, V_CHUNKS * v_desc.block_type.nbytes)
            for c in gl.static_range(V_CHUNKS):
                _tma_load(v_desc, [row, v_col + c * CHUNK], vb, v_smem.index(stage * V_CHUNKS + c))

    @gluon.jit
    def _scores(q_smem, k_smem, stage, s, W: gl.constexpr, QK_CHUNKS: gl.constexpr):
        """Warpgroup W's Q rows times the K tile of `stage`, transposed: QK_CHUNKS async wgmma groups over the
        64-column chunks (s: zeros of the accumulator's layout, not accumulated)."""
        for c in gl.static_range(QK_CHUNKS):
            s = warpgroup_mma(q_smem.index(W * QK_CHUNKS + c), k_smem.index(stage * QK_CHUNKS + c).permute((1, 0)), s,
                              use_acc=c > 0, is_async=True)
        return s

    @gluon.jit
    def _softmax(s, m_i, l_i, qk_scale, col0, pos, cols, masked):
        """The online softmax of one tile's scores (log2 domain): p = exp2(s * qk_scale - m_new) (one FMA; qk_scale
        > 0), alpha = exp2(m_i - m_new) the rescale of the running sum and output. masked: keys col0 + c past a
        row's position get p = 0. Every row sees key 0 in its first tile, so m_new is finite from there on."""
        if masked:
            s = gl.where(gl.expand_dims(cols, 0) <= gl.expand_dims(pos - col0, 1), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _ring_stage(j, carried, NUM_STAGES: gl.constexpr):
        """Key tile j's stage in the K/V ring: j % NUM_STAGES where NUM_STAGES is a power of two (the GPU-tested code,
        unchanged), else `carried` (the consumer counts it from tile to tile: `_ring_advance`). Why: with j % 3 and
        j // 3 in this loop, the ptxas of Triton 3.6 (CUDA 12.8) gave the second consumer warpgroup's last PV of a
        program the V descriptor the loop's other branch had left in uniform registers (the previous tile's; never
        written in a one-tile program): wrong values on the GPU. The carried form compiles correctly there; what in
        the division set ptxas off is not known, so `bench compile` checks every wgmma kernel's SASS for it
        (`deepinfer_cuda.bench.sass_check`)."""
        if NUM_STAGES & (NUM_STAGES - 1) == 0:
            return j % NUM_STAGES
        else:
            return carried

    @gluon.jit
    def _ring_phase(j, carried, NUM_STAGES: gl.constexpr):
        """Key tile j's phase parity on its stage's barriers: (j // NUM_STAGES) & 1, or `carried` (as `_ring_stage`)."""
        if NUM_STAGES & (NUM_STAGES - 1) == 0:
            return (j // NUM_STAGES) & 1
        else:
            return carried

    @gluon.jit
    def _ring_advance(stage, phase, NUM_STAGES: gl.constexpr):
        """The carried (stage, phase) of the next key tile; unchanged (unused) where NUM_STAGES is a power of two."""
        if NUM_STAGES & (NUM_STAGES - 1) == 0:
            return stage, phase
        else:
            wrap = (stage + 1 == NUM_STAGES).to(gl.int32)
            return (stage + 1) * (1 - wrap), phase ^ wrap

    @gluon.jit
    def _consumer(q_smem, k_smem, v_tiles, q_bar, k_ready, v_ready, kv_empty, turn,
                  out_ptr, stride_ot, stride_oh, q_start, row_end, first_row, pos0, head, num_tiles, n_full, qk_scale,
                  W: gl.constexpr, BLOCK_N: gl.constexpr, D_V: gl.constexpr, QK_CHUNKS: gl.constexpr, NUM_STAGES: gl.constexpr):
        """Consumer warpgroup W: query rows first_row + 64W .. + 63 of the request (module docstring's steps 1-3).
        pos0: the key position of the request's query 0 (k_len - q_len); row_end: the request's query count (0 for a
        program with no tile); key tiles j >= n_full are masked."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D_V, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        pos = pos0 + first_row + W * 64 + gl.arange(0, 64, layout=row_layout)  # each row's key position
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        m_i = gl.full([64], float("-inf"), gl.float32, layout=row_layout)
        l_i = gl.zeros([64], gl.float32, layout=row_layout)
        acc = gl.zeros([64, D_V], gl.float32, layout=o_layout)
        p_op = gl.zeros([64, BLOCK_N], gl.bfloat16, layout=p_layout)
        # Turns: warpgroup W's k-th wait on turn[W] (k = 0, 1, ...) waits for the other's k-th arrival there, except
        # warpgroup 0's first, which passes on the fresh barrier (phase parity 1): (k & 1) ^ (1 - W).
        if num_tiles > 0:
            mbarrier.wait(q_bar, 0)
            mbarrier.wait(k_ready.index(0), 0)
            mbarrier.wait(turn.index(W), 1 - W)
            s = _scores(q_smem, k_smem, 0, gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout), W, QK_CHUNKS)
            mbarrier.arrive(turn.index(1 - W))
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, 0, pos, cols, n_full == 0)
            p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        ring = num_tiles * 0  # (carried stage and phase of tile j, for rings of 3: `_ring_stage`)
        ring_phase = num_tiles * 0
        for j in range(num_tiles):
            stage = _ring_stage(j, ring, NUM_STAGES)
            ring_next, ring_phase_next = _ring_advance(ring, ring_phase, NUM_STAGES)
            mbarrier.wait(turn.index(W), ((j + 1) & 1) ^ (1 - W))
            if j + 1 < num_tiles:
                nxt = _ring_stage(j + 1, ring_next, NUM_STAGES)
                mbarrier.wait(k_ready.index(nxt), _ring_phase(j + 1, ring_phase_next, NUM_STAGES))
                s = _scores(q_smem, k_smem, nxt, gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout), W, QK_CHUNKS)
                mbarrier.wait(v_ready.index(stage), _ring_phase(j, ring_phase, NUM_STAGES))
                o = warpgroup_mma(p_op, v_tiles.index(stage), acc, is_async=True)
                mbarrier.arrive(turn.index(1 - W))
                # S_{j+1} first (groups retire in order: all but PV_j's one), its softmax while PV_j runs
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
                p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, (j + 1) * BLOCK_N, pos, cols, j + 1 >= n_full)
                acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_op))
                _sync_warps()  # every warp's wgmmas on the stage are done
                mbarrier.arrive(kv_empty.index(stage))
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
                p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
            else:
                mbarrier.wait(v_ready.index(stage), _ring_phase(j, ring_phase, NUM_STAGES))
                o = warpgroup_mma(p_op, v_tiles.index(stage), acc, is_async=True)
                mbarrier.arrive(turn.index(1 - W))
                acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o, p_op))
                _sync_warps()
                mbarrier.arrive(kv_empty.index(stage))
            ring = ring_next
            ring_phase = ring_phase_next
        # O / l (l > 0 for every row that saw a tile; rows of a program with no tile are not stored)
        l_o = gl.convert_layout(l_i, o_rows)
        inv = 1.0 / gl.where(l_o > 0.0, l_o, 1.0)
        rows = first_row + W * 64 + gl.arange(0, 64, layout=o_rows)
        ocols = gl.arange(0, D_V, layout=gl.SliceLayout(0, o_layout))
        dst = out_ptr + gl.expand_dims((q_start + rows).to(gl.int64) * stride_ot + head * stride_oh, 1) + gl.expand_dims(ocols, 0)
        gl.store(dst, (acc * gl.expand_dims(inv, 1)).to(out_ptr.dtype.element_ty), mask=gl.expand_dims(rows < row_end, 1))

    @gluon.jit(do_not_specialize=["num_requests", "search_steps"])
    def _prefill_ws_kernel(
        q_desc, k_desc, v_desc,  # TMA over the [T, H * D] views, [64, 64] (q) and [BLOCK_N, 64] (k, v) boxes
        out_ptr, cu_q_ptr, cu_k_ptr,
        stride_ot, stride_oh,
        num_requests, search_steps,  # search_steps: the bit length of num_requests - 1
        qk_scale,  # softmax_scale * log2(e)
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
        head = gl.program_id(1)
        # the request b whose slots [cu_q[b] // BLOCK_M + b, cu_q[b + 1] // BLOCK_M + b + 1) hold pid (triton_common.find_request)
        lo = pid * 0
        hi = lo + num_requests
        for _ in range(search_steps):
            mid = (lo + hi) // 2
            if gl.load(cu_q_ptr + mid) // BLOCK_M + mid <= pid:
                lo = mid
            else:
                hi = mid
        b = lo
        q_start = gl.load(cu_q_ptr + b)
        q_len = gl.load(cu_q_ptr + b + 1) - q_start
        k_start = gl.load(cu_k_ptr + b)
        k_len = gl.load(cu_k_ptr + b + 1) - k_start
        num_m_blocks = (q_len + BLOCK_M - 1) // BLOCK_M
        slot = pid - (q_start // BLOCK_M + b)
        live = (slot < num_m_blocks).to(gl.int32)  # 0: a slot past the request's tiles (no tile, nothing stored)
        m_blk = gl.maximum(num_m_blocks - 1 - slot, 0)  # the last query tile (most keys) first
        pos0 = k_len - q_len  # the key position of the request's query 0
        first_pos = pos0 + m_blk * BLOCK_M
        last_pos = pos0 + gl.minimum((m_blk + 1) * BLOCK_M, q_len) - 1
        num_tiles = live * ((last_pos + BLOCK_N) // BLOCK_N)
        n_full = (first_pos + 1) // BLOCK_N  # key tiles visible to every row of the tile: no mask
        row_end = live * q_len

        q_smem, k_smem, v_smem, v_tiles = _operand_smem(q_desc, k_desc, v_desc, D_V, BLOCK_N, NUM_STAGES, QK_CHUNKS, V_CHUNKS)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)  # both consumer warpgroups
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        fence_async_shared()

        q_row = q_start + m_blk * BLOCK_M
        gl.warp_specialize(
            [
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_empty,
                             q_row, k_start, head * D_QK, head * D_V, num_tiles, BLOCK_N, QK_CHUNKS, V_CHUNKS, NUM_STAGES)),
                (_consumer, (q_smem, k_smem, v_tiles, q_bar, k_ready, v_ready, kv_empty, turn,
                             out_ptr, stride_ot, stride_oh, q_start, row_end, m_blk * BLOCK_M, pos0, head, num_tiles, n_full, qk_scale,
                             0, BLOCK_N, D_V, QK_CHUNKS, NUM_STAGES)),
                (_consumer, (q_smem, k_smem, v_tiles, q_bar, k_ready, v_ready, kv_empty, turn,
                             out_ptr, stride_ot, stride_oh, q_start, row_end, m_blk * BLOCK_M, pos0, head, num_tiles, n_full, qk_scale,
                             1, BLOCK_N, D_V, QK_CHUNKS, NUM_STAGES)),
            ],
            [4, 4],
            [CONSUMER_REGS, CONSUMER_REGS],
        )


# ---------------------------------------------------------------------------------------------
# Host side: which calls the kernel serves, its grid and launch


def _packed_rows(x: torch.Tensor) -> bool:
    """x [T, H, D] is a [T, H * D] matrix of 16-byte aligned rows (a TMA view): heads packed, D contiguous."""
    size = x.element_size()
    return x.stride(2) == 1 and x.stride(1) == x.shape[2] and (x.stride(0) * size) % 16 == 0 and x.stride(0) >= x.shape[1] * x.shape[2] \
        and x.data_ptr() % 16 == 0


def not_served(q, k, v, softmax_scale: float, sliding_window: int | None = None) -> str | None:
    """Why this kernel does not serve a call (None: it does). Devices, dtypes, shapes, strides and alignment only."""
    if GLUON_IMPORT_ERROR is not None:
        return f"no Gluon for Hopper in this Triton ({GLUON_IMPORT_ERROR})"
    if q.device.type not in ("cuda", "meta"):  # ("meta" tensors pass: the compile check)
        return f"not on a GPU ({q.device.type}: the interpreter runs the tl kernel)"
    if q.device.type == "cuda" and capability(q.device)[0] != 9:
        return f"not an SM90 GPU (capability {capability(q.device)})"
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
        return f"q/k/v are {q.dtype}/{k.dtype}/{v.dtype}, not bfloat16"
    if (q.shape[2], v.shape[2]) not in HEAD_DIMS:
        return f"Dqk = {q.shape[2]}, Dv = {v.shape[2]}: wants one of {HEAD_DIMS}"
    if sliding_window is not None:
        return "sliding window"
    if not softmax_scale > 0:
        return f"softmax_scale = {softmax_scale}: wants > 0 (exp2(s * scale - m) as one FMA)"
    if q.shape[1] > MAX_GRID_Y:
        return f"H = {q.shape[1]}: the grid's second dimension holds at most {MAX_GRID_Y} heads"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not _packed_rows(x):
            return f"{name} is not a [T, H * D] matrix of 16-byte aligned rows (TMA)"
    return None


def grid(num_tokens: int, num_requests: int, heads: int) -> tuple[int, int]:
    """Slots for every request's 128-row query tiles from shapes only (prefill.py's rule): Tq // BLOCK_M + B."""
    return num_tokens // BLOCK_M + num_requests, heads


@dataclass(frozen=True)
class ProgramPlan:
    """What one program of `_prefill_ws_kernel` works on (any head): its request, query tile and key tiles."""

    request: int
    m_blk: int  # the query tile (rows m_blk * BLOCK_M .. of the request)
    q_start: int
    q_len: int
    k_start: int
    k_len: int
    num_tiles: int  # key tiles 0 .. num_tiles - 1 (BLOCK_N keys each, from the request's key 0)
    n_full: int  # key tiles 0 .. n_full - 1 visible to every row of the query tile: no mask


def program_plan(cu_seqlens_q: list[int], cu_seqlens_k: list[int], pid: int, block_n: int = BLOCK_N) -> ProgramPlan | None:
    """The kernel's prologue in Python, for program `pid` of grid axis 0: None for a slot past its request's tiles. The
    same integer arithmetic as the kernel (the binary search included), so the CPU tests can check what no GPU has run:
    every query tile gets exactly one program and its key tiles cover its causal range. block_n: the tuning's key tile."""
    num_requests = len(cu_seqlens_q) - 1
    lo, hi = 0, num_requests
    for _ in range(max(num_requests - 1, 0).bit_length()):
        mid = (lo + hi) // 2
        if cu_seqlens_q[mid] // BLOCK_M + mid <= pid:
            lo = mid
        else:
            hi = mid
    b = lo
    q_start, k_start = cu_seqlens_q[b], cu_seqlens_k[b]
    q_len, k_len = cu_seqlens_q[b + 1] - q_start, cu_seqlens_k[b + 1] - k_start
    num_m_blocks = (q_len + BLOCK_M - 1) // BLOCK_M
    slot = pid - (q_start // BLOCK_M + b)
    if slot >= num_m_blocks:
        return None
    m_blk = num_m_blocks - 1 - slot
    pos0 = k_len - q_len
    last_pos = pos0 + min((m_blk + 1) * BLOCK_M, q_len) - 1
    return ProgramPlan(b, m_blk, q_start, q_len, k_start, k_len, (last_pos + block_n) // block_n, (pos0 + m_blk * BLOCK_M + 1) // block_n)


def _descriptor(x: torch.Tensor, block_rows: int):
    """TMA over x's [T, H * D] view in [block_rows, 64] boxes (128-byte swizzle: wgmma's operand layout)."""
    x2 = x.as_strided((x.shape[0], x.shape[1] * x.shape[2]), (x.stride(0), 1))
    box = [block_rows, CHUNK]
    return TensorDescriptor(x2, list(x2.shape), list(x2.stride()), box, gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16))


def launch_prefill_gluon(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float,
    sliding_window: int | None = None,
    *,
    tuning: Tuning | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """prefill.launch_prefill's arguments; None for a call this kernel does not serve (`not_served`: the caller falls back).
    tuning: the switches (`Tuning`; None: DEFAULT_TUNING); a tuning that cannot run these head dims is a ValueError.
    out: the output [Tq, H, Dv] (bf16, contiguous) to write (the sweep passes NaN-filled buffers: rows left unwritten show)."""
    attention_ops.check_prefill_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, sliding_window)
    if not_served(q, k, v, softmax_scale, sliding_window) is not None:
        return None
    tuning = DEFAULT_TUNING if tuning is None else tuning
    num_tokens, heads, d_qk = q.shape
    d_v = v.shape[2]
    problem = tuning.problem(d_qk, d_v)
    if problem is not None:
        raise ValueError(f"prefill_gluon tuning {tuning}: {problem}")
    if out is None:
        out = torch.empty(num_tokens, heads, d_v, dtype=q.dtype, device=q.device)
    elif out.shape != (num_tokens, heads, d_v) or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out: wants a contiguous {q.dtype} [{num_tokens}, {heads}, {d_v}], got {out.dtype} {list(out.shape)}")
    num_requests = cu_seqlens_q.shape[0] - 1
    if num_tokens == 0 or heads == 0 or num_requests == 0:
        return out
    cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32)
    cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32)
    descriptors = (_descriptor(q, 64), _descriptor(k, tuning.block_n), _descriptor(v, tuning.block_n))
    from deepinfer_cuda.kernels import prefill_gluon_persistent

    # (a batch of more query tiles than the persistent order sorts runs a program a tile: the same outputs, bit for bit)
    if tuning.persistent and prefill_gluon_persistent.num_slots(num_tokens, num_requests) <= prefill_gluon_persistent.MAX_SLOTS:
        prefill_gluon_persistent.launch(descriptors, out, cu_q, cu_k, k.shape[0], softmax_scale * LOG2E, d_qk, d_v, tuning)
        return out
    _prefill_ws_kernel[grid(num_tokens, num_requests, heads)](
        *descriptors,
        out, cu_q, cu_k,
        out.stride(0), out.stride(1),
        num_requests, max(num_requests - 1, 0).bit_length(),
        float(softmax_scale) * LOG2E,
        D_QK=d_qk, D_V=d_v, BLOCK_M=BLOCK_M, BLOCK_N=tuning.block_n, NUM_STAGES=tuning.num_stages,
        CONSUMER_REGS=tuning.consumer_regs,
        num_warps=4,
    )
    return out


def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    softmax_scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The op on this kernel where it serves the call (`not_served`), else on prefill.py's tl kernel."""
    from deepinfer_cuda.kernels import prefill as tl_prefill

    out = launch_prefill_gluon(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, sliding_window)
    return out if out is not None else tl_prefill.launch_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, sliding_window)


def _chosen(ctx) -> bool:
    """prefill_path=gluon, or auto where Triton has Gluon for Hopper, on an SM90 device."""
    path = PREFILL_PATH.value(ctx)
    return (path == "gluon" or (path == "auto" and GLUON_IMPORT_ERROR is None)) and capability(ctx.device)[0] == 9


def _unusable(ctx) -> str | None:
    return gluon_unusable("prefill_path=gluon", GLUON_IMPORT_ERROR)


REGISTRATIONS = [
    Registration(
        op="prefill",
        fn=prefill,
        dtypes=(torch.bfloat16,),
        when=_chosen,
        priority=1,
        unusable=_unusable,
        note="Gluon (SM90; prefill_path=auto or gluon): FlashAttention-3's schedule, a TMA producer and two wgmma warpgroups taking "
        "turns, for bf16 calls with Dqk/Dv 192/128 or 128/128 and no sliding window; the tl kernel for the rest",
    ),
]

__all__ = ["DEFAULT_TUNING", "REGISTRATIONS", "ProgramPlan", "Tuning", "grid", "launch_prefill_gluon", "not_served", "prefill", "program_plan"]
