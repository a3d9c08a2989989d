"""The ascend backend's `linear` / `grouped_gemm` Triton kernels and fp8 activation quantiser, under
community Triton's interpreter, on both simulated chips (910B: 24 AI cores, 950: 32).

Shapes beyond the golden set: partial M/N/K blocks, more tiles than AI cores (the persistent loop),
experts with zero rows, padding rows, masked_m of 0 and of max_m, int64 offsets, every activation
dtype the kernels take, mixed and float64 dense weights, linear's out_dtype, every e4m3 byte and every e2m1 code, the
950's fp8-dot operand path forced (its indexing; operands upcast under the interpreter), and the
tile plans against each chip's buffer budget. Products are compared with the op references in
deepinfer.ops (float64 from the same inputs, as the golden set is) within the op's tolerance; the
quantiser must match deepinfer.ops.quant.quantize_act_fp8 bit for bit.

TRITON_INTERPRET and the simulated chip must be set before triton is imported, so each chip's
checks run in a subprocess: this file is also the script (`python test_gemm_kernels.py
910B` prints one JSON line per check). The pytest side never imports triton.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CHIPS = ("910B", "950")
CHECKS = (
    "registrations",
    "plans_fit_buffer",
    "quantizer_bit_exact",
    "e4m3_every_byte",
    "e2m1_every_code",
    "linear_dense",
    "linear_out_dtype",
    "linear_fp8_block",
    "linear_mxfp4",
    "linear_fp8_block32",
    "contiguous_all_formats",
    "masked_all_formats",
    "fp8_dot_path_forced",
    "empty_inputs",
)


# ---------------------------------------------------------------------------------------------
# pytest side


def _run_chip(chip: str) -> dict[str, dict]:
    from waits import HANG_S  # (here, not at the top: the script side runs without tests/ on its path)

    env = dict(os.environ, TRITON_INTERPRET="1", DEEPINFER_ASCEND_SIM_CHIP=chip)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), chip], env=env, capture_output=True, text=True, timeout=HANG_S)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            item = json.loads(line)
            results[item["check"]] = item
    if proc.returncode != 0 and not results:
        raise AssertionError(f"the {chip} check script failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return results


_CACHE: dict[str, dict[str, dict]] = {}


def _results(chip: str) -> dict[str, dict]:
    if chip not in _CACHE:
        _CACHE[chip] = _run_chip(chip)
    return _CACHE[chip]


try:
    import pytest
except ImportError:  # the script side needs no pytest
    pytest = None

if pytest is not None:

    @pytest.mark.parametrize("check", CHECKS)
    @pytest.mark.parametrize("chip", CHIPS)
    def test_gemm_kernels(chip: str, check: str):
        item = _results(chip).get(check)
        assert item is not None, f"check {check!r} did not report on {chip} (the script crashed earlier?)"
        assert item["ok"], f"{chip} {check}: {item['detail']}"


# ---------------------------------------------------------------------------------------------
# script side (runs under TRITON_INTERPRET=1 with the chip simulated)


def _script(chip: str) -> int:
    import traceback

    import torch

    from deepinfer.ops import gemm as ref
    from deepinfer.ops import quant
    from deepinfer_ascend.kernels import gemm as kg

    assert os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("DEEPINFER_ASCEND_SIM_CHIP") == chip

    def gen(seed):
        return torch.Generator().manual_seed(seed)

    def weight_in(fmt, *lead, n, k, seed, dtype=torch.float32):
        w = torch.randn(*lead, n, k, generator=gen(seed)) * 10 ** (torch.rand(*lead, n, 1, generator=gen(seed + 1)) * 2 - 2)
        if fmt == "dense":
            return {"weight": w.to(dtype)}
        quantize = {"fp8_block": quant.quantize_weight_fp8_block, "fp8_block32": quant.quantize_weight_fp8_block32}.get(fmt, quant.quantize_weight_mxfp4)
        q, s = quantize(w)
        return {"weight": q, "weight_scale": s, "fmt": fmt}

    def as_float64(kw):
        return {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != quant.FP8_DTYPE else v) for k, v in kw.items()}

    def compare(op_name, kw, label):
        got = getattr(kg, op_name)(**kw)
        want = getattr(ref, op_name)(**as_float64(kw))
        x = kw["x"]
        out_dtype = kw.get("out_dtype") or x.dtype  # linear's out_dtype: the output's dtype and tolerance
        if got.dtype != out_dtype or got.shape != want.shape:
            return f"{label}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {out_dtype}"
        if op_name == "grouped_gemm":
            got = ref._grouped_gemm_canonicalize(kw, {"out": got})["out"]
        tol = ref.GEMM_TOLERANCES[out_dtype]
        err = (got.double() - want).abs()
        bound = tol.atol * x.shape[-1] + tol.rtol * want.abs()
        if not torch.isfinite(got.double()).all():
            return f"{label}: non-finite output"
        if not (err <= bound).all():
            return f"{label}: max err/tol {float((err / bound).max()):.3g}"
        return None

    def run_all(cases):
        failures = [f for f in (compare(*c) for c in cases) if f]
        return not failures, "; ".join(failures) or f"{len(cases)} cases"

    def check_registrations():
        from deepinfer.registry import Registry, ResolveContext

        reg = Registry()
        reg.register_all("ascend", kg.REGISTRATIONS)  # checks the signatures against the ops
        ctx = ResolveContext(backend="ascend", dtype=torch.bfloat16)
        picked = all(reg.pick(ctx, op, fmt) is not None for op in ("linear", "grouped_gemm") for fmt in ref.FORMATS)
        all_fast = ResolveContext(backend="ascend", dtype=torch.bfloat16, options={"npu_fast_paths": "all"})  # Triton still serves the rest
        still_served = all(reg.pick(all_fast, op, "dense") is not None for op in ("linear", "grouped_gemm"))
        return picked and still_served, f"picked every format: {picked}; still served under npu_fast_paths=all: {still_served}"

    def check_plans():
        budget = kg.current().ub_bytes // 2
        bad = []
        for fmt in ref.FORMATS:
            for dt in (torch.bfloat16, torch.float16, torch.float32):
                for fp8_dot in (False, True):
                    dot = kg._dot_kind(fmt, dt, dt if fmt == "dense" else torch.uint8, fp8_dot)
                    for rows in (1, 7, 16, 33, 100, 128, 4096):
                        bm, bn = kg.plan_tiles(fmt, dot, dt, dt, rows)
                        size = kg.tile_bytes(fmt, dot, dt.itemsize, dt.itemsize, bm, bn)
                        if size > budget or 128 % bn or bm < 16 or (bm * dt.itemsize) % 32:
                            bad.append(f"{fmt} {dt} dot{dot} rows{rows}: {bm}x{bn} {size} B")
        return not bad, "; ".join(bad) or f"every plan <= {budget} B"

    def check_quantizer():
        failures = []
        g = gen(7)
        col_scale = torch.logspace(-9, 3, 300).double()
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            x = (torch.randn(9, 300, generator=g, dtype=torch.float64) * col_scale).to(dt)
            x[1, 128:256] = 0  # an all-zero group: the amax floor
            x[2, :128] = torch.tensor([448.0 * (i % 17) / 16 for i in range(128)], dtype=torch.float64).to(dt)  # exact ties
            x[3] = (torch.randn(300, generator=g) * 1e-6).to(dt)  # scale from the floor, e4m3 subnormals
            want_q, want_s = quant.quantize_act_fp8(x)
            for codes in (True, False):
                q, s = kg.quantize_act_fp8(x, codes=codes)
                same_q = torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) if codes else torch.equal(q.float(), want_q.float())
                if not (same_q and torch.equal(s, want_s)):
                    failures.append(f"{dt} codes={codes}: q equal {same_q}, scale equal {torch.equal(s, want_s)}")
        x3 = torch.randn(2, 5, 7, 130, generator=g).bfloat16()  # leading dims
        q, s = kg.quantize_act_fp8(x3)
        wq, ws = quant.quantize_act_fp8(x3)
        if not (torch.equal(q.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(s, ws)):
            failures.append("[2, 5, 7, 130] input")
        return not failures, "; ".join(failures) or "bit-exact (bytes and float16 values, scales)"

    def check_e4m3_every_byte():
        # every finite e4m3 byte (subnormals included) as a weight; one-hot float32 activations
        codes = torch.arange(256, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0
        weight = codes.reshape(2, 128).view(quant.FP8_DTYPE)
        scale = torch.tensor([[0.75]])
        x = torch.eye(128, dtype=torch.float32)[::3] * 3.0
        return run_all([("linear", {"x": x, "weight": weight, "weight_scale": scale, "fmt": "fp8_block"}, "every byte")])

    def check_e2m1_every_code():
        codes = torch.arange(16, dtype=torch.uint8).repeat(64 // 16)
        packed = (codes[0::2] | (codes[1::2] << 4)).repeat(24, 2)  # [24, 64]: K = 128
        scale = torch.randint(122, 131, (24, 4), generator=gen(3), dtype=torch.uint8)  # 2^-5 .. 2^3
        x = torch.randn(5, 128, generator=gen(4))
        return run_all([
            ("linear", {"x": x.to(dt), "weight": packed, "weight_scale": scale, "fmt": "mxfp4"}, f"{dt}")
            for dt in (torch.float32, torch.bfloat16)
        ])

    def linear_case(fmt, t, n, k, dt, seed, wdt=None):
        inputs = {"x": torch.randn(t, k, generator=gen(seed)).to(dt), **weight_in(fmt, n=n, k=k, seed=seed + 1, dtype=wdt or dt)}
        return ("linear", inputs, f"{fmt} {dt} w {wdt or dt} t{t} n{n} k{k}")

    def check_linear_dense():
        return run_all([
            linear_case("dense", 1, 72, 200, torch.bfloat16, 10),
            linear_case("dense", 130, 136, 160, torch.bfloat16, 11),
            linear_case("dense", 19, 300, 96, torch.float16, 12),
            linear_case("dense", 40, 90, 272, torch.float32, 13),
            linear_case("dense", 3, 64, 130, torch.bfloat16, 14, wdt=torch.float32),
            linear_case("dense", 3, 48, 64, torch.float32, 15, wdt=torch.float64),
        ])

    def check_linear_out_dtype():
        # the MoE router (bf16 x, float32 weight, float32 logits: held to float32's tolerance), float32 out of bf16
        # operands (the accumulator stored without the bf16 rounding), and bf16 out of float32 operands
        cases = [
            (linear_case("dense", 3, 64, 130, torch.bfloat16, 16, wdt=torch.float32), torch.float32),
            (linear_case("dense", 1, 256, 512, torch.bfloat16, 17, wdt=torch.float32), torch.float32),
            (linear_case("dense", 5, 48, 96, torch.bfloat16, 18), torch.float32),
            (linear_case("dense", 4, 40, 72, torch.float32, 19), torch.bfloat16),
        ]
        return run_all([(op, {**kw, "out_dtype": out}, f"{label} out {out}") for (op, kw, label), out in cases])

    def check_linear_fp8():
        return run_all([
            linear_case("fp8_block", 1, 136, 200, torch.bfloat16, 20),
            linear_case("fp8_block", 37, 264, 384, torch.bfloat16, 21),
            linear_case("fp8_block", 6, 96, 256, torch.float16, 22),
            linear_case("fp8_block", 4, 130, 300, torch.float32, 23),
        ])

    def check_linear_mxfp4():
        return run_all([
            linear_case("mxfp4", 1, 72, 96, torch.bfloat16, 30),
            linear_case("mxfp4", 33, 100, 288, torch.bfloat16, 31),
            linear_case("mxfp4", 5, 64, 160, torch.float16, 32),
            linear_case("mxfp4", 5, 40, 128, torch.float32, 33),
            # mxfp4_a8 (W4A8 MX): MX FP8 activations, the same packed weights
            linear_case("mxfp4_a8", 7, 100, 288, torch.bfloat16, 34),
            linear_case("mxfp4_a8", 3, 40, 160, torch.float32, 35),
        ])

    def check_linear_fp8_block32():
        # W8A16 (V4.1): e4m3 with e8m0 per 32x32 block; N and K not multiples of 32 (partial edge blocks),
        # more N tiles than one scale row; then random e4m3 bytes under scales that differ in every block,
        # read back one at a time by one-hot activations (exact products: a wrong block's scale shows)
        weight = torch.randint(0, 256, (72, 100), generator=gen(75), dtype=torch.uint8)
        weight[(weight & 0x7F) == 0x7F] = 0
        scale = torch.randint(112, 140, (3, 4), generator=gen(76), dtype=torch.uint8)
        x = torch.eye(100)[::3] * 3.0
        return run_all([
            linear_case("fp8_block32", 1, 80, 112, torch.bfloat16, 70),
            linear_case("fp8_block32", 37, 264, 200, torch.bfloat16, 71),
            linear_case("fp8_block32", 6, 96, 48, torch.float16, 72),
            linear_case("fp8_block32", 4, 130, 300, torch.float32, 73),
            *[("linear", {"x": x.to(dt), "weight": weight.view(quant.FP8_DTYPE), "weight_scale": scale, "fmt": "fp8_block32"}, f"every block's scale {dt}")
              for dt in (torch.float32, torch.bfloat16)],
        ])

    def contiguous_case(fmt, counts, padding, n, k, dt, seed, offsets_dtype=torch.int32):
        offsets = torch.tensor([0, *counts]).cumsum(0).to(offsets_dtype)
        m = int(offsets[-1]) + padding
        x = torch.randn(m, k, generator=gen(seed)).to(dt)
        return ("grouped_gemm", {"x": x, **weight_in(fmt, len(counts), n=n, k=k, seed=seed + 1, dtype=dt), "expert_offsets": offsets},
                f"contiguous {fmt} {dt} counts {counts}")

    def check_contiguous():
        return run_all([
            contiguous_case("dense", [7, 0, 20, 1, 0, 13], 5, 256, 96, torch.bfloat16, 40),  # > 24 tiles
            contiguous_case("dense", [0, 0, 33], 0, 40, 136, torch.float32, 41, torch.int64),
            contiguous_case("fp8_block", [3, 0, 17, 9], 4, 136, 200, torch.bfloat16, 42),
            contiguous_case("fp8_block", [0, 5], 2, 64, 128, torch.float32, 43, torch.int64),
            contiguous_case("mxfp4", [2, 11, 0, 6], 3, 96, 192, torch.bfloat16, 44),
            contiguous_case("mxfp4", [0, 0, 0], 6, 32, 64, torch.bfloat16, 45),  # no rows at all
            contiguous_case("mxfp4_a8", [2, 11, 0, 6], 3, 96, 192, torch.bfloat16, 46),
            contiguous_case("fp8_block32", [2, 11, 0, 6], 3, 80, 144, torch.bfloat16, 48),  # wo_a's grouped projection
            # decode: fewer rows than experts (a grid of min(tiles + E, rows) row tiles)
            contiguous_case("dense", [0, 1, 0, 0, 1, 0, 1, 0, 0, 0, 1, 0, 1, 1, 0, 0], 0, 64, 64, torch.bfloat16, 47),
        ])

    def masked_case(fmt, counts, max_m, n, k, dt, seed, mm_dtype=torch.int32):
        x = torch.randn(len(counts), max_m, k, generator=gen(seed)).to(dt)
        return ("grouped_gemm", {"x": x, **weight_in(fmt, len(counts), n=n, k=k, seed=seed + 1, dtype=dt), "masked_m": torch.tensor(counts, dtype=mm_dtype)},
                f"masked {fmt} {dt} masked_m {counts}")

    def check_masked():
        return run_all([
            masked_case("dense", [0, 24, 9, 1, 24], 24, 200, 64, torch.bfloat16, 50),
            masked_case("dense", [3, 0], 5, 72, 100, torch.float16, 51, torch.int64),
            masked_case("fp8_block", [2, 8, 0], 8, 200, 256, torch.bfloat16, 52),
            masked_case("fp8_block", [1, 4], 4, 64, 130, torch.float32, 53),
            masked_case("mxfp4", [5, 0, 16], 16, 64, 96, torch.bfloat16, 54),
            masked_case("mxfp4", [0, 0], 4, 32, 64, torch.float32, 55),
            masked_case("mxfp4_a8", [5, 0, 16], 16, 64, 96, torch.float16, 56),
            masked_case("fp8_block32", [5, 0, 16], 16, 48, 80, torch.bfloat16, 57),
        ])

    def check_fp8_dot_forced():
        saved = kg.fp8_dot_enabled
        kg.fp8_dot_enabled = lambda: True
        try:
            return run_all([
                linear_case("fp8_block", 5, 200, 320, torch.bfloat16, 60),
                contiguous_case("fp8_block", [3, 0, 9], 2, 136, 256, torch.float16, 61),
                masked_case("fp8_block", [0, 7, 2], 8, 72, 200, torch.bfloat16, 62),
            ])
        finally:
            kg.fp8_dot_enabled = saved

    def check_empty():
        out = kg.linear(torch.zeros(0, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16))
        out2 = kg.grouped_gemm(torch.zeros(0, 4, 128), torch.zeros(0, 16, 128), masked_m=torch.zeros(0, dtype=torch.int32))
        ok = out.shape == (0, 32) and out2.shape == (0, 4, 16)
        return ok, f"shapes {tuple(out.shape)} {tuple(out2.shape)}"

    checks = {
        "registrations": check_registrations,
        "plans_fit_buffer": check_plans,
        "quantizer_bit_exact": check_quantizer,
        "e4m3_every_byte": check_e4m3_every_byte,
        "e2m1_every_code": check_e2m1_every_code,
        "linear_dense": check_linear_dense,
        "linear_out_dtype": check_linear_out_dtype,
        "linear_fp8_block": check_linear_fp8,
        "linear_mxfp4": check_linear_mxfp4,
        "linear_fp8_block32": check_linear_fp8_block32,
        "contiguous_all_formats": check_contiguous,
        "masked_all_formats": check_masked,
        "fp8_dot_path_forced": check_fp8_dot_forced,
        "empty_inputs": check_empty,
    }
    assert set(checks) == set(CHECKS)
    for name, fn in checks.items():
        try:
            ok, detail = fn()
        except Exception as exc:  # noqa: BLE001 - reported as that check's failure
            ok, detail = False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"
        print(json.dumps({"check": name, "ok": bool(ok), "detail": detail}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_script(sys.argv[1]))
