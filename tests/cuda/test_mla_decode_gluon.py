"""The SM90 Gluon mla_decode over the bf16 cache (its GPU cases passed on an H200, 2026-12-07): on a CPU, backend option mla_decode_path (which
kernel each cache and value resolves to), which calls it serves, which of them its op hands to the tl kernel, its plan
and its TMA descriptor; on an SM90 GPU (TRITON_INTERPRET=0 pytest tests/cuda/test_mla_decode_gluon.py), its output
against the reference op (16 and 128 heads, S = 1 and 2, ragged lengths, one split and several, empty splits, stale NaN
rows after a request's end). Its compilation for sm90 is tests/cuda/test_compile_check.py's (`deepinfer bench compile
--case "bf16 gluon"`); its golden cases are `deepinfer conformance --backend cuda --op mla_decode --backend-option
mla_decode_path=gluon`'s."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import deepinfer_cuda.kernels.mla_decode_gluon as g  # (imports without Gluon too: GLUON_IMPORT_ERROR says why, below)
import deepinfer_cuda.kernels.mla_decode_gluon_parts as parts
from deepinfer.options import BackendOptionError, resolve_options
from deepinfer.registry import ModelFacts, Registry, RegistryError, ResolveContext

from triton_mode import GPU, mode

if g.GLUON_IMPORT_ERROR is not None:
    pytest.skip(f"no Gluon for Hopper in this Triton (runs with Triton >= 3.5: CI, the GPU machine): {g.GLUON_IMPORT_ERROR}", allow_module_level=True)

BF16_MODEL = ModelFacts(kv_cache_fp8=False, kv_lora_rank=512, qk_rope_head_dim=64, sliding_window=0, kv_block_size=64, num_heads=128)
FP8_MODEL = dataclasses.replace(BF16_MODEL, kv_cache_fp8=True)


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _chosen(monkeypatch, options, model=BF16_MODEL, sm90=True, deterministic=False):
    """The mla_decode function the cuda backend's registrations (tl, FP8 Gluon, bf16 Gluon) resolve to."""
    import deepinfer_cuda.kernels.gemm_mxfp4_gluon as gemm_gluon
    from deepinfer_cuda.kernels import mla_decode as tl_mla
    from deepinfer_cuda.kernels import mla_decode_fp8_gluon as fp8_gluon

    monkeypatch.setattr(gemm_gluon, "is_sm90", lambda device: sm90)
    registry = Registry()
    registry.register_all("cuda", tl_mla.REGISTRATIONS + fp8_gluon.REGISTRATIONS + g.REGISTRATIONS)
    ctx = ResolveContext("cuda", device=torch.device("cuda", 0), options=options, model=model, deterministic=deterministic)
    return registry.choose(ctx, "mla_decode").fn


def test_the_backend_option_chooses_it_for_bf16_caches_on_sm90_only(monkeypatch):
    """auto (the default) and gluon take this kernel on SM90 for a model with a bf16 cache of its rows (the FP8 Gluon
    kernel for an FP8 cache), the tl kernel elsewhere, for facts not known and in deterministic mode; tl keeps the tl
    kernel for both; without Gluon for Hopper auto is the tl kernel and gluon an error."""
    from deepinfer_cuda.kernels import mla_decode as tl_mla
    from deepinfer_cuda.kernels import mla_decode_fp8_gluon as fp8_gluon
    from deepinfer_cuda.options import MLA_DECODE_PATH, OPTIONS

    assert MLA_DECODE_PATH in OPTIONS and MLA_DECODE_PATH.choices == ("auto", "tl", "gluon") and MLA_DECODE_PATH.default == "auto"
    gluon, tl = {"mla_decode_path": "gluon"}, {"mla_decode_path": "tl"}
    assert _chosen(monkeypatch, {}) is _chosen(monkeypatch, {"mla_decode_path": "auto"}) is g.mla_decode
    assert _chosen(monkeypatch, {}, sm90=False) is tl_mla.mla_decode
    assert _chosen(monkeypatch, {}, FP8_MODEL) is fp8_gluon.mla_decode
    assert _chosen(monkeypatch, tl) is _chosen(monkeypatch, tl, FP8_MODEL) is tl_mla.mla_decode
    assert _chosen(monkeypatch, gluon) is g.mla_decode
    assert _chosen(monkeypatch, gluon, FP8_MODEL) is fp8_gluon.mla_decode
    assert _chosen(monkeypatch, gluon, sm90=False) is tl_mla.mla_decode
    assert _chosen(monkeypatch, gluon, deterministic=True) is tl_mla.mla_decode_invariant
    for other in (dict(kv_cache_fp8=None), dict(kv_lora_rank=96), dict(qk_rope_head_dim=32), dict(sliding_window=128),
                  dict(sliding_window=None), dict(kv_block_size=128)):  # fmt: skip
        assert _chosen(monkeypatch, gluon, dataclasses.replace(BF16_MODEL, **other)) is tl_mla.mla_decode, other
    monkeypatch.setattr(g, "GLUON_IMPORT_ERROR", "ImportError: no hopper")
    assert _chosen(monkeypatch, {}) is tl_mla.mla_decode
    with pytest.raises(RegistryError, match="mla_decode_path=gluon, but Triton .* no usable Gluon for Hopper") as err:
        _chosen(monkeypatch, gluon)
    assert "\n" not in str(err.value)
    monkeypatch.setenv("DEEPINFER_CUDA_MLA_DECODE_PATH", "gluon")
    assert resolve_options("cuda", OPTIONS)["mla_decode_path"] == "gluon"
    monkeypatch.setenv("DEEPINFER_CUDA_MLA_DECODE_PATH", "fast")
    with pytest.raises(BackendOptionError, match="DEEPINFER_CUDA_MLA_DECODE_PATH"):
        resolve_options("cuda", OPTIONS)


def test_calls_it_does_not_serve_say_why():
    cache = _meta(8, 64, 576)
    q = lambda s, h, dtype=torch.bfloat16: (_meta(2, s, h, 512, dtype=dtype), _meta(2, s, h, 64, dtype=dtype))  # noqa: E731
    for s, h in ((1, 16), (4, 16), (1, 64), (1, 128), (2, 64), (2, 32)):
        assert g.not_served(*q(s, h), cache, None) is None, (s, h)
    assert "S*H = 96" in g.not_served(*q(1, 96), cache, None)
    assert "S*H = 256" in g.not_served(*q(2, 128), cache, None)
    assert "not bfloat16" in g.not_served(*q(1, 16), _meta(8, 64, 592, dtype=torch.float8_e4m3fn), None)
    assert "not bfloat16" in g.not_served(*q(1, 16), _meta(8, 64, 576, dtype=torch.float16), None)
    assert "wants [pages, 64, 576]" in g.not_served(*q(1, 16), _meta(8, 32, 576), None)
    padded_rows = _meta(8, 64, 580)[..., :576]  # rows of 1160 bytes: not 16-byte aligned
    assert "TMA view" in g.not_served(*q(1, 16), padded_rows, None)
    assert g.not_served(*q(1, 16), _meta(8, 64, 584)[..., :576], None) is None  # rows of 1168 bytes
    assert "TMA view" in g.not_served(*q(1, 16), _meta(64, 8, 576).transpose(0, 1), None)  # pages not one matrix
    assert "sliding window" in g.not_served(*q(1, 16), cache, 128)
    assert "bfloat16" in g.not_served(*q(1, 16, torch.float16), cache, None)
    assert "tuning overrides" in g.not_served(*q(1, 16), cache, None, overrides={"BLOCK_N": 32})
    assert "deterministic" in g.not_served(*q(2, 16), cache, None, tiles_of_one_query=True)
    cpu = torch.zeros(1, 1, 16, 512, dtype=torch.bfloat16), torch.zeros(1, 1, 16, 64, dtype=torch.bfloat16)
    assert "not on a GPU" in g.not_served(*cpu, torch.zeros(2, 64, 576, dtype=torch.bfloat16), None)


def test_its_op_serves_calls_of_at_least_64_rows_and_hands_the_rest_to_the_tl_kernel(monkeypatch):
    """mla_decode_path=gluon: 64 and 128 query rows (S * H) on this kernel, 16 or 32 rows (memory-bound, not yet measured
    against the tl kernel) and the calls it does not serve on the tl kernel."""
    from deepinfer_cuda.kernels import mla_decode as tl_mla

    calls = []
    monkeypatch.setattr(parts, "launch", lambda kernel, cache, strides, q_nope, *a, **kw: calls.append(("gluon", q_nope.shape[1:3])) or q_nope)
    monkeypatch.setattr(tl_mla, "launch_mla_decode", lambda q_nope, *a: calls.append(("tl", q_nope.shape[1:3])) or q_nope)
    assert g.GLUON_MIN_ROWS == 64
    for s, h, cache in ((1, 16, _meta(8, 64, 576)), (2, 16, _meta(8, 64, 576)), (1, 64, _meta(8, 64, 576)), (2, 32, _meta(8, 64, 576)),
                        (1, 128, _meta(8, 64, 576)), (2, 64, _meta(8, 64, 576)), (1, 128, _meta(8, 64, 592, dtype=torch.float8_e4m3fn))):  # fmt: skip
        g.mla_decode(_meta(2, s, h, 512), _meta(2, s, h, 64), cache, _meta(2, 8, dtype=torch.int32), _meta(2, dtype=torch.int32), softmax_scale=0.1)
    assert calls == [("tl", (1, 16)), ("tl", (2, 16)), ("gluon", (1, 64)), ("gluon", (2, 32)), ("gluon", (1, 128)), ("gluon", (2, 64)),
                     ("tl", (1, 128))]  # fmt: skip


def test_the_plan_at_the_benchmarked_shapes(monkeypatch):
    """The split plan (shared with the FP8 Gluon kernel) on a 132-SM H100: B128 H128 fills the GPU with one split (the
    output written directly); B32 ctx2048 and B1 ctx8192 split their contexts into whole pages and merge."""
    monkeypatch.setattr(parts, "num_sms", lambda device: 132)
    meta = torch.device("meta")
    assert parts.plan(128, 128, 4096, meta) == parts.GluonPlan(rows=128, row_tiles=2, tokens_per_split=4096, num_splits=1)
    for batch, ctx in ((32, 2048), (1, 8192)):
        p = parts.plan(batch, 128, ctx, meta)
        assert p.row_tiles == 2 and p.num_splits > 1 and not p.direct and p.tokens_per_split % g.PAGE == 0
        assert p.tokens_per_split * p.num_splits >= ctx > p.tokens_per_split * (p.num_splits - 1)
    assert parts.plan(128, 16, 4096, meta).num_splits == 1


def test_its_tuning_switches_reach_the_launch(monkeypatch):
    """The tuning entry mla_decode/gluon_bf16 (the default table's: what was measured) gives the seesaw schedule with
    early release at 232 / 40 registers and the plan's split limits; its switches (the schedule, the register split, the
    split limits) reach the kernel's constexprs and the plan; an unknown schedule is an error, not a silent default."""
    from deepinfer_cuda.tuning import config

    assert config("mla_decode", "gluon_bf16", torch.device("meta")) == {"schedule": "seesaw_early_release", "attend_regs": 232, "load_regs": 40,
                                                                         "min_tokens_per_split": 256, "max_splits": 64, "balanced": False,
                                                                         "balanced_overhead_tiles": 1}
    assert (g.PARTITION_REGS, parts.MIN_TOKENS_PER_SPLIT, parts.MAX_SPLITS) == ((232, 40), 256, 64)
    launches = []
    monkeypatch.setattr(parts, "launch", lambda kernel, cache, strides, *a, **kw: launches.append((a[-3:], kw)) or a[0])
    args = (_meta(2, 1, 128, 512), _meta(2, 1, 128, 64), _meta(8, 64, 576), _meta(2, 4, dtype=torch.int32), _meta(2, dtype=torch.int32), 0.1)
    g.launch_mla_decode_gluon(*args)
    limits = {"min_tokens_per_split": 256, "max_splits": 64}
    assert launches.pop() == ((None, None, limits), {"REGS_ATTEND": 232, "REGS_LOAD": 40, "SEESAW": True, "EARLY_RELEASE": True})
    table = g.config
    switches = {"schedule": "seesaw", "attend_regs": 240, "load_regs": 24, "min_tokens_per_split": 512, "max_splits": 8}
    monkeypatch.setattr(g, "config", lambda op, v, device=None: {**table(op, v, device), **switches})
    g.launch_mla_decode_gluon(*args, num_splits=3)
    assert launches.pop() == ((3, None, {"min_tokens_per_split": 512, "max_splits": 8}),
                              {"REGS_ATTEND": 240, "REGS_LOAD": 24, "SEESAW": True, "EARLY_RELEASE": False})
    switches["schedule"] = "seesaw_early_release"
    g.launch_mla_decode_gluon(*args)
    assert launches.pop()[1] == {"REGS_ATTEND": 240, "REGS_LOAD": 24, "SEESAW": True, "EARLY_RELEASE": True}
    switches["schedule"] = "split_keys"
    g.launch_mla_decode_gluon(*args)
    assert launches.pop()[1] == {"REGS_ATTEND": 240, "REGS_LOAD": 24, "SEESAW": False, "EARLY_RELEASE": False}
    switches["schedule"] = "seesaw_fast"
    with pytest.raises(ValueError, match="schedule 'seesaw_fast'"):
        g.launch_mla_decode_gluon(*args)


def test_the_plan_honours_the_split_limits(monkeypatch):
    """min_tokens_per_split and max_splits bound the splits `plan` picks (B32 ctx2048 at 128 heads: 64 (row tile, request)
    groups on 132 SMs); a forced count is honoured whatever they say."""
    monkeypatch.setattr(parts, "num_sms", lambda device: 132)
    meta = torch.device("meta")
    default = parts.plan(32, 128, 2048, meta)
    assert parts.plan(32, 128, 2048, meta, min_tokens_per_split=256, max_splits=64) == default
    assert parts.plan(32, 128, 2048, meta, min_tokens_per_split=2048).num_splits == 1
    assert parts.plan(32, 128, 2048, meta, max_splits=1).num_splits == 1
    assert parts.plan(32, 128, 2048, meta, max_splits=1, num_splits=4).num_splits == 4
    assert parts.plan(128, 128, 4096, meta, min_tokens_per_split=64).num_splits == 1  # 256 programs fill the SMs already


def test_the_sweep_entry_times_every_switch_on_the_benchmarked_shapes():
    """`python -m deepinfer_cuda.bench.gemm --sweep mla_gluon_bf16`: the table's entry first (the baseline), then switches
    of the tuning entry only, on bench/attention_decode.py's three 128-head Gluon cases (B128 on the stream, B32 and B1
    from graph replays, as `deepinfer bench ops`); `deepinfer bench compile --sweep mla_gluon_bf16` builds each at the
    kernel's two forms (one split: the output directly; splits: partials)."""
    from deepinfer_cuda.bench import compile_check as cc
    from deepinfer_cuda.bench import gemm as bench
    from deepinfer_cuda.tuning import config

    candidates = bench.SWEEP["mla_gluon_bf16"]
    assert candidates[0] == ({}, {}) and len({str(c) for c in candidates}) == len(candidates)
    keys = set(config("mla_decode", "gluon_bf16", None))
    assert all(set(cfg) <= keys and not extra for cfg, extra in candidates), candidates
    assert all(cfg.get("schedule", "split_keys") in g.SCHEDULES for cfg, _ in candidates)
    assert bench.sweep_entries("mla_gluon_bf16") == ("gluon_bf16",) and bench.SWEEP_OPS["mla_gluon_bf16"] == "mla_decode"
    cases = bench.sweep_cases("mla_gluon_bf16")
    assert [(c.name, c.graph, c.bound) for c in cases] == [("B128_ctx4096_H128_S1_bf16_page64, gluon", False, "compute"),
                                                           ("B32_ctx2048_H128_S1_bf16_page64, gluon", True, "compute"),
                                                           ("B1_ctx8k_H128_S1_bf16_page64, gluon", True, "compute")]  # fmt: skip
    compile_cases = cc.sweep_cases("mla_gluon_bf16")
    assert len(compile_cases) == 2 * len(candidates) and all(c.archs == ("sm90",) and c.tma for c in compile_cases)


def test_the_sweep_loop_runs_each_switch_beside_the_tl_kernel(monkeypatch):
    """gemm.py's _sweep_case on a toy Gluon mla_decode case on the CPU (the tl kernel under the interpreter; the Gluon
    kernel stubbed by the tl one, recording the tuning entry each row runs with; timing stubbed): one row a candidate,
    each run with its switches over the table's entry, then the tl kernel's row; each row's difference from the tl
    kernel's output (0 here); the tuning lookup restored after."""
    from deepinfer_cuda.bench import attention_decode, common
    from deepinfer_cuda.bench import gemm as bench
    from deepinfer_cuda.bench.common import BenchCase

    seen = []

    def gluon_stub(state):
        seen.append(g.config("mla_decode", "gluon_bf16", None))
        return attention_decode._mla_kernel(state)

    monkeypatch.setattr(common, "time_ms", lambda fn, **_: (fn(), 1.0)[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    case = BenchCase("mla_decode", "toy B2_ctx128_H16, gluon", attention_decode._mla_setup(2, 128, 16), gluon_stub, None, "",
                     attention_decode._mla_flops, attention_decode._mla_bytes, bound="compute")
    table = g.config
    candidates = bench.SWEEP["mla_gluon_bf16"]
    rows = bench._sweep_case("mla_gluon_bf16", case, torch.device("cpu"))
    assert g.config is table
    assert [r["cfg"] for r in rows] == [cfg for cfg, _ in candidates] + ["tl kernel (mla_decode_path=tl)"]
    assert all(r["ms"] == 1.0 and r["unit"] == "TFLOP/s" for r in rows), rows
    assert all(r["max_diff"] == 0 and r["max_diff_tl"] == 0 for r in rows[: len(candidates)]), rows
    base = table("mla_decode", "gluon_bf16", None)
    # seen: the table's reference run, then each candidate's checked run and its timed run
    assert seen[0] == base and seen[1::2] == [{**base, **cfg} for cfg, _ in candidates] == seen[2::2]


def test_the_sweep_table_lists_every_row():
    """`sweep_table`: one line a row, microseconds, the rate, both differences (blank where not compared)."""
    from deepinfer_cuda.bench import gemm as bench

    rows = [{"variant": "mla_gluon_bf16", "case": "B128_ctx4096_H128_S1_bf16_page64, gluon", "cfg": {}, "extra": {}, "ms": 0.3325, "rate": 439.0,
             "unit": "TFLOP/s", "max_diff": 0.0, "max_diff_tl": 0.0039},
            {"variant": "mla_gluon_bf16", "case": "B128_ctx4096_H128_S1_bf16_page64, gluon", "cfg": {"schedule": "seesaw"}, "extra": {}, "ms": None,
             "rate": None, "unit": "TFLOP/s", "max_diff": None, "max_diff_tl": None},
            {"variant": "mla_gluon_bf16", "case": "B128_ctx4096_H128_S1_bf16_page64, gluon", "cfg": "tl kernel (mla_decode_path=tl)", "extra": {},
             "ms": 0.5728, "rate": 254.9, "unit": "TFLOP/s", "max_diff": None}]  # fmt: skip
    lines = bench.sweep_table(rows).splitlines()
    assert len(lines) == 4 and "us" in lines[0].split() and "max|d tl|" in lines[0]
    assert "table" in lines[1] and "332.5" in lines[1] and "439.0" in lines[1] and "0.0039" in lines[1]
    assert "schedule=seesaw" in lines[2] and "332.5" not in lines[2]
    assert "tl kernel (mla_decode_path=tl)" in lines[3] and "572.8" in lines[3]


def test_the_tma_descriptor_sees_the_pages_as_one_matrix():
    """Page p's row r is row p * 64 + r of the descriptor's [pages * 64, 576] view (the loader's coordinate), read in
    [64, 64] boxes, 128-byte swizzled as the stages; a padded row stride carries over."""
    cache = torch.zeros(3, 64, 584, dtype=torch.bfloat16)[..., :576]
    desc = g._descriptor(cache)
    assert list(desc.shape) == [192, 576] and list(desc.strides) == [584, 1] and list(desc.block_shape) == [64, 64]
    assert desc.base.data_ptr() == cache.data_ptr() and desc.layout.swizzle_byte_width == 128


def _inputs(batch, heads, queries, ctx, seq_lens=None, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = batch * (ctx // 64)
    cache = torch.randn(pages, 64, 576, device="cuda", generator=gen).to(torch.bfloat16)
    block_table = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32).view(batch, ctx // 64)
    if seq_lens is None:
        seq_lens = torch.randint(max(queries, ctx // 2), ctx + 1, (batch,), device="cuda", generator=gen, dtype=torch.int32)
    else:
        seq_lens = torch.tensor(seq_lens, device="cuda", dtype=torch.int32)
    q_nope = torch.randn(batch, queries, heads, 512, device="cuda", generator=gen).to(torch.bfloat16)
    q_rope = torch.randn(batch, queries, heads, 64, device="cuda", generator=gen).to(torch.bfloat16)
    return q_nope, q_rope, cache, block_table, seq_lens


ON_SM90 = pytest.mark.skipif(mode() != GPU or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                             reason="runs on an SM90 GPU only (TRITON_INTERPRET=0 pytest tests/cuda/test_mla_decode_gluon.py)")


def _check(got, q_nope, q_rope, cache, block_table, seq_lens, scale):
    from deepinfer.ops.attention import mla_decode as ref_mla_decode

    want = ref_mla_decode(q_nope.float(), q_rope.float(), cache.float(), block_table, seq_lens, softmax_scale=scale)
    assert got is not None and got.dtype == torch.bfloat16 and got.shape == q_nope.shape and torch.isfinite(got).all()
    err = (got.float() - want).abs().max().item()
    assert err <= 1.6e-2 * max(1.0, want.abs().max().item()), err  # bf16 rounding of p and of outputs ~1


# the tuning switches the GPU tests run each case under (over the table's entry): the table's, and the seesaw schedule
# (mla_decode_gluon_seesaw.py; its form without spills not yet run on a GPU) at the table's registers and at 240 / 24
# (which it needed with S > 1 before its stages' descriptors left the registers), and in its early-release order
TUNINGS = {"table": {}, "seesaw": {"schedule": "seesaw"}, "seesaw_r240": {"schedule": "seesaw", "attend_regs": 240, "load_regs": 24},
           "seesaw_early_release": {"schedule": "seesaw_early_release"}}


@pytest.fixture(params=list(TUNINGS))
def tuning(request, monkeypatch):
    """The kernel's tuning entry with this case's switches (TUNINGS)."""
    table = g.config
    switches = TUNINGS[request.param]
    monkeypatch.setattr(g, "config", lambda op, v, device=None: {**table(op, v, device), **(switches if v == "gluon_bf16" else {})})
    return request.param


@ON_SM90
@pytest.mark.parametrize("batch, heads, ctx, queries, splits", [
    (4, 16, 4096, 1, None), (4, 16, 4096, 1, 1), (4, 16, 4096, 1, 8), (4, 128, 4096, 1, None), (4, 128, 4096, 1, 1),
    (4, 128, 4096, 1, 5), (2, 64, 2048, 2, None), (3, 16, 960, 2, 1), (3, 16, 960, 2, 4), (1, 128, 8192, 1, None),
])  # fmt: skip
def test_matches_the_reference_on_the_gpu(batch, heads, ctx, queries, splits, tuning):
    args = _inputs(batch, heads, queries, ctx)
    got = g.launch_mla_decode_gluon(*args, 192**-0.5, num_splits=splits)
    _check(got, *args, 192**-0.5)


@ON_SM90
@pytest.mark.parametrize("heads, queries, splits", [(16, 1, None), (128, 1, 8), (32, 2, 3)])
def test_lengths_inside_pages_and_empty_splits_on_the_gpu(heads, queries, splits, tuning):
    """Lengths of 2, 63, 64, 65 and 1000 tokens among 4096-token block tables (splits past a request's end see no key),
    and the rows after each request's end in its last page poisoned with NaN: the loader zeroes them in the stage, so
    p . v stays finite where p = 0."""
    q_nope, q_rope, cache, block_table, seq_lens = _inputs(5, heads, queries, 4096, seq_lens=[2, 63, 64, 65, 1000])
    for b, n in enumerate(seq_lens.tolist()):
        if n % 64:
            cache[block_table[b, n // 64].long(), n % 64 :] = float("nan")
    got = g.launch_mla_decode_gluon(q_nope, q_rope, cache, block_table, seq_lens, 0.1, num_splits=splits)
    _check(got, q_nope, q_rope, cache, block_table, seq_lens, 0.1)


@ON_SM90
def test_the_op_matches_its_launch_on_the_gpu():
    """The registered op (mla_decode_path=gluon) runs this kernel for 128 heads: the same bits as its launch."""
    args = _inputs(2, 128, 1, 2048)
    assert torch.equal(g.mla_decode(*args, softmax_scale=0.1), g.launch_mla_decode_gluon(*args, 0.1))
