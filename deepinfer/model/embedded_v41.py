"""The embedded tiny DeepSeek-V4.1 (`--model tiny-v41`): the released layout at small widths, random weights.

Its ten layers hold every role of the release's schedule (docs/models/deepseek_v41.md): 0-1 sliding window only
(1 with Engram), 2 a ratio-2 KV source (Full) and 3 its Reuse, 4 another ratio-2 Full layer with Engram (as 14),
5 the ratio-1 KV source and candidate source (as 20), then the decoder: 6 a Reuse of 5's selection, 7 a Reindex
layer selecting inside 5's candidate blocks, 8-9 Reuses of 7's; one DSpark block (`mtp.0`) drafting from layers
7-9. The window (128) and the DSpark block (5) are the release's, so the bounded replay's tail is its 133 tokens;
the candidate blocks bind past 64 compressed entries (64 tokens at ratio 1), not 16384. It carries DeepSeek's
real tokenizer (its 99092 Engram keys, as the release's). Weights are stored as the release stores them: FP8
e4m3 projections with e8m0 scales per 32x32 block, FP4 experts packed two per byte, FP8 Engram rows; values of
a trained model's sizes (norms near 1, projections of unit gain) drawn from one seeded generator in name order.
"""

from __future__ import annotations

import torch

V41_VERSION = "1"  # bump whenever the config, the seed or the recipe changes
V41_SEED = 20261206
ENGRAM_VOCAB = 1000  # where the Engram prime walk starts: 6 primes per table (3 n-gram orders x 2 heads)

V41_CONFIG = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "image_token_id": 129264,
    "tie_word_embeddings": False,
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
    "deepinfer_dummy_weights": True,  # read by the loader: say "dummy weights" even when loaded by path
    "text_config": {
        "model_type": "deepseek_v41_text",
        "vocab_size": 129280,  # DeepSeek's tokenizer
        "hidden_size": 64,
        "num_hidden_layers": 10,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 48,  # a partial 32x32 scale block
        "o_lora_rank": 32,
        "o_groups": 2,
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "rms_norm_eps": 1e-20,
        "max_position_embeddings": 1024,  # each of max_num_seqs state slots holds this many positions' compressed history
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 64},
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 64,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "sliding_window": 128,
        "window_size": 128,
        "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 1, 1, 0],
        "kv_source_layer_ids": [2, 4, 5],
        "index_source_layer_ids": [2, 4, 5, 7],
        "index_n_heads": 8,  # enough heads that an all-negative (exactly zero) index score is rare
        "index_head_dim": 32,
        "index_topk": 32,
        "candidate_source_layer_id": 5,
        "candidate_topk_blocks": 8,
        "candidate_block_size": 8,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "engram_layer_ids": [1, 4],
        "engram_num_embeddings": [6126, 6332],  # each table: the sum of its 6 primes (test_embedded_v41.py recomputes them)
        "engram_max_ngram_size": 4,
        "engram_n_heads": 2,
        "engram_head_dim": 32,
        "engram_vocab_size": ENGRAM_VOCAB,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 99092,  # DeepSeek's tokenizer.json normalises to this many keys
        "num_nextn_predict_layers": 1,
        "dspark_block_size": 5,
        "dspark_noise_token_id": 128799,
        "dspark_target_layer_ids": [7, 8, 9],
        "dspark_markov_rank": 16,
        "dspark_n_routed_experts": 8,
        "dspark_num_experts_per_tok": 2,
    },
}


def random_v41_weights(config_dict: dict | None = None, seed: int = V41_SEED) -> dict[str, torch.Tensor]:
    """Every text tensor of a V4.1 config by DeepSeek's name, in the release's storage (module docstring)."""
    from deepinfer.model.deepseek_v41.config import V41Config
    from deepinfer.model.deepseek_v41.tensors import FLOAT32, FP4_EXPERT, FP8_BLOCK, FP8_ROWS, v41_tensor_specs
    from deepinfer.ops import quant

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, spec in sorted(v41_tensor_specs(V41Config.from_dict(config_dict or V41_CONFIG)).items()):
        value = draw_value(name, spec.shape, generator)
        base = name.removesuffix(".weight")
        if spec.kind == FP8_BLOCK:
            tensors[name], tensors[f"{base}.scale"] = fp8_e8m0(value, (32, 32))
        elif spec.kind == FP8_ROWS:
            tensors[name], tensors[f"{base}.scale"] = fp8_e8m0(value, (1, 32))
        elif spec.kind == FP4_EXPERT:
            packed, scale = quant.quantize_weight_mxfp4(value)
            tensors[name], tensors[f"{base}.scale"] = packed.view(torch.int8), scale.view(torch.float8_e8m0fnu)
        else:
            tensors[name] = value.float() if spec.kind == FLOAT32 else value.to(torch.bfloat16)
    return tensors


def draw_value(name: str, shape: tuple[int, ...], generator: torch.Generator, device=None) -> torch.Tensor:
    """A float32 value of a trained model's size for the tensor `name`, so routing, top-k and greedy choices have
    margins a float comparison resolves (drawn on `device`, the generator's)."""
    draw = torch.randn(shape, generator=generator, device=device)
    if name.endswith(("norm.weight", "q_weight", "k_weight")):
        return 1 + 0.1 * draw
    if name.endswith("attn_sink"):
        return draw
    if name.endswith(("gate.bias", "bias_vl")):
        return 0.1 * draw
    if "hc_" in name:
        part = name.rsplit("_", 1)[1]
        return {"fn": 0.5 * draw / shape[-1] ** 0.5, "base": 0.5 * draw, "scale": 0.5 + 0.1 * draw}[part]
    if name == "embed.weight" or "engram.embed" in name:
        return draw
    return draw / shape[-1] ** 0.5  # a projection [out, in]: unit gain


def fp8_e8m0(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w as FP8 e4m3 with a power-of-two (e8m0) scale per `block`, partial edge blocks included: (values, scales)."""
    rows, cols = w.shape
    br, bc = block
    padded = torch.zeros(-(-rows // br) * br, -(-cols // bc) * bc)
    padded[:rows, :cols] = w.float().abs()
    amax = padded.view(padded.shape[0] // br, br, padded.shape[1] // bc, bc).amax(dim=(1, 3)).clamp(min=1e-4)
    exponent = torch.ceil(torch.log2(amax / 448)).clamp(-127, 127)
    full = torch.exp2(exponent).repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return (w.float() / full).to(torch.float8_e4m3fn), (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
