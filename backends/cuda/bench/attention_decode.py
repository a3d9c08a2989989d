"""Benchmarks of mla_decode and kv_cache_write at DeepSeek-V3 decode sizes (issue 4's targets).

mla_decode: B=128 requests, 4096 cached tokens each, latent 512 + rope 64, pages of 64 tokens
handed out in a shuffled order (as a paged allocator leaves them), bf16 cache, S=1.
  - 16 heads: memory-bound; bytes = the cache rows read once + q read + out written.
  - 128 heads: compute-bound; flops = 2*B*H*S*ctx*(576 + 512).
The peer is torch SDPA on the materialised equivalent (the paged rows gathered into a dense
[B, 1, ctx, 576] key tensor and a [B, 1, ctx, 512] value tensor, outside the timing); all heads share
the single latent KV head, so with S=1 the heads fold into SDPA's query length (MQA as one head:
q [B, 1, H, 576]). The naive per-request torch reference is far too slow to be a fair peer.

kv_cache_write: 128 decode tokens scattered into shuffled slots of a bf16 cache; the peer is torch
index_copy_ of the concatenated rows (the reference without its host-side bounds check).

Both again with an FP8 cache (kv_cache_dtype="fp8", deepinfer.ops.kv_cache_format: 592-byte rows),
bytes counted on the FP8 rows. Rows ending ", gluon" time the SM90 Gluon kernel over the bf16 cache (backend option
mla_decode_path=gluon, mla_decode_gluon.py; timed on an H200 2026-12-07) on the inputs of the tl row of the same name.

`python -m deepinfer_cuda.bench.attention_decode` (on a GPU) runs these cases, then sweeps
mla_decode tuning variants (each checked against a float32 torch computation), captures
mla_decode (split + combine) and kv_cache_write in CUDA graphs, and profiles split vs combine:
the numbers behind the tuning tables (tuning/sm90.py).

Measured on an H200, 2026-11-30 (torch 2.11, Triton 3.6):
  mla_decode H16:  173 us, 3.52 TB/s (~84% of the 4.19 TB/s copy ceiling); SDPA peer 503 us.
  mla_decode H128: 570 us, 256 TFLOP/s (34% of 750); SDPA peer 1171 us.
  kv_cache_write T128: 5.4-13 us eager (host launch bound), 5.7 us as a CUDA-graph replay; peer 8-9 us.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.ops import kv_cache_format
from deepinfer_cuda.bench.common import BenchCase

OPS = ("mla_decode", "kv_cache_write")  # what this bench module covers: the runner finds it by this
TABLE_ORDER = 10  # where its rows sit in `deepinfer bench ops`: attention first, misc last

LATENT, ROPE = 512, 64
PAGE = 64
SCALE = (128 + 64) ** -0.5


def _mla_setup(batch: int, ctx: int, heads: int, queries: int = 1, dtype: torch.dtype = torch.bfloat16, page: int = PAGE, fp8: bool = False):
    def setup(device: torch.device) -> dict:
        g = torch.Generator(device=device).manual_seed(0)
        pages = -(-ctx // page)
        num_blocks = batch * pages + 7
        kv_cache = torch.randn(num_blocks, page, LATENT + ROPE, device=device, dtype=dtype, generator=g)
        if fp8:
            kv_cache = kv_cache_format.quantize_rows(kv_cache)
        order = torch.randperm(num_blocks, device=device, generator=g)[: batch * pages]
        block_table = order.view(batch, pages).to(torch.int32).contiguous()
        state = {
            "q_nope": torch.randn(batch, queries, heads, LATENT, device=device, dtype=dtype, generator=g),
            "q_rope": torch.randn(batch, queries, heads, ROPE, device=device, dtype=dtype, generator=g),
            "kv_cache": kv_cache,
            "block_table": block_table,
            "seq_lens": torch.full((batch,), ctx, dtype=torch.int32, device=device),
            "ctx": ctx,
        }
        return state

    return setup


def _materialise(s: dict) -> None:
    """Dense keys/values for the SDPA peer (built once, outside the timing)."""
    if "k_dense" in s:
        return
    kv, bt, ctx = s["kv_cache"], s["block_table"], s["ctx"]
    rows = kv_cache_format.dequantize_rows(kv[bt.long()].flatten(1, 2)[:, :ctx], s["q_nope"].dtype)  # [B, ctx, 576]
    s["k_dense"] = rows.unsqueeze(1).contiguous()  # [B, 1, ctx, 576]
    s["v_dense"] = rows[..., :LATENT].unsqueeze(1).contiguous()  # [B, 1, ctx, 512]
    batch, queries, heads, _ = s["q_nope"].shape
    q = torch.cat((s["q_nope"], s["q_rope"]), dim=-1)  # [B, S, H, 576]
    s["q_dense"] = q.reshape(batch, 1, queries * heads, LATENT + ROPE).contiguous()


def _mla_kernel(s: dict):
    from deepinfer_cuda.kernels.mla_decode import mla_decode

    return mla_decode(s["q_nope"], s["q_rope"], s["kv_cache"], s["block_table"], s["seq_lens"], softmax_scale=SCALE)


def _mla_kernel_fp8(s: dict):
    """What the cuda backend runs over an FP8 cache of these rows: the SM90 Gluon kernel where it serves the call,
    else the tl kernel (its module hands those calls back)."""
    from deepinfer_cuda.kernels.mla_decode_fp8_gluon import mla_decode

    return mla_decode(s["q_nope"], s["q_rope"], s["kv_cache"], s["block_table"], s["seq_lens"], softmax_scale=SCALE)


def _mla_kernel_gluon(s: dict):
    """The SM90 Gluon kernel over the bf16 cache (backend option mla_decode_path=gluon), launched
    directly whatever the row count (its op leaves calls of fewer than GLUON_MIN_ROWS rows to the tl kernel: the 16-head
    row says whether it should); an error where it declines the call, so that no row times the tl kernel under its name."""
    from deepinfer_cuda.kernels.mla_decode_gluon import launch_mla_decode_gluon, not_served

    args = (s["q_nope"], s["q_rope"], s["kv_cache"], s["block_table"], s["seq_lens"])
    out = launch_mla_decode_gluon(*args, SCALE)
    if out is None:
        raise RuntimeError(f"mla_decode_gluon declined the call: {not_served(*args[:3], None)}")
    return out


def _mla_peer(s: dict):
    _materialise(s)
    # S=1: every (head, query) row sees the whole context, so no mask is needed.
    return F.scaled_dot_product_attention(s["q_dense"], s["k_dense"], s["v_dense"], scale=SCALE)


def _mla_bytes(s: dict) -> float:
    batch, queries, heads, _ = s["q_nope"].shape
    cache = batch * s["ctx"] * s["kv_cache"].shape[-1] * s["kv_cache"].element_size()  # an FP8 row: 576 + 4 bytes
    q = batch * queries * heads * (LATENT + ROPE) * s["q_nope"].element_size()
    out = batch * queries * heads * LATENT * s["q_nope"].element_size()
    return cache + q + out


def _mla_flops(s: dict) -> float:
    batch, queries, heads, _ = s["q_nope"].shape
    return 2.0 * batch * heads * queries * s["ctx"] * ((LATENT + ROPE) + LATENT)


def _write_setup(tokens: int, num_blocks: int = 4096, dtype: torch.dtype = torch.bfloat16, fp8: bool = False):
    def setup(device: torch.device) -> dict:
        g = torch.Generator(device=device).manual_seed(0)
        slots = torch.randperm(num_blocks * PAGE, device=device, generator=g)[:tokens]
        cache = torch.randn(num_blocks, PAGE, LATENT + ROPE, device=device, dtype=dtype, generator=g)
        return {
            "kv_c": torch.randn(tokens, LATENT, device=device, dtype=dtype, generator=g),
            "k_pe": torch.randn(tokens, ROPE, device=device, dtype=dtype, generator=g),
            "kv_cache": kv_cache_format.quantize_rows(cache) if fp8 else cache,
            "slot_mapping": slots.to(torch.int64),
        }

    return setup


def _write_kernel(s: dict):
    from deepinfer_cuda.kernels.kv_cache import kv_cache_write

    return kv_cache_write(s["kv_c"], s["k_pe"], s["kv_cache"], s["slot_mapping"])


def _write_peer(s: dict):
    cache = s["kv_cache"]
    rows = torch.cat((s["kv_c"], s["k_pe"]), dim=-1)
    rows = kv_cache_format.quantize_rows(rows) if kv_cache_format.is_fp8(cache) else rows.to(cache.dtype)
    cache.view(-1, cache.shape[-1]).index_copy_(0, s["slot_mapping"], rows)
    return cache


def _write_bytes(s: dict) -> float:
    t = s["kv_c"].shape[0]
    return t * ((LATENT + ROPE) * s["kv_c"].element_size() + s["kv_cache"].shape[-1] * s["kv_cache"].element_size()) + t * 8


def _write_flops(s: dict) -> float:
    return 0.0


_SDPA = "torch SDPA on dense gathered K/V (heads folded into the query length, MQA)"

# The 16-head rows at ctx 4096 (B64 / B128 / B256, each cache format: the FP8 reader against the bf16 one) are timed
# from CUDA graph replays, as the engine's decode runs: eagerly the FP8 Gluon kernel's launch is bound by the host (an
# H100 machine's, 2026-12-07: 170-334 µs a call for the kernel, its three TMA descriptors and its combine, against 73
# µs of kernel at B64 and 131 at B128; the bf16 tl kernel's 108-133).
CASES = [
    BenchCase("mla_decode", "B128_ctx4096_H16_S1_bf16_page64", _mla_setup(128, 4096, 16), _mla_kernel, _mla_peer, _SDPA,
              _mla_flops, _mla_bytes, bound="memory", graph=True),
    BenchCase("mla_decode", "B128_ctx4096_H128_S1_bf16_page64", _mla_setup(128, 4096, 128), _mla_kernel, _mla_peer, _SDPA,
              _mla_flops, _mla_bytes, bound="compute"),
    BenchCase("kv_cache_write", "T128_bf16_page64", _write_setup(128), _write_kernel, _write_peer, "torch cat + index_copy_",
              _write_flops, _write_bytes, bound="memory"),
    # FP8 cache (kv_cache_dtype="fp8": e4m3 rows + a float32 scale per token and padding, 592 bytes): about half the bytes
    # of bf16's to stream; the peer attends over the dequantised bf16 rows.
    BenchCase("mla_decode", "B128_ctx4096_H16_S1_fp8cache_page64", _mla_setup(128, 4096, 16, fp8=True), _mla_kernel_fp8, _mla_peer, _SDPA + ", dequantised",
              _mla_flops, _mla_bytes, bound="memory", graph=True),
    BenchCase("mla_decode", "B128_ctx4096_H128_S1_fp8cache_page64", _mla_setup(128, 4096, 128, fp8=True), _mla_kernel_fp8, _mla_peer, _SDPA + ", dequantised",
              _mla_flops, _mla_bytes, bound="compute"),
    BenchCase("kv_cache_write", "T128_fp8cache_page64", _write_setup(128, fp8=True), _write_kernel, _write_peer, "torch quantise + index_copy_",
              _write_flops, _write_bytes, bound="memory"),
    # the FP8 reader against the bf16 one at B64 and B256 too (issue targets: B64 / B128 / B256)
    *(BenchCase("mla_decode", f"B{b}_ctx4096_H16_S1_{fmt}_page64", _mla_setup(b, 4096, 16, fp8=fmt == "fp8cache"),
                _mla_kernel_fp8 if fmt == "fp8cache" else _mla_kernel, _mla_peer, _SDPA + (", dequantised" if fmt == "fp8cache" else ""),
                _mla_flops, _mla_bytes, bound="memory", graph=True)
      for b in (64, 256) for fmt in ("bf16", "fp8cache")),
    # Long contexts at small batches (a single long request must spread over every SM: splits of the
    # context). Timed from a CUDA graph, as the engine's decode runs: eagerly the host's launch (split +
    # combine) would be the figure. 16 heads are memory-bound; 128 heads do 2 * 128 * 1088 flops per
    # 1152-byte cache row (242 flop/byte, above the H200's ~200 balance point) at any batch: compute-bound.
    *(BenchCase("mla_decode", f"B{b}_ctx{ctx // 1024}k_H{h}_S1_bf16_page64", _mla_setup(b, ctx, h), _mla_kernel, _mla_peer, _SDPA,
                _mla_flops, _mla_bytes, bound="memory" if h == 16 else "compute", graph=True)
      for h in (16, 128) for b in (1, 4, 8) for ctx in (8192, 32768, 65536)),
    # 128 heads at a middle batch and context (compute-bound; split into whole pages, merged by the combine kernel)
    BenchCase("mla_decode", "B32_ctx2048_H128_S1_bf16_page64", _mla_setup(32, 2048, 128), _mla_kernel, _mla_peer, _SDPA, _mla_flops, _mla_bytes,
              bound="compute", graph=True),
    # The SM90 Gluon kernel over the bf16 cache (mla_decode_path=gluon; a TMA loader warp, two wgmma warpgroups) beside the tl
    # rows of the same names, timed the same way; no peer (the tl row's is the same)
    *(BenchCase("mla_decode", f"{name}, gluon", _mla_setup(b, ctx, h), _mla_kernel_gluon, None, "", _mla_flops, _mla_bytes,
                bound="memory" if h == 16 else "compute", graph=graph)
      for name, b, ctx, h, graph in (("B128_ctx4096_H128_S1_bf16_page64", 128, 4096, 128, False), ("B32_ctx2048_H128_S1_bf16_page64", 32, 2048, 128, True),
                                     ("B1_ctx8k_H128_S1_bf16_page64", 1, 8192, 128, True), ("B128_ctx4096_H16_S1_bf16_page64", 128, 4096, 16, False))),
]


# ---------------------------------------------------------------------------------------------
# Tuning sweep (GPU only): every variant is checked against a float32 torch computation.


def _torch_reference(s: dict, window: int | None = None) -> torch.Tensor:
    """Float32 torch mla_decode on the GPU (batched; causal within the S queries; optional window)."""
    kv, bt = s["kv_cache"], s["block_table"]
    seq = s["seq_lens"].long()
    batch, queries, heads, _ = s["q_nope"].shape
    rows = kv[bt.long()].flatten(1, 2).float()  # [B, cap, 576]
    cap = rows.shape[1]
    q = torch.cat((s["q_nope"], s["q_rope"]), dim=-1).float().reshape(batch, queries * heads, -1)
    scores = torch.bmm(q, rows.transpose(1, 2)) * SCALE  # [B, SH, cap]
    pos = seq[:, None] - queries + torch.arange(queries, device=q.device).repeat_interleave(heads)[None, :]  # [B, SH]
    j = torch.arange(cap, device=q.device)
    visible = j[None, None, :] <= pos[:, :, None]
    if window is not None:
        visible &= j[None, None, :] > pos[:, :, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.bmm(torch.softmax(scores, dim=-1), rows[..., :LATENT])
    return out.reshape(batch, queries, heads, LATENT)


def sweep(device: torch.device | None = None) -> list[dict]:
    from triton.testing import do_bench

    from deepinfer_cuda.kernels import mla_decode as mla

    device = device or torch.device("cuda")
    results = []

    def measure(label, s, overrides, num_splits=None, window=None, ref=None):
        args = (s["q_nope"], s["q_rope"], s["kv_cache"], s["block_table"], s["seq_lens"], SCALE, window)
        try:
            out, handle = mla.launch_mla_decode_with_handle(*args, num_splits=num_splits, overrides=overrides)
            torch.cuda.synchronize()
            regs = (getattr(handle, "n_regs", None), getattr(handle, "n_spills", None), handle.metadata.shared if handle is not None else None)
            err = float(((out.float() - ref).norm() / ref.norm()).item()) if ref is not None else float("nan")
            ms = do_bench(lambda: mla.launch_mla_decode(*args, num_splits=num_splits, overrides=overrides), warmup=10, rep=60, return_mode="median")
        except Exception as exc:  # a config that does not compile (shared memory) is a row, not a crash
            print(f"{label:>10} {overrides} splits={num_splits}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:150]}", flush=True)
            return None
        batch, queries, heads, _ = s["q_nope"].shape
        _, _, _, _, splits = mla.plan(batch, queries * heads, s["block_table"].shape[1] * PAGE, device, num_splits, None, overrides)
        tbs, tflops = _mla_bytes(s) / ms / 1e9, _mla_flops(s) / ms / 1e9
        row = {"case": label, **overrides, "splits": splits, "ms": ms, "tbs": tbs, "tflops": tflops, "rel_err": err, "regs_spills_smem": regs}
        rates = f"{ms * 1e3:8.1f} us  {tbs:6.2f} TB/s  {tflops:6.1f} TFLOP/s"
        print(f"{label:>10} {overrides} splits={splits}: {rates}  err {err:.2e} regs/spills/smem {regs}", flush=True)
        results.append(row)
        return row

    # 16 heads, S=1 (memory-bound): the default plan; tile/occupancy variants; graph capture; profile.
    s = _mla_setup(128, 4096, 16)(device)
    ref = _torch_reference(s)
    measure("H16", s, {}, ref=ref)
    measure("H16", s, {"fused_combine": False}, ref=ref)  # the separate combine kernel
    for splits in (3, 4, 6):
        measure("H16", s, {}, num_splits=splits, ref=ref)
    for bn, w, st, ctas, ev in ((64, 4, 2, 2, "evict_first"), (64, 4, 3, 2, ""), (32, 4, 2, 3, ""), (32, 4, 3, 3, "")):
        measure("H16", s, {"BLOCK_N": bn, "num_warps": w, "num_stages": st, "ctas_per_sm": ctas, "evict": ev}, ref=ref)
    _graph_check(s, device)
    _profile(s)
    del s, ref
    torch.cuda.empty_cache()

    # 16 heads with S=2 (MTP), full contexts: 32 rows.
    s = _mla_setup(128, 4096, 16, queries=2)(device)
    ref = _torch_reference(s)
    for bn, w, st, ctas in ((64, 4, 2, 2), (32, 4, 2, 3), (32, 4, 3, 3), (16, 4, 3, 4)):
        measure("H16_S2", s, {"BLOCK_N": bn, "num_warps": w, "num_stages": st, "ctas_per_sm": ctas}, ref=ref)
    del s, ref
    torch.cuda.empty_cache()

    # 128 heads (compute-bound): the default, and with the cache loads marked evict_first.
    s = _mla_setup(128, 4096, 128)(device)
    ref = _torch_reference(s)
    measure("H128", s, {}, ref=ref)
    for splits in (2, 3):
        measure("H128", s, {}, num_splits=splits, ref=ref)
    del s, ref
    torch.cuda.empty_cache()

    # window + MTP with random lengths (correctness at scale)
    s = _mla_setup(64, 4096, 16, queries=3)(device)
    s["seq_lens"] = torch.randint(3, 4097, (64,), device=device, dtype=torch.int32)
    measure("H16_S3w", s, {}, window=1000, ref=_torch_reference(s, window=1000))
    return results


def _graph_check(s: dict, device: torch.device) -> None:
    """mla_decode (split + combine) and kv_cache_write captured in one CUDA graph: no host sync."""
    from triton.testing import do_bench

    from deepinfer_cuda.kernels.kv_cache import kv_cache_write
    from deepinfer_cuda.kernels.mla_decode import launch_mla_decode

    w = _write_setup(128)(device)
    args = (s["q_nope"], s["q_rope"], s["kv_cache"], s["block_table"], s["seq_lens"], SCALE, None)
    eager = launch_mla_decode(*args, num_splits=4)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            launch_mla_decode(*args, num_splits=4)
            kv_cache_write(w["kv_c"], w["k_pe"], w["kv_cache"], w["slot_mapping"])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = launch_mla_decode(*args, num_splits=4)
        graph.replay()
        torch.cuda.synchronize()
        replay_us = do_bench(graph.replay, warmup=10, rep=60, return_mode="median") * 1e3
        print(f"graph: mla_decode captured, replay equal to eager: {torch.equal(out, eager)}; replay {replay_us:.1f} us", flush=True)
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2):
            kv_cache_write(w["kv_c"], w["k_pe"], w["kv_cache"], w["slot_mapping"])
        g2.replay()
        torch.cuda.synchronize()
        print(f"graph: kv_cache_write captured; replay {do_bench(g2.replay, warmup=10, rep=60, return_mode='median') * 1e3:.1f} us", flush=True)
    except Exception as exc:
        print(f"graph: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)


def _profile(s: dict) -> None:
    from torch.profiler import ProfilerActivity, profile

    from deepinfer_cuda.kernels.mla_decode import launch_mla_decode

    args = (s["q_nope"], s["q_rope"], s["kv_cache"], s["block_table"], s["seq_lens"], SCALE, None)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            launch_mla_decode(*args)
        torch.cuda.synchronize()
    for evt in prof.key_averages():
        if evt.device_type is not None and "mla" in evt.key:
            avg = getattr(evt, "device_time", None) or getattr(evt, "cuda_time", 0.0)
            print(f"profile: {evt.key[:60]:<60} calls {evt.count:4d} avg {avg:8.1f} us", flush=True)


def run_cases() -> None:
    """The CASES above, kernel and peer, printed (the lead's runner does this with the ceilings)."""
    from deepinfer_cuda.bench.common import time_ms

    device = torch.device("cuda")
    for case in CASES:
        print(_case_line(case, device, time_ms), flush=True)  # the case's tensors are freed on return
        torch.cuda.empty_cache()


def _case_line(case, device: torch.device, time_ms) -> str:
    state = case.setup(device)
    line = f"{case.op:>15} {case.name:<36}"
    try:
        case.kernel(state)
        torch.cuda.synchronize()
        ms = time_ms(lambda: case.kernel(state))
        line += f" kernel {ms * 1e3:8.1f} us {case.bytes(state) / ms / 1e9:6.2f} TB/s {case.flops(state) / ms / 1e9:7.1f} TFLOP/s"
    except Exception as exc:
        line += f" kernel FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    try:
        case.peer(state)
        torch.cuda.synchronize()
        pms = time_ms(lambda: case.peer(state))
        line += f" | peer {pms * 1e3:8.1f} us"
    except Exception as exc:
        line += f" | peer FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return line


if __name__ == "__main__":
    import json
    import os

    run_cases()
    rows = sweep()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "mla_sweep.json"), "w") as f:
            json.dump(rows, f, indent=1)
