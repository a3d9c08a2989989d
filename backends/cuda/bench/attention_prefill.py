"""Benchmarks of `prefill` (var-len causal flash attention) against torch SDPA at the issue's shapes.

The peer pads the batch to [B, H, L, D] (all requests of a case have equal lengths, so this is a
view of the packed tensors, no copy) and calls `F.scaled_dot_product_attention` with causal
masking: `is_causal=True` when q_len == k_len, `causal_lower_right` (end-aligned, the op's
convention) when there is a cached prefix. torch picks the backend: Dqk 192 != Dv 128 rules
out flash attention, so torch takes the memory-efficient (or cuDNN) kernel; the d=128/128 cases
are there for reference against SDPA's flash kernel.

Rows ending ", gluon" time the same inputs through the SM90 Gluon kernel (kernels/prefill_gluon.py: FlashAttention-3's
schedule, registered for nothing until it has run on a GPU) by calling its launch directly, beside the tl kernel's
rows; a call it does not serve (not SM90, no Gluon) is an error row saying why, never the tl kernel timed again.

FLOPs: 2 * (Dqk + Dv) * H * (visible query-key pairs), the pairs counted exactly
(q_len * prefix + q_len * (q_len + 1) / 2 per request): the causal half, no credit for masked work.

`python -m deepinfer_cuda.bench.attention_prefill [--check] [--sweep CONFIGS] [--cases 0,2]` runs the
cases standalone (and optionally checks correctness on the GPU and times other tile configurations).
`python -m deepinfer_cuda.bench.attention_prefill --sweep prefill_gluon [--json FILE]` times the SM90 Gluon kernel's
tunings (GLUON_SWEEP: its variants; first run on an H100, 2026-12-07) against its default and torch SDPA on GLUON_SWEEP_SHAPES, each
output compared with the default's (`gluon_sweep`).
"""

from __future__ import annotations

import math

import torch

from deepinfer_cuda.bench.common import BenchCase

OPS = ("prefill",)  # what this bench module covers: the runner finds it by this
TABLE_ORDER = 20  # where its rows sit in `deepinfer bench ops`: attention first, misc last

DTYPE = torch.bfloat16


def _visible_pairs(q_len: int, k_len: int) -> int:
    return q_len * (k_len - q_len) + q_len * (q_len + 1) // 2


def _setup(batch: int, q_len: int, k_len: int, heads: int, d_qk: int, d_v: int):
    def setup(device: torch.device) -> dict:
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(batch * q_len, heads, d_qk, device=device, dtype=DTYPE, generator=g)
        k = torch.randn(batch * k_len, heads, d_qk, device=device, dtype=DTYPE, generator=g)
        v = torch.randn(batch * k_len, heads, d_v, device=device, dtype=DTYPE, generator=g)
        cu_q = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * q_len
        cu_k = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * k_len
        scale = 1.0 / math.sqrt(d_qk)
        # The peer's batch form: views of the packed tensors, [B, H, L, D].
        qb = q.view(batch, q_len, heads, d_qk).transpose(1, 2)
        kb = k.view(batch, k_len, heads, d_qk).transpose(1, 2)
        vb = v.view(batch, k_len, heads, d_v).transpose(1, 2)
        mask = None
        if q_len != k_len:
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(q_len, k_len)
        return dict(
            q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k, scale=scale, qb=qb, kb=kb, vb=vb, mask=mask,
            batch=batch, q_len=q_len, k_len=k_len, heads=heads, d_qk=d_qk, d_v=d_v,
        )

    return setup


def _kernel(s: dict):
    from deepinfer_cuda.kernels.prefill import prefill

    return prefill(s["q"], s["k"], s["v"], s["cu_q"], s["cu_k"], softmax_scale=s["scale"])


def _kernel_gluon(s: dict):
    from deepinfer_cuda.kernels import prefill_gluon

    out = prefill_gluon.launch_prefill_gluon(s["q"], s["k"], s["v"], s["cu_q"], s["cu_k"], s["scale"])
    if out is None:
        raise RuntimeError(f"prefill_gluon does not serve the call: {prefill_gluon.not_served(s['q'], s['k'], s['v'], s['scale'])}")
    return out


def _peer(s: dict):
    import torch.nn.functional as F

    if s["mask"] is None:
        return F.scaled_dot_product_attention(s["qb"], s["kb"], s["vb"], is_causal=True, scale=s["scale"])
    return F.scaled_dot_product_attention(s["qb"], s["kb"], s["vb"], attn_mask=s["mask"], scale=s["scale"])


def _flops(s: dict) -> float:
    return 2.0 * (s["d_qk"] + s["d_v"]) * s["heads"] * s["batch"] * _visible_pairs(s["q_len"], s["k_len"])


def _bytes(s: dict) -> float:
    size = torch.finfo(DTYPE).bits // 8
    tq, tk = s["batch"] * s["q_len"], s["batch"] * s["k_len"]
    return float(size * s["heads"] * (tq * s["d_qk"] + tk * (s["d_qk"] + s["d_v"]) + tq * s["d_v"]))


# (name, batch, q_len, k_len, heads, d_qk, d_v)
SHAPES = [
    ("causal_b4x4096_h16_dqk192_dv128", 4, 4096, 4096, 16, 192, 128),
    ("prefix3072_b4x1024_h16_dqk192_dv128", 4, 1024, 4096, 16, 192, 128),
    ("causal_b2x2048_h128_dqk192_dv128", 2, 2048, 2048, 128, 192, 128),
    ("causal_b4x4096_h16_d128 (reference)", 4, 4096, 4096, 16, 128, 128),
    ("causal_b2x2048_h128_d128 (reference)", 2, 2048, 2048, 128, 128, 128),
]

CASES = [
    BenchCase(
        op="prefill",
        name=name + suffix,
        setup=_setup(b, lq, lk, h, dqk, dv),
        kernel=kernel,
        peer=_peer,
        peer_name="torch SDPA (causal, batch form)",
        flops=_flops,
        bytes=_bytes,
        bound="compute",
    )
    for name, b, lq, lk, h, dqk, dv in SHAPES
    for suffix, kernel in (("", _kernel), (", gluon", _kernel_gluon))
]


def _gluon_tuning(**fields):
    from deepinfer_cuda.kernels.prefill_gluon import Tuning

    return Tuning(**fields)


# `--sweep prefill_gluon`: the SM90 Gluon prefill's tunings (prefill_gluon.Tuning; swept on an H100, 2026-12-07:
# docs/backends/cuda.md), each timed beside the default and torch SDPA on GLUON_SWEEP_SHAPES. A tuning that does not fit a shape's head
# dims (shared memory) is a row saying why. `deepinfer bench compile --arch sm90 --sweep prefill_gluon` compiles them.
GLUON_SWEEP = [
    ("default", _gluon_tuning()),  # the persistent kernel, 2 stages of 128 keys, 232 / 40 registers
    ("regs 240/24", _gluon_tuning(consumer_regs=240)),  # FlashAttention-3's register split
    ("one section", _gluon_tuning(section_bytes=0)),  # the longest-first order over all heads at once
    ("BLOCK_N 64 x 4 stages", _gluon_tuning(block_n=64, num_stages=4)),
    ("3 stages", _gluon_tuning(num_stages=3)),  # (Dqk 128 only: 224 KiB)
    ("a program a tile", _gluon_tuning(persistent=False)),  # prefill_gluon.py's kernel: one program per (query tile, head)
    ("a program a tile, regs 240/24", _gluon_tuning(persistent=False, consumer_regs=240)),
    ("a program a tile, BLOCK_N 64 x 4 stages", _gluon_tuning(persistent=False, block_n=64, num_stages=4)),
    ("a program a tile, 3 stages", _gluon_tuning(persistent=False, num_stages=3)),  # (Dqk 128 only)
]
GLUON_SWEEP_SHAPES = (0, 2, 3, 4)  # SHAPES: causal B4 x 4096 H16 and B2 x 2048 H128, at 192/128 and 128/128


def _check(device: torch.device) -> None:
    """Correctness on the GPU against the float64 reference, on small var-len batches."""
    from deepinfer.ops.attention import prefill as reference
    from deepinfer_cuda.kernels.prefill import prefill

    g = torch.Generator(device="cpu").manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        for d_qk, d_v in ((192, 128), (64, 64), (128, 128), (80, 48)):
            for window in (None, 100):
                q_lens = [1, 63, 64, 65, 128, 300, 777]
                k_lens = [q + p for q, p in zip(q_lens, [0, 5, 0, 130, 64, 1000, 0])]
                cu_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
                cu_k = torch.tensor([0] + k_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
                h = 3
                q = torch.randn(sum(q_lens), h, d_qk, generator=g).to(device, dtype)
                k = torch.randn(sum(k_lens), h, d_qk, generator=g).to(device, dtype)
                v = torch.randn(sum(k_lens), h, d_v, generator=g).to(device, dtype)
                scale = d_qk ** -0.5
                out = prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, sliding_window=window)
                ref = reference(q.double(), k.double(), v.double(), cu_q, cu_k, softmax_scale=scale, sliding_window=window)
                rel = float((out.double() - ref).norm() / ref.norm())
                worst = float((out.double() - ref).abs().max())
                print(f"check {str(dtype):15s} dqk {d_qk:3d} dv {d_v:3d} window {window}: rel {rel:.2e} max {worst:.2e}")


def gluon_sweep(device: torch.device, tunings=None, shapes=GLUON_SWEEP_SHAPES, timer=None) -> list[dict]:
    """Each GLUON_SWEEP tuning of the SM90 Gluon prefill on each of `shapes` (SHAPES indices), beside its default tuning
    and torch SDPA: microseconds, TFLOP/s, % of the bf16 matmul rate (runner.measure_matmul_tflops, measured once here),
    SDPA's time over the row's, and the largest |output - the default tuning's output| with the rows left unwritten
    (each output goes into a NaN-filled buffer, so a tuning that skipped rows shows NaN there, not another call's data).
    Prints one table and returns its rows."""
    from deepinfer_cuda.bench.common import time_ms
    from deepinfer_cuda.bench.runner import measure_matmul_tflops

    timer = timer or (lambda fn: time_ms(fn, warmup_ms=10, rep_ms=40))
    tunings = GLUON_SWEEP if tunings is None else tunings
    matmul = measure_matmul_tflops(device, timer)
    print(f"{torch.__version__} {torch.cuda.get_device_name(device)}; bf16 matmul {matmul:.1f} TFLOP/s (runner.measure_matmul_tflops)", flush=True)
    head = f"{'shape':38s} {'variant':34s} {'us':>8s} {'TFLOP/s':>8s} {'% matmul':>8s} {'x SDPA':>7s} {'max|d default|':>14s} {'NaN rows':>8s}"
    print(head, flush=True)
    rows = []
    for index in shapes:
        rows += _gluon_sweep_shape(SHAPES[index], tunings, device, timer, matmul)  # the shape's tensors are freed on return
        torch.cuda.empty_cache()
    return rows


def _gluon_sweep_shape(shape, tunings, device: torch.device, timer, matmul: float) -> list[dict]:
    """gluon_sweep's rows of one SHAPES entry."""
    from deepinfer_cuda.kernels import prefill_gluon

    rows = []
    name, batch, q_len, k_len, heads, d_qk, d_v = shape
    s = _setup(batch, q_len, k_len, heads, d_qk, d_v)(device)
    flops = _flops(s)

    def nan_out():
        return torch.full((batch * q_len, heads, d_v), float("nan"), dtype=DTYPE, device=device)

    def launch(tuning, out=None):
        return prefill_gluon.launch_prefill_gluon(s["q"], s["k"], s["v"], s["cu_q"], s["cu_k"], s["scale"], tuning=tuning, out=out)

    def row(label, ms=None, diff=None, nan_rows=None, note=""):
        rate = None if ms is None else flops / (ms * 1e-3) / 1e12
        r = {"shape": name, "variant": label, "us": None if ms is None else ms * 1e3, "tflops": rate,
             "matmul_fraction": None if rate is None else rate / matmul, "vs_sdpa": None if ms is None else sdpa_ms / ms,
             "max_diff_default": diff, "nan_rows": nan_rows, "note": note}
        if ms is None:
            print(f"{name[:38]:38s} {label[:34]:34s} {note}", flush=True)
        else:
            d = "-" if diff is None else f"{diff:.3g}"
            print(f"{name[:38]:38s} {label[:34]:34s} {ms * 1e3:8.1f} {rate:8.1f} {100 * r['matmul_fraction']:7.1f}% {r['vs_sdpa']:7.3f} {d:>14s}"
                  f" {'-' if nan_rows is None else nan_rows:>8}  {note}", flush=True)
        rows.append(r)

    sdpa_ms = timer(lambda: _peer(s))
    want = launch(None, nan_out())
    if want is None:
        raise RuntimeError(f"prefill_gluon does not serve the call: {prefill_gluon.not_served(s['q'], s['k'], s['v'], s['scale'])}")
    # the default's output against SDPA's (batch form [B, H, L, Dv]): a sanity check of the table's reference row
    sdpa_diff = float((want.view(batch, q_len, heads, d_v).transpose(1, 2).float() - _peer(s).float()).abs().max())
    row("torch SDPA (causal, batch form)", sdpa_ms, note=f"max |default - SDPA| {sdpa_diff:.3g}")
    for label, tuning in tunings:
        problem = tuning.problem(d_qk, d_v)
        if problem is not None:
            row(label, note=f"n/a: {problem}")
            continue
        try:
            got = launch(tuning, nan_out())
            torch.cuda.synchronize(device)
            diff = float((got.float() - want.float()).abs().max())  # (NaN where either left rows unwritten)
            nan_rows = int(torch.isnan(got).any(dim=-1).sum())
            del got
            row(label, timer(lambda: launch(tuning)), diff, nan_rows)
        except Exception as exc:  # noqa: BLE001 - a tuning that fails is a row, not the end of the sweep
            row(label, note=f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
    return rows


def main(argv: list[str] | None = None) -> None:
    import argparse

    from deepinfer_cuda.bench.common import time_ms
    from deepinfer_cuda.kernels import prefill as module

    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--sweep", default="", help="tile configs to time besides the table's: 'BMxBN/warps/stages[/tma][/ws];...'; or prefill_gluon: "
                    "the SM90 Gluon kernel's tunings (GLUON_SWEEP) against its default and SDPA")
    ap.add_argument("--cases", default="", help="comma-separated case indices (default: all; with --sweep prefill_gluon: SHAPES indices)")
    ap.add_argument("--json", default=None, help="with --sweep prefill_gluon: write its rows here")
    ap.add_argument("--only", default="", help="with --sweep prefill_gluon: the tunings whose label holds one of these ';'-separated texts (and the default)")
    args = ap.parse_args(argv)
    if args.sweep == "prefill_gluon":
        import json

        shapes = tuple(int(i) for i in args.cases.split(",")) if args.cases else GLUON_SWEEP_SHAPES
        only = [text for text in args.only.split(";") if text]
        tunings = [(label, t) for label, t in GLUON_SWEEP if not only or label == "default" or any(text in label for text in only)]
        rows = gluon_sweep(torch.device("cuda"), tunings=tunings, shapes=shapes)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    sweep = []
    for item in filter(None, args.sweep.split(";")):
        tile, warps, stages, *flags = item.split("/")
        bm, bn = (int(x) for x in tile.split("x"))
        sweep.append((item, dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=int(warps), num_stages=int(stages), tma="tma" in flags, warp_specialize="ws" in flags)))
    cases = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else CASES
    device = torch.device("cuda")
    print(torch.__version__, torch.cuda.get_device_name(0))
    if args.check:
        _check(device)
    for case in cases:
        _time_case(case, device, sweep, time_ms, module.launch_prefill)  # the case's tensors are freed on return
        torch.cuda.empty_cache()


def _time_case(case, device: torch.device, sweep: list, time_ms, launch_prefill) -> None:
    """One case: kernel and SDPA peer timed and compared, then each swept tile config."""
    s = case.setup(device)
    flops = case.flops(s)
    ms = time_ms(lambda: case.kernel(s))
    peer_ms = time_ms(lambda: case.peer(s))
    peer_out = case.peer(s).float()

    def diff(out: torch.Tensor) -> float:
        return float((out.view(s["batch"], s["q_len"], s["heads"], s["d_v"]).transpose(1, 2).float() - peer_out).abs().max())

    err = diff(case.kernel(s))
    print(
        f"{case.name:40s} kernel {ms:7.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s | SDPA {peer_ms:7.3f} ms {flops / peer_ms / 1e9:6.1f} TFLOP/s"
        f" | ratio {peer_ms / ms:5.2f} | max|diff| {err:.3g}"
    )
    for label, cfg in sweep:
        def run():
            return launch_prefill(s["q"], s["k"], s["v"], s["cu_q"], s["cu_k"], s["scale"], None, cfg=cfg)

        try:
            e = diff(run())
            t = time_ms(run)
            print(f"    {label:24s}: {t:7.3f} ms {flops / t / 1e9:6.1f} TFLOP/s  max|diff| {e:.3g}")
        except Exception as e:  # out of shared memory, say
            print(f"    {label:24s}: failed {type(e).__name__}: {str(e)[:100]}")


if __name__ == "__main__":
    main()
