"""The Ascend backend's kernels on a CPU, as CI checks them: the Triton interpreter, simulated chips.

- every golden case passes with the core counts of a 910B (A2) and of a 950;
- the cuda and ascend kernels agree with each other: sampled tokens and gate ids identical;
- so do both backends' batch-invariant kernels (deterministic mode), every case passing: the cases of
  the ops whose invariant kernel is one of its own on either backend (the others' invariant kernel is
  the default one, which the first run checks);
- the tiny embedded model generates the same greedy tokens through the ascend kernels as through
  the reference backend.

The three conformance runs are separate processes started together when the module's first test
asks for them, so they share the machine's cores with each other and with the in-process
generation test (the interpreter keeps one core busy per process).
"""

import json
import os
import subprocess
import sys

import pytest

from waits import HANG_S


def _env(chip: str) -> dict[str, str]:
    return dict(os.environ, TRITON_INTERPRET="1", DEEPINFER_ASCEND_SIM_CHIP=chip)


@pytest.fixture(scope="module")
def conformance_runs(tmp_path_factory):
    """`deepinfer conformance` of cuda vs ascend (910B), of ascend alone (950), and of cuda vs ascend
    in deterministic mode (their batch-invariant kernels), all running."""
    folder = tmp_path_factory.mktemp("ascend_conformance")
    runs = {}
    own = [a for op in _ops_with_own_invariant_kernels() for a in ("--op", op)]
    for name, chip, backends, extra in (("cross", "910B", ("cuda", "ascend"), []), ("a950", "950", ("ascend",), []),
                                        ("deterministic", "910B", ("cuda", "ascend"), ["--deterministic", *own])):  # fmt: skip
        report = folder / f"{name}.json"
        args = [a for b in backends for a in ("--backend", b)]
        command = [sys.executable, "-m", "deepinfer", "conformance", *args, "--interpret", "--quiet", *extra, "--json", str(report)]
        runs[name] = (subprocess.Popen(command, env=_env(chip), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), report)
    yield runs
    for proc, _ in runs.values():
        if proc.poll() is None:
            proc.kill()


def _ops_with_own_invariant_kernels() -> list[str]:
    """Ops for which deterministic mode resolves another kernel than the default, on cuda or ascend."""
    import torch

    from deepinfer.registry import all_ops
    from deepinfer.runtime import open_runtime

    own = set()
    for backend, options in (("cuda", None), ("ascend", {"sim_chip": "910B"})):
        for dtype in (torch.float32, torch.bfloat16):
            invariant, default = (open_runtime(backend, interpret=True, deterministic=d, dtype=dtype, options=options).ops for d in (True, False))
            for name, spec in all_ops().items():
                formats = spec.formats or (None,)
                if name in invariant and name in default and any(invariant.registration(name, f) != default.registration(name, f) for f in formats):
                    own.add(name)
    assert {"mla_decode", "linear", "grouped_gemm"} <= own, sorted(own)
    return sorted(own)


def _finished(run, every_op: bool = True) -> tuple[str, list[dict]]:
    """The run's output and its rows; both backends have kernels for every op, the model-specific
    ones (DeepSeek-V4's) included, so no row is "no kernel"."""
    from deepinfer.registry import all_ops

    proc, report = run
    stdout, stderr = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-2000:]
    rows = json.loads(report.read_text())
    model_specific = {name for name, spec in all_ops().items() if spec.model_types}
    unserved = [r for r in rows if r["status"] == "no kernel"]
    assert not unserved, unserved[:3]
    assert not every_op or model_specific <= {r["op"] for r in rows}, "both backends serve every model-specific op (DeepSeek-V4's)"
    return stdout, rows


@pytest.mark.parametrize("chip", ["910B"])
def test_tiny_model_greedy_tokens_through_ascend_kernels_equal_the_reference(chip, monkeypatch, conformance_runs, tmp_path):
    """The tiny model with a 512-token vocabulary (with its 129k-wide lm_head and sampling this took
    nearly 3 minutes of CI in the interpreter), two token-id prompts, a prefill and a decode step."""
    monkeypatch.setenv("DEEPINFER_ASCEND_SIM_CHIP", chip)
    from deepinfer import LLM, SamplingParams

    from engine.determinism import SMALL_VOCAB, neighbour_prompts, write_small_checkpoint

    model = str(write_small_checkpoint(tmp_path / "tiny-v3-small-vocab", num_hidden_layers=2))  # a dense layer and a MoE layer
    prompts = neighbour_prompts(2, SMALL_VOCAB, seed=3, lengths=(5, 12))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)  # a prefill step and a decode step
    ascend = LLM(model=model, backend="ascend", interpret=True, announce=False)
    assert ascend.backend == "ascend" and ascend.engine.block_size == 128
    reference = LLM(model=model, backend="reference", announce=False)
    got = [o.outputs[0].token_ids for o in ascend.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    assert got == want and all(len(t) == 2 for t in got)


def test_cuda_and_ascend_kernels_pass_every_case_and_agree(conformance_runs):
    stdout, rows = _finished(conformance_runs["cross"])
    ascend = [r for r in rows if r["backend"] == "ascend"]
    assert ascend and all(r["status"] == "pass" for r in rows)
    assert all(r["versus"] == "cuda" and r["cross_ok"] for r in ascend)
    # Sampled tokens and gate ids compare exactly (cross_ok above); tokens differ in no element.
    sampled = [r for r in ascend if r["op"] == "sample"]
    assert sampled and all(r["cross_score"] == 0 for r in sampled)
    assert any(r["op"] == "gate" for r in ascend)
    assert "vs" in stdout.splitlines()[-1] and "pass" in stdout.splitlines()[-1]


def test_ascend_kernels_pass_every_case_with_950_core_counts(conformance_runs):
    _, rows = _finished(conformance_runs["a950"])
    assert len(rows) >= 89 and all(r["status"] == "pass" for r in rows)


def test_the_batch_invariant_kernels_of_both_backends_pass_every_case_and_agree(conformance_runs):
    stdout, rows = _finished(conformance_runs["deterministic"], every_op=False)
    assert rows and all(r["status"] == "pass" for r in rows), [r for r in rows if r["status"] != "pass"][:3]
    assert all(r["cross_ok"] for r in rows if r["backend"] == "ascend")
    assert "deterministic" in stdout.splitlines()[-1]
