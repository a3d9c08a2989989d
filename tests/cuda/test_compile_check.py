"""Ahead-of-time compile check of the cuda kernels for SM90 and SM100; no GPU needed, but run in the GPU
sessions (`TRITON_INTERPRET=0 pytest tests/cuda/test_compile_check.py`, beside the kernels' own runs):
the ptxas builds took 3-7 minutes of the 20-minute CI on the 2-core machine. CI keeps the checks of
the command itself (usage errors, instruction classes). Runs `deepinfer bench compile --arch sm90,sm100 --json FILE` in a subprocess without TRITON_INTERPRET
(tests/conftest.py sets it for this process, and interpreted kernels cannot be compiled), then checks
every kernel: compiled, no spills, the expected matrix instruction class (SM90 wgmma, SM100 tcgen05,
block-scaled tcgen05 for mxfp8 and mxfp4_a8; a case's own expectation where it differs, with why);
every launch passes its PDL argument, and the cases marked `pdl` compile a second time with PDL on
(griddepcontrol.wait and .launch_dependents in the PTX, no spills where the kernel without PDL has none).
Entries in compile_check.KNOWN_FAILURES stay visible in the table and must still fail: when one is
fixed, the test says so and the entry is to be removed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from deepinfer_cuda.bench import compile_check as cc

from waits import HANG_S


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    return subprocess.run([sys.executable, "-m", "deepinfer.cli.main", "bench", "compile", *args], env=env, capture_output=True, text=True, timeout=HANG_S)


ARCHS = ("sm90", "sm100")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    if os.environ.get("TRITON_INTERPRET") != "0":
        pytest.skip("runs in the GPU sessions: TRITON_INTERPRET=0 pytest tests/cuda/test_compile_check.py (no GPU needed; minutes of ptxas)")
    path = tmp_path_factory.mktemp("compile") / "compile.json"
    proc = _cli("--arch", ",".join(ARCHS), "--json", str(path))
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    return json.loads(path.read_text())


def test_every_case_compiles_for_every_arch_checked(report):
    for arch in ARCHS:
        cases = {r["case"] for r in report["results"] if r["arch"] == arch}
        assert cases == {c.name for c in cc.CASES if arch in c.archs}, arch


def test_kernels_compile_without_spills_at_the_expected_mma_class(report):
    assert report["passed"]
    for r in report["results"]:
        key = (r["case"], r["kernel"], r["arch"])
        if key in cc.KNOWN_FAILURES:
            continue
        where = f"{r['arch']} {r['case']} {r['kernel']}"
        assert r["compiled"], f"{where}: {r['error']}"
        assert r["spills"] == 0, f"{where}: spills {r['spills']} bytes"
        assert r["regs"] and r["regs"] <= 255, where
        if r["expected"]:
            assert cc.CLASSES.index(r["instr"]) >= cc.CLASSES.index(r["expected"]), f"{where}: {r['instr']}, expected {r['expected']}"
    matrix = [r for r in report["results"] if r["expected"] and (r["case"], r["kernel"], r["arch"]) not in cc.KNOWN_FAILURES]
    assert {r["arch"] for r in matrix} == set(ARCHS)
    assert any(r["instr"].startswith("tcgen05") for r in matrix if r["arch"] == "sm100")
    # mxfp8 (both operands MX) reaches the block-scaled tcgen05 MMA on SM100, decode (16 tokens, swapped) included
    mx8 = [r for r in matrix if r["arch"] == "sm100" and "mxfp8" in r["case"] and not r["pdl"]]
    assert len(mx8) == 2 and all(r["instr"] == "tcgen05.mma.block_scale" for r in mx8)
    # so does mxfp4_a8 (W4A8 MX: e4m3 activations x e2m1 weights -> kind::mxf8f6f4.block_scale)
    mx4a8 = [r for r in matrix if r["arch"] == "sm100" and "mxfp4_a8" in r["case"] and not r["pdl"]]
    assert len(mx4a8) == 2 and all(r["instr"] == "tcgen05.mma.block_scale" for r in mx4a8)


def test_gluon_mxfp4_kernel_is_warp_specialised_wgmma_over_tma_on_sm90(report):
    """The SM90 Gluon mxfp4 kernel (mxfp4_path=gluon) builds for every layout without spills, with wgmma and TMA loads;
    so does its persistent form (the prefill entry's flag)."""
    gluon = [r for r in report["results"] if r["kernel"] in ("_mxfp4_gemm_ws_kernel", "_mxfp4_gemm_persistent_kernel")]
    assert {r["case"] for r in gluon} == {c.name for c in cc.CASES if "mxfp4 gluon" in c.name}
    assert {r["case"] for r in gluon if r["kernel"] == "_mxfp4_gemm_persistent_kernel"} == {c.name for c in cc.CASES if "mxfp4 gluon persistent" in c.name}
    assert all(r["arch"] == "sm90" and r["ok"] and r["tma"] and r["instr"] == "wgmma" and r["spills"] == 0 for r in gluon), gluon


def test_gluon_fp8_kernel_is_warp_specialised_wgmma_over_tma_on_sm90(report):
    """The SM90 Gluon fp8_block kernel (fp8_path=gluon) builds for every layout, prefill and decode tiles, with and
    without K splits, without spills, with fp8 wgmma and TMA loads."""
    gluon = [r for r in report["results"] if r["kernel"] == "_fp8_gemm_ws_kernel"]
    assert {r["case"] for r in gluon} == {c.name for c in cc.CASES if "fp8_block gluon" in c.name}
    assert all(r["arch"] == "sm90" and r["ok"] and r["tma"] and r["instr"] == "wgmma" and r["spills"] == 0 for r in gluon), gluon
    assert any(r["kernel"] == "_split_k_reduce_kernel" and "fp8_block gluon" in r["case"] for r in report["results"])  # a split case


def test_ci_compiles_the_gluon_kernels_for_sm90(tmp_path):
    """The Gluon kernels have no interpreter twin of their own, so CI compiles them (seconds of ptxas, not the
    full check's minutes): `bench compile --case gluon` builds each for SM90, warp-specialised wgmma, no spills; the mxfp4
    and fp8_block GEMMs load through TMA, the FP8 mla_decode and sparse_attention kernels' converting warps load the cache
    bytes themselves, the bf16 sparse_attention kernel's loader (and its persistent variant's) gathers the rows by cp.async, the prefill's producer loads
    q, k and v by TMA, the bf16 mla_decode's loader warp the cache pages, in its split grid and its balanced persistent one,
    and so does the keys-as-M FP8 mla_decode's (split cases also build their reduce or combine kernels, the balanced one
    its schedule and combine: no matrix)."""
    path = tmp_path / "gluon.json"
    proc = _cli("--arch", "sm90", "--case", "gluon", "--json", str(path))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    results = json.loads(path.read_text())["results"]
    assert {r["case"] for r in results} == {c.name for c in cc.CASES if "gluon" in c.name and "sm90" in c.archs}
    assert all(r["ok"] and r["spills"] == 0 for r in results), results
    matrix = [r for r in results if r["expected"]]
    assert {r["kernel"] for r in matrix} == {
        "_mxfp4_gemm_ws_kernel", "_mxfp4_gemm_persistent_kernel", "_fp8_gemm_ws_kernel", "_mla_decode_fp8_ws_kernel",
        "_sparse_attention_fp8_ws_kernel", "_sparse_attention_ws_kernel", "sparse_attention_persistent_kernel", "_prefill_ws_kernel",
        "_prefill_ws_persistent_kernel", "_mla_decode_ws_kernel", "_mla_decode_balanced_kernel", "_mla_decode_fp8_keys_m_kernel"}, results  # fmt: skip
    assert all(r["instr"] == "wgmma" for r in matrix), matrix
    tma_kernels = {"_mxfp4_gemm_ws_kernel", "_mxfp4_gemm_persistent_kernel", "_fp8_gemm_ws_kernel", "_prefill_ws_kernel", "_prefill_ws_persistent_kernel",
                   "_mla_decode_ws_kernel", "_mla_decode_balanced_kernel", "_mla_decode_fp8_keys_m_kernel"}
    assert all(r["tma"] == (r["kernel"] in tma_kernels) for r in matrix), matrix


def test_the_v4_prefill_sweep_candidates_compile_for_sm90_at_k_1024(tmp_path):
    """`bench compile --sweep fp8_v4_prefill` builds a gemm sweep's candidates (bench/gemm.py's SWEEP) at V4-Flash's
    prefill shapes; CI compiles them at wq_b's K 1024 (seconds): each through TMA, wgmma, no spills. An unknown variant is
    a usage error."""
    path = tmp_path / "sweep.json"
    proc = _cli("--arch", "sm90", "--sweep", "fp8_v4_prefill", "--case", "wq_b", "--json", str(path))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    results = json.loads(path.read_text())["results"]
    gemm = [r for r in results if r["kernel"] == "_gemm_tma_kernel"]
    assert len(gemm) == len({c.name for c in cc.sweep_cases("fp8_v4_prefill") if "wq_b" in c.name}) > 0
    assert all(r["ok"] and r["spills"] == 0 and r["instr"] == "wgmma" and r["tma"] for r in gemm), gemm
    proc = _cli("--arch", "sm90", "--sweep", "no_such_variant")
    assert proc.returncode == 2 and "--sweep" in proc.stderr, proc.stdout + proc.stderr


def test_the_prefill_gluon_sweep_tunings_compile_for_sm90(tmp_path):
    """`bench compile --sweep prefill_gluon` builds each tuning of bench/attention_prefill.py's GLUON_SWEEP where it fits
    the head dims (the case filter: the 128/128 ones), without spills, wgmma over TMA, the wgmmas asynchronous, every
    HGMMA's descriptor registers written on every path of the SASS (under Triton 3.6 the 3-stage build's were not before
    the consumer carried its ring position: sass_check)."""
    from deepinfer_cuda.bench import attention_prefill as bench

    path = tmp_path / "sweep.json"
    proc = _cli("--arch", "sm90", "--sweep", "prefill_gluon", "--case", "128/128", "--json", str(path))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    results = json.loads(path.read_text())["results"]
    matrix = [r for r in results if r["expected"]]
    assert len(matrix) == sum(t.problem(128, 128) is None for _, t in bench.GLUON_SWEEP) == len({r["case"] for r in results})
    assert all(r["ok"] and r["tma"] and r["instr"] == "wgmma" and not r["wgmma_serialized"] and not r["unwritten_descriptors"] for r in matrix), matrix


def test_a_case_filter_that_matches_nothing_is_a_usage_error():
    proc = _cli("--arch", "sm90", "--case", "no such kernel")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no compile case" in proc.stderr


def test_pdl_variants_wait_and_trigger_without_new_spills(report):
    """Every launch passes PDL (False on "meta" tensors: no griddepcontrol); each kernel of a `pdl` case
    also has a row with PDL on, whose PTX waits and triggers, spilling only where the kernel without
    PDL already does."""
    rows = report["results"]
    assert all(r["pdl_arg"] for r in rows), [(r["case"], r["kernel"]) for r in rows if not r["pdl_arg"]]
    assert not any(any(r["griddepcontrol"]) for r in rows if not r["pdl"] and r["compiled"])
    pdl_cases = {c.name for c in cc.CASES if c.pdl}
    assert len(pdl_cases) >= 8
    for arch in ARCHS:
        base = {(r["case"], r["kernel"]): r for r in rows if r["arch"] == arch and not r["pdl"]}
        with_pdl = {(r["case"], r["kernel"]): r for r in rows if r["arch"] == arch and r["pdl"]}
        assert set(with_pdl) == {key for key in base if key[0] in pdl_cases}, arch
        for key, r in with_pdl.items():
            where = f"{arch} {key[0]} {key[1]} with PDL"
            assert r["compiled"], f"{where}: {r['error']}"
            assert r["griddepcontrol"] == [True, True], where
            assert r["spills"] == 0 or base[key]["spills"], f"{where}: spills {r['spills']} bytes, none without PDL"


def test_pdl_rows_problems():
    """A PDL row without griddepcontrol, or spilling where its kernel without PDL does not, fails; a
    launch that does not pass PDL fails."""
    ok = cc.Result("c", "sm90", "k", True, regs=40, spills=0, pdl=True, griddepcontrol=(True, True), spills_without_pdl=0)
    assert ok.ok
    assert not cc.Result("c", "sm90", "k", True, regs=40, spills=0, pdl=True, griddepcontrol=(True, False), spills_without_pdl=0).ok
    assert not cc.Result("c", "sm90", "k", True, regs=40, spills=8, pdl=True, griddepcontrol=(True, True), spills_without_pdl=0).ok
    assert cc.Result("c", "sm90", "k", True, regs=40, spills=8, pdl=True, griddepcontrol=(True, True), spills_without_pdl=8).ok
    assert not cc.Result("c", "sm90", "k", True, regs=40, spills=0, griddepcontrol=(True, True)).ok  # PDL off, yet griddepcontrol
    assert not cc.Result("c", "sm90", "k", True, regs=40, spills=0, pdl_arg=False).ok
    assert cc.griddepcontrol("griddepcontrol.wait;\n griddepcontrol.launch_dependents;") == (True, True)
    assert cc.griddepcontrol("ld.global.v4.b32") == (False, False)


def test_known_failures_still_fail(report):
    by_key = {(r["case"], r["kernel"], r["arch"]): r for r in report["results"] if not r["pdl"]}
    for key, why in cc.KNOWN_FAILURES.items():
        if key[2] not in ARCHS:
            continue
        assert key in by_key, f"known failure {key} no longer produced by the check"
        assert not by_key[key]["ok"], f"{key} now passes ({why}): remove it from KNOWN_FAILURES"


def test_unknown_arch_is_a_usage_error():
    proc = _cli("--arch", "sm80")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "unknown arch" in proc.stderr


def test_a_case_is_compiled_only_for_its_archs_and_tma_is_read_from_the_ptx():
    called = []
    case = cc.Case("sm90 only", lambda: called.append(1), "mma", archs=("sm90",), tma=True)
    assert cc.run(["sm100"], cases=[case]) == [] and not called
    assert cc.uses_tma("cp.async.bulk.tensor.2d.shared::cta.global.mbarrier::complete_tx::bytes [x]")
    assert not cc.uses_tma("cp.async.cg.shared.global [x]")
    r = cc.Result("c", "sm90", "k", True, regs=100, spills=0, instr="wgmma", expected="wgmma", tma=False, needs_tma=True)
    assert r.problems == ["no TMA load (cp.async.bulk.tensor), expected one"]
    gluon = [c for c in cc.CASES if "gluon" in c.name]
    # 15 mxfp4 (5 persistent), 9 fp8_block (3 of its schedule options), 5 FP8 (2 keys as M) and 16 bf16 mla_decode (8 of
    # its schedules other than the table's, 3 of its balanced grid), 5 FP8 (2 L2 prefetch) and 14 bf16 sparse_attention
    # (4 fused combine, 3 persistent, 1 L2 prefetch), 6 prefill (2 a program a tile)
    assert len(gluon) == 70 and all(c.archs == ("sm90",) for c in gluon)
    # (the FP8 attention kernels' converting warps load the cache bytes, the bf16 sparse_attention loader copies rows by
    # cp.async; the prefill's producer loads q, k, v by TMA, the mla_decode loaders of the bf16 and the keys-as-M kernels
    # the cache pages)
    tma_names = ("mxfp4", "fp8_block", "prefill gluon", "mla_decode bf16 gluon", "keys_as_m")
    assert all(c.tma == any(t in c.name for t in tma_names) for c in gluon)


def test_wgmma_descriptor_registers_left_unwritten_on_a_path_fail_the_case():
    """sass_check's finding (ptxas 12.8 on the 3-stage prefill_gluon build) is a problem of every wgmma case."""
    finding = "0xaec0 HGMMA.64x128x16.F32.BF16 R88, R156, gdesc[UR8].tnspB, R88: UR10, UR11 not written on every path"
    r = cc.Result("c", "sm90", "k", True, regs=168, spills=0, instr="wgmma", expected="wgmma", unwritten_descriptors=[finding])
    assert r.problems == [f"ptxas left wgmma descriptor registers unwritten on a path (miscompiled): {finding}"]
    assert cc.Result("c", "sm90", "k", True, regs=168, spills=0, instr="wgmma", expected="wgmma").ok


def test_serialised_wgmmas_are_read_from_ptxas_and_fail_the_cases_that_need_them_async():
    log = ("ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma "
           "instructions reading accumulator registers of  a wgmma between start and end of the pipeline stage in the function 'k'")
    assert cc.wgmma_serialized(log) and not cc.wgmma_serialized("ptxas info    : Used 168 registers, used 4 barriers")
    r = cc.Result("c", "sm90", "k", True, regs=168, spills=0, instr="wgmma", expected="wgmma", wgmma_serialized=True)
    assert r.ok and "serialised" in cc.format_row(r)  # recorded, not a problem where the case does not need them async
    r.needs_async = True
    assert r.problems == ["ptxas serialised the wgmmas (C7514), expected them asynchronous"]
    overlapped = [c for c in cc.CASES if c.wgmma_async]
    assert overlapped and all("fp8_block gluon overlap" in c.name or "mla_decode bf16 gluon" in c.name or "mla_decode fp8 gluon keys_as_m" in c.name
                              or "prefill gluon" in c.name and "a program a tile" not in c.name for c in overlapped)  # fmt: skip
    assert all(c.wgmma_async for c in cc.CASES if "mla_decode bf16 gluon" in c.name)
    assert {c.wgmma_async for c in cc.sweep_cases("fp8_gluon_large")} == {True, False}
    assert all(c.wgmma_async for c in cc.sweep_cases("mla_gluon_bf16"))
    assert [c.wgmma_async for c in cc.sweep_cases("mla_gluon_fp8")] == [False, False, True, True]  # (the keys-as-M candidate's)


def test_instruction_class():
    assert cc.instruction_class("tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale [x]") == "tcgen05.mma.block_scale"
    assert cc.instruction_class("tcgen05.mma.cta_group::1.kind::f16 [x]") == "tcgen05.mma"
    assert cc.instruction_class("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16") == "wgmma"
    assert cc.instruction_class("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == "mma.sync"
    assert cc.instruction_class("ld.global.v4.b32") == "none"
