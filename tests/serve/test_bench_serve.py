"""`deepinfer bench serve` on the CPU with the tiny model: a server started in-process, two request
rates (Poisson and all at once), every request completed, the percentiles ordered, the JSON and
the PNG written; and the same driven against a running server by --url."""

from __future__ import annotations

import json

import pytest

from deepinfer.bench.serve import percentiles
from deepinfer.cli.main import main

from serve.server_process import ServerProcess


def test_percentiles():
    p = percentiles([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert p == pytest.approx({"mean": 50.5, "median": 50.0, "p90": 90.0, "p99": 99.0})
    assert percentiles([])["p99"] is None


def check_results(path, rates):
    data = json.loads(path.read_text())
    assert data["kind"] == "serve" and [r["request_rate"] for r in data["results"]] == rates
    for r in data["results"]:
        assert r["completed"] == 6 and r["failed"] == 0, r["errors"]
        assert r["output_tokens_per_s"] > 0 and r["request_throughput"] > 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            p = r[key]
            assert 0 < p["median"] <= p["p90"] <= p["p99"], (key, p)
    return data


def test_bench_serve_in_process(tmp_path, cache, monkeypatch, capsys):
    monkeypatch.setenv("DEEPINFER_CACHE", str(cache))
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--backend", "reference", "--request-rate", "50", "--request-rate", "inf", "--num-prompts", "6",
            "--input-len", "8", "--output-len", "3", "--range-ratio", "0", "--json", str(out), "--plot", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    data = check_results(out, [50.0, "inf"])
    assert all(r["e2e_ms"]["median"] >= r["ttft_ms"]["median"] for r in data["results"])
    assert (tmp_path / "serve.png").stat().st_size > 0
    assert "TTFT p50" in capsys.readouterr().out


def test_bench_serve_against_a_url(tmp_path, cache):
    server = ServerProcess("--backend", "reference", "--num-kv-blocks", "64", cache=cache, api_key="k")
    try:
        out = tmp_path / "url.json"
        argv = ["bench", "serve", "--url", server.url, "--api-key", "k", "--vocab", "1000", "--request-rate", "inf", "--num-prompts", "6",
                "--input-len", "8", "--output-len", "3", "--range-ratio", "0", "--json", str(out)]  # fmt: skip
        assert main(argv) == 0
        assert check_results(out, ["inf"])["machine"]["model"] == "tiny-v3"
    finally:
        assert server.stop()[0] == 0


def test_every_rate_and_the_warmup_send_prompts_of_their_own(monkeypatch):
    """A prompt sent before would hit the server's prefix cache: a cheaper, different workload."""
    import deepinfer.bench.serve as bench

    sent = []

    async def fake_run_rate(url, model, workload, rate, seed, headers, max_connections):
        sent.append((rate, workload))
        return [], 1.0

    monkeypatch.setattr(bench, "run_rate", fake_run_rate)
    monkeypatch.setattr(bench, "summarize", lambda rate, records, wall: {"request_rate": rate})
    make = lambda seed: bench.random_workload(4, 32, 2, 0.0, 1000, seed)  # noqa: E731
    assert bench.sweep("http://x", "m", make, [5.0, float("inf")], seed=0) == [{"request_rate": 5.0}, {"request_rate": float("inf")}]
    assert [rate for rate, _ in sent] == [float("inf"), 5.0, float("inf")], "the untimed warm-up first, all at once"
    prompts = [tuple(p) for _, workload in sent for p, _ in workload]
    assert len(set(prompts)) == len(prompts) == 12
    sent.clear()
    bench.sweep("http://x", "m", make, [5.0], seed=0, warmup=False)
    assert len(sent) == 1
