"""The DeepSeek-V4 oracle itself (model_v4/oracle.py): its configs cover what they claim, its checkpoints carry
random values everywhere and the names they claim, and transformers' reference is deterministic and causal."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from model_v4 import oracle
from model_v4.oracle import MTP_EXTRA_NAMES, TINY_CONFIGS, build_config, build_model, hf_prompt_logits, hf_reference, load_hf, prompt


def test_tiny_configs_cover_every_layer_and_mlp_type():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    configs = {name: build_config(name) for name in TINY_CONFIGS}
    assert {t for c in configs.values() for t in c.layer_types} == {oracle.SLIDING, oracle.CSA, oracle.HCA}
    assert {t for c in configs.values() for t in c.mlp_layer_types} == {"hash_moe", "moe"}
    assert {c.hc_mult for c in configs.values()} >= {2, 4}
    for name, c in configs.items():
        assert c.hc_mult >= 2 and c.o_groups >= 2 and c.num_nextn_predict_layers == 1, name
        assert 8 <= c.sliding_window <= 32 and c.qk_rope_head_dim % 2 == 0, name
        hca = c.compress_rates[oracle.HCA]
        assert hca % 4 == 0 and hca <= 32, name
        assert 300 // c.compress_rates[oracle.CSA] > c.index_topk, name  # a 300-token prompt makes the indexer choose
        assert c.mlp_layer_types[-1] == "moe", name  # the MTP block copies the last layer: it routes with gate.bias
    yarn = configs["yarn"]
    assert yarn.rope_parameters["compress"]["rope_type"] == "yarn" and yarn.rope_parameters["main"]["rope_type"] == "default"
    rope = DeepseekV4RotaryEmbedding(yarn)
    dim = yarn.qk_rope_head_dim
    plain = 1.0 / (yarn.compress_rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    assert not torch.allclose(rope.compress_inv_freq, plain)  # YaRN really rescales the compress rope
    assert rope.compress_attention_scaling == 1.0


def test_checkpoint_parameters_are_all_random(v4_checkpoint):
    """transformers initialises sinks, position biases, hc base / scale, the router bias, tid2eid and the norms to
    constants; the oracle's checkpoints randomise them all, and tid2eid rows are distinct experts."""
    config = TINY_CONFIGS["mixed"]
    state = load_hf(v4_checkpoint("mixed")).state_dict()
    for name, tensor in state.items():
        if tensor.numel() > 1:
            assert tensor.unique().numel() > 1, f"{name} is constant"
        if name.endswith("scale") or tensor.numel() == 1:
            assert not torch.equal(tensor, torch.ones_like(tensor)), name
    tables = [t for name, t in state.items() if name.endswith("tid2eid")]
    assert len(tables) == config["mlp_layer_types"].count("hash_moe")
    for table in tables:
        assert table.dtype == torch.int64 and table.shape == (config["vocab_size"], config["num_experts_per_tok"])
        assert int(table.min()) >= 0 and int(table.max()) < config["n_routed_experts"]
        assert bool((table[:, 0] != table[:, 1]).all())
        assert table.unique().numel() == config["n_routed_experts"]


def test_deepseek_names_load_like_hf_names(v4_checkpoint):
    hf, ds = v4_checkpoint("mixed", names="hf"), v4_checkpoint("mixed", names="deepseek")
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        hf_names = set(f.keys())
    with safe_open(str(ds / "model.safetensors"), "pt") as f:
        ds_names = set(f.keys())
        assert f.get_tensor("layers.0.ffn.gate.tid2eid").dtype == torch.int64
    assert not [n for n in ds_names if n.startswith("model.")]
    assert {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"} <= ds_names
    assert {"model.embed_tokens.weight", "head.weight", "model.norm.weight", "model.hc_head.hc_fn"} <= hf_names
    assert {oracle.hf_to_deepseek_name(n) for n in hf_names} == ds_names
    for names in (hf_names, ds_names):
        mtp = {n[len("mtp.0."):] for n in names if n.startswith("mtp.")}
        assert set(MTP_EXTRA_NAMES) <= mtp and {"attn.wq_a.weight", "ffn.gate.bias", "hc_attn_fn", "ffn.experts.0.w1.weight"} <= mtp
    a, b = load_hf(hf).state_dict(), load_hf(ds).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # transformers maps the release names back


def test_swiglu_clamp_triggers_in_every_config():
    """The routed experts' gate / up pre-activations exceed swiglu_limit somewhere on a short prompt."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

    for name in TINY_CONFIGS:
        with oracle.one_thread():
            model = build_model(name)
        seen = {"over": 0, "all": 0}

        def watch(experts):
            apply_gate = experts._apply_gate

            def spy(gate_up):
                seen["over"] += int((gate_up.abs() > experts.limit).sum())
                seen["all"] += gate_up.numel()
                return apply_gate(gate_up)

            experts._apply_gate = spy

        for module in model.modules():
            if isinstance(module, DeepseekV4Experts):
                watch(module)
        with oracle.one_thread(), torch.inference_mode():
            model(input_ids=torch.tensor([prompt(48, seed=2)]), use_cache=False)
        assert seen["all"] > 0 and seen["over"] > 0, name


def test_reference_is_deterministic_and_not_degenerate(v4_checkpoint):
    folder, ids = v4_checkpoint("mixed"), prompt(40, seed=3)  # 10 CSA entries for index_topk 8: the indexer chooses
    first, second = hf_reference(folder, ids, 4), hf_reference(folder, ids, 4)
    assert first["tokens"] == second["tokens"] and len(first["tokens"]) == 4
    assert all(torch.equal(a, b) for a, b in zip(first["step_logits"], second["step_logits"]))
    assert torch.equal(first["logits"], first["step_logits"][0]) and first["logits"].dtype == torch.float32
    assert first["logits"].shape == (TINY_CONFIGS["mixed"]["vocab_size"],) and bool(torch.isfinite(first["logits"]).all())
    assert float(first["logits"].std()) > 0.3 and len(set(first["tokens"])) > 1
    assert first["indexer_margin"] < float("inf") and min(first["margins"]) > 0


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_reference_is_causal(name, v4_checkpoint):
    """Position t's logits do not change when 20 tokens follow it, token by token or in one full-sequence forward.
    From t = 4 * (index_topk + 1) - 1 on the indexer chooses; t is past that, and past every HCA ratio (<= 32)."""
    config = TINY_CONFIGS[name]
    folder, t = v4_checkpoint(name), max(4 * (config["index_topk"] + 2), 40)
    ids = prompt(t + 21, seed=4)
    alone = hf_reference(folder, ids[: t + 1], 1)["logits"]
    stepwise = hf_prompt_logits(folder, ids)
    full = hf_prompt_logits(folder, ids, chunk=len(ids))
    assert float((stepwise[t] - alone).abs().max()) < 1e-5
    assert float((full[t] - alone).abs().max()) < 1e-5
    assert float((full - stepwise).abs().max()) < 1e-5  # every position, not only t


def test_cached_reference_is_shared_and_stored(v4_checkpoint, monkeypatch, tmp_path):
    monkeypatch.setattr(oracle, "CACHE_DIR", tmp_path / "v4-oracle")
    monkeypatch.setattr(oracle, "_MEMO", {})
    monkeypatch.delenv("DEEPINFER_TEST_CACHE_OFF", raising=False)
    folder, ids = v4_checkpoint("mixed"), prompt(20, seed=5)
    fresh = oracle.hf_reference_cached(folder, ids, 2)
    assert len(list((tmp_path / "v4-oracle").glob("*.pt"))) == 1
    oracle._MEMO.clear()
    stored = oracle.hf_reference_cached(folder, ids, 2)
    assert stored["tokens"] == fresh["tokens"] and torch.equal(stored["logits"], fresh["logits"])
    assert oracle.hf_reference_cached(folder, ids, 2) is stored


def test_pick_prompt_finds_robust_choices(v4_checkpoint):
    folder = v4_checkpoint("mixed")
    ids = oracle.pick_prompt(folder, 100, 4)
    ref = hf_reference(folder, ids, 4, chunk=len(ids))
    assert len(ids) == 100 and ref["indexer_margin"] >= 1e-4 and min(ref["margins"]) >= 1e-3
    with pytest.raises(ValueError, match="no prompt"):
        oracle.pick_prompt(folder, 100, 4, min_margin=1e3, tries=2)
