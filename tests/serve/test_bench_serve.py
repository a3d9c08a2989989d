"""`deepinfer bench serve` on the CPU with the tiny model: a server started in-process, two request
rates (Poisson and all at once), every request completed, the percentiles ordered, the engine steps
of each rate read from the server's metrics, the JSON and the PNG written; the same with the server
in a process of its own (--server-process), and driven against a running server by --url."""

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
    assert data["machine"]["server"] == "a thread of the client's process"
    assert all(r["server_steps"] >= 3 and r["server_step_ms"] > 0 for r in data["results"]), "the engine steps each rate took, from /metrics"
    assert (tmp_path / "serve.png").stat().st_size > 0
    assert "TTFT p50" in capsys.readouterr().out


def test_bench_serve_with_its_server_in_a_process_of_its_own(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE", str(cache))  # the server process inherits it
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--server-process", "--backend", "reference", "--request-rate", "inf", "--num-prompts", "6", "--input-len", "8",
            "--output-len", "3", "--range-ratio", "0", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    data = check_results(out, ["inf"])
    assert data["machine"]["server"] == "a process of its own" and data["machine"]["backend"] == "reference"
    assert data["machine"]["max_model_len"] > 8 + 3  # tiny-v3's own (no --max-model-len), told by the server process
    (rate,) = data["results"]
    assert rate["server_steps"] >= 3 and rate["server_step_ms"] > 0  # 3 tokens each: at least 3 engine steps


def test_a_server_process_that_fails_is_one_line(tmp_path, capfd):
    argv = ["bench", "serve", "--server-process", "--backend", "reference", "--model", str(tmp_path / "missing"), "--num-prompts", "1"]
    assert main(argv) == 2
    err = capfd.readouterr().err
    assert "the benchmark's server process exited with code 2 before it listened" in err
    assert str(tmp_path / "missing") in err, "the server process says what was wrong"
    assert main(["bench", "serve", "--server-process", "--url", "http://127.0.0.1:1"]) == 2
    assert "--server-process are for one started here" in capfd.readouterr().err


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


def test_each_rate_records_the_server_steps_it_took(monkeypatch):
    import deepinfer.bench.serve as bench

    async def fake_run_rate(url, model, workload, rate, seed, headers, max_connections):
        return [], 1.0

    totals = iter([(10, 1.0), (30, 1.5), (30, 1.5), (30, 1.5)])  # (steps, seconds) before and after each rate
    monkeypatch.setattr(bench, "run_rate", fake_run_rate)
    monkeypatch.setattr(bench, "summarize", lambda rate, records, wall: {"request_rate": rate})
    make = lambda seed: bench.random_workload(2, 4, 2, 0.0, 1000, seed)  # noqa: E731
    first, second = bench.sweep("http://x", "m", make, [5.0, 8.0], seed=0, warmup=False, server_steps=lambda: next(totals))
    assert first["server_steps"] == 20 and first["server_step_ms"] == pytest.approx(25.0)
    assert second["server_steps"] == 0 and second["server_step_ms"] is None


# A test-only shrink of V4-Flash (deepinfer/bench/e2e_v4.py's shape): V4's window, ratios and formats at small widths, 4 layers.
V4_TINY = dict(vocab_size=512, hidden_size=256, num_attention_heads=4, head_dim=128, qk_rope_head_dim=32, q_lora_rank=128, o_groups=2,
               o_lora_rank=128, index_n_heads=4, index_head_dim=64, index_topk=16, n_routed_experts=16, num_experts_per_tok=4,
               moe_intermediate_size=64, num_hidden_layers=4)  # fmt: skip


def test_bench_serve_with_the_v4_flash_shape(tmp_path, monkeypatch):
    """--model-shape v4-flash: the server started here runs bench e2e's random V4-Flash-shaped model (shrunk here), cut to
    --layers, its max_model_len the workload's longest request."""
    from deepinfer.bench import e2e_v4

    monkeypatch.setattr(e2e_v4, "V4_FLASH", {**e2e_v4.V4_FLASH, **V4_TINY})
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--backend", "reference", "--model-shape", "v4-flash", "--layers", "3", "--request-rate", "inf", "--num-prompts", "3",
            "--input-len", "6", "--output-len", "3", "--range-ratio", "0", "--max-num-seqs", "4", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["machine"]["model"] == "random-v4-flash-3-layers" and data["machine"]["max_model_len"] == 9
    (rate,) = data["results"]
    assert rate["completed"] == 3 and rate["failed"] == 0 and rate["output_tokens_per_s"] > 0, rate["errors"]


def parse_serve(*argv: str):
    from deepinfer.cli.main import build_parser

    return build_parser(["bench", "serve", *argv]).parse_args(["bench", "serve", *argv])


def test_the_v4_flash_server_process_gets_the_workloads_max_model_len():
    from deepinfer.cli.bench_serve import check, server_argv

    args = parse_serve("--model-shape", "v4-flash", "--layers", "8", "--input-len", "512", "--output-len", "128", "--range-ratio", "0.5")
    check(args)
    assert args.max_model_len == 768 + 192  # the longest prompt and output the workload draws
    argv = server_argv(args)
    assert argv[argv.index("--max-model-len") + 1] == "960" and argv[argv.index("--model-shape") + 1] == "v4-flash"
    given = parse_serve("--model-shape", "v4-flash", "--input-len", "16", "--output-len", "8", "--max-model-len", "4096")
    check(given)
    assert given.max_model_len == 4096
    tiny = parse_serve("--input-len", "16", "--output-len", "8")
    check(tiny)
    assert tiny.max_model_len is None and "--max-model-len" not in server_argv(tiny)  # a --model's own


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--url", "http://127.0.0.1:1", "--max-model-len", "64"], "--max-model-len and --server-process are for one started here"),
        (["--model-shape", "v4-flash", "--layers", "44"], "--layers cuts the model: at most 43 (V4-Flash), not 44"),
        (["--model-shape", "v4-flash", "--layers", "0"], "--layers must be at least 1, not 0"),
        (["--input-len", "16", "--output-len", "8", "--range-ratio", "0", "--max-model-len", "20"],
         "--max-model-len 20 is shorter than the workload's longest request (24 tokens, prompt and output)"),
    ],
)
def test_bad_v4_flash_values_are_one_line(argv, message, capsys):
    assert main(["bench", "serve", "--backend", "reference", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err
