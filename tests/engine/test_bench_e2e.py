"""The end-to-end benchmark's plumbing on the CPU: same weights in transformers and deepinfer, same
greedy tokens, and a floor computed from the config. (Its timings are only meaningful on a GPU.)"""

import json

import torch

from deepinfer.bench import e2e

TINY_V2 = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
    num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256,
)


def test_tiny_run_produces_results_and_json(tmp_path):
    out = tmp_path / "e2e.json"
    results = e2e.run("reference", batches=(1, 3), prompt_len=8, new_tokens=2, layers=2, json_path=out, config_overrides=TINY_V2, copy_gib=0.01)
    assert [r.batch for r in results] == [1, 3]
    for r in results:
        assert r.deepinfer_step_ms > 0 and r.hf_step_ms > 0 and r.floor_ms > 0
        assert r.deepinfer_tok_s == r.batch / (r.deepinfer_step_ms / 1e3)
    saved = json.loads(out.read_text())
    assert saved["machine"]["layers"] == 2 and len(saved["results"]) == 2
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
    ours = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p.tolist()} for p in ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)]
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
