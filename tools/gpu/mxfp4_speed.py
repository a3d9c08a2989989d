"""MXFP4 routed experts on the H200: the register dequant path (MX_MODE 3) against bf16 and
the old mxfp4 paths, at V4-Flash expert shapes, with a small config sweep (GPU only, < 4 minutes).

python tools/gpu/mxfp4_speed.py --out DIR [--no-sweep]

1. Correctness on the GPU: every case's register-path output against the reference op
   (deepinfer.ops.gemm, float32 activations, a few experts' rows: the whole problem would not fit the
   reference's float64 weights), max relative error and the op's tolerance; the old paths and the
   mxfp8 / mxfp4_a8 register path on one case each.
2. Copy bandwidth: a 2 GiB device-to-device copy, bytes read + written per second.
3. Timings (CUDA events, median of 25 after 3 warm-up calls, no cache flush): bf16 grouped GEMM (the
   dense kernel on bf16 weights of the same shapes), mxfp4 through the register path (MX_MODE 3), through
   tl.dot_scaled and through the in-kernel upcast (MX_MODE 1 and 0), on
   prefill (contiguous): 8192 and 2048 tokens x top-6 over 256 experts (random routing, each token 6
   distinct experts), w13 (K 4096 -> N 4096) and w2 (K 2048 -> N 4096);
   decode: masked 16 tokens per expert over 256 and over 8 experts; contiguous 64 and 256 tokens x top-6.
   mxfp8 and mxfp4_a8: the register path against tl.dot_scaled (Triton's emulation on SM90) on one
   prefill and one decode case (activation quantisation included).
4. Sweep: a handful of register-path configurations (tiles, warps, stages, split-K policy) per
   tuning variant (mxfp4_reg_large on the prefill cases, mxfp4_reg_small on decode and the 2048-token
   prefill), best printed per case.

Table: case, kernel, ms, TB/s on the weight bytes the call reads (mxfp4: packed bytes + e8m0 scales of
the experts with tokens; bf16: 2 bytes per weight), fraction of copy bandwidth, TFLOP/s, ratio vs bf16
(bf16 time / time), target: prefill register >= 0.9x bf16, decode register >= 60% of copy.
JSON with every row, the checks and the sweep goes to DIR/mxfp4_speed.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from deepinfer.ops import gemm as ref
from deepinfer.ops import quant
from deepinfer_cuda.kernels import gemm as kg
from deepinfer_cuda.tuning import config as table_config

E = 256
TOP_K = 6
SHAPES = {"w13": (4096, 4096), "w2": (2048, 4096)}  # (K, N)
MX_PATHS = ("register", "dot_scaled", "upcast")
WARMUP, REPS = 3, 25
PREFILL_TARGET = 0.9  # x bf16 throughput
DECODE_TARGET = 0.6  # of copy bandwidth
TIME_BUDGET_S = 170.0  # the sweep stops starting new configurations past this

# Register-path configurations swept per tuning variant (the table's entry first).
SWEEP = {
    "mxfp4_reg_large": [
        {},
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
        {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
        {"BLOCK_M": 256, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
        {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
    ],
    "mxfp4_reg_small": [
        {},
        {"BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4},
        {"BLOCK_N": 128, "BLOCK_K": 256, "num_warps": 8, "num_stages": 4},
        {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 6},
        {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 8},
        {"split_target_per_sm": 4, "min_iters_per_split": 2},
    ],
}
SWEEP_CASES = {
    "mxfp4_reg_large": ["prefill 8192 w13", "prefill 8192 w2"],
    "mxfp4_reg_small": ["decode masked 256e x16 w13", "decode masked 8e x16 w13", "decode contig 64 w13", "prefill 2048 w13"],
}


def median_ms(fn) -> float:
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_tbs(dev) -> float:
    bufs = [torch.empty(2 << 30, dtype=torch.uint8, device=dev) for _ in range(2)]
    ms = median_ms(lambda: bufs[1].copy_(bufs[0]))
    bufs.clear()
    torch.cuda.empty_cache()
    return 2 * (2 << 30) / (ms * 1e-3) / 1e12


def routing(tokens: int, dev, gen) -> torch.Tensor:
    """expert_offsets [E+1] of tokens x TOP_K rows: each token picks TOP_K distinct experts at random."""
    ids = torch.rand(tokens, E, device=dev, generator=gen).topk(TOP_K, dim=1).indices
    counts = torch.bincount(ids.flatten(), minlength=E).to(torch.int32)
    offs = torch.zeros(E + 1, dtype=torch.int32, device=dev)
    offs[1:] = counts.cumsum(0)
    return offs


def make_weights(dev, gen) -> dict:
    """Per shape: bf16 [E, N, K], mxfp4 packed [E, N, K/2] + e8m0 [E, N, K/32] (random codes, scales
    2^-9 .. 2^-3: realistic magnitudes), built directly (no float64 quantiser on 17 GB)."""
    out = {}
    for name, (k, n) in SHAPES.items():
        bf16 = (torch.randn(E, n, k, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02)
        packed = torch.randint(0, 256, (E, n, k // 2), device=dev, generator=gen, dtype=torch.uint8)
        scale = torch.randint(118, 125, (E, n, k // 32), device=dev, generator=gen, dtype=torch.uint8)
        out[name] = {"bf16": bf16, "packed": packed, "scale": scale}
    return out


def cases(dev, gen) -> list[dict]:
    """(name, kind, shape, layout tensors, rows) for every case."""
    out = []
    for tokens in (8192, 2048):
        offs = routing(tokens, dev, gen)
        for shape in SHAPES:
            out.append({"name": f"prefill {tokens} {shape}", "kind": "prefill", "shape": shape, "offs": offs, "rows": tokens * TOP_K})
    for experts in (256, 8):
        for shape in SHAPES:
            out.append({"name": f"decode masked {experts}e x16 {shape}", "kind": "decode", "shape": shape, "masked": experts, "rows": experts * 16})
    for tokens in (64, 256):
        offs = routing(tokens, dev, gen)
        for shape in SHAPES:
            out.append({"name": f"decode contig {tokens} {shape}", "kind": "decode", "shape": shape, "offs": offs, "rows": tokens * TOP_K})
    return out


def build_call(case: dict, w: dict, fmt: str, fn, dev, gen, weight=None, scale=None):
    """A closure running one case through `fn` (a grouped_gemm), its inputs made once."""
    k, n = SHAPES[case["shape"]]
    weight = w["bf16"] if fmt == "dense" else (w["packed"] if weight is None else weight)
    scale = None if fmt == "dense" else (w["scale"] if scale is None else scale)
    if "masked" in case:
        e = case["masked"]
        x = torch.randn(e, 16, k, device=dev, generator=gen, dtype=torch.bfloat16)
        mm = torch.full((e,), 16, dtype=torch.int32, device=dev)
        kw = {"x": x, "weight": weight[:e], "masked_m": mm, "fmt": fmt}
        if scale is not None:
            kw["weight_scale"] = scale[:e]
    else:
        x = torch.randn(case["rows"], k, device=dev, generator=gen, dtype=torch.bfloat16)
        kw = {"x": x, "weight": weight, "expert_offsets": case["offs"], "fmt": fmt}
        if scale is not None:
            kw["weight_scale"] = scale
    return (lambda: fn(**kw)), kw


def touched_experts(case: dict) -> int:
    if "masked" in case:
        return case["masked"]
    offs = case["offs"]
    return int(((offs[1:] - offs[:-1]) > 0).sum())


def weight_bytes(case: dict, fmt: str) -> float:
    k, n = SHAPES[case["shape"]]
    per = {"dense": n * k * 2, "mxfp4": n * k // 2 + n * k // 32, "mxfp4_a8": n * k // 2 + n * k // 32, "mxfp8": n * k + n * k // 32}[fmt]
    return touched_experts(case) * per


def check(kw: dict, got: torch.Tensor, experts: int = 4) -> dict:
    """got against the reference op on the first `experts` experts' rows (float32 activations)."""
    fmt, x = kw["fmt"], kw["x"]
    sub = {"fmt": fmt, "weight": kw["weight"][:experts]}
    if "weight_scale" in kw:
        sub["weight_scale"] = kw["weight_scale"][:experts]
    if "masked_m" in kw:
        sub.update(x=x[:experts].float(), masked_m=kw["masked_m"][:experts])
        got = got[:experts]
    else:
        offs = kw["expert_offsets"][: experts + 1]
        lo, hi = int(offs[0]), int(offs[-1])
        sub.update(x=x[lo:hi].float(), expert_offsets=offs - offs[0])
        got = got[lo:hi]
    want = ref.grouped_gemm(**sub).double()
    if "masked_m" in kw:
        got = ref._grouped_gemm_canonicalize(sub, {"out": got})["out"]
    err = (got.double() - want).abs()
    tol = ref.GEMM_TOLERANCES[torch.bfloat16]
    bound = tol.atol * x.shape[-1] + tol.rtol * want.abs()
    return {"max_rel_err": (err.max() / want.abs().max().clamp(min=1e-30)).item(), "within_tolerance": bool((err <= bound).all()),
            "finite": bool(torch.isfinite(got).all())}


def report_check(result: dict, case: dict, label: str, kw: dict, got: torch.Tensor) -> None:
    c = {"case": case["name"], "kernel": label, **check(kw, got)}
    result["checks"].append(c)
    verdict = "ok" if c["within_tolerance"] and c["finite"] else "FAIL"
    print(f"check {c['case']:30s} {c['kernel']:22s} max rel err {c['max_rel_err']:.2e} tolerance {verdict}", flush=True)


def with_config(variant: str, override: dict):
    base = dict(table_config("gemm", variant, torch.device("cuda")))
    full = {**base, **override}
    kg.config = lambda op, v, dev, _full=full, _variant=variant: dict(_full) if v == _variant else table_config(op, v, dev)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    import triton

    info = {"device": torch.cuda.get_device_name(dev), "capability": torch.cuda.get_device_capability(dev), "torch": torch.__version__,
            "triton": triton.__version__, "auto_path": kg.mxfp4_path()}
    print(info, flush=True)
    copy = copy_tbs(dev)
    print(f"copy bandwidth (2 GiB, read + written): {copy:.2f} TB/s", flush=True)
    weights = make_weights(dev, gen)
    ops = {path: kg._gemm_ops(mx_path=path)[1] for path in MX_PATHS}
    result = {"info": info, "copy_tbs": copy, "checks": [], "rows": [], "sweep": []}

    # 1. correctness
    all_cases = cases(dev, gen)
    for case in all_cases:
        call, kw = build_call(case, weights[case["shape"]], "mxfp4", ops["register"], dev, gen)
        report_check(result, case, "mxfp4 register", kw, call())
    small = next(c for c in all_cases if c["name"] == "decode masked 8e x16 w13")
    for path in ("dot_scaled", "upcast"):
        call, kw = build_call(small, weights["w13"], "mxfp4", ops[path], dev, gen)
        report_check(result, small, f"mxfp4 {path}", kw, call())
    k13, n13 = SHAPES["w13"]
    w8 = (torch.randn(8, n13, k13, device=dev, generator=gen) * 0.02).to(quant.FP8_DTYPE)
    s8 = torch.randint(118, 125, (8, n13, k13 // 32), device=dev, generator=gen, dtype=torch.uint8)
    mx8 = {"mxfp8": (w8, s8), "mxfp4_a8": (weights["w13"]["packed"], weights["w13"]["scale"])}
    for fmt, (wq, ws) in mx8.items():
        for path in ("register", "dot_scaled"):
            call, kw = build_call(small, weights["w13"], fmt, ops[path], dev, gen, weight=wq, scale=ws)
            report_check(result, small, f"{fmt} {path}", kw, call())

    # 2. timings
    rows = result["rows"]
    for case in all_cases:
        bf16_ms = None
        runs = [("bf16", "dense", kg.grouped_gemm)] + [(f"mxfp4 {p}", "mxfp4", ops[p]) for p in MX_PATHS]
        for label, fmt, fn in runs:
            call, _ = build_call(case, weights[case["shape"]], fmt, fn, dev, gen)
            try:
                ms = median_ms(call)
            except Exception as exc:  # noqa: BLE001 - a path that fails is a row
                print(f"{case['name']:30s} {label:20s} ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:160]}", flush=True)
                rows.append({"case": case["name"], "kernel": label, "error": str(exc)[:300]})
                continue
            bf16_ms = ms if fmt == "dense" else bf16_ms
            rows.append(row(case, label, fmt, ms, bf16_ms, copy))
            print(format_row(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    # mxfp8 / mxfp4_a8: register against dot_scaled on one prefill and one decode case (w13: the mxfp8 weights are 8 experts
    # for decode; the prefill case takes all 256 experts' e4m3 weights, made here)
    w8_all = (torch.randn(E, n13, k13, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02).to(quant.FP8_DTYPE)
    s8_all = torch.randint(118, 125, (E, n13, k13 // 32), device=dev, generator=gen, dtype=torch.uint8)
    mx8["mxfp8"] = (w8_all, s8_all)
    bf16_of = {r["case"]: r["ms"] for r in rows if r.get("kernel") == "bf16"}
    for case in (c for c in all_cases if c["name"] in ("prefill 8192 w13", "decode masked 256e x16 w13")):
        for fmt, (wq, ws) in mx8.items():
            for path in ("register", "dot_scaled"):
                call, _ = build_call(case, weights["w13"], fmt, ops[path], dev, gen, weight=wq, scale=ws)
                ms = median_ms(call)
                rows.append(row(case, f"{fmt} {path}", fmt, ms, bf16_of.get(case["name"]), copy))
                print(format_row(rows[-1]), flush=True)
    del w8_all, s8_all, mx8
    torch.cuda.empty_cache()

    # 3. sweep
    if not args.no_sweep:
        by_name = {c["name"]: c for c in all_cases}
        for variant, names in SWEEP_CASES.items():
            for name in names:
                case = by_name[name]
                best = None
                for override in SWEEP[variant]:
                    if time.perf_counter() - t0 > TIME_BUDGET_S:
                        print(f"sweep: time budget ({TIME_BUDGET_S:.0f} s) spent, stopping", flush=True)
                        break
                    with_config(variant, override)
                    try:
                        call, _ = build_call(case, weights[case["shape"]], "mxfp4", ops["register"], dev, gen)
                        ms = median_ms(call)
                    except Exception as exc:  # noqa: BLE001
                        print(f"sweep {variant} {name} {override} ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:160]}", flush=True)
                        continue
                    finally:
                        kg.config = table_config
                    r = row(case, "mxfp4 register", "mxfp4", ms, bf16_of.get(name), copy)
                    entry = {"variant": variant, "case": name, "override": override, **r}
                    result["sweep"].append(entry)
                    print(f"sweep {variant:16s} {name:28s} {json.dumps(override):90s} {ms:8.4f} ms  {r['frac_copy']:.2f} of copy  "
                          f"{r['tflops']:6.1f} TFLOP/s  x{r['vs_bf16'] or 0:.2f} bf16", flush=True)
                    if best is None or ms < best[1]:
                        best = (override, ms)
                if best is not None:
                    print(f"BEST {variant} {name}: {json.dumps(best[0]) or '(table entry)'} {best[1]:.4f} ms", flush=True)

    # 4. summary
    print("\n" + HEADER)
    for r in rows:
        if "error" not in r:
            print(format_row(r))
    met = [r for r in rows if r.get("target") in ("met", "MISSED")]
    print(f"\ntargets: {sum(r['target'] == 'met' for r in met)}/{len(met)} met; checks: "
          f"{sum(c['within_tolerance'] and c['finite'] for c in result['checks'])}/{len(result['checks'])} within tolerance; "
          f"{time.perf_counter() - t0:.0f} s")
    (args.out / "mxfp4_speed.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


def row(case: dict, label: str, fmt: str, ms: float, bf16_ms: float | None, copy: float) -> dict:
    k, n = SHAPES[case["shape"]]
    tbs = weight_bytes(case, fmt) / (ms * 1e-3) / 1e12
    vs = (bf16_ms / ms) if bf16_ms else None
    target = "-"
    if label == "mxfp4 register":
        ok = (vs or 0) >= PREFILL_TARGET if case["kind"] == "prefill" else tbs / copy >= DECODE_TARGET
        target = "met" if ok else "MISSED"
    return {"case": case["name"], "kernel": label, "ms": ms, "weight_tbs": tbs, "frac_copy": tbs / copy,
            "tflops": 2 * case["rows"] * n * k / (ms * 1e-3) / 1e12, "vs_bf16": vs, "target": target}


HEADER = f"{'case':30s} {'kernel':22s} {'ms':>9s} {'TB/s':>6s} {'copy':>5s} {'TFLOP/s':>8s} {'vs bf16':>8s}  target"


def format_row(r: dict) -> str:
    vs = f"x{r['vs_bf16']:.2f}" if r.get("vs_bf16") else "-"
    return (f"{r['case']:30s} {r['kernel']:22s} {r['ms']:9.4f} {r['weight_tbs']:6.2f} {r['frac_copy']:5.2f} {r['tflops']:8.1f} "
            f"{vs:>8s}  {r['target']}")


if __name__ == "__main__":
    raise SystemExit(main())
