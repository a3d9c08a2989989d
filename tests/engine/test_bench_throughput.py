"""`deepinfer bench throughput` / `sweep` / `plot` on the reference backend and the embedded tiny model:
the workload is what was asked (lengths, concurrency cap), the figures add up, the JSON and the plots
are written, and bad input is one line."""

from __future__ import annotations

import json

import pytest

from deepinfer.bench import throughput
from deepinfer.cli.main import main

from cli_helpers import run_main, write_lines

TINY = ["--backend", "reference", "--num-prompts", "6", "--input-len", "12", "--output-len", "5"]


def test_random_requests_have_the_asked_lengths():
    fixed = throughput.random_requests(20, 16, 8, 0.0, 100, seed=1)
    assert [len(r.prompt_token_ids) for r in fixed] == [16] * 20 and [r.output_len for r in fixed] == [8] * 20
    spread = throughput.random_requests(200, 16, 8, 0.5, 100, seed=1)
    ins = [len(r.prompt_token_ids) for r in spread]
    assert min(ins) >= 8 and max(ins) <= 24 and len(set(ins)) > 5
    assert spread == throughput.random_requests(200, 16, 8, 0.5, 100, seed=1)  # seeded


def test_the_concurrency_cap_holds_and_the_figures_add_up(monkeypatch):
    from deepinfer import LLM

    llm = LLM(backend="reference", announce=False, max_num_seqs=8)
    engine, running = llm.engine, []
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: running.append(len(engine.scheduler.running) + len(engine.scheduler.waiting)) or step())
    requests = throughput.random_requests(7, 10, 4, 0.0, engine.vocab_size)
    result = throughput.run(llm, requests, concurrency=3)
    assert max(running) == 3 and result.num_requests == 7 and result.output_len == 4 and result.input_len == 10
    assert result.output_tokens_per_s == pytest.approx(7 * 4 / result.seconds)
    assert result.total_tokens_per_s == pytest.approx(7 * 14 / result.seconds)
    assert 0 < result.ttft_ms["mean"] <= result.seconds * 1e3 and result.tpot_ms["p99"] >= result.tpot_ms["median"] > 0


def test_the_timed_pass_computes_every_prompt_as_the_warmup_did():
    """The warm-up pass's prefix cache is forgotten: cache hits in the timed pass would make it a
    different workload (cheaper prefills, kernels of other shapes compiled inside the timing)."""
    from deepinfer import LLM

    llm = LLM(backend="reference", announce=False, max_num_seqs=4)
    requests = throughput.random_requests(4, 40, 2, 0.0, llm.engine.vocab_size)
    computed = []
    run = llm.engine.runner.run
    llm.engine.runner.run = lambda batch, *a, **kw: computed.append(sum(batch.num_new_tokens) if batch.is_prefill else 0) or run(batch, *a, **kw)
    throughput.run(llm, requests, concurrency=4)
    assert sum(computed) == 2 * 4 * 40, "each pass prefills all 160 prompt tokens"
    assert llm.reset_prefix_cache()


def test_sweep_writes_json_and_plots_it(tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert main(["bench", "sweep", *TINY, "--concurrency", "1", "--concurrency", "3", "--json", str(out), "--plot", str(tmp_path)]) == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "throughput" and [r["concurrency"] for r in data["results"]] == [1, 3]
    assert (tmp_path / "sweep.png").stat().st_size > 1000
    assert main(["bench", "plot", str(out), "--out", str(tmp_path)]) == 0 and (tmp_path / "sweep.png").is_file()
    e2e = tmp_path / "e2e.json"
    rows = [{"batch": b, "deepinfer_step_ms": 2.0 * b**0.5, "floor_ms": 0.4 * b**0.5} for b in (1, 64, 256)]
    e2e.write_text(json.dumps({"machine": {"gpu": "H200"}, "results": rows}))
    assert main(["bench", "plot", str(e2e), "--out", str(tmp_path)]) == 0 and (tmp_path / "e2e.png").stat().st_size > 1000


def test_a_dataset_file_gives_the_prompts(tmp_path, capsys):
    data = write_lines(tmp_path / "p.jsonl", [{"prompt": "hello there"}, {"prompt_token_ids": [5, 6, 7], "max_tokens": 3}])
    out = tmp_path / "r.json"
    assert main(["bench", "throughput", "--backend", "reference", "--dataset", str(data), "--output-len", "2", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["num_requests"] == 2 and row["output_len"] == 2.5


@pytest.mark.parametrize(
    "args, message",
    [
        (["--concurrency", "0"], "--concurrency must be at least 1, not 0"),
        (["--range-ratio", "1.5"], "--range-ratio must lie in [0, 1), not 1.5"),
        (["--dataset", "/nonexistent.jsonl"], "--dataset /nonexistent.jsonl: no such file"),
        (["--json", "/nonexistent/x.json"], "cannot write /nonexistent/x.json: folder /nonexistent does not exist"),
        (["--model-shape", "v2-lite", "--model", "tiny-v3"], "give --model or --model-shape, not both"),
        (["--layers", "2"], "--layers cuts a --model-shape model; a --model checkpoint runs whole"),
        (["--model-shape", "v2-lite", "--layers", "0"], "--layers must be at least 1, not 0"),
    ],
)
def test_bad_input_is_one_line(args, message):
    proc = run_main("bench", "throughput", *TINY, *args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_a_file_that_is_no_benchmark_is_one_line(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"results": [{"foo": 1}]}))
    proc = run_main("bench", "plot", str(bad), "--out", str(tmp_path))
    assert proc.returncode == 2 and "is neither a `bench throughput`/`sweep`, a `bench serve` nor a `bench e2e` --json file" in proc.stderr


def test_a_random_model_shape_runs_cut_to_its_layers(tmp_path, monkeypatch, capsys):
    """--model-shape v2-lite: bench e2e's random-weight model (shrunk here to test sizes), cut to --layers."""
    from deepinfer.bench import e2e

    small = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
                 n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32, qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16,
                 bos_token_id=0, eos_token_id=1)  # fmt: skip
    monkeypatch.setattr(e2e, "V2_LITE", dict(e2e.V2_LITE, **small))
    out = tmp_path / "r.json"
    args = ["bench", "throughput", "--backend", "reference", "--model-shape", "v2-lite", "--layers", "2", "--num-prompts", "3",
            "--input-len", "6", "--output-len", "3", "--no-mixed-steps", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert data["machine"]["model"] == "random v2-lite (2 layers)" and data["machine"]["mixed_steps"] is False
    (row,) = data["results"]
    assert row["num_requests"] == 3 and row["output_len"] == 3 and row["input_len"] == 6
