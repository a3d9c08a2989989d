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
        (["--model-shape", "v4-flash", "--layers", "44"], "--layers cuts the model: at most 43 (V4-Flash), not 44"),
        (["--max-model-len", "16"], "--max-model-len 16 is shorter than the workload's longest request (17 tokens, prompt and output)"),
        (["--max-model-len", "24", "--range-ratio", "0.5"], "--max-model-len 24 is shorter than the workload's longest request (25 tokens"),
        (["--max-model-len", "0"], "--max-model-len must be at least 1, not 0"),
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


# A test-only shrink of V4-Flash (deepinfer/bench/e2e_v4.py's shape): V4's window, ratios and formats at small widths, 4 layers.
V4_TINY = dict(vocab_size=512, hidden_size=256, num_attention_heads=4, head_dim=128, qk_rope_head_dim=32, q_lora_rank=128, o_groups=2,
               o_lora_rank=128, index_n_heads=4, index_head_dim=64, index_topk=16, n_routed_experts=16, num_experts_per_tok=4,
               moe_intermediate_size=64, num_hidden_layers=4)  # fmt: skip


@pytest.fixture
def tiny_v4_flash(monkeypatch):
    from deepinfer.bench import e2e_v4

    monkeypatch.setattr(e2e_v4, "V4_FLASH", {**e2e_v4.V4_FLASH, **V4_TINY})
    return e2e_v4


def test_the_v4_flash_shape_serves_the_workload_at_its_own_max_model_len(tmp_path, tiny_v4_flash):
    """--model-shape v4-flash: bench e2e's random V4-Flash-shaped model (fp8 projections, mxfp4 experts, FP8 KV), its
    max_model_len the workload's longest request (6 + 3 tokens), not the config's 1M positions."""
    out = tmp_path / "r.json"
    args = ["bench", "throughput", "--backend", "reference", "--model-shape", "v4-flash", "--num-prompts", "3", "--input-len", "6",
            "--output-len", "3", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert data["machine"]["model"] == "random v4-flash (4 layers)" and data["machine"]["max_model_len"] == 9
    (row,) = data["results"]
    assert row["num_requests"] == 3 and row["output_len"] == 3 and row["input_len"] == 6
    dataset = write_lines(tmp_path / "p.jsonl", [{"prompt_token_ids": [5, 6, 7], "max_tokens": 9}, {"prompt_token_ids": list(range(8))}])
    args = ["bench", "throughput", "--backend", "reference", "--model-shape", "v4-flash", "--dataset", str(dataset), "--output-len", "2", "--json", str(out)]
    assert main(args) == 0
    assert json.loads(out.read_text())["machine"]["max_model_len"] == 12  # its longest request: 3 prompt tokens and 9 out


def test_the_v4_flash_llm_keeps_the_release_formats_and_an_fp8_cache(tiny_v4_flash):
    import torch

    options = {"seed": 0, "max_num_seqs": 2, "max_model_len": 40}
    llm = throughput.shape_llm("v4-flash", "reference", 3, options, "bench throughput")
    engine = llm.engine
    assert engine.max_model_len == 40 and engine.cache_dtype == torch.float8_e4m3fn and engine.loaded.config.num_hidden_layers == 3
    assert engine.num_kv_blocks == 2 * -(-40 // engine.block_size)  # max_num_seqs requests of max_model_len tokens
    model = engine.loaded.model
    assert model.layers[2].attn.wq_b.fmt == "fp8_block" and model.layers[2].ffn.down.fmt == "mxfp4"
    result = throughput.run(llm, throughput.random_requests(2, 30, 4, 0.0, engine.vocab_size), concurrency=2)
    assert result.num_requests == 2 and result.output_len == 4


def test_the_v4_flash_shape_keeps_the_layers_that_fit(tiny_v4_flash, monkeypatch, capsys):
    """Without --layers, the most layers whose weights, KV cache, state slots and prefill activations fit the free memory;
    a misfit of even one layer is one line."""
    import torch

    e2e_v4 = tiny_v4_flash
    # 3 requests of 9 tokens: 3 KV blocks of 16 tokens, 3 state slots, a prefill step of at most 27 tokens; float32 on the CPU
    engine = e2e_v4.EnginePlan(num_blocks=3, max_seqs=3, prefill_tokens=27, longest=9)

    def need(n):
        return sum(e2e_v4.memory_parts(e2e_v4.flash_config(n), [engine], 16, torch.float8_e4m3fn, torch.float32).values())

    monkeypatch.setattr(e2e_v4, "free_memory", lambda device, memory_info: int(need(2) + (need(3) - need(2)) // 2))
    args = ["bench", "throughput", "--backend", "reference", "--model-shape", "v4-flash", "--num-prompts", "3", "--input-len", "6", "--output-len", "3"]
    assert main(args) == 0
    assert "V4-Flash shape cut to 2 of 4 layers" in capsys.readouterr().err
    monkeypatch.setattr(e2e_v4, "free_memory", lambda device, memory_info: 1 << 30)
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "bench throughput --model-shape v4-flash needs at least" in err and "1.0 GiB is free for even one layer" in err, err
    assert "lower --max-num-seqs / --input-len / --output-len (or --max-model-len)" in err
