"""Where `sample`'s and `dispatch`'s time goes on the H200, by variants (graph replays, no profiler):

sample (B 256, V 129280, float32): the whole op over chunk widths and warps for greedy, top-k 50 /
top-p 0.9 and temperature-only rows; the first pass's registers and spills per configuration; and a
chunk pass that does only greedy's work (the max and first argmax of each chunk) as the bound a
greedy row could reach with this chunking, against torch.argmax.

dispatch (T 4096, K 8, E 256, D 7168 bf16): the counting sort alone, the whole op, its copy kernel's
share, and what the H200 does with the same bytes: a write-only fill of the 470 MB of rows, a
broadcast copy (each row read once, written 8 times), and a gather (torch.index_select by the
destination rows' tokens).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_cuda.bench.runner import graph_time_ms


@triton.jit
def _greedy_chunks(x_ptr, stride, wf_ptr, wi_ptr, V, NCH, CH, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    offs = c * CH + lanes
    ok = (lanes < CH) & (offs < V)
    x = tl.load(x_ptr + row.to(tl.int64) * stride + offs, mask=ok, other=float("-inf"))
    m = tl.max(x, axis=0)
    tl.store(wf_ptr + row * NCH + c, m)
    tl.store(wi_ptr + row * NCH + c, tl.min(tl.where(x == m, offs, 2**31 - 1), axis=0))


def _regs(kernel) -> list[str]:
    out = []
    caches = getattr(kernel, "cache", None) or {d: c[0] for d, c in getattr(kernel, "device_caches", {}).items()}
    for cache in caches.values():
        for compiled in cache.values():
            out.append(f"{kernel.__name__}: regs {compiled.n_regs} spills {compiled.n_spills} warps {compiled.metadata.num_warps}")
    return out


_CASES = {  # name: (temperature, top_k, top_p, min_p, logit scale), batch 256 at V 129280
    "greedy": (0.0, 0, 1.0, 0.0, 1.0),
    "topk50_topp0.9": (1.0, 50, 0.9, 0.0, 1.0),
    "temperature": (0.8, 0, 1.0, 0.0, 1.0),
    "topp0.9_peaked": (1.0, 0, 0.9, 0.0, 4.0),
    "minp0.1": (1.0, 0, 1.0, 0.1, 1.0),
}
_ARGS = ("logits", "temperature", "top_k", "top_p", "min_p", "seeds", "positions")


def _sample_cases(dev: torch.device, names) -> dict:
    from deepinfer_cuda.bench import sampling as bench

    return {n: bench._setup(256, bench.VOCAB, *_CASES[n][:4], scale=_CASES[n][4])(dev) for n in names}


def _times(fn, cases: dict, kw: dict, b16: bool = False) -> str:
    """One line: the op's graph-replay time per case (and B16 top-k/top-p) with these overrides."""
    line = []
    for name, s in cases.items():
        args = tuple(s[a] for a in _ARGS)
        line.append(f"{name} {graph_time_ms(lambda args=args: fn(*args, **kw)) * 1e3:6.1f}")
    if b16:
        small = tuple(cases["topk50_topp0.9"][a][:16] for a in _ARGS)
        line.append(f"B16 topk/topp {graph_time_ms(lambda: fn(*small, **kw)) * 1e3:6.1f}")
    return " | ".join(line)


def sample_probe() -> None:
    from deepinfer_cuda.bench import sampling as bench
    from deepinfer_cuda.kernels import sampling as ks

    dev = torch.device("cuda")
    B, V = 256, bench.VOCAB
    cases = _sample_cases(dev, _CASES)
    logits = cases["greedy"]["logits"]
    ms_argmax = graph_time_ms(lambda: logits.argmax(dim=-1))
    gbytes = logits.numel() * 4 / 1e9
    print(f"torch.argmax: {ms_argmax * 1e3:7.1f} us {gbytes / ms_argmax:.2f} TB/s", flush=True)
    for block in (1024, 2048, 4096, 8192):
        nch = -(-V // block)
        ch = min(block, -(-(-(-V // nch)) // 16) * 16)
        nch = -(-V // ch)
        wf = torch.empty(B * nch, device=dev)
        wi = torch.empty(B * nch, device=dev, dtype=torch.int32)
        for warps in (1, 2, 4, 8):
            if block // (32 * warps) > 64:
                continue
            ms = graph_time_ms(lambda: _greedy_chunks[(B, nch)](logits, logits.stride(0), wf, wi, V, nch, ch, BLOCK=block, num_warps=warps))
            print(f"greedy-only chunk pass BLOCK {block:5d} warps {warps}: {ms * 1e3:7.1f} us {gbytes / ms:.2f} TB/s", flush=True)
    variants = [
        ("filter G=NCH (a chunk a program)", dict(filter_programs=1 << 20, filter_prefetch=False)),
        ("filter 2048 programs", dict(filter_programs=2048, filter_prefetch=False)),
        ("filter 2048 programs prefetch", dict(filter_programs=2048, filter_prefetch=True)),
        ("filter 4096 programs prefetch", dict(filter_programs=4096, filter_prefetch=True)),
        ("filter 8192 programs", dict(filter_programs=8192, filter_prefetch=False)),
        ("filter 1024 programs prefetch", dict(filter_programs=1024, filter_prefetch=True)),
        ("argmax 512 programs, filter G=NCH", dict(pass1_programs=512, filter_programs=1 << 20, filter_prefetch=False)),
        ("argmax 1024 programs, filter 8192", dict(pass1_programs=1024, filter_programs=8192, filter_prefetch=False)),
    ]
    for label, kw in variants:
        print(f"{label:36s} us: " + _times(ks._sample, cases, kw, b16=True), flush=True)
    try:
        print("compiled:", *_regs(ks._sample_pass1_argmax), *_regs(ks._sample_pass1_filter), *_regs(ks._sample_pass2), sep="\n  ")
    except Exception as e:  # noqa: BLE001 - the cache's layout differs between Triton versions
        print("compiled kernels' registers not read:", e)


def dispatch_probe() -> None:
    from deepinfer_cuda.bench import moe as bench
    from deepinfer_cuda.kernels import moe

    dev = torch.device("cuda")
    s = bench._routing_setup(4096, 8, 256, 7168)(dev)
    x, ids = s["x"], s["ids"]
    T, D = x.shape
    K = ids.shape[-1]
    nbytes = bench._dispatch_bytes(s)
    ms_sort = graph_time_ms(lambda: moe.count_slots(ids, 256))
    ms_all = graph_time_ms(lambda: moe.dispatch(x, ids, num_experts=256))
    expert_x, _, row_of_slot = moe.dispatch(x, ids, num_experts=256)
    token_of_row = torch.empty(T * K, dtype=torch.int64, device=dev)
    token_of_row[row_of_slot.long()] = torch.arange(T * K, device=dev) // K
    ms_fill = graph_time_ms(lambda: expert_x.fill_(1.0))
    out = torch.empty(T, K, D, dtype=x.dtype, device=dev)
    ms_bcast = graph_time_ms(lambda: out.copy_(x[:, None, :].expand(T, K, D)))
    ms_gather = graph_time_ms(lambda: torch.index_select(x, 0, token_of_row, out=expert_x))
    ms_copy = graph_time_ms(lambda: expert_x.copy_(out.view(T * K, D)))
    wbytes = T * K * D * 2
    print(f"dispatch T4096 K8 D7168: counting sort {ms_sort * 1e3:.1f} us; whole {ms_all * 1e3:.1f} us = {nbytes / ms_all / 1e9:.2f} TB/s", flush=True)
    print(f"  write-only fill of the rows {ms_fill * 1e3:.1f} us = {wbytes / ms_fill / 1e9:.2f} TB/s of writes", flush=True)
    print(f"  broadcast copy (read once, write 8) {ms_bcast * 1e3:.1f} us = {nbytes / ms_bcast / 1e9:.2f} TB/s", flush=True)
    print(f"  gather by destination row (index_select) {ms_gather * 1e3:.1f} us = {nbytes / ms_gather / 1e9:.2f} TB/s", flush=True)
    print(f"  plain copy of the rows {ms_copy * 1e3:.1f} us = {2 * wbytes / ms_copy / 1e9:.2f} TB/s (read + write)", flush=True)
    try:
        print("compiled:", *_regs(moe._dispatch_copy_kernel), sep="\n  ")
    except Exception as e:  # noqa: BLE001
        print("compiled kernels' registers not read:", e)


def filter_probe() -> None:
    """The filtered rows' first pass: the kernel before the split (one kernel for every row, a chunk a
    program; put it there first: `git show bcdb0e2:backends/cuda/kernels/sampling.py >
    tools/gpu/old_sampling_probe_copy.py`) against the filter kernel's programs, prefetch and warps."""
    import importlib.util
    from pathlib import Path

    from deepinfer_cuda.kernels import sampling as ks

    spec = importlib.util.spec_from_file_location("old_sampling", Path(__file__).with_name("old_sampling_probe_copy.py"))
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    cases = _sample_cases(torch.device("cuda"), _CASES)
    variants = [("before the split (HEAD)", old._sample, {})]
    for programs in (1024, 1 << 20):
        for prefetch in (True, False):
            for warps in (2, 4, 8):
                if programs > 4096 and prefetch:
                    continue
                label = f"filter {'G=NCH' if programs > 4096 else programs} {'prefetch' if prefetch else 'plain'} w{warps}"
                variants.append((label, ks._sample, dict(filter_programs=programs, filter_prefetch=prefetch, filter_warps=warps)))
    for label, fn, kw in variants:
        print(f"{label:28s} us: " + _times(fn, cases, kw, b16=True), flush=True)
    try:
        print("compiled:", *_regs(old._sample_pass1), *_regs(ks._sample_pass1_filter), sep="\n  ")
    except Exception as e:  # noqa: BLE001 - the cache's layout differs between Triton versions
        print("compiled kernels' registers not read:", e)


def followup_probe() -> None:
    """The second chunk pass's program count (sample) and the counting sort's tile and warps (dispatch)."""
    from deepinfer_cuda.bench import moe as moe_bench
    from deepinfer_cuda.kernels import moe
    from deepinfer_cuda.kernels import sampling as ks

    dev = torch.device("cuda")
    cases = _sample_cases(dev, ("greedy", "topk50_topp0.9", "topp0.9_peaked", "minp0.1"))
    logits = cases["greedy"]["logits"]
    print(f"torch.argmax {graph_time_ms(lambda: logits.argmax(dim=-1)) * 1e3:.1f} us", flush=True)
    original = ks.PASS2_PROGRAMS
    for programs in (512, 1024, 2048, 4096):
        ks.PASS2_PROGRAMS = programs
        print(f"sample PASS2_PROGRAMS {programs:5d} us: " + _times(ks._sample, cases, {}), flush=True)
    ks.PASS2_PROGRAMS = original
    s = moe_bench._routing_setup(4096, 8, 256, 7168)(dev)
    x, ids = s["x"], s["ids"]
    nbytes = moe_bench._dispatch_bytes(s)
    original_cfg = moe._cfg
    for tile_elems, warps in ((16384, 8), (8192, 4), (8192, 8), (32768, 8), (32768, 16), (4096, 4)):
        cfg = dict(original_cfg("dispatch", "tokens", dev), count_tile_elems=tile_elems, count_warps=warps)
        moe._cfg = lambda o, v, d, cfg=cfg: cfg if o == "dispatch" else original_cfg(o, v, d)
        ms_sort = graph_time_ms(lambda: moe.count_slots(ids, 256))
        ms_all = graph_time_ms(lambda: moe.dispatch(x, ids, num_experts=256))
        print(f"dispatch count_tile_elems {tile_elems:5d} warps {warps:2d}: counting sort {ms_sort * 1e3:5.1f} us, "
              f"whole {ms_all * 1e3:6.1f} us = {nbytes / ms_all / 1e9:.2f} TB/s", flush=True)
    moe._cfg = original_cfg


if __name__ == "__main__":
    import sys

    if "--followup" in sys.argv:
        followup_probe()
    elif "--filter" in sys.argv:
        filter_probe()
    else:
        sample_probe()
        dispatch_probe()
