"""An op family, its conformance cases and a backend, added from outside the tree: the package in
tests/fixtures/oot_extension (op `softcap`, backend `oot_ext`, a Triton softcap on cuda), installed
for real, is seen by the CLI and the Python API, and the core names none of it. Broken op and case
packages (tests/fixtures/oot_bad_ops) are reported and take nothing else down."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch

from deepinfer import discovery
from deepinfer.registry import OPS, OpSpec, Registry, RegistryError, ResolveContext, all_ops, load_op_packages

from cli_helpers import run_cli
from waits import HANG_S

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def ext_env(oot_extension_env) -> dict[str, str]:
    return oot_extension_env


# ------------------------------------------------------------------------------------- the CLI


def test_backends_lists_the_new_op_and_every_backends_coverage_of_it(ext_env):
    result = run_cli("backends", "--json", env=ext_env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["plugin_failures"] == []
    backends = {b["name"]: b for b in report["backends"]}
    assert backends["oot_ext"]["available"] and backends["oot_ext"]["plugin"] == "oot_ext"
    assert backends["oot_ext"]["coverage"]["softcap"] == ["planted bug: hard clip", "torch, in place in float32"]
    assert backends["reference"]["coverage"]["softcap"] == ["pure torch", "pure torch, exact sums (batch-invariant)"]  # the reference serves every declared op
    assert backends["cuda"]["coverage"]["softcap"] == ["Triton (deepinfer-oot-extension)"]  # a kernel on a backend it does not own
    core = set(all_ops())  # this process does not see the extension
    assert all(backends["oot_ext"]["coverage"][op] == ["reference (oot_ext)"] for op in core)
    assert [o["name"] for o in backends["oot_ext"]["options"]] == ["softcap_kernel"]

    text = run_cli("backends", env=ext_env).stdout
    total = len(core) + 1
    assert f"oot_ext: {total}/{total} ops covered" in text and f"reference: {total}/{total} ops covered" in text
    assert "softcap_kernel: tanh | hard_clip (default: tanh)" in text


def test_conformance_runs_the_new_cases_on_the_new_backend_and_every_core_case(ext_env, tmp_path):
    report = tmp_path / "report.json"
    result = run_cli("conformance", "--backend", "oot_ext", "--quiet", "--json", str(report), env=ext_env)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(report.read_text())
    softcap = [r for r in rows if r["op"] == "softcap"]
    assert len(softcap) == 6 and {r["dtype"] for r in softcap} == {"float32", "bfloat16"}
    assert all(r["status"] == "pass" for r in rows)
    assert {r["op"] for r in rows} == set(all_ops()) | {"softcap"}


def test_the_planted_wrong_kernel_fails_the_new_cases(ext_env, tmp_path):
    report = tmp_path / "report.json"
    result = run_cli(
        "conformance", "--backend", "oot_ext", "--backend-option", "softcap_kernel=hard_clip", "--op", "softcap", "--op", "silu_and_mul",
        "--json", str(report), env=ext_env,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    rows = json.loads(report.read_text())
    failed = {(r["name"], r["dtype"]) for r in rows if r["status"] == "FAIL"}
    assert {("t5_v129_saturating", "float32"), ("t5_v129_saturating", "bfloat16"), ("t1_v7_below_cap", "float32")} <= failed
    assert all(r["op"] == "softcap" for r in rows if r["status"] != "pass")
    assert any(r["op"] == "silu_and_mul" and r["status"] == "pass" for r in rows)


def test_the_kernel_added_to_an_existing_backend_passes_under_the_interpreter(ext_env):
    result = run_cli("conformance", "--backend", "cuda", "--interpret", "--op", "softcap", env=ext_env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "6 pass" in result.stdout.splitlines()[-1]


def test_the_packaged_golden_set_ignores_installed_case_packages(ext_env):
    """`generate` writes and checks the core cases only: out-of-tree goldens are computed per run."""
    proc = subprocess.run([sys.executable, "-m", "deepinfer_conformance.generate", "--check"], env=ext_env, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 differences" in proc.stdout


# ------------------------------------------------------------------------------- the Python API

API = """
import json, torch
from deepinfer.plugins import load_plugins
from deepinfer.registry import Registry, ResolveContext, all_ops
from deepinfer.runtime import open_runtime

spec = all_ops()["softcap"]
x = torch.randn(3, 50, dtype=torch.float32) * 40
x0 = x.clone()
want = spec.reference(x, cap=30.0)
plugins = load_plugins()
registry = plugins.registry("oot_ext")
table = registry.resolve(ResolveContext("oot_ext", dtype=torch.float32))
ext = open_runtime("oot_ext", dtype=torch.float32)
wrong = open_runtime("oot_ext", dtype=torch.float32, options={"softcap_kernel": "hard_clip"})
ref = open_runtime("reference", dtype=torch.float32)
cuda = open_runtime("cuda", dtype=torch.float32, interpret=True)
print(json.dumps({
    "family": spec.family, "out_of_tree": spec.out_of_tree, "declared_in": spec.declared_in,
    "bf16_rtol": spec.tolerance(torch.bfloat16).rtol, "compare": dict(spec.compare),
    "registry_note": table.registration("softcap").note,
    "runtime_note": ext.ops.registration("softcap").note, "runtime_ok": torch.allclose(ext.ops.softcap(x, cap=30.0), want),
    "wrong_note": wrong.ops.registration("softcap").note, "wrong_ok": torch.allclose(wrong.ops.softcap(x, cap=30.0), want),
    "reference_is_the_reference": ref.ops.softcap is spec.reference,
    "cuda_note": cuda.ops.registration("softcap").note, "cuda_ok": torch.allclose(cuda.ops.softcap(x, cap=30.0), want, rtol=1.3e-6, atol=1e-6),
    "input_unchanged": torch.equal(x, x0),
}))
"""


def test_registry_and_open_runtime_resolve_the_new_op(ext_env):
    proc = subprocess.run([sys.executable, "-c", API], env=ext_env, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["family"] == "logits" and got["out_of_tree"] and got["declared_in"] == "deepinfer_oot_ext.ops"
    assert got["bf16_rtol"] == 8e-3 and got["compare"] == {"out": "allclose"}
    assert got["registry_note"] == got["runtime_note"] == "torch, in place in float32" and got["runtime_ok"]
    assert got["wrong_note"] == "planted bug: hard clip" and not got["wrong_ok"]
    assert got["reference_is_the_reference"]
    assert got["cuda_note"] == "Triton (deepinfer-oot-extension)" and got["cuda_ok"]
    assert got["input_unchanged"]  # no kernel wrote into x


def _logit_cap(x: torch.Tensor, *, cap: float) -> torch.Tensor:
    """An out-of-tree op for the tests below (declared in this module, not in deepinfer.ops)."""
    return cap * torch.tanh(x / cap)


def test_a_backend_without_a_kernel_for_an_out_of_tree_op_still_opens():
    """The core never calls an op package's ops: a backend that lacks one resolves, and calling the
    op is the one-line missing-kernel error (the reference with the fallback allowed)."""
    spec = OpSpec(name="logit_cap", family="test", reference=_logit_cap, outputs=("out",), compare={"out": "allclose"})
    assert spec.out_of_tree and not all_ops()["rms_norm"].out_of_tree
    reg = Registry({**all_ops(), "logit_cap": spec})
    for name, core in all_ops().items():
        reg.register_kernel("b", name, core.reference)
    table = reg.resolve(ResolveContext("b"))
    assert "logit_cap" not in table and "rms_norm" in table
    with pytest.raises(RegistryError) as err:
        table.logit_cap(torch.ones(2), cap=1.0)
    assert "'b'" in str(err.value) and "'logit_cap'" in str(err.value) and __name__ in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(AttributeError):
        table.no_such_op  # noqa: B018
    fallback = reg.resolve(ResolveContext("b"), allow_fallback=True)
    assert fallback.logit_cap is _logit_cap and fallback.fallbacks == ("logit_cap",)
    with pytest.raises(RegistryError, match="no kernel for op 'logit_cap'"):
        reg.resolve(ResolveContext("b"), only=["logit_cap"])  # asked for by name: required


# ------------------------------------------------------------------------- broken packages


def test_broken_and_clashing_op_packages_are_reported_and_the_others_still_load(oot_extension_and_bad_ops_env):
    env = oot_extension_and_bad_ops_env
    result = run_cli("backends", env=env)
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.split())  # unwrapped
    assert "plugin broken = deepinfer_oot_bad_ops.broken (op package) failed to load: ImportError:" in out and "imaginary_math_lib" in out
    assert (
        "plugin clash = deepinfer_oot_bad_ops.clash (op package) failed to load: ValueError: "
        "op 'rms_norm' is declared twice: in deepinfer.ops.norm and in deepinfer_oot_bad_ops.clash" in out
    )
    total = len(all_ops()) + 1  # softcap loaded; nothing of the clashing package (not even its first op)
    assert f"reference: {total}/{total} ops covered" in out and "softcap" in out and "bad_ops_square" not in out
    assert result.stderr.count("deepinfer_oot_bad_ops.clash (op package) failed to load") == 1  # logged once

    report = run_cli("backends", "--json", env=env)
    failures = {f["entry_point"]: f["error"] for f in json.loads(report.stdout)["plugin_failures"]}
    assert set(failures) == {"broken = deepinfer_oot_bad_ops.broken (op package)", "clash = deepinfer_oot_bad_ops.clash (op package)"}


def test_a_broken_case_package_is_an_error_row_and_the_other_cases_run(oot_extension_and_bad_ops_env, tmp_path):
    report = tmp_path / "report.json"
    result = run_cli("conformance", "--backend", "reference", "--op", "softcap", "--json", str(report), env=oot_extension_and_bad_ops_env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    rows = json.loads(report.read_text())
    errors = [r for r in rows if r["status"] == "error"]
    assert len(errors) == 1 and errors[0]["case"] == "orphan_cases = deepinfer_oot_bad_ops.orphan_cases (conformance cases)"
    assert "undeclared op(s) bad_ops_square" in errors[0]["detail"]
    assert sum(r["op"] == "softcap" and r["status"] == "pass" for r in rows) == 6


@pytest.fixture
def scratch_ops():
    """OPS as it was, after the test (the tests below declare ops in this process)."""
    saved = dict(OPS)
    yield
    OPS.clear()
    OPS.update(saved)


def test_an_op_package_that_fails_halfway_declares_nothing(tmp_path, monkeypatch, scratch_ops):
    all_ops()
    header = "import torch\nfrom deepinfer.registry import op\n"
    (tmp_path / "zz_good_ops.py").write_text(header + '@op(family="t", outputs=("out",))\ndef zz_double(x):\n    """2x."""\n    return 2 * x\n')
    (tmp_path / "zz_halfway_ops.py").write_text(
        header + '@op(family="t", outputs=("out",))\ndef zz_first(x):\n    """x."""\n    return x\n\n'
        '@op(family="t", outputs=("out",))\ndef silu_and_mul(x):\n    """clash."""\n    return x\n'
    )  # fmt: skip
    (tmp_path / "zz_exiting_ops.py").write_text("raise SystemExit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = [EntryPoint(name=n, value=f"zz_{n}_ops", group="deepinfer.ops") for n in ("exiting", "good", "halfway")]
    failures = load_op_packages(eps)
    assert [f.entry_point for f in failures] == ["exiting = zz_exiting_ops (op package)", "halfway = zz_halfway_ops (op package)"]
    assert failures[0].error == "SystemExit: 3"
    assert "op 'silu_and_mul' is declared twice: in deepinfer.ops.activation and in zz_halfway_ops" in failures[1].error
    assert "zz_double" in OPS and OPS["zz_double"].out_of_tree and "zz_first" not in OPS
    assert OPS["silu_and_mul"].declared_in == "deepinfer.ops.activation"


def test_out_of_tree_case_ids_must_be_new(tmp_path, monkeypatch):
    from deepinfer_conformance.out_of_tree import module_cases

    (tmp_path / "zz_reused_cases.py").write_text(
        "import torch\nfrom deepinfer_conformance.cases import Case\n"
        "CASES = [Case('rms_norm', 't1_d7168', torch.float32, lambda gen, dtype: {})]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = EntryPoint(name="reused", value="zz_reused_cases", group="deepinfer.conformance_cases")
    with pytest.raises(ValueError, match=r"case ids already taken: rms_norm\.t1_d7168\.float32"):
        module_cases(ep, taken={"rms_norm.t1_d7168.float32"})


def test_entry_points_of_a_group_are_in_name_order_each_name_once(monkeypatch):
    seen = [EntryPoint("b", "pkg_b", "g"), EntryPoint("a", "pkg_a", "g"), EntryPoint("b", "pkg_b", "g")]
    monkeypatch.setattr(discovery, "entry_points", lambda group: seen if group == "g" else [])
    assert [ep.name for ep in discovery.entry_points_of("g")] == ["a", "b"]


# ----------------------------------------------------------------------- the core names none of it


def test_nothing_in_the_core_names_the_extension():
    assert "softcap" not in all_ops()  # without the package installed, the op does not exist
    sources = [*ROOT.glob("deepinfer/**/*.py"), *ROOT.glob("conformance/**/*.py"), *ROOT.glob("backends/**/*.py"), ROOT / "pyproject.toml", ROOT / "setup.py"]
    for path in sources:
        text = path.read_text(encoding="utf-8")
        for name in ("softcap", "oot_ext", "deepinfer_oot"):
            assert name not in text, f"{path.relative_to(ROOT)} names {name!r}: the extension must need no core edit"
