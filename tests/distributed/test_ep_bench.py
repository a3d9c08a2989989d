"""`deepinfer bench ops --ep N`: the expert-parallel dispatch/combine benchmark's plumbing on the CPU
(gloo, the reference backend, a few tokens): torchrun starts the ranks, rank 0 writes the JSON with
a row per implementation, op and row dtype, and the all_to_all_single peer. Bad requests are
one-line errors with exit code 2. Speeds are not asserted (they are measured on the GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from cli_helpers import run_main
from waits import HANG_S


def deepinfer(*argv, env=None, timeout=HANG_S):
    environ = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "deepinfer", *argv], capture_output=True, text=True, timeout=timeout, env=environ)


def test_bench_ops_ep2_reference_over_gloo_writes_every_row(tmp_path):
    out = tmp_path / "ep.json"
    proc = deepinfer("bench", "ops", "--backend", "reference", "--op", "dispatch", "--op", "combine", "--ep", "2",
                     "--tokens", "16", "--repeat", "2", "--warmup", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ep"] == 2 and result["process_group"] == "gloo" and result["p2p"] is None and result["notes"] == []
    assert result["device"].startswith("cpu (")
    assert [i["name"] for i in result["implementations"]] == ["reference (all_to_all_single)"]
    got = {(r["impl"], r["op"], r["dtype"], r["tokens"]) for r in result["rows"]}
    impl, peer = "reference (all_to_all_single)", "all_to_all_single (gloo)"
    assert got == {(impl, "dispatch", "bf16", 16), (impl, "combine", "bf16", 16), (impl, "dispatch", "fp8", 16),
                   (peer, "all_to_all", "bf16", 16), (peer, "all_to_all", "fp8", 16)}
    for r in result["rows"]:
        assert r["status"] == "ok" and r["us"] > 0 and len(r["us_per_rank"]) == 2, r
        assert r["remote_bytes"] > 0 and r["gbs"] > 0 and r["fraction_p2p"] is None
    # 16 tokens x 8 experts, about half of them remote; bf16 rows of 7168 values, fp8 half of that
    bf16 = next(r for r in result["rows"] if r["op"] == "dispatch" and r["dtype"] == "bf16")
    fp8 = next(r for r in result["rows"] if r["op"] == "dispatch" and r["dtype"] == "fp8")
    assert bf16["remote_bytes"] % (7168 * 2) == 0 and 0 < bf16["remote_bytes"] // (7168 * 2) <= 128
    # each token row once per other rank it reaches: at most the (token, k) rows, at most one per token
    assert 0 < bf16["unique_remote_bytes"] <= min(bf16["remote_bytes"], 16 * 7168 * 2) and bf16["unique_gbs"] > 0
    assert fp8["remote_bytes"] * 2 == bf16["remote_bytes"]
    assert "dispatch" in proc.stdout and "all_to_all_single (gloo)" in proc.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--backend", "reference", "--ep", "2", "--op", "gate"], "only dispatch and combine"),
        (["--backend", "reference", "--ep", "0"], "--ep must be >= 1"),
        (["--backend", "reference", "--ep", "100000"], "on the CPU starts 100000 processes"),
        (["--backend", "nosuch", "--ep", "2"], "unknown backend"),
    ],
)
def test_bench_ops_ep_bad_requests_are_one_line_errors(argv, message):
    proc = run_main("bench", "ops", *argv)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs only on a machine without a GPU (as CI is): it checks the error a GPU-less machine gives")
def test_bench_ops_ep_cuda_without_a_gpu_is_an_error():
    """The backend's own reason (its probe's), and how to run its kernels on a CPU instead."""
    proc = deepinfer("bench", "ops", "--backend", "cuda", "--ep", "2", env={"TRITON_INTERPRET": "0"})
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "backend 'cuda' is not available: " in proc.stderr and "on a CPU: TRITON_INTERPRET=1" in proc.stderr, proc.stderr


def test_bench_ops_ep_hands_the_backend_options_to_the_ranks(tmp_path):
    """--backend-option ep_path=nccl reaches every rank: with DEEPINFER_EP_PATH=symm as the default, a
    rank that missed it would choose symmetric memory, which cannot run on the CPU, and fail."""
    out = tmp_path / "ep.json"
    proc = deepinfer("bench", "ops", "--backend", "cuda", "--ep", "2", "--backend-option", "ep_path=nccl", "--tokens", "4",
                     "--repeat", "1", "--warmup", "0", "--json", str(out), env={"TRITON_INTERPRET": "1", "DEEPINFER_EP_PATH": "symm"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["backend_options"]["ep_path"] == "nccl"
    assert [i["name"] for i in result["implementations"]] == ["all_to_all_single path (NCCL)"]


def test_phases_come_from_the_flag_alone(monkeypatch):
    """Options are flags, not environment variables (issue 14, item 1): DEEPINFER_EP_BENCH_PHASES,
    which duplicated --phases, is gone; the help says device events, not CUDA events."""
    from deepinfer.bench import ep as bench
    from deepinfer.cli import bench_ops_ep, launch
    from deepinfer.cli.main import build_parser

    seen = []
    monkeypatch.setattr(launch, "launched_by_torchrun", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("DEEPINFER_EP_BENCH_PHASES", "1")
    monkeypatch.setattr(bench, "run_rank", lambda **kwargs: seen.append(kwargs["phases"]))
    parser = build_parser()
    for extra in ([], ["--phases"]):
        assert bench_ops_ep.run(parser.parse_args(["bench", "ops", "--backend", "reference", "--ep", "2", *extra])) == 0
    assert seen == [False, True]
    ops_help = " ".join(deepinfer("bench", "ops", "--help").stdout.split())
    assert "(device events)" in ops_help and "CUDA events" not in ops_help and "DEEPINFER_EP_BENCH_PHASES" not in ops_help


def test_ep_implementations_of_the_cuda_backend_on_the_cpu():
    from deepinfer.bench.ep import ep_implementations
    from deepinfer.registry import Registry
    from deepinfer_cuda.kernels import moe, moe_ep, moe_ep_symm

    registry = Registry()
    for module in (moe, moe_ep, moe_ep_symm):
        registry.register_all("cuda", module.REGISTRATIONS)
    impls = ep_implementations(registry, "cuda", torch.device("cpu"), 2)
    assert [i.name for i in impls] == ["all_to_all_single path (NCCL)"]  # symmetric memory: never on the CPU
    assert impls[0].dispatch.fn is moe_ep.dispatch and impls[0].combine.fn is moe_ep.combine
    assert ep_implementations(registry, "cuda", torch.device("cpu"), 1) == []


def test_phase_medians_and_intervals_of_marks():
    from deepinfer.bench.ep import intervals, phase_medians

    stamps = [
        ("dispatch", 0.0), ("count", 2.0), ("barrier 1", 5.0), ("dispatch end", 6.0), ("combine", 7.0), ("scatter back", 9.0), ("combine end", 10.0),
        ("dispatch", 10.0), ("count", 14.0), ("barrier 1", 15.0), ("dispatch end", 16.0), ("combine", 16.0), ("scatter back", 17.0), ("combine end", 19.0),
    ]
    assert intervals(stamps, "dispatch", "dispatch end") == [6.0, 6.0]
    assert intervals(stamps, "combine", "combine end") == [3.0, 3.0]
    got = phase_medians(stamps, {"dispatch": "dispatch", "combine": "combine"})
    assert got == {"dispatch: count": 3.0, "dispatch: barrier 1": 2.0, "dispatch: rest": 1.0,
                   "combine: scatter back": 1.5, "combine: rest": 1.5}


def test_traffic_counts_token_rows_and_their_copies():
    from deepinfer.bench import ep as bench

    W, T = 4, 32
    moved = bench.traffic(W, T)
    L = bench.EXPERTS // W
    owners = [bench.routing(r, T, torch.device("cpu"))[3].long() // L for r in range(W)]
    copies = [[int((owners[s] == r).sum()) for r in range(W)] for s in range(W)]  # (token, k) rows s -> r
    tokens = [[int((owners[s] == r).any(1).sum()) for r in range(W)] for s in range(W)]  # tokens of s reaching r
    assert [t.tolist() for t in moved["sent"]] == copies
    assert moved["dispatch"] == (max(sum(copies[s][r] for r in range(W) if r != s) for s in range(W)),
                                 max(sum(tokens[s][r] for r in range(W) if r != s) for s in range(W)))
    assert moved["combine"] == (max(sum(copies[s][r] for s in range(W) if s != r) for r in range(W)),
                                max(sum(tokens[s][r] for s in range(W) if s != r) for r in range(W)))
    assert moved["dispatch"][1] < moved["dispatch"][0]  # top-8 of 64 local experts: tokens reach a rank with several copies


def test_the_symmetric_memory_path_is_measured_three_ways_at_the_latency_size():
    from deepinfer.bench import ep as bench

    symm = bench.Impl(bench.SYMM, None, None)
    nccl = bench.Impl("all_to_all_single path (NCCL)", None, None)
    graph = f"{bench.SYMM} (CUDA graph)"
    assert bench._variants(symm, 128, True) == ([(bench.SYMM, 128, False), (f"{bench.SYMM} (T exchanged)", None, False), (graph, 128, True)], [])
    assert bench._variants(symm, 4096, True) == ([(bench.SYMM, 4096, False), (f"{bench.SYMM} (T exchanged)", None, False)], [])
    # no graph capture: the in-graph rows are left out
    assert bench._variants(symm, 128, False) == ([(bench.SYMM, 128, False), (f"{bench.SYMM} (T exchanged)", None, False)], [graph])
    assert bench._variants(nccl, 128, True) == ([(nccl.name, 128, False)], [])
