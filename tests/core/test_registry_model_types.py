"""Ops only some model types call (`OpSpec.model_types`: DeepSeek-V4's nine, six of them V4.1's too, and V4.1's eight). A backend without
kernels for them (cuda and ascend today) still serves DeepSeek-V2/V3 exactly as before; a V4 model
there is a one-line error naming the first missing op and the fix, or, with the fallback allowed
explicitly, the reference serves those ops and each is logged once. The conformance suite shows
their cases as "no kernel" rows that name the ops and do not fail the run."""

from __future__ import annotations

import logging

import pytest
import torch

from deepinfer.backends import reference
from deepinfer.model.facts import checkpoint_facts
from deepinfer.plugins import Plugins, hookimpl, load_plugins
from deepinfer.registry import OPS, ModelFacts, RegistryError, ResolveContext, all_ops
from deepinfer.runtime import open_runtime
from deepinfer_conformance import runner, worker
from deepinfer_conformance.golden_io import read_cases

from fake_backend import NAME, FakeBackend

V4 = ("clamped_silu_and_mul", "compress_kv", "decode_plan", "hc_head", "hc_post", "hc_pre", "head_norm_rope", "indexer_topk", "norm_rope_kv_write",
      "sparse_attention")
V3 = ModelFacts(model_type="deepseek_v3", num_experts=256, top_k=8, score_func="sigmoid", n_group=8, topk_group=4, renormalize=True, correction_bias=True)
V4_FACTS = ModelFacts(model_type="deepseek_v4", num_experts=256, top_k=6, score_func="sqrtsoftplus", n_group=1, topk_group=1, num_heads=64, sliding_window=128)


@pytest.fixture
def without_v4():
    """The fake backend (every op by its reference) lacking kernels for DeepSeek-V4's ops, as cuda
    and ascend do, beside the reference backend."""
    return Plugins(load_entry_points=False, extra_plugins=(FakeBackend(without=V4), reference))


def _resolve(plugins: Plugins, facts: ModelFacts, **kwargs):
    return plugins.registry(NAME).resolve(ResolveContext(NAME, dtype=torch.bfloat16, model=facts), **kwargs)


V41_ONLY = ("cache_pack", "cache_round", "cache_unpack", "candidate_blocks", "engram_gate_add", "engram_hash", "hc_pre_delayed", "indexer_topk_in_blocks")
SHARED_WITH_V41 = ("clamped_silu_and_mul", "compress_kv", "decode_plan", "hc_post", "indexer_topk", "sparse_attention")


def test_deepseek_v4_ops_are_declared_for_deepseek_v4_and_v41_only():
    ops = all_ops()
    assert {name for name, spec in ops.items() if spec.model_types} == set(V4) | set(V41_ONLY)
    assert all(ops[name].model_types == (("deepseek_v4", "deepseek_v41") if name in SHARED_WITH_V41 else ("deepseek_v4",)) for name in V4)
    assert all(ops[name].model_types == ("deepseek_v41",) for name in V41_ONLY)
    assert ops["sparse_attention"].needed_by(V4_FACTS) and not ops["sparse_attention"].needed_by(V3)
    assert not ops["sparse_attention"].needed_by(ModelFacts())  # unknown model: not called
    assert ops["rms_norm"].needed_by(V3) and ops["rms_norm"].needed_by(V4_FACTS) and ops["rms_norm"].needed_by(ModelFacts())


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2", None])
@pytest.mark.parametrize("allow_fallback", [False, True])
def test_a_backend_without_v4_kernels_serves_v2_v3_as_before(without_v4, model_type, allow_fallback, caplog):
    with caplog.at_level(logging.WARNING, logger="deepinfer.registry"):
        table = _resolve(without_v4, ModelFacts(model_type=model_type), allow_fallback=allow_fallback)
    assert table.fallbacks == () and caplog.records == []  # nothing falls back, nothing is logged, fallback allowed or not
    assert all(name in table for name in all_ops() if name not in V4)
    assert table.registration("rms_norm").note == "plain"  # the backend's own kernel, chosen by its option, as before
    for name in V4:
        assert name not in table
        with pytest.raises(RegistryError) as err:
            getattr(table, name)
        message = str(err.value)
        assert f"op {name!r}" in message and f"{NAME!r}" in message and "deepseek_v4" in message and "--allow-fallback" in message
        assert "\n" not in message


def test_a_v4_model_on_a_backend_without_v4_kernels_names_the_first_missing_op_and_the_fix(without_v4):
    first = next(name for name in all_ops() if name in V4)  # the registry resolves in name order
    with pytest.raises(RegistryError) as err:
        _resolve(without_v4, V4_FACTS)
    message = str(err.value)
    assert f"no kernel for op {first!r}" in message and f"{NAME!r}" in message and "--allow-fallback" in message and "\n" not in message
    with pytest.raises(RegistryError, match=f"no kernel for op {first!r}"):
        open_runtime(NAME, plugins=without_v4, model=V4_FACTS)


def test_a_v4_model_with_the_fallback_allowed_runs_v4_ops_on_the_reference_logged_once(without_v4, caplog):
    with caplog.at_level(logging.WARNING, logger="deepinfer.registry"):
        table = _resolve(without_v4, V4_FACTS, allow_fallback=True)
    assert sorted(table.fallbacks) == sorted(V4)
    for name in V4:
        assert getattr(table, name) is OPS[name].reference
        assert table.registration(name) is None
        assert sum(f"op {name} runs on the reference implementation" in r.getMessage() for r in caplog.records) == 1
    assert len(caplog.records) == len(V4)
    x = torch.randn(3, 16) * 20
    torch.testing.assert_close(table.clamped_silu_and_mul(x, limit=10.0), OPS["clamped_silu_and_mul"].reference(x, limit=10.0))
    assert table.rms_norm is not None and "rms_norm" not in table.fallbacks  # the backend's own kernels still serve the rest


@pytest.mark.parametrize(("alias", "model_type"), [("tiny-v3", "deepseek_v3"), ("tiny-v4", "deepseek_v4")])
def test_a_checkpoints_facts_carry_its_model_type(alias, model_type):
    """The engine resolves the ops with checkpoint_facts: the model type decides which ops it needs."""
    facts = checkpoint_facts(alias)
    assert facts.model_type == model_type
    assert all(spec.needed_by(facts) == (model_type in spec.model_types or not spec.model_types) for spec in all_ops().values())
    if model_type == "deepseek_v4":  # V4.1's own ops are not V4's
        assert not any(all_ops()[name].needed_by(facts) for name in V41_ONLY)


# ------------------------------------------------------------------------------ the real backends


@pytest.mark.parametrize("backend", ["cuda", "ascend"])
def test_cuda_and_ascend_under_the_interpreter_serve_v3_and_v4_without_a_fallback(backend, monkeypatch):
    """The kernels cuda and ascend register (as for the Triton interpreter): every V4 op has one, so
    a V3 model and a V4 model both resolve with no fallback; the V3 table leaves the V4 ops in (they
    have kernels) but never needs them."""
    monkeypatch.setenv("DEEPINFER_ASCEND_SIM_CHIP", "910B")
    registry = load_plugins().registry(backend, interpret=True)
    assert all(registry.candidates(backend, name) for name in V4), "every DeepSeek-V4 op has a kernel on this backend"
    v3 = registry.resolve(ResolveContext(backend, dtype=torch.bfloat16, model=V3))
    assert v3.fallbacks == ()
    v4 = registry.resolve(ResolveContext(backend, dtype=torch.bfloat16, model=V4_FACTS))
    assert v4.fallbacks == () and all(name in v4 for name in V4)


# -------------------------------------------------------------------------------- the conformance


@pytest.fixture
def worker_in_process(without_v4, monkeypatch):
    monkeypatch.setattr(worker, "load_plugins", lambda: without_v4)
    monkeypatch.setattr(runner, "run_workers", lambda backends, out_dir, golden_dirs, interpret, ops, shares, deterministic=False:
                        {b: worker.run_backend(b, out_dir, golden_dirs, interpret, ops, shares[b], deterministic) for b in backends})  # fmt: skip


def test_conformance_shows_no_kernel_rows_for_the_v4_ops_and_does_not_fail(worker_in_process):
    rows = runner.run([NAME], ops=["sparse_attention", "hc_post", "silu_and_mul"])
    unserved = [r for r in rows if r.op in V4]
    assert {r.op for r in unserved} == {"sparse_attention", "hc_post"}
    assert len(unserved) == sum(c.op in ("sparse_attention", "hc_post") for c in read_cases())
    assert all(r.status == "no kernel" and r.score is None for r in unserved)
    assert all(f"no {NAME} kernel for {r.op}" in r.detail and "--allow-fallback" in r.detail for r in unserved)
    assert all(r.status == "pass" for r in rows if r.op == "silu_and_mul")
    text, ok = runner.summary(rows)
    assert ok
    assert f"{len(unserved)} no kernel" in text and f"{NAME} has no kernel for hc_post, sparse_attention" in text and "--allow-fallback" in text
    assert "pass" in text


class Float32HcPost:
    """A kernel for hc_post in float32 only, added to the backend without V4 kernels."""

    @hookimpl
    def deepinfer_register_kernels(self, backend, registry):
        if backend.name == NAME:
            registry.register_kernel(NAME, "hc_post", OPS["hc_post"].reference, dtypes=[torch.float32], note="float32 only")


def test_a_missing_dtype_of_a_v4_op_that_has_a_kernel_still_fails(monkeypatch, tmp_path):
    """Only a backend with no kernel at all for a model-specific op gets "no kernel": one that has a
    kernel, but not for a case's dtype, is "missing" and fails, as for every other op."""
    plugins = Plugins(load_entry_points=False, extra_plugins=(FakeBackend(without=V4), Float32HcPost()))
    monkeypatch.setattr(worker, "load_plugins", lambda: plugins)
    report = worker.run_backend(NAME, tmp_path, ops_filter=["hc_post"])
    statuses = [(case_id.rsplit(".", 1)[1], s["status"]) for case_id, s in report["cases"].items()]
    assert {s for _, s in statuses} == {"ran", "missing"}
    assert all(s == ("ran" if dtype == "float32" else "missing") for dtype, s in statuses)
    missing = runner.Row("c", "hc_post", "c", "bfloat16", NAME, "missing", None, "no kernel")
    assert runner.summary([missing, runner.Row("d", "rms_norm", "d", "bfloat16", NAME, "pass", 0.1, "")])[1] is False
