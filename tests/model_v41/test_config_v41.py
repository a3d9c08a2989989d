"""DeepSeek-V4.1's config.json: the released nested form parses, each layer's role follows from the
source lists, the released shapes come out, and each bad value is one line naming the key and what is allowed."""

from __future__ import annotations

import copy
import json

import pytest

from deepinfer.model.deepseek_v41.config import V41Config
from deepinfer.model.deepseek_v41.roles import FULL, REINDEX, REUSE, SWA
from deepinfer.model.deepseek_v41.tensors import FP4_EXPERT, v41_tensor_specs
from deepinfer.model.errors import CheckpointError
from deepinfer.model.loader import load_config

from model_v41.tiny_v41 import TINY_V41, tiny_config

# The released Flash text_config (docs/models/deepseek_v41.md; v41.md section 1).
FLASH_TEXT = {
    "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_lora_rank": 1024, "o_groups": 8,
    "hidden_act": "silu", "swiglu_limit": 10.0, "rms_norm_eps": 1e-20, "max_position_embeddings": 1048576, "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 65536},
    "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 2304, "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "sliding_window": 128, "window_size": 128,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0], "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36], "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
    "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4,
    "engram_n_heads": 8, "engram_head_dim": 256, "engram_vocab_size": 16000000, "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092, "num_nextn_predict_layers": 3, "dspark_block_size": 5, "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
}  # fmt: skip
FLASH = {**copy.deepcopy(TINY_V41), "image_token_id": 129264, "text_config": FLASH_TEXT}
FLASH["vision_config"] = {
    "model_type": "deepseek_v41_vision",
    "num_hidden_layers": 32,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "intermediate_size": 2816,
    "patch_size": 14,
}


def test_the_released_flash_config_gives_the_released_layer_schedule():
    config = V41Config.from_dict(FLASH)
    kinds = {kind: [r.layer for r in config.roles if r.kind == kind] for kind in (SWA, FULL, REINDEX, REUSE)}
    assert kinds[SWA] == [0, 1] and kinds[FULL] == [2, 8, 14, 20] and kinds[REINDEX] == [24, 28, 32, 36]
    assert len(kinds[REUSE]) == 40 - 2 - 4 - 4
    assert [r.kv_source for r in config.roles[2:]] == [2] * 6 + [8] * 6 + [14] * 6 + [20] * 20
    assert [config.roles[layer].topk_owner for layer in (3, 21, 23, 25, 27, 37, 39)] == [2, 20, 20, 24, 24, 36, 36]
    assert [r.layer for r in config.roles if r.candidate_filtered] == [24, 28, 32, 36]  # Reindex inside layer 20's candidates
    assert [r.layer for r in config.roles if r.engram is not None] == [1, 14]
    assert config.engram_hash_heads == 24 and config.hc_coefficients == 24
    assert config.compress_rope == {"rope_theta": 160000.0, "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                                    "beta_slow": 1, "rope_type": "yarn", "attention_factor": 1.0}  # fmt: skip
    assert config.quantization == {"weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    assert config.vision.num_hidden_layers == 32 and config.eos_token_ids == (1,)


def test_the_released_flash_config_implies_the_release_shard_headers_counts_and_shapes():
    specs = v41_tensor_specs(V41Config.from_dict(FLASH))
    count = lambda suffix: sum(n.startswith("layers.") and n.endswith(suffix) for n in specs)  # noqa: E731
    # the counts the release's shard headers show (v41.md section 2)
    assert count("attn.wq_a.weight") == 40 and count("attn.compressor.wkv.weight") == 4 and count("attn.compressor.wgate.weight") == 3
    assert count("attn.indexer.wq_b.weight") == 8 and count("attn.indexer.wk.weight") == 4 and count("engram.embed.weight") == 2
    assert sum(n.startswith("layers.") and specs[n].kind == FP4_EXPERT for n in specs) == 40 * 384 * 3
    shapes = {
        "layers.0.attn.wq_a.weight": (1280, 5120), "layers.0.attn.wq_b.weight": (32768, 1280), "layers.0.attn.wo_a.weight": (8192, 4096),
        "layers.0.attn.wo_b.weight": (5120, 8192), "layers.0.hc_attn_fn": (24, 20480), "layers.0.ffn.experts.383.w2.weight": (5120, 2304),
        "layers.0.ffn.gate.bias_vl": (384,), "layers.20.attn.indexer.wk.weight": (128, 512), "layers.24.attn.indexer.wq_b.weight": (4096, 1280),
        "layers.1.engram.embed.weight": (384006168, 256), "layers.14.engram.wkv.weight": (25600, 6144), "layers.14.engram.q_weight": (4, 5120),
        "mtp.0.main_proj.weight": (5120, 15360), "mtp.1.ffn.gate.weight": (128, 5120), "mtp.2.ffn.experts.127.w1.weight": (2304, 5120),
        "mtp.2.markov_head.embed.weight": (129280, 256), "mtp.2.confidence_head.proj.weight": (1, 5376), "head.weight": (129280, 5120),
    }  # fmt: skip
    assert {name: specs[name].shape for name in shapes} == shapes
    assert "layers.20.attn.compressor.wgate.weight" not in specs and "mtp.0.attn.compressor.wkv.weight" not in specs
    assert "mtp.0.ffn.experts.128.w1.weight" not in specs and "layers.3.attn.indexer.wq_b.weight" not in specs


def _set(path: str, value):
    """A TINY_V41 copy with the key at `path` ("text_config.x", "quantization_config.y", "z") set; value ... deletes it."""
    cfg = copy.deepcopy(TINY_V41)
    *parents, key = path.split(".")
    node = cfg
    for p in parents:
        node = node[p]
    if value is ...:
        del node[key]
    else:
        node[key] = value
    return cfg


BAD = [
    ("model_type", "deepseek_v4x", "model_type 'deepseek_v4x' is not supported"),
    ("text_config", ..., "text_config is missing"),
    ("text_config", [1], r"text_config is \[1\], expected an object"),
    ("text_config.model_type", "deepseek_v4", "text_config.model_type 'deepseek_v4' is not supported; supported: deepseek_v41_text"),
    ("text_config.hidden_size", ..., "required field text_config.hidden_size is missing"),
    ("text_config.hidden_size", 64.5, "text_config.hidden_size is 64.5, expected an integer >= 1"),
    ("quantization_config.weight_block_size", [128, 128], r"quantization_config.weight_block_size is \[128, 128\], expected \[32, 32\]"),
    ("quantization_config.scale_fmt", "float32", "quantization_config.scale_fmt 'float32' is not supported; supported: ue8m0"),
    ("quantization_config.expert_dtype", "fp8", "quantization_config.expert_dtype 'fp8' is not supported; supported: fp4"),
    ("quantization_config.quant_method", ..., "required field quantization_config.quant_method is missing"),
    ("vision_config.model_type", "clip", "vision_config.model_type 'clip' is not supported"),
    ("text_config.num_key_value_heads", 2, "text_config.num_key_value_heads is 2, expected 1"),
    ("text_config.n_shared_experts", 2, "text_config.n_shared_experts is 2, expected 1"),
    ("text_config.first_k_dense_replace", 1, "text_config.first_k_dense_replace is 1, expected 0"),
    ("text_config.scoring_func", "softmax", "text_config.scoring_func 'softmax' is not supported; supported: sqrtsoftplus"),
    ("text_config.rms_norm_eps", 0, "text_config.rms_norm_eps is 0, expected a finite number > 0"),
    ("text_config.sliding_window", 10**6, r"text_config.sliding_window is 1000000, expected an integer in \[1, 16384\]"),
    ("text_config.window_size", 32, "text_config.window_size is 32 but sliding_window is 16"),
    ("text_config.index_topk", 10**9, r"text_config.index_topk is 1000000000, expected an integer in \[1, 16384\]"),
    ("text_config.hc_sinkhorn_iters", 10**6, r"text_config.hc_sinkhorn_iters is 1000000, expected an integer in \[1, 256\]"),
    (
        "text_config.compress_ratios",
        [0, 0, 3, 3, 1, 1, 1, 1, 0, 0, 0],
        "text_config.compress_ratios is .*, expected a list of compress ratios, each 0 or a power of two",
    ),
    (
        "text_config.compress_ratios",
        [0, 0, 2, 2, 1, 1, 1, 1, 0, 0],
        r"compress_ratios has 10 entries, expected num_hidden_layers \+ num_nextn_predict_layers = 8 \+ 3",
    ),
    ("text_config.compress_ratios", [0, 0, 2, 2, 1, 1, 1, 1, 0, 0, 2], r"compress_ratios ends with \[0, 0, 2\] for the DSpark blocks, expected 0 each"),
    (
        "text_config.compress_ratios",
        [0, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0],
        r"layer 1 has compress_ratio 2 but no KV source at or before it \(kv_source_layer_ids \[2, 4\]\)",
    ),
    (
        "text_config.compress_ratios",
        [0, 0, 2, 1, 1, 1, 1, 1, 0, 0, 0],
        "layer 3 has compress_ratio 1 but reads the compressed KV of layer 2, whose compress_ratio is 2",
    ),
    ("text_config.kv_source_layer_ids", [1, 4], "kv_source_layer_ids holds layer 1, whose compress_ratio is 0"),
    ("text_config.kv_source_layer_ids", [2, 4, 5], "kv_source_layer_ids holds layer 5, which is not in index_source_layer_ids"),
    ("text_config.kv_source_layer_ids", [4, 2], r"kv_source_layer_ids is \[4, 2\], expected layer ids in increasing order without repeats"),
    ("text_config.index_source_layer_ids", [2, 4, 6, 9], r"index_source_layer_ids holds layer 9, outside \[0, num_hidden_layers=8\)"),
    ("text_config.index_source_layer_ids", [0, 2, 4], "index_source_layer_ids holds layer 0, whose compress_ratio is 0"),
    ("text_config.candidate_source_layer_id", 6, r"candidate_source_layer_id is 6, expected -1 \(off\) or one of kv_source_layer_ids \[2, 4\]"),
    ("text_config.candidate_topk_blocks", 1, r"candidate_topk_blocks x candidate_block_size - \(candidate_block_size - 1\) = 1 is below index_topk=4"),
    ("text_config.candidate_block_size", -1, "candidate_topk_blocks=4 and candidate_block_size=-1 must be >= 1 while candidate_source_layer_id is set"),
    ("text_config.engram_num_embeddings", [40], "engram_num_embeddings has 1 tables for 2 engram_layer_ids"),
    ("text_config.engram_num_embeddings", [40, 5], "engram_num_embeddings gives layer 2 5 rows, fewer than its 6 hash heads"),
    ("text_config.engram_num_embeddings", 40, "text_config.engram_num_embeddings is 40, expected a list of integers >= 1"),
    ("text_config.engram_layer_ids", [1, 8], r"engram_layer_ids holds layer 8, outside \[0, num_hidden_layers=8\)"),
    ("text_config.engram_max_ngram_size", 1, r"text_config.engram_max_ngram_size is 1, expected an integer in \[2, 8\]"),
    ("text_config.engram_pad_token_id", 200, "engram_pad_token_id=200 is not below engram_compressed_vocab_size=200"),
    ("text_config.dspark_target_layer_ids", [], "dspark_target_layer_ids is empty, but num_nextn_predict_layers=3 DSpark blocks need target layers"),
    ("text_config.dspark_target_layer_ids", [6, 8], r"dspark_target_layer_ids is \[6, 8\], expected distinct layers below num_hidden_layers=8"),
    ("text_config.dspark_num_experts_per_tok", 5, "dspark_num_experts_per_tok=5 exceeds dspark_n_routed_experts=4"),
    ("text_config.dspark_noise_token_id", 256, "dspark_noise_token_id=256 is not below vocab_size=256"),
    ("text_config.dspark_block_size", 0, r"text_config.dspark_block_size is 0, expected an integer in \[1, 64\]"),
    ("text_config.num_experts_per_tok", 5, "num_experts_per_tok=5 exceeds n_routed_experts=4"),
    ("text_config.o_groups", 3, "o_groups=3 does not divide num_attention_heads x head_dim = 256"),
    ("text_config.qk_rope_head_dim", 15, "qk_rope_head_dim=15 must be even and at most head_dim=64"),
    ("text_config.index_head_dim", 8, "index_head_dim=8 is narrower than qk_rope_head_dim=16"),
    ("text_config.rope_scaling", {"type": "yarn", "factor": 16}, "text_config.rope_scaling.original_max_position_embeddings is required for yarn rope scaling"),
    ("image_token_id", 256, "image_token_id=256 is not below text_config.vocab_size=256"),
]


@pytest.mark.parametrize("path, value, message", BAD, ids=[f"{p}={v!r}"[:60] for p, v, _ in BAD])
def test_a_bad_value_is_one_line_naming_the_key_and_what_is_allowed(path, value, message):
    with pytest.raises(CheckpointError, match=message) as caught:
        V41Config.from_dict(_set(path, value), source="x/config.json")
    assert "\n" not in str(caught.value) and str(caught.value).startswith("x/config.json: ")


def test_the_tiny_config_is_valid_and_read_through_the_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(max_position_embeddings=512)))
    config = load_config(tmp_path)
    assert isinstance(config, V41Config) and config.model_type == "deepseek_v41" and config.max_position_embeddings == 512
    (tmp_path / "config.json").write_text(json.dumps(_set("text_config.kv_source_layer_ids", [1, 4])))
    with pytest.raises(CheckpointError, match=rf"^{tmp_path}/config.json: text_config: kv_source_layer_ids holds layer 1"):
        load_config(tmp_path)
