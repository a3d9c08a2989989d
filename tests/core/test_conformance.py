"""The conformance suite: golden set determinism, the runner's measures, a planted wrong kernel."""

import json

import pytest
import torch

from deepinfer.registry import all_ops
from deepinfer_conformance import generate
from deepinfer_conformance.cases import all_cases
from deepinfer_conformance.golden_io import GOLDEN_DIR, CaseRecord, GoldenTensors, read_cases, split_kwargs
from deepinfer_conformance.runner import measure

from cli_helpers import run_cli, run_main


def _record(compare="allclose", rtol=1e-2, atol=1e-3, reduction=10):
    return CaseRecord("op.c.float32", "op", "c", "float32", 0, {}, [], ["out"], [], {"out": compare}, rtol, atol, reduction)


def test_stored_golden_set_is_what_the_cases_generate():
    files, records = generate.build(all_cases())
    assert generate.check(GOLDEN_DIR, files, records) == []


def test_every_op_has_cases_covering_the_edges():
    cases = read_cases()
    ops = all_ops()
    assert {c.op for c in cases} == set(ops), "every op needs golden cases"
    for op in ops:
        assert sum(c.op == op for c in cases) >= 2, op


def test_tuple_parameters_are_read_back_as_the_tuples_the_case_gave(tmp_path):
    """decode_plan's ratios and compressor kinds are (nested) tuples: the manifest stores them as JSON lists, and the
    recorded case gives the kernel the tuples back (a list is no plain parameter)."""
    case = next(c for c in all_cases() if c.op == "decode_plan" and c.inputs()["rings"])
    files, records = generate.build([case])
    generate.write(tmp_path, files, records)
    (stored,) = read_cases(tmp_path)
    given = case.inputs()
    inputs = GoldenTensors(tmp_path).inputs(stored)
    for name in ("ratios", "rings"):
        assert inputs[name] == given[name] and type(inputs[name]) is tuple and all(type(v) is type(w) for v, w in zip(inputs[name], given[name]))
    with pytest.raises(TypeError, match="only tensors, plain values, tuples of them and dtypes"):
        split_kwargs({"rings": [(4, True, 8)]})


def test_a_call_that_chooses_its_output_dtype_is_stored_and_held_to_it(tmp_path):
    """linear's out_dtype: the parameter is stored (JSON has no dtype) and read back as the dtype, the outputs are stored
    in it, and the case is held to its tolerance, not to the case dtype's."""
    from deepinfer_conformance.cases import Case
    from deepinfer_conformance.golden_io import GoldenTensors

    def router(gen, dtype):
        return {"x": torch.randn(2, 8, generator=gen).to(dtype), "weight": torch.randn(3, 8, generator=gen), "out_dtype": torch.float32}

    case = Case("linear", "router", torch.bfloat16, router)
    files, records = generate.build([case])
    generate.write(tmp_path, files, records)
    (stored,) = read_cases(tmp_path)
    assert stored.params == {"out_dtype": {"dtype": "float32"}}
    assert (stored.rtol, stored.atol) == (1.3e-6, 1e-6)  # float32's, not bfloat16's
    golden = GoldenTensors(tmp_path)
    assert golden.inputs(stored)["out_dtype"] is torch.float32
    assert golden.outputs(stored)["out"].dtype == torch.float32


def test_allclose_measure_scales_atol_by_reduction_length():
    case = _record(rtol=0.0, atol=1e-3, reduction=10)  # allowed |err| = 1e-2
    ref = torch.zeros(4)
    assert measure("allclose", ref + 0.009, ref, case).ok
    assert not measure("allclose", ref + 0.011, ref, case).ok


def test_allclose_measure_rejects_nan_shape_and_inf_mismatches():
    case = _record()
    ref = torch.tensor([1.0, float("-inf"), 3.0])
    assert measure("allclose", ref.clone(), ref, case).ok
    assert not measure("allclose", torch.tensor([1.0, 0.0, 3.0]), ref, case).ok
    assert not measure("allclose", torch.tensor([float("nan"), float("-inf"), 3.0]), ref, case).ok
    assert not measure("allclose", ref[:2], ref, case).ok


def test_exact_measure_counts_differences():
    case = _record("exact")
    ref = torch.tensor([1, 2, 3])
    m = measure("exact", torch.tensor([1, 5, 3]), ref, case)
    assert not m.ok and m.score == 1 and "1/3" in m.detail
    assert measure("exact", ref.clone(), ref, case).ok
    assert not measure("exact", ref.to(torch.int32), ref, case).ok


def test_reference_backend_passes_every_case(tmp_path):
    report = tmp_path / "report.json"
    result = run_cli("conformance", "--backend", "reference", "--quiet", "--json", str(report))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(report.read_text())
    assert len(rows) == len(read_cases())
    assert all(r["status"] == "pass" for r in rows)
    assert "pass" in result.stdout.splitlines()[-1]


def test_a_planted_wrong_kernel_fails_and_the_backends_disagree(oot_env, tmp_path):
    report = tmp_path / "report.json"
    result = run_cli(
        "conformance", "--backend", "oot", "--backend", "oot_wrong", "--op", "rms_norm", "--op", "silu_and_mul", "--json", str(report), env=oot_env
    )
    assert result.returncode == 1, result.stdout + result.stderr
    rows = json.loads(report.read_text())
    wrong_norm = [r for r in rows if r["backend"] == "oot_wrong" and r["op"] == "rms_norm"]
    assert wrong_norm and all(r["status"] == "FAIL" and r["cross_ok"] is False for r in wrong_norm)
    others = [r for r in rows if not (r["backend"] == "oot_wrong" and r["op"] == "rms_norm")]
    assert others and all(r["status"] == "pass" for r in others)
    assert all(r["cross_ok"] for r in others if r["backend"] == "oot_wrong")
    assert "FAIL" in result.stdout and "cross-backend disagreements" in result.stdout


def test_conformance_usage_errors_exit_2_with_one_line():
    for args in (["conformance"], ["conformance", "--backend", "nope"], ["conformance", "--backend", "reference", "--op", "nope"]):
        result = run_main(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
