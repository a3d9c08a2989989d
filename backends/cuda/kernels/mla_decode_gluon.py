"""Gluon kernel (SM90): `mla_decode` over the bf16 KV cache, warp-specialised, a TMA loader warp and two wgmma warpgroups.

Chosen by backend option mla_decode_path (`_chosen`: auto, the default, or gluon), on SM90 GPUs whose Triton has Gluon
for Hopper, for models with a bf16 cache of these rows, for the calls of at least GLUON_MIN_ROWS query rows (S * H) it
serves (`not_served`); every other call goes to mla_decode.py's tl kernel, which stays what the interpreter checks in CI
and what deterministic mode runs. It passed `deepinfer conformance --backend cuda --op mla_decode --backend-option
mla_decode_path=gluon` on an H100 (2026-12-07, Triton 3.6: 16 cases, docs/measurements/2026-12-07/h100_round14/a/; the
case of two 64-head queries, b1_s2_h64_len97_two_row_tiles, is the one it serves) and its GPU tests on an H200
(tests/cuda/test_mla_decode_gluon.py, against the reference op). Measured there (`bench ops
--op mla_decode`): 128 heads B128 ctx4096 332.5 us against the tl kernel's 572.8, B32 ctx2048 56.1 against 99.9, B1
ctx8192 22.4 against 29.3; 16 heads B128 ctx4096 174.9 against 168.7 (memory-bound: why 16-head calls, below
GLUON_MIN_ROWS, keep the tl kernel). Compiled in CI by `deepinfer bench compile --case "mla_decode bf16
gluon"` (wgmma, TMA, no spills: Triton 3.9 and 3.6).

Why: the tl kernel runs the compute-bound 128-head decode (B128 ctx4096, one H100) at ~607 us, 240 TFLOP/s, where
FlashMLA's SM90 bf16 decode kernel takes 251 us (581 TFLOP/s). This kernel is mla_decode_fp8_gluon.py's schedule (two
attention warpgroups each scoring half of a 64-row tile's keys, agreeing on the rescale through shared memory, each
owning half of the output columns over all keys; FlashMLA's SM90 division of the work), which ran the FP8 cache 1.37-1.39x
faster than the tl bf16 reader at 128 heads on an H100. Over a bf16 cache nothing needs converting: the converting
warpgroup becomes a single TMA producer warp, and the registers it held go to the attention warpgroups (232 each
against 192 / 200).

Semantics: mla_decode.py's split kernel over a bf16 cache (pages of 64 rows of 576 values: 512 latent, 64 rope), scores
in the log2 domain, online softmax in float32. With one split it writes the normalised output; with several it writes
exactly the split kernel's partials (part_out [B, splits, rows, 512] float32, part_lse [B, splits, rows] log2-domain,
-inf for a split that saw no key) and mla_decode.py's combine kernel (or its wide combine) merges them in split order,
as there (mla_decode_gluon_parts.launch).

Schedule (split_keys; the table's seesaw shares its loader, plan and partials: mla_decode_gluon_seesaw.py says what
differs): one program per (64-row tile, request, split), grid (row tiles, B, splits) as the tl kernel's; tiles of 64
cache rows (one page); three partitions:
- the loader (a worker, 1 warp; Triton pads it to a warpgroup for setmaxnreg, the padding warps idle): per tile j, once
  both attention warpgroups have released stage j % 2 (`bf_empty`), nine TMA copies of [64, 64] boxes (128-byte
  swizzle) of the page's rows from a descriptor over the cache seen as one [pages * 64, 576] matrix, completing on
  `bf_ready`; the block-table entry of the next tile is loaded while it waits. The split's last tile when it is partial
  (the request ends inside the page) lands on a barrier of its own (`landed`), the loader sets its rows past the end to
  zero (so that a stale row of the page cannot bring NaN or Inf into p . v with p = 0) and then arrives on `bf_ready`.
- two attention warpgroups (mla_decode_gluon_parts._attend, unscaled: a key past the split's end, or with S > 1 after its
  row's query position, is masked by its index): as in mla_decode_fp8_gluon.py.
q [64, 576] bf16 is loaded into shared memory by the default warps before the partitions fork (rows past S*H zero).
Shared memory (as the FP8 kernel's less the row scales): q 72 KiB + two bf16 stages 144 KiB + p 8 KiB + maxima / row
sums 1 KiB + 10 mbarriers; one CTA per SM.
Registers (setmaxnreg over 12 warps, 168 a thread at launch, 504 per thread of each warpgroup triple): attention
warpgroups 232 each (PARTITION_REGS; warpgroup 0, the default partition, gets the rest), the loader's warpgroup 40.

Served (`not_served` says why not; `launch_mla_decode_gluon` returns None so callers fall back): a bf16 cache with pages
of 64 rows of 576 values laid out as one matrix of 16-byte aligned rows (the TMA view), C = 512, R = 64, bf16 q,
S*H <= 64 (one 64-row tile, padded) or S*H = 128 (two row tiles, the second's cache reads hit L2), no sliding window, no
tuning overrides, no `tiles_of_one_query` unless S = 1. The splits are chosen as the FP8 kernel's
(mla_decode_gluon_parts.plan: host shapes only, CUDA-graph safe); a forced num_splits / tokens_per_split is honoured.

Tuning switches (the tuning entry mla_decode/gluon_bf16, default.py's; its values are the schedule the table runs, timed
by the sweep on an H100, 2026-12-07, docs/backends/cuda.md: seesaw_early_release 284.5 against split_keys' 330.7 us at
B128 ctx4096, and conformance (16 cases) and the GPU tests (78) passed with it in the table): "schedule" ("split_keys":
the schedule above; "seesaw": mla_decode_gluon_seesaw.py, each attention warpgroup scoring whole tiles, alternately, for
[64, 64] score wgmmas that the SM's shared memory can feed and one handshake a tile; "seesaw_early_release", the
table's: the same, each warpgroup releasing the other's stage before it waits for its own), "attend_regs" / "load_regs"
(setmaxnreg of attention warpgroup 1 and of the loader; warpgroup 0 gets 504 less both), "min_tokens_per_split" /
"max_splits" (the plan's limits), "balanced" (True: mla_decode_gluon_balanced.py's persistent grid of one CTA per SM,
each a contiguous share of the flattened (request, key tile) work cut on the device from the lengths, the cut requests
merged by its combine; with "seesaw_early_release" only; a forced num_splits / tokens_per_split keeps the split grid;
not yet run on a GPU) and "balanced_overhead_tiles" (its schedule's cost of a segment, in tiles).
`python -m deepinfer_cuda.bench.gemm --sweep mla_gluon_bf16` times the candidates on a GPU beside the tl kernel, `deepinfer
bench compile --arch sm90 --sweep mla_gluon_bf16` compiles them. One CTA processing both 64-row tiles of a 128-row call
over one stage is not among them: its output accumulators (128 rows x 512 float32) alone would take the SM's whole
register file (64 Ki registers).

Triton 3.6 (the GPU machine) and 3.9 differ in the names of the TMA copy (`tma_load`) and of the partition-wide barrier
(`_sync_warps`): gluon_hopper.py's shims.
"""

from __future__ import annotations

import torch

from deepinfer_cuda.kernels import mla_decode_gluon_parts as parts
from deepinfer_cuda.kernels.common import Registration
from deepinfer_cuda.kernels.gluon_hopper import GLUON_IMPORT_ERROR, gluon_unusable
from deepinfer_cuda.kernels.mla_decode_gluon_parts import LATENT, PAGE, ROPE
from deepinfer_cuda.options import MLA_DECODE_PATH
from deepinfer_cuda.tuning import config

if GLUON_IMPORT_ERROR is None:  # (else the launch declines every call)
    from deepinfer_cuda.kernels.gluon_hopper import TensorDescriptor, fence_async_shared, gl, gluon, mbarrier, reinterpret_shared
    from deepinfer_cuda.kernels.gluon_hopper import sync_warps as _sync_warps
    from deepinfer_cuda.kernels.gluon_hopper import tma_load as _tma_load
    from deepinfer_cuda.kernels.mla_decode_gluon_parts import _attend, _attention_barriers, _attention_smem, _split_range, _stage_q
    from deepinfer_cuda.kernels.mla_decode_gluon_seesaw import _attend_seesaw, _seesaw_smem

PARTITION_REGS = (232, 40)  # setmaxnreg of attention warpgroup 1 and of the loader's warpgroup (warpgroup 0: the rest, 232): the table's default
# the tuning entry's "schedule": "split_keys" (parts._attend: both warpgroups score half of every tile; what was measured)
# or "seesaw" / "seesaw_early_release" (mla_decode_gluon_seesaw.py: each scores whole tiles, alternately; swept on an H100)
SCHEDULES = ("split_keys", "seesaw", "seesaw_early_release")
CHUNK = 64  # columns per TMA box and shared-memory chunk (128 bytes of bf16: the swizzle's width)
# mla_decode_path=gluon serves the calls of at least this many query rows here: 16-head rows (memory-bound, three
# quarters of each 64-row wgmma padding) stay on the tl kernel until measured (the rows `deepinfer bench ops --op
# mla_decode` times with ", gluon" say which wins)
GLUON_MIN_ROWS = 64


if GLUON_IMPORT_ERROR is None:

    @gluon.jit
    def _copy_tile(kv_desc, row, bf_smem, t, bar, NUM_CHUNKS: gl.constexpr):
        """The TMA copies of the page at cache row `row` into stage t (NUM_CHUNKS [64, 64] boxes), completing on `bar`."""
        mbarrier.expect(bar, NUM_CHUNKS * kv_desc.block_type.nbytes)
        for c in gl.static_range(NUM_CHUNKS):
            _tma_load(kv_desc, [row, c * 64], bar, bf_smem.index(t * NUM_CHUNKS + c))

    @gluon.jit
    def _zero_rows_from(bf_bands, t, live, BLOCK_N: gl.constexpr, NUM_CHUNKS: gl.constexpr):
        """Rows live .. BLOCK_N - 1 of stage t set to zero, by one warp, from the band of 8 rows (one swizzle atom) that
        holds row `live` on. bf_bands: the stages as [2 * NUM_CHUNKS * BLOCK_N / 8, 8, 64] bands."""
        BANDS: gl.constexpr = BLOCK_N // 8
        band_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])  # [8, 64]: two 16-byte vectors a thread
        rows = gl.arange(0, 8, layout=gl.SliceLayout(1, band_layout))
        for band in range(live // 8, BANDS):
            keep = gl.expand_dims(rows + band * 8 < live, 1)
            for c in gl.static_range(NUM_CHUNKS):
                view = bf_bands.index((t * NUM_CHUNKS + c) * BANDS + band)
                x = view.load(band_layout)
                view.store(gl.where(keep, x, gl.zeros_like(x)))

    @gluon.jit
    def _loader(kv_desc, bt_row, bf_smem, bf_bands, bf_ready, bf_empty, landed, lo, split_end, num_tiles,
                PAGE: gl.constexpr, BLOCK_N: gl.constexpr, NUM_CHUNKS: gl.constexpr):
        """One warp: tile j's page (block-table entry lo // PAGE + j) into stage j % 2 once both attention warpgroups have
        released it (a fresh `empty` barrier counts as having completed the phase before 0). A partial tile (the split's
        last) lands on `landed`, gets its rows past the end zeroed, then is handed over on bf_ready."""
        first = lo // PAGE
        page = gl.load(bt_row + first, mask=num_tiles > 0, other=0).to(gl.int32)
        for j in range(num_tiles):
            t = j % 2
            page_next = gl.load(bt_row + first + j + 1, mask=j + 1 < num_tiles, other=0).to(gl.int32)
            live = split_end - (lo + j * BLOCK_N)  # rows of the tile before the split's end
            mbarrier.wait(bf_empty.index(t), ((j // 2) & 1) ^ 1)
            if live >= BLOCK_N:
                _copy_tile(kv_desc, page * PAGE, bf_smem, t, bf_ready.index(t), NUM_CHUNKS)
            else:  # (at most once a program: the last tile)
                _copy_tile(kv_desc, page * PAGE, bf_smem, t, landed, NUM_CHUNKS)
                mbarrier.wait(landed, 0)
                _zero_rows_from(bf_bands, t, live, BLOCK_N, NUM_CHUNKS)
                fence_async_shared()  # the stores, before wgmma reads the stage (the async proxy)
                _sync_warps()
                mbarrier.arrive(bf_ready.index(t))
            page = page_next

    @gluon.jit(do_not_specialize=["tokens_per_split"])
    def _mla_decode_ws_kernel(
        kv_desc,  # TMA over the cache as [pages * 64, 576] bf16, [64, 64] boxes
        q_nope_ptr, q_rope_ptr, block_table_ptr, seq_lens_ptr,
        dst_ptr,  # DIRECT: the output [B, S, H, C]; else the split partials [B, splits, rows, C] float32
        part_lse_ptr,
        qk_scale,  # softmax_scale * log2(e)
        tokens_per_split,  # a multiple of BLOCK_N
        stride_qn_b, stride_qn_s, stride_qn_h,
        stride_qr_b, stride_qr_s, stride_qr_h,
        stride_bt_b,
        stride_o_b, stride_o_s, stride_o_h,
        stride_po_b, stride_po_split, stride_po_m,
        stride_pl_b, stride_pl_split,
        S: gl.constexpr, H: gl.constexpr,
        C: gl.constexpr, R: gl.constexpr,
        PAGE: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        DIRECT: gl.constexpr,
        REGS_ATTEND: gl.constexpr, REGS_LOAD: gl.constexpr,
        SEESAW: gl.constexpr,  # mla_decode_gluon_seesaw.py's schedule (tuning switch "schedule": "seesaw" or "seesaw_early_release")
        EARLY_RELEASE: gl.constexpr,  # (with SEESAW) "seesaw_early_release": the other's stage released before this one is waited for
        num_warps: gl.constexpr,
    ):
        gl.static_assert(PAGE == BLOCK_N, "a tile is one page")
        NUM_CHUNKS: gl.constexpr = (C + R) // 64
        seq_len, lo, split_end, num_tiles = _split_range(seq_lens_ptr, tokens_per_split, BLOCK_N)
        bt_row = block_table_ptr + gl.program_id(1).to(gl.int64) * stride_bt_b
        if SEESAW:  # mla_decode_gluon_seesaw.py's schedule
            q_smem, bf_smem, p_smem, mx_smem, sum_smem, bf_ready, bf_empty, published, sums_bar = _seesaw_smem(BLOCK_M, BLOCK_N, NUM_CHUNKS)
        else:
            q_smem, bf_smem, p_smem = _attention_smem(BLOCK_M, BLOCK_N, NUM_CHUNKS)
            mx_smem, bf_ready, bf_empty, p_ready, p_free, mx_bar = _attention_barriers(BLOCK_M)
        # the stages as bands of 8 rows (one 128-byte swizzle atom each: the same bytes) for the loader's zeroing
        chunk: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], gl.bfloat16)  # (the stages' layout)
        bf_bands = reinterpret_shared(bf_smem, gl.bfloat16, [2 * NUM_CHUNKS * (BLOCK_N // 8), 8, 64], chunk)
        landed = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # the partial tile's TMA copies
        mbarrier.init(landed, count=1)
        _stage_q(q_smem, q_nope_ptr, q_rope_ptr, stride_qn_b, stride_qn_s, stride_qn_h, stride_qr_b, stride_qr_s, stride_qr_h,
                 S, H, C, R, BLOCK_M, num_warps)

        if SEESAW:
            gl.warp_specialize(
                [
                    (_attend_seesaw, (q_smem, bf_smem, p_smem, mx_smem, sum_smem, bf_ready, bf_empty, published, sums_bar,
                                      dst_ptr, part_lse_ptr, seq_len, lo, split_end, num_tiles, qk_scale,
                                      stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m, stride_pl_b, stride_pl_split,
                                      S, H, BLOCK_M, BLOCK_N, NUM_CHUNKS, DIRECT, 0, EARLY_RELEASE)),
                    (_attend_seesaw, (q_smem, bf_smem, p_smem, mx_smem, sum_smem, bf_ready, bf_empty, published, sums_bar,
                                      dst_ptr, part_lse_ptr, seq_len, lo, split_end, num_tiles, qk_scale,
                                      stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m, stride_pl_b, stride_pl_split,
                                      S, H, BLOCK_M, BLOCK_N, NUM_CHUNKS, DIRECT, 1, EARLY_RELEASE)),
                    (_loader, (kv_desc, bt_row, bf_smem, bf_bands, bf_ready, bf_empty, landed, lo, split_end, num_tiles, PAGE, BLOCK_N, NUM_CHUNKS)),
                ],
                [4, 1],
                [REGS_ATTEND, REGS_LOAD],
            )
        else:
            gl.warp_specialize(
                [
                    (_attend, (q_smem, bf_smem, None, p_smem, mx_smem, bf_ready, bf_empty, p_ready, p_free, mx_bar,
                               dst_ptr, part_lse_ptr, seq_len, lo, split_end, num_tiles, qk_scale,
                               stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m, stride_pl_b, stride_pl_split,
                               S, H, BLOCK_M, BLOCK_N, NUM_CHUNKS, DIRECT, 0, False)),
                    (_attend, (q_smem, bf_smem, None, p_smem, mx_smem, bf_ready, bf_empty, p_ready, p_free, mx_bar,
                               dst_ptr, part_lse_ptr, seq_len, lo, split_end, num_tiles, qk_scale,
                               stride_o_b, stride_o_s, stride_o_h, stride_po_b, stride_po_split, stride_po_m, stride_pl_b, stride_pl_split,
                               S, H, BLOCK_M, BLOCK_N, NUM_CHUNKS, DIRECT, 1, False)),
                    (_loader, (kv_desc, bt_row, bf_smem, bf_bands, bf_ready, bf_empty, landed, lo, split_end, num_tiles, PAGE, BLOCK_N, NUM_CHUNKS)),
                ],
                [4, 1],
                [REGS_ATTEND, REGS_LOAD],
            )


# ---------------------------------------------------------------------------------------------
# Host side: which calls the kernel serves and its launch (the plan and the launch with the combine: mla_decode_gluon_parts)


def not_served(q_nope, q_rope, kv_cache, sliding_window, overrides=None, tiles_of_one_query=False) -> str | None:
    """Why this kernel does not serve a call (None: it does). Shapes, dtypes, strides and alignment only."""
    why = parts.q_not_served(q_nope, q_rope, sliding_window, overrides, tiles_of_one_query)
    if why is not None:
        return why
    if kv_cache.dtype != torch.bfloat16:
        return f"the cache is {kv_cache.dtype}, not bfloat16"
    if kv_cache.dim() != 3 or kv_cache.shape[1] != PAGE or kv_cache.shape[2] != LATENT + ROPE:
        return f"cache {tuple(kv_cache.shape)}: wants [pages, {PAGE}, {LATENT + ROPE}]"
    if kv_cache.stride(2) != 1 or (kv_cache.stride(1) * kv_cache.element_size()) % 16 or kv_cache.stride(0) != PAGE * kv_cache.stride(1):
        return "cache pages are not one matrix of 16-byte aligned rows (the TMA view)"
    if kv_cache.data_ptr() % 16:
        return "cache base is not 16-byte aligned"
    if kv_cache.shape[0] * PAGE >= 2**31:
        return "more cache rows than a 32-bit TMA coordinate reaches"
    return None


def _descriptor(kv_cache: torch.Tensor):
    """TMA over the cache's [pages * 64, 576] view in [64, 64] boxes (128-byte swizzle: wgmma's operand layout)."""
    rows = kv_cache.as_strided((kv_cache.shape[0] * PAGE, LATENT + ROPE), (kv_cache.stride(1), 1))
    box = [PAGE, CHUNK]
    return TensorDescriptor(rows, list(rows.shape), list(rows.stride()), box, gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16))


def launch_mla_decode_gluon(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    sliding_window: int | None = None,
    *,
    num_splits: int | None = None,
    tokens_per_split: int | None = None,
    overrides: dict | None = None,
    separate_combine: bool = False,
    tiles_of_one_query: bool = False,
) -> torch.Tensor | None:
    """mla_decode.launch_mla_decode's signature; None for a call this kernel does not serve (`not_served`: the caller
    falls back to it). Several splits: the partials are merged by mla_decode.py's combine kernel (parts.launch);
    separate_combine changes nothing here (this kernel never merges in its split programs)."""
    from deepinfer.ops import attention as attention_ops

    del separate_combine
    attention_ops.check_mla_decode_shapes(q_nope, q_rope, kv_cache, sliding_window)
    if not_served(q_nope, q_rope, kv_cache, sliding_window, overrides, tiles_of_one_query) is not None:
        return None
    cfg = config("mla_decode", "gluon_bf16", q_nope.device)
    if cfg["schedule"] not in SCHEDULES:
        raise ValueError(f"mla_decode gluon_bf16 tuning: schedule {cfg['schedule']!r}, wants one of {SCHEDULES}")
    if cfg.get("balanced", False) and num_splits is None and tokens_per_split is None:
        # the persistent balanced grid (mla_decode_gluon_balanced.py; not yet run on a GPU): the early-release seesaw only
        if cfg["schedule"] != "seesaw_early_release":
            raise ValueError(f"mla_decode gluon_bf16 tuning: balanced wants schedule 'seesaw_early_release', not {cfg['schedule']!r}")
        from deepinfer_cuda.kernels import mla_decode_gluon_balanced as balanced

        return balanced.launch_balanced(_descriptor(kv_cache), q_nope, q_rope, block_table, seq_lens, softmax_scale, cfg["attend_regs"],
                                        cfg["load_regs"], cfg.get("balanced_overhead_tiles", 1))
    limits = {"min_tokens_per_split": cfg["min_tokens_per_split"], "max_splits": cfg["max_splits"]}
    return parts.launch(_mla_decode_ws_kernel, _descriptor(kv_cache), (), q_nope, q_rope, block_table, seq_lens, softmax_scale,
                        num_splits, tokens_per_split, limits, REGS_ATTEND=cfg["attend_regs"], REGS_LOAD=cfg["load_regs"],
                        SEESAW=cfg["schedule"].startswith("seesaw"), EARLY_RELEASE=cfg["schedule"] == "seesaw_early_release")


# mla_decode_path=gluon: the op on this kernel for the calls of at least GLUON_MIN_ROWS rows it serves, else on the tl kernel
mla_decode = parts.op_with_fallback(launch_mla_decode_gluon, __name__, GLUON_MIN_ROWS)


def _chosen(ctx) -> bool:
    """mla_decode_path=gluon, or auto where Triton has Gluon for Hopper, on an SM90 device serving a model with a bf16
    cache of this kernel's rows (C 512, R 64, pages of 64, no sliding window); facts not known keep the tl kernel (an FP8
    cache: mla_decode_fp8_gluon.py's)."""
    from deepinfer_cuda.kernels.gemm_mxfp4_gluon import is_sm90

    m = ctx.model
    path = MLA_DECODE_PATH.value(ctx)
    return ((path == "gluon" or (path == "auto" and GLUON_IMPORT_ERROR is None)) and is_sm90(ctx.device) and m.kv_cache_fp8 is False
            and m.kv_lora_rank == LATENT and m.qk_rope_head_dim == ROPE and m.sliding_window == 0 and m.kv_block_size == PAGE)  # fmt: skip


def _unusable(ctx) -> str | None:
    return gluon_unusable("mla_decode_path=gluon", GLUON_IMPORT_ERROR)


REGISTRATIONS = [
    Registration(
        op="mla_decode",
        fn=mla_decode,
        dtypes=(torch.bfloat16,),
        when=_chosen,
        priority=1,
        unusable=_unusable,
        note="Gluon (SM90, bf16 cache; mla_decode_path=auto or gluon): warp-specialised, a TMA loader warp filling "
        f"two 64-row stages, two wgmma warpgroups each scoring half the keys and owning half the output columns, for calls of at "
        f"least {GLUON_MIN_ROWS} query rows; the tl kernel for the rest",
    ),
]
