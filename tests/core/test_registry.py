"""The op registry: declarations, signature checks, resolve-once, fallback, formats, predicates."""

import logging

import pytest
import torch

from deepinfer.registry import OPS, Registry, RegistryError, ResolveContext, all_ops


def test_every_op_of_the_issue_is_declared_with_a_reference():
    ops = all_ops()
    expected = {
        "mla_decode", "prefill", "kv_cache_write", "grouped_gemm", "linear", "gate", "dispatch", "combine",
        "sample", "apply_token_bitmask", "rms_norm", "rope", "silu_and_mul",
    }
    assert expected <= set(ops)
    for spec in ops.values():
        assert callable(spec.reference) and spec.doc, spec.name
        assert set(spec.compare) == set(spec.outputs)
        assert set(spec.compare.values()) <= {"allclose", "exact"}
    assert ops["sample"].compare["tokens"] == "exact"
    assert ops["gate"].compare["topk_ids"] == "exact"
    assert set(ops["linear"].formats) == {"dense", "fp8_block", "mxfp4", "mxfp8", "mxfp4_a8", "fp8_block32"}


def test_kernel_with_a_different_signature_is_refused():
    reg = Registry()

    def wrong_names(x, w, *, eps=1e-6, residual=None):
        return x, None

    def wrong_default(x, weight, *, eps=1e-5, residual=None):
        return x, None

    def positional_eps(x, weight, eps=1e-6, residual=None):
        return x, None

    for fn in (wrong_names, wrong_default, positional_eps):
        with pytest.raises(RegistryError, match="rms_norm"):
            reg.register_kernel("b", "rms_norm", fn)


def test_unknown_op_and_unknown_format_are_refused():
    reg = Registry()
    with pytest.raises(RegistryError, match="unknown op 'flash'"):
        reg.register_kernel("b", "flash", lambda x: x)
    with pytest.raises(RegistryError, match="formats"):
        reg.register_kernel("b", "linear", OPS["linear"].reference, formats=["int3"])


def test_missing_kernel_is_an_error_naming_op_and_backend():
    reg = Registry()
    reg.register_kernel("b", "rms_norm", OPS["rms_norm"].reference)
    with pytest.raises(RegistryError) as err:
        reg.resolve(ResolveContext("b"))
    message = str(err.value)
    assert "'b'" in message and "op '" in message and "--allow-fallback" in message
    assert "\n" not in message


def test_fallback_uses_the_reference_and_is_reported_once(caplog):
    reg = Registry()
    calls = []

    def my_norm(x, weight, *, eps=1e-6, residual=None):
        calls.append(1)
        return OPS["rms_norm"].reference(x, weight, eps=eps, residual=residual)

    reg.register_kernel("b", "rms_norm", my_norm)
    with caplog.at_level(logging.WARNING, logger="deepinfer.registry"):
        table = reg.resolve(ResolveContext("b", dtype=torch.float32), allow_fallback=True)
    assert "rms_norm" not in table.fallbacks and "silu_and_mul" in table.fallbacks
    assert "linear[fp8_block]" in table.fallbacks
    fallback_lines = [r.getMessage() for r in caplog.records]
    assert len(fallback_lines) == len(table.fallbacks)
    assert sum("silu_and_mul" in m for m in fallback_lines) == 1
    x = torch.randn(3, 8)
    table.rms_norm(x, torch.ones(8))
    assert calls == [1]
    assert table.silu_and_mul is OPS["silu_and_mul"].reference


def test_formats_dispatch_by_fmt_and_dtype_and_predicates_filter():
    reg = Registry()
    seen = []

    def dense(x, weight, *, weight_scale=None, fmt="dense", out_dtype=None):
        seen.append(("dense", fmt))
        return x @ weight.T

    def dense_ep(x, weight, *, weight_scale=None, fmt="dense", out_dtype=None):
        seen.append(("ep", fmt))
        return x @ weight.T

    reg.register_kernel("b", "linear", dense, formats=["dense"], dtypes=[torch.float32])
    reg.register_kernel("b", "linear", dense_ep, formats=["dense"], when=lambda ctx: ctx.ep_size > 1, priority=5)
    assert reg.pick(ResolveContext("b", dtype=torch.bfloat16), "linear", "dense") is None
    assert reg.pick(ResolveContext("b", dtype=torch.float32), "linear", "dense").fn is dense
    assert reg.pick(ResolveContext("b", dtype=torch.float32, ep_size=2), "linear", "dense").fn is dense_ep
    assert reg.pick(ResolveContext("b", dtype=torch.float32), "linear", "fp8_block") is None
    table = reg.resolve(ResolveContext("b", dtype=torch.float32), allow_fallback=True, only=["linear"])
    x, w = torch.randn(2, 4), torch.randn(3, 4)
    torch.testing.assert_close(table.linear(x, w, fmt="dense"), x @ w.T)
    assert seen == [("dense", "dense")]
    assert table.fallbacks == ("linear[fp8_block]", "linear[mxfp4]", "linear[mxfp8]", "linear[mxfp4_a8]", "linear[fp8_block32]")
    with pytest.raises(RegistryError, match="format 'int3'"):
        table.linear(x, w, fmt="int3")


def test_resolve_happens_once_table_holds_plain_callables():
    reg = Registry()
    for name, spec in reg.ops.items():
        reg.register_kernel("b", name, spec.reference)
    table = reg.resolve(ResolveContext("b"))
    assert table.rms_norm is OPS["rms_norm"].reference
    assert table.fallbacks == ()
