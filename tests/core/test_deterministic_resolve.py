"""Deterministic mode in the registry and at the surfaces: only batch-invariant kernels resolve, an
op without one is a one-line error naming it (fallback or not), `deepinfer backends` marks the
invariant kernels, `deepinfer run --deterministic` generates, and the reference's exact sums are
exact and order-free."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from deepinfer.registry import OPS, Registry, RegistryError, ResolveContext, all_ops


def _registry(invariant_for: set[str]) -> Registry:
    """Backend "b": every core op by its reference, batch-invariant only for `invariant_for`."""
    reg = Registry()
    for name, spec in all_ops().items():
        reg.register_kernel("b", name, spec.reference, batch_invariant=name in invariant_for)
    return reg


def test_deterministic_mode_chooses_only_invariant_kernels():
    reg = _registry(set(all_ops()))
    fast = lambda x, weight, *, eps=1e-6, residual=None: (x, None)  # noqa: E731 - a default-mode-only kernel
    reg.register_kernel("b", "rms_norm", fast, priority=5)
    assert reg.resolve(ResolveContext("b")).kernel("rms_norm") is fast
    table = reg.resolve(ResolveContext("b", deterministic=True))
    assert table.kernel("rms_norm") is OPS["rms_norm"].reference
    assert table.deterministic and table.registration("rms_norm").batch_invariant


@pytest.mark.parametrize("allow_fallback", [False, True])
def test_an_op_without_an_invariant_kernel_is_one_line_naming_it(allow_fallback):
    reg = _registry(set(all_ops()) - {"mla_decode"})
    reg.resolve(ResolveContext("b"))  # the default mode is fine
    with pytest.raises(RegistryError) as err:
        reg.resolve(ResolveContext("b", deterministic=True), allow_fallback=allow_fallback)
    message = str(err.value)
    assert "batch-invariant" in message and "'mla_decode'" in message and "--deterministic" in message
    assert "\n" not in message


def test_every_reference_op_has_an_invariant_kernel_and_the_backends_listing_marks_them():
    from deepinfer.runtime import open_runtime

    runtime = open_runtime("reference", dtype=torch.float32, deterministic=True)
    assert runtime.ops.deterministic and not runtime.ops.fallbacks
    out = subprocess.run([sys.executable, "-m", "deepinfer", "backends", "--json"], capture_output=True, text=True, check=True)
    reference = next(b for b in json.loads(out.stdout)["backends"] if b["name"] == "reference")
    assert all(reference["batch_invariant"].values())
    assert any("(batch-invariant)" in note for note in reference["coverage"]["linear"])


def test_run_deterministic_generates(tmp_path):
    env_out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "deepinfer", "run", "--backend", "reference", "--deterministic", "--prompt", "Hello", "--max-tokens", "3",
           "--temperature", "0", "--no-progress", "--output", str(env_out)]
    import os

    run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "DEEPINFER_CACHE": str(tmp_path / "cache")})
    assert run.returncode == 0, run.stderr[-2000:]
    assert len(json.loads(env_out.read_text().splitlines()[0])["token_ids"]) == 3


def test_exact_sums_are_exact_and_order_free():
    from deepinfer.exact_order import ExactOrder

    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 300, generator=g) * torch.logspace(-8, 8, 300)  # a wide range of magnitudes
    w = torch.randn(50, 300, generator=g)
    exact = (x.double() @ w.double().T)  # float64 of float32 inputs: ~1e-16 relative, then rounded
    with ExactOrder():
        got = x @ w.T
        alone = x[5:6] @ w.T
        total = x.sum(dim=1)
        soft = torch.softmax(x[:, :8], dim=-1)
    assert torch.equal(got[5], alone[0])
    assert torch.allclose(got.double(), exact, rtol=1e-6, atol=0)
    assert torch.allclose(total.double(), x.double().sum(dim=1), rtol=1e-6, atol=0)
    assert torch.allclose(soft.sum(-1), torch.ones(37))
    with ExactOrder(), pytest.raises(NotImplementedError, match="exact-order"):
        torch.prod(x, dim=1)
