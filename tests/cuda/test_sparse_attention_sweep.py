"""The sweep of the SM90 Gluon sparse_attention over bf16 caches (bench/sparse_attention_sweep.py) on a CPU: its variants
are launches the kernel takes, `bench compile --sweep sparse_gluon_bf16` builds each at each batch, its table reads as
one row a (batch, variant); and the fused combine's counters (kernels/sparse_attention_gluon_common.py) are kept, never
freed. The sweep itself runs on an SM90 GPU (`python -m deepinfer_cuda.bench.sparse_attention_sweep --sweep
sparse_gluon_bf16`); the fused combine's GPU tests are tests/cuda/test_sparse_attention_gluon.py's."""

from __future__ import annotations

import inspect

import torch

from deepinfer_cuda.bench import compile_check as cc
from deepinfer_cuda.bench import sparse_attention_sweep as sweep
from deepinfer_cuda.kernels import sparse_attention_gluon as g
from deepinfer_cuda.kernels import sparse_attention_gluon_common as common


def test_every_variant_is_a_launch_the_kernel_takes():
    params = inspect.signature(g.launch_sparse_attention_gluon).parameters
    for name, variants in sweep.SWEEP.items():
        assert "default" in variants and variants["default"] == {}, name
        for label, launch in variants.items():
            assert set(launch) <= {"tile_rows", "early_release", "fused_combine", "persistent", "num_splits", "l2_prefetch"}, (label, launch)
            assert all(params[key].kind is inspect.Parameter.KEYWORD_ONLY for key in launch), label
            if "tile_rows" in launch:
                assert launch["tile_rows"] in g.TILES, label


def test_bench_compile_builds_every_variant_at_every_batch():
    for name in ("sparse_gluon_bf16", "sparse_gluon_l2"):
        cases = cc.sweep_cases(name)
        assert [c.name for c in cases] == [f"sweep {name} {label} B{b}" for label in sweep.SWEEP[name] for b in sweep.BATCHES]
        assert all(c.archs == ("sm90",) and c.matrix == "mma" for c in cases)


def test_the_table_has_one_row_a_batch_and_variant():
    rows = [
        {"batch": 64, "variant": "tl kernel", "plan": "-", "us": 47.5, "copy_pct": 24.8, "max_diff_tl": 0.0, "error": None},
        {"batch": 64, "variant": "gluon fused", "plan": "2 splits x 64 rows/2 st", "us": 20.0, "copy_pct": 59.0, "max_diff_tl": 0.0039, "error": None},
        {"batch": 64, "variant": "gluon r32", "plan": "2 splits x 32 rows/4 st", "us": None, "copy_pct": None, "max_diff_tl": None, "error": "X: y"},
    ]
    lines = sweep.format_table(rows).splitlines()
    assert len(lines) == 2 + len(rows)
    assert "47.5" in lines[2] and "24.8%" in lines[2]
    assert "2 splits x 64 rows/2 st" in lines[3] and "0.0039" in lines[3]
    assert "ERROR X: y" in lines[4]


def test_the_fused_combine_s_counters_are_kept_and_only_grow(monkeypatch):
    """Zeros, reused call after call; a larger need adds a buffer and keeps the old one (a captured CUDA graph holds its
    address)."""
    monkeypatch.setattr(common, "_SPLIT_COUNTERS", {})
    cpu = torch.device("cpu")
    first = common.split_counters(cpu, 10)
    assert first.dtype == torch.int32 and first.numel() >= common.SPLIT_COUNTERS_MIN and int(first.abs().sum()) == 0
    assert common.split_counters(cpu, 100) is first
    bigger = common.split_counters(cpu, common.SPLIT_COUNTERS_MIN + 1)
    assert bigger is not first and bigger.numel() > common.SPLIT_COUNTERS_MIN
    kept = common._SPLIT_COUNTERS[cpu]
    assert len(kept) == 2 and kept[0] is first and kept[1] is bigger


def test_a_batch_s_rows_on_the_cpu(monkeypatch):
    """The sweep's loop over one batch on small CPU inputs (the interpreter runs the tl kernel; the Gluon launch declines
    off a GPU): the tl kernel's row is timed (a fake timer) and matches itself, each Gluon variant is an error row that
    says why, and the loop goes on after one."""
    import deepinfer_cuda.bench.v4_attention as v4

    def small_setup(batch, ctx):
        def setup(device):
            gen = torch.Generator().manual_seed(0)
            return {
                "q": torch.randn(batch, 4, 64, generator=gen).bfloat16(),
                "kv": torch.randn(40, 64, generator=gen).bfloat16(),
                "indices": torch.randint(-1, 40, (batch, 8), generator=gen, dtype=torch.int32),
                "extra_kv": torch.randn(30, 64, generator=gen).bfloat16(),
                "extra_indices": torch.randint(-1, 30, (batch, 8), generator=gen, dtype=torch.int32),
                "sinks": torch.randn(4, generator=gen),
                "distinct_rows": 10,
            }

        return setup

    monkeypatch.setattr(v4, "_sparse_setup", small_setup)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    rows = sweep._sweep_batch("sparse_gluon_bf16", 2, torch.device("cpu"), copy_tbs=1.0, timer=lambda fn: (fn(), 0.01)[1])
    assert [r["variant"] for r in rows] == ["tl kernel"] + [f"gluon {label}" for label in sweep.SWEEP["sparse_gluon_bf16"]]
    tl = rows[0]
    assert tl["error"] is None and tl["us"] == 10.0 and tl["max_diff_tl"] == 0.0 and tl["copy_pct"] > 0
    assert all(r["error"] is not None and "does not serve" in r["error"] for r in rows[1:]), rows
    assert "ERROR" in sweep.format_table(rows)
