"""Tiny random DeepSeek-V4.1 checkpoints in the released layout, for the V4.1 loading tests.

`TINY_V41` is a released-style nested config.json at small widths holding every layer role (SWA, Full
at ratio 2 and 1, Reuse, Reindex inside the candidate source's blocks), two Engram layers and three
DSpark blocks. `random_v41_tensors` gives its tensors by DeepSeek's names, stored as the release
stores them: FP8 e4m3 projections with e8m0 scales per 32x32 block (q_lora_rank 48: a partial edge
block), FP4 experts packed two per byte with e8m0 per 32, Engram tables in FP8 rows, and a few
vision-tower tensors the loader skips.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from deepinfer.model.deepseek_v41.config import V41Config
from deepinfer.model.deepseek_v41.tensors import FP4_EXPERT, FP8_BLOCK, FP8_ROWS, v41_tensor_specs
from deepinfer.model.embedded_v41 import fp8_e8m0  # the embedded tiny-v41 writes its FP8 blocks the same way
from deepinfer.ops import quant

LAYERS = 8
TINY_V41 = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "image_token_id": 255,
    "tie_word_embeddings": False,
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
    "vision_config": {
        "model_type": "deepseek_v41_vision",
        "num_hidden_layers": 1,
        "hidden_size": 32,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "patch_size": 14,
    },
    "text_config": {
        "model_type": "deepseek_v41_text",
        "vocab_size": 256,
        "hidden_size": 64,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 48,
        "o_lora_rank": 32,
        "o_groups": 2,
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-20,
        "max_position_embeddings": 4096,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 256},
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "sliding_window": 16,
        "window_size": 16,
        # layers: 0-1 SWA, 2 Full r2, 3 Reuse, 4 Full r1 (candidate source), 5 Reuse, 6 Reindex, 7 Reuse; then 3 DSpark blocks
        "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 1, 0, 0, 0],
        "kv_source_layer_ids": [2, 4],
        "index_source_layer_ids": [2, 4, 6],
        "index_n_heads": 2,
        "index_head_dim": 32,
        "index_topk": 4,
        "candidate_source_layer_id": 4,
        "candidate_topk_blocks": 4,
        "candidate_block_size": 2,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "engram_layer_ids": [1, 2],
        "engram_num_embeddings": [40, 48],
        "engram_max_ngram_size": 4,
        "engram_n_heads": 2,
        "engram_head_dim": 32,
        "engram_vocab_size": 1000,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 200,
        "num_nextn_predict_layers": 3,
        "dspark_block_size": 5,
        "dspark_noise_token_id": 250,
        "dspark_target_layer_ids": [5, 6, 7],
        "dspark_markov_rank": 16,
        "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2,
    },
}
VISION = {"vision.blocks.0.attn.qkv.weight": torch.randn(96, 32), "aligner.proj.weight": torch.randn(64, 32), "image_newline": torch.randn(64)}


def tiny_config(**text_overrides) -> dict:
    """A deep copy of TINY_V41 with `text_config` keys replaced."""
    cfg = copy.deepcopy(TINY_V41)
    cfg["text_config"].update(text_overrides)
    return cfg


def random_v41_tensors(config: dict = TINY_V41, seed: int = 0, vision: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of `config` in the release's storage: the specs' shapes, random values."""
    torch.manual_seed(seed)
    out = {}
    for name, spec in v41_tensor_specs(V41Config.from_dict(config)).items():
        w = torch.randn(spec.shape) * 0.05
        base = name.removesuffix(".weight")
        if spec.kind == FP8_BLOCK:
            out[name], out[f"{base}.scale"] = fp8_e8m0(w, (32, 32))
        elif spec.kind == FP8_ROWS:
            out[name], out[f"{base}.scale"] = fp8_e8m0(w, (1, 32))
        elif spec.kind == FP4_EXPERT:
            packed, scale = quant.quantize_weight_mxfp4(w)
            out[name], out[f"{base}.scale"] = packed.view(torch.int8), scale.view(torch.float8_e8m0fnu)
        else:
            out[name] = w.to(torch.bfloat16)
    if vision:
        out.update({n: t.to(torch.bfloat16) for n, t in VISION.items()})
    return out


def write_v41(folder: Path, tensors: dict[str, torch.Tensor], config: dict = TINY_V41, shards: int = 2) -> Path:
    """The checkpoint folder: config.json, `shards` safetensors files and model.safetensors.index.json."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        save_file(part, str(folder / file))
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


# ---- the oracle's checkpoint: NeMo Automodel's V4.1 code runs it too (make_oracle_fixtures.py) ----------------------

# Engram bucket sizes: the primes above engram_vocab_size (20), one global walk, 6 per layer; a table holds their sum.
ORACLE_PRIMES = ((23, 29, 31, 37, 41, 43), (47, 53, 59, 61, 67, 71))


def tiny_vocabulary() -> list[str]:
    """256 token strings: three specials, then words whose normalised keys collide (case, accents, spaces),
    so the Engram token map compresses them (`engram_token_map`)."""
    words = ["<bos>", "<eos>", "<pad>"]
    letters = "abcdefghijklmnopqrstuvwxyz"
    words += list(letters) + [c.upper() for c in letters[:20]] + [" " + c for c in letters[:20]] + ["é", "É", "  ", "\t"]
    words += [a + b for a in letters[:8] for b in letters[:8]] + [(a + b).upper() for a in letters[:4] for b in letters[:8]]
    words += [f"w{i}" for i in range(256 - len(words))]
    return words


def tiny_tokenizer_json() -> str:
    """tokenizer.json of `tiny_vocabulary` (a WordLevel model: one token per id, decoded as itself)."""
    from tokenizers import Tokenizer, models

    vocab = {w: i for i, w in enumerate(tiny_vocabulary())}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.add_special_tokens(["<bos>", "<eos>", "<pad>"])
    return tokenizer.to_str()


ORACLE_COMPRESSED_VOCAB = 181  # distinct normalised keys of tiny_vocabulary (checked by the oracle test)
ORACLE_V41 = tiny_config(
    index_n_heads=8,  # enough heads that an all-negative (exactly zero) index score is rare
    engram_vocab_size=20,
    engram_num_embeddings=[sum(p) for p in ORACLE_PRIMES],
    engram_compressed_vocab_size=ORACLE_COMPRESSED_VOCAB,
)


def oracle_tensors(config: dict = ORACLE_V41, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of `config` stored as the release stores them, with values of a trained model's sizes (norm
    weights near 1, projections near unit gain, hyper-connection mixes near their biases), so that logits, routing
    and top-k boundaries have margins a float32 comparison can resolve."""
    torch.manual_seed(seed)
    out = {}
    for name, spec in v41_tensor_specs(V41Config.from_dict(config)).items():
        shape = spec.shape
        base = name.removesuffix(".weight")
        if name.endswith(("norm.weight", "q_weight", "k_weight")):
            w = 1 + 0.1 * torch.randn(shape)
        elif name.endswith("attn_sink"):
            w = torch.randn(shape)
        elif name.endswith(("gate.bias", "bias_vl")):
            w = 0.1 * torch.randn(shape)
        elif "hc_" in name:
            part = name.rsplit("_", 1)[1]
            w = {"fn": 0.5 * torch.randn(shape) / shape[-1] ** 0.5, "base": 0.5 * torch.randn(shape), "scale": 0.5 + 0.1 * torch.randn(shape)}[part]
        elif name == "embed.weight" or "engram.embed" in name:
            w = torch.randn(shape)
        else:  # a projection [out, in]: unit gain
            w = torch.randn(shape) / shape[-1] ** 0.5
        if spec.kind == FP8_BLOCK:
            out[name], out[f"{base}.scale"] = fp8_e8m0(w, (32, 32))
        elif spec.kind == FP8_ROWS:
            out[name], out[f"{base}.scale"] = fp8_e8m0(w, (1, 32))
        elif spec.kind == FP4_EXPERT:
            packed, scale = quant.quantize_weight_mxfp4(w)
            out[name], out[f"{base}.scale"] = packed.view(torch.int8), scale.view(torch.float8_e8m0fnu)
        elif spec.kind == "float32":
            out[name] = w.float()
        else:
            out[name] = w.to(torch.bfloat16)
    return out


def write_oracle_checkpoint(folder: Path, seed: int = 0) -> Path:
    """The oracle's checkpoint folder: `ORACLE_V41`, `oracle_tensors(seed)` and the tiny tokenizer."""
    write_v41(folder, oracle_tensors(ORACLE_V41, seed), ORACLE_V41)
    (folder / "tokenizer.json").write_text(tiny_tokenizer_json())
    return folder
