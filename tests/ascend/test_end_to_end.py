"""The Ascend backend's kernels on a CPU, as CI checks them: the Triton interpreter, simulated chips.

- every golden case passes with the core counts of a 910B (A2) and of a 950;
- the cuda and ascend kernels agree with each other: sampled tokens and gate ids identical;
- the tiny embedded model generates the same greedy tokens through the ascend kernels as through
  the reference backend.
"""

import json
import os

import pytest

from cli_helpers import run_cli


def _env(chip: str) -> dict[str, str]:
    return dict(os.environ, TRITON_INTERPRET="1", DEEPINFER_ASCEND_SIM_CHIP=chip)


def test_cuda_and_ascend_kernels_pass_every_case_and_agree(tmp_path):
    report = tmp_path / "cross.json"
    result = run_cli("conformance", "--backend", "cuda", "--backend", "ascend", "--interpret", "--quiet", "--json", str(report), env=_env("910B"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    rows = json.loads(report.read_text())
    ascend = [r for r in rows if r["backend"] == "ascend"]
    assert ascend and all(r["status"] == "pass" for r in rows)
    assert all(r["versus"] == "cuda" and r["cross_ok"] for r in ascend)
    # Sampled tokens and gate ids compare exactly (cross_ok above); tokens differ in no element.
    sampled = [r for r in ascend if r["op"] == "sample"]
    assert sampled and all(r["cross_score"] == 0 for r in sampled)
    assert any(r["op"] == "gate" for r in ascend)
    assert "vs" in result.stdout.splitlines()[-1] and "pass" in result.stdout.splitlines()[-1]


def test_ascend_kernels_pass_every_case_with_950_core_counts(tmp_path):
    report = tmp_path / "a950.json"
    result = run_cli("conformance", "--backend", "ascend", "--interpret", "--quiet", "--json", str(report), env=_env("950"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    rows = json.loads(report.read_text())
    assert len(rows) >= 89 and all(r["status"] == "pass" for r in rows)


@pytest.mark.parametrize("chip", ["910B"])
def test_tiny_model_greedy_tokens_through_ascend_kernels_equal_the_reference(chip, monkeypatch):
    monkeypatch.setenv("DEEPINFER_ASCEND_SIM_CHIP", chip)
    from deepinfer import LLM, SamplingParams

    prompts = ["Hello, my name is", "The capital of France is"]
    params = SamplingParams(temperature=0.0, max_tokens=3)
    ascend = LLM(backend="ascend", interpret=True, announce=False)
    assert ascend.backend == "ascend" and ascend.engine.block_size == 128
    reference = LLM(backend="reference", announce=False)
    got = [o.outputs[0].token_ids for o in ascend.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    assert got == want and all(len(t) == 3 for t in got)
