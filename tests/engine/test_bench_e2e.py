"""The end-to-end benchmark's plumbing on the CPU: same weights in transformers and deepinfer, same
greedy tokens, and a floor computed from the config. (Its timings are only meaningful on a GPU.)"""

import itertools
import json

import torch

from deepinfer.bench import e2e

TINY_V2 = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
    num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256,
    bos_token_id=510, eos_token_id=511,  # inside the tiny vocabulary
)


def test_tiny_run_produces_results_and_json(tmp_path, monkeypatch):
    # A clock that only moves forward, one millisecond per timed call: each later (longer) generation
    # takes longer, so the plumbing is checked without timing the machine (a busy CPU would void it).
    clock = itertools.count(1)
    monkeypatch.setattr(e2e, "_timed", lambda fn, device: (fn(), next(clock) * 1e-3)[1])
    out = tmp_path / "e2e.json"
    results = e2e.run("reference", batches=(1, 3), prompt_len=8, new_tokens=2, layers=2, json_path=out, config_overrides=TINY_V2, copy_gib=0.01)
    assert [r.batch for r in results] == [1, 3]
    for r in results:
        assert r.deepinfer_step_ms > 0 and r.hf_step_ms > 0 and r.floor_ms > 0
        assert r.deepinfer_tok_s == r.batch / (r.deepinfer_step_ms / 1e3)
    saved = json.loads(out.read_text())
    assert saved["machine"]["layers"] == 2 and len(saved["results"]) == 2
    assert saved["machine"]["backend"] == "reference" and saved["machine"]["gpu"] == "cpu"
    assert "floor ms" in e2e.format_results(results)


def test_deepinfer_runs_the_transformers_weights_token_for_token():
    from transformers import AutoConfig, AutoModelForCausalLM

    from deepinfer.engine.llm import LLM
    from deepinfer.engine.llm_engine import EngineConfig, LLMEngine
    from deepinfer.engine.sampling_params import SamplingParams
    from deepinfer.model.config import ModelConfig
    from deepinfer.model.deepseek import DeepseekForCausalLM
    from deepinfer.model.loader import LoadedModel
    from deepinfer.model.weights import WeightStore
    from deepinfer.runtime import open_runtime

    cfg = dict(e2e.V2_LITE, **TINY_V2, num_hidden_layers=2)
    torch.manual_seed(0)
    hf_config = AutoConfig.for_model("deepseek_v2", **cfg)
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    rt = open_runtime("reference", dtype=torch.float32)
    config = ModelConfig.from_dict({**hf_config.to_dict(), **cfg, "model_type": "deepseek_v2"}, source="tiny")
    model = DeepseekForCausalLM(config, rt.ops, rt.device, torch.float32)
    model.load_weights(WeightStore(e2e.hf_to_deepinfer_tensors(hf.state_dict(), cfg)))
    llm = LLM.from_engine(LLMEngine(LoadedModel(model, config, None, "tiny"), rt, torch.float32, EngineConfig(num_kv_blocks=64)))
    ids = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(3))
    outputs = llm.generate([{"prompt_token_ids": p.tolist()} for p in ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    ours = [o.outputs[0].token_ids for o in outputs]
    with torch.inference_mode():
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False)[:, 7:].tolist()
    assert ours == theirs


def test_floor_counts_touched_experts():
    one = e2e.decode_floor_bytes(e2e.V2_LITE, batch=1, context=0)
    many = e2e.decode_floor_bytes(e2e.V2_LITE, batch=64, context=0)
    expert = 3 * 2048 * 1408 * 2
    # batch 1 touches 6 routed experts per MoE layer; batch 64 nearly all 64.
    assert 26 * 50 * expert < many - one < 26 * 58 * expert
    assert 15e9 < e2e.decode_floor_bytes(e2e.V2_LITE, batch=64, context=0) < 33e9


def test_memory_needed_counts_the_v2_lite_weights_once():
    parts = e2e.memory_needed(e2e.V2_LITE, max_batch=64, prompt_len=128, new_tokens=64, with_hf=True, copy_gib=2.0)
    assert 15.5e9 * 2 < parts["weights"] < 16e9 * 2  # DeepSeek-V2-Lite: 15.7B parameters in bf16
    assert 14e9 * 2 < parts["stacked experts"] < parts["weights"]  # deepinfer's copy of the 64 x 26 routed experts
    assert parts["KV cache"] <= e2e.ENGINE_KV_CACHE_GIB * e2e.GiB and parts["bandwidth test"] == 4 * e2e.GiB
    assert "HF KV cache" not in e2e.memory_needed(e2e.V2_LITE, 64, 128, 64, with_hf=False, copy_gib=2.0)


def test_cli_refuses_a_run_that_does_not_fit_in_one_line(monkeypatch, capsys):
    from deepinfer.cli.main import main

    monkeypatch.setattr(e2e, "free_memory", lambda device, memory_info: 3 * e2e.GiB)
    assert main(["bench", "e2e", "--backend", "reference", "--layers", "2", "--no-hf"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "bench e2e needs at least 7.6 GiB on cpu (weights 2.0, stacked experts 1.0, KV cache 0.6, bandwidth test 4.0) and 3.0 GiB is free" in err
    assert "--layers" in err


def test_cli_asks_the_chosen_backend_whether_it_can_run():
    from cli_helpers import run_main

    result = run_main("bench", "e2e", "--backend", "cuda")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "backend 'cuda' is not available" in lines[0]
    result = run_main("bench", "e2e", "--layers", "28")
    assert result.returncode == 2 and "--layers cuts the model: at most 27, not 28" in result.stderr
