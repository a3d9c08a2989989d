"""A kernel must leave its inputs as it found them, except the argument its op declares `in_place`:
the conformance worker compares every input tensor after the call with a copy taken before, and a
changed input is a failing row that names the argument (an out-of-tree kernel that overwrote its
float32 input used to pass, because its outputs were right)."""

from __future__ import annotations

import pytest

import deepinfer.plugins as plugins_mod
from deepinfer.plugins import Availability, BackendSpec, Plugins, hookimpl
from deepinfer.registry import OPS, all_ops
from deepinfer_conformance import runner, worker

NAME = "overwrites_x"


def rms_norm_into_x(x, weight, *, eps=1e-6, residual=None):
    """The reference's answer, written over x and returned: right outputs, a clobbered input."""
    out, residual_out = OPS["rms_norm"].reference(x, weight, eps=eps, residual=residual)
    return x.copy_(out), residual_out


class OverwritingBackend:
    """Every op by its reference (kv_cache_write and apply_token_bitmask write their declared
    in_place argument, as they should), except rms_norm, which overwrites x."""

    @hookimpl
    def deepinfer_add_backends(self, register):
        register(BackendSpec(name=NAME, device_type="cpu", probe=lambda interpret=False: Availability(True, "here")))

    @hookimpl
    def deepinfer_register_kernels(self, backend, registry):
        if backend.name != NAME:
            return
        for name, spec in all_ops().items():
            registry.register_kernel(NAME, name, rms_norm_into_x if name == "rms_norm" else spec.reference, note=name)


@pytest.fixture
def overwriting(monkeypatch):
    plugins = Plugins(load_entry_points=False, extra_plugins=(OverwritingBackend(),))
    monkeypatch.setattr(plugins_mod, "load_plugins", lambda: plugins)
    monkeypatch.setattr(worker, "load_plugins", lambda: plugins)
    # the runner's worker, in this process (a subprocess would not see this plugin)
    monkeypatch.setattr(runner, "run_workers", lambda backends, out_dir, golden_dirs, interpret, ops, shares, deterministic=False:
                        {b: worker.run_backend(b, out_dir, golden_dirs, interpret, ops, shares[b], deterministic) for b in backends})


def test_a_kernel_that_overwrites_its_input_fails_naming_it(overwriting):
    rows = runner.run([NAME], ops=["rms_norm", "silu_and_mul", "kv_cache_write", "apply_token_bitmask"])
    norm = [r for r in rows if r.op == "rms_norm"]
    assert norm and all(r.status == "FAIL" for r in norm)
    assert all("changed its input 'x'" in r.detail and "'weight'" not in r.detail for r in norm), [r.detail for r in norm]
    others = [r for r in rows if r.op != "rms_norm"]
    assert {r.op for r in others} == {"silu_and_mul", "kv_cache_write", "apply_token_bitmask"}
    assert all(r.status == "pass" for r in others), [(r.op, r.status, r.detail) for r in others if r.status != "pass"]
    summary, ok = runner.summary(rows)
    assert not ok and f"{len(norm)} FAIL" in summary


def test_the_worker_reports_which_inputs_changed(overwriting, tmp_path):
    report = worker.run_backend(NAME, tmp_path, ops_filter=["rms_norm"])
    statuses = list(report["cases"].values())
    assert statuses and all(s["status"] == "FAIL" and s["changed_inputs"] == ["x"] for s in statuses), statuses
    assert all(s["error"].startswith("the kernel changed its input 'x'") for s in statuses)
