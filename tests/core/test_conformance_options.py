"""Backend options in the conformance suite: `deepinfer conformance --backend-option KEY=VALUE` reaches
each worker of a backend that declares the option, and each case is resolved with the ModelFacts its
call implies (so a kernel serving only some models is checked on the cases it would serve)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.options import BackendOptionError
from deepinfer.registry import ModelFacts
from deepinfer_conformance import runner, worker
from deepinfer_conformance.golden_io import GoldenTensors, read_cases

from cli_helpers import run_cli


def test_worker_resolves_with_the_backends_options(tmp_path, monkeypatch):
    from deepinfer_ascend import device

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(device, "_simulated", None)
    report = worker.run_backend("ascend", tmp_path, interpret=True, ops_filter=["silu_and_mul"], options={"sim_chip": "950"})
    assert report["options"] == {"npu_fast_paths": "off", "sim_chip": "950"} and device.current().chip == "950"
    assert {c["status"] for c in report["cases"].values()} == {"ran"}
    with pytest.raises(BackendOptionError, match="sim_chip='A9'"):
        worker.run_backend("ascend", tmp_path, interpret=True, ops_filter=["silu_and_mul"], options={"sim_chip": "A9"})


def test_options_go_to_the_backends_that_declare_them():
    assert runner.options_per_backend(["reference", "cuda"], {"ep_path": "nccl"}) == {"reference": {}, "cuda": {"ep_path": "nccl"}}
    with pytest.raises(BackendOptionError, match=r"no backend of this run has option 'ep_path' \(reference: none"):
        runner.options_per_backend(["reference"], {"ep_path": "nccl"})
    with pytest.raises(BackendOptionError, match="ep_path='fast' is not allowed"):
        runner.options_per_backend(["cuda"], {"ep_path": "fast"})


def test_conformance_with_an_option_no_backend_has_exits_2_with_one_line():
    result = run_cli("conformance", "--backend", "reference", "--backend-option", "npu_fast_paths=on")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "no backend of this run has option 'npu_fast_paths'" in lines[0], result.stderr


def test_each_case_stands_for_a_model():
    golden = GoldenTensors()
    cases = {c.op: c for c in read_cases()}
    gate = golden.inputs(cases["gate"])
    facts = worker.case_facts("gate", gate)
    assert facts.num_experts == gate["logits"].shape[-1] and facts.top_k == gate["top_k"]
    assert facts.correction_bias == (gate.get("correction_bias") is not None) and facts.score_func in ("softmax", "sigmoid", "sqrtsoftplus")
    mla = golden.inputs(cases["mla_decode"])
    facts = worker.case_facts("mla_decode", mla)
    assert (facts.kv_block_size, facts.kv_lora_rank, facts.num_heads) == (mla["kv_cache"].shape[1], mla["q_nope"].shape[-1], mla["q_nope"].shape[2])
    assert facts.sliding_window == (mla.get("sliding_window") or 0)
    assert worker.case_facts("rms_norm", {"x": torch.zeros(1, 2), "weight": torch.ones(2)}) == ModelFacts()
