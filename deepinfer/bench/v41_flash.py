"""The random DeepSeek-V4.1-Flash-shaped model of `bench e2e --model-shape v41-flash` and its floors.

Shape: V4.1-Flash's config (docs/models/deepseek_v41.md: hidden 5120, 64 heads of 512 over one shared KV
row, window 128, ratio-2 KV sources 2/8/14 and the ratio-1 source 20, Reindex layers 24-36, 384 experts top-6
of width 2304, hc_mult 4, Engram at layers 1 and 14), cut to its first N layers: the source lists keep the
layers below N (the candidate source only when kept), no DSpark blocks (drafting is not served yet). Engram
tables are cut to the primes above ENGRAM_VOCAB (about 1.6M rows instead of 384M: the release's 98 GB tables
do not fit beside the model on one device, and a step reads 24 rows a token of them, whatever their size).

Weights (`RandomV41Weights`, drawn on the device as the model takes them): as the model keeps the release's
tensors today (deepinfer/model/deepseek_v41/weights.py): routed experts MXFP4 packed (e2m1 + e8m0 per 32), the
FP8 32x32-block projections and Engram rows decoded to the model dtype, float32 where the release keeps it.

Floors, for the kept layers:
- decode (`floor_parts`): the bytes a step must read: every dense weight once, the embedding and Engram rows of
  the batch's tokens, the routed experts hit (E(1 - (1 - k/E)^batch) of E), and per sequence at position p the
  stored caches it reads: every layer's min(128, p + 1) window rows (528 B), every compressed layer's
  min(index_topk, visible) selected entries (288 B), every index source's scoring of all visible index keys
  (68 B), visible = (p + 1) // ratio. Left out (a lower bound): writes, activations, host work.
- prefill (`prefill_flops`): the FLOPs of `batch` prompts of `prompt_len` tokens from position 0, 2 per
  multiply-add, by part, every part over the bf16 matmul rate (the projections are bf16 products here; the
  experts are W4A16; the compressor's float32 projections and the scoring too: a lower bound).
"""

from __future__ import annotations

import math

import torch

from deepinfer.model.deepseek_v41.config import V41Config
from deepinfer.model.deepseek_v41.tensors import FLOAT32, FP4_EXPERT, v41_tensor_specs
from deepinfer.model.embedded_v41 import draw_value
from deepinfer.model.linear import ExpertWeights, LinearWeight
from deepinfer.ops.cache_storage import row_bytes
from deepinfer.ops.quant import MX_BLOCK

V41_FLASH_TEXT = {
    "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_lora_rank": 1024, "o_groups": 8,
    "hidden_act": "silu", "swiglu_limit": 10.0, "rms_norm_eps": 1e-20, "max_position_embeddings": 1048576, "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 65536},
    "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 2304, "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "sliding_window": 128,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20, "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36], "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
    "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "engram_layer_ids": [1, 14], "engram_max_ngram_size": 4, "engram_n_heads": 8, "engram_head_dim": 256,
    "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092, "num_nextn_predict_layers": 0,
}  # fmt: skip
FULL_LAYERS = V41_FLASH_TEXT["num_hidden_layers"]
POSITIONS = V41_FLASH_TEXT["max_position_embeddings"]
ENGRAM_VOCAB = 1 << 16  # the bench's Engram prime walk starts here (the release's: 16000000)


def flash_config(layers: int | None = None, overrides: dict | None = None) -> V41Config:
    """The V41Config of the V4.1-Flash shape (text `overrides` applied), cut to its first `layers` layers."""
    from deepinfer.model.deepseek_v41.engram import hash_constants

    text = {**V41_FLASH_TEXT, **(overrides or {})}
    n = text["num_hidden_layers"] if layers is None else layers
    below = lambda ids: [i for i in ids if i < n]  # noqa: E731
    text.update(num_hidden_layers=n, compress_ratios=text["compress_ratios"][:n], kv_source_layer_ids=below(text["kv_source_layer_ids"]),
                index_source_layer_ids=below(text["index_source_layer_ids"]), engram_layer_ids=below(text["engram_layer_ids"]))  # fmt: skip
    if text["candidate_source_layer_id"] not in text["kv_source_layer_ids"]:
        text["candidate_source_layer_id"] = -1
    text.setdefault("engram_vocab_size", ENGRAM_VOCAB)
    raw = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "bos_token_id": 0, "eos_token_id": 1, "text_config": text}
    # each table's rows are the sum of its hash primes: computed from a config with placeholder counts
    text["engram_num_embeddings"] = [1 << 30] * len(text["engram_layer_ids"])
    probe = V41Config.from_dict(raw, source="the V4.1-Flash shape")
    text["engram_num_embeddings"] = [int(primes.sum()) for _, primes, _ in hash_constants(probe, text["engram_compressed_vocab_size"])]
    return V41Config.from_dict(raw, source="the V4.1-Flash shape")


def kept_bytes(spec, dtype_bytes: int) -> int:
    """Device bytes of a tensor as the model keeps it: FP4 experts packed with their scales, float32, else the model dtype."""
    numel = math.prod(spec.shape)
    if spec.kind == FP4_EXPERT:
        return numel // 2 + numel // MX_BLOCK
    return numel * (4 if spec.kind == FLOAT32 else dtype_bytes)


def is_routed_expert(name: str) -> bool:
    return ".ffn.experts." in name


class RandomV41Weights:
    """Every tensor of `config`'s model, drawn on `device` when the model takes it, from one generator seeded once
    (the model takes its tensors in a fixed order). Values: the embedded tiny-v41's recipe (`draw_value`), except the
    router's bias, zero (routing spreads near-uniformly, as the floor's count of distinct experts assumes); experts are
    random e2m1 bytes with the e8m0 scale that gives them unit gain."""

    def __init__(self, config: V41Config, device: torch.device, dtype: torch.dtype, seed: int = 0):
        self.specs, self.device, self.dtype = v41_tensor_specs(config), torch.device(device), dtype
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.tensors: dict = {}  # what the model takes as stored (its DSpark blocks'): none, the shape has no DSpark blocks

    def __contains__(self, name: str) -> bool:
        return name in self.specs

    def tensor(self, name: str) -> torch.Tensor:
        spec = self.specs[name]
        if name.endswith(("gate.bias", "bias_vl")):
            return torch.zeros(spec.shape, dtype=torch.float32, device=self.device)
        value = draw_value(name, spec.shape, self.generator, self.device)
        return value.float() if spec.kind == FLOAT32 else value.to(self.dtype)

    def linear(self, base: str) -> LinearWeight:
        from deepinfer.bench.v4_weights import mxfp4_scale_byte

        spec = self.specs[f"{base}.weight"]
        if spec.kind != FP4_EXPERT:
            return LinearWeight(self.tensor(f"{base}.weight"))
        rows, cols = spec.shape
        packed = torch.randint(0, 256, (rows, cols // 2), generator=self.generator, device=self.device, dtype=torch.uint8)
        scale = torch.full((rows, cols // MX_BLOCK), mxfp4_scale_byte(cols), dtype=torch.uint8, device=self.device)
        return LinearWeight(packed, scale, format="mxfp4")


    def grouped(self, base: str, groups: int) -> ExpertWeights:
        """`<base>.weight` [G * O, K] as G stacked weights [G, O, K] (the grouped output projection), dense as `linear`'s."""
        w = self.tensor(f"{base}.weight")
        return ExpertWeights(w.view(groups, w.shape[0] // groups, w.shape[1]), None)


def build_model(config: V41Config, runtime, dtype: torch.dtype, max_positions: int, seed: int = 0):
    """The random model on the runtime's device as a LoadedModel (the Engram token map: ids modulo the compressed vocabulary)."""
    from deepinfer.model.deepseek_v41.model import DeepseekV41ForCausalLM
    from deepinfer.model.loader import LoadedModel

    model = DeepseekV41ForCausalLM(config, runtime.ops, runtime.device, dtype, max_positions=max_positions, swa_bounded_replay=True)
    vocab = config.engram_compressed_vocab_size
    model.load_weights(RandomV41Weights(config, runtime.device, dtype, seed), torch.arange(config.vocab_size) % vocab, vocab)
    path = f"in-memory DeepSeek-V4.1-Flash-shaped model ({config.num_hidden_layers} layers)"
    return LoadedModel(model=model, config=config, tokenizer=None, path=path, dummy_weights=True)


def layer_kinds(config: V41Config) -> dict[str, int]:
    """Layers by role, in layer order: {"swa": 2, "full": 1, "reuse": 5, ...}."""
    kinds = [role.kind for role in config.roles]
    return {kind: kinds.count(kind) for kind in dict.fromkeys(kinds)}


# ---------------------------------------------------------------------------------------------
# Floors


def _visible(config: V41Config, layer: int, position: int) -> int:
    ratio = config.roles[layer].ratio
    return (position + 1) // ratio if ratio else 0


def cache_read_bytes(config: V41Config, position: int) -> int:
    """Bytes of stored cache one sequence's decode step at `position` must read (module docstring)."""
    c = config
    window, entry, key = row_bytes(c.head_dim, "fp8"), row_bytes(c.head_dim, "nvfp4"), row_bytes(c.index_head_dim, "mxfp4")
    total = 0
    for role in c.roles:
        visible = _visible(c, role.layer, position)
        total += min(c.sliding_window, position + 1) * window + min(c.index_topk, visible) * entry
        if role.has_indexer:
            total += visible * key
    return total


def floor_parts(config: V41Config, batch: int, position: int, dtype_bytes: int = 2) -> dict[str, float]:
    """Bytes one decode step of `batch` sequences at `position` must read: "dense weights", "routed experts", "cache"."""
    from deepinfer.bench.e2e_v4 import distinct_experts

    c = config
    dense = routed = 0.0
    touched = distinct_experts(c.n_routed_experts, c.num_experts_per_tok, batch)
    for name, spec in v41_tensor_specs(c).items():
        if name == "embed.weight":
            dense += batch * c.hidden_size * dtype_bytes
        elif "engram.embed" in name:
            dense += batch * c.engram_hash_heads * c.engram_head_dim * dtype_bytes
        elif is_routed_expert(name):
            routed += kept_bytes(spec, dtype_bytes) * touched / c.n_routed_experts
        else:
            dense += kept_bytes(spec, dtype_bytes)
    return {"dense weights": dense, "routed experts": routed, "cache": float(batch * cache_read_bytes(c, position))}


def _causal_sum(prompt_len: int, per_position) -> float:
    """sum over positions p = 0..prompt_len-1 of per_position(p) (a tensor function of p)."""
    return float(per_position(torch.arange(prompt_len, dtype=torch.float64)).sum())


def prefill_flops(config: V41Config, batch: int, prompt_len: int) -> dict[str, float]:
    """FLOPs of prefilling `batch` prompts of `prompt_len` tokens from position 0, by part (module docstring)."""
    c = config
    specs = v41_tensor_specs(c)
    tokens = batch * prompt_len
    parts = dict.fromkeys(("projections", "routed experts", "compressor", "indexer scoring", "attention"), 0.0)
    for name, spec in specs.items():
        if len(spec.shape) != 2 or name == "embed.weight" or "engram.embed" in name or is_routed_expert(name):
            continue
        if ".compressor." in name or ".indexer.wk." in name:  # per token; wk per entry (ratio <= 2: at most per token)
            layer = int(name.split(".")[1])
            parts["compressor"] += 2 * math.prod(spec.shape) * (tokens if ".compressor." in name else tokens // c.roles[layer].ratio)
        elif name != "head.weight":
            parts["projections"] += 2 * math.prod(spec.shape) * tokens
    parts["routed experts"] = 2 * 3 * c.hidden_size * c.moe_intermediate_size * c.num_experts_per_tok * tokens * c.num_hidden_layers
    for role in c.roles:
        r = role.ratio
        window = lambda p: torch.clamp(p + 1, max=c.sliding_window)  # noqa: E731
        selected = (lambda p: torch.clamp(torch.div(p + 1, r, rounding_mode="floor"), max=c.index_topk)) if r else (lambda p: 0 * p)
        parts["attention"] += batch * 4 * c.num_attention_heads * c.head_dim * _causal_sum(prompt_len, lambda p: window(p) + selected(p))
        if role.has_indexer:
            visible = _causal_sum(prompt_len, lambda p: torch.div(p + 1, r, rounding_mode="floor"))
            parts["indexer scoring"] += batch * 2 * c.index_n_heads * c.index_head_dim * visible
    parts["projections"] += 2 * math.prod(specs["head.weight"].shape) * batch  # one sampled row per prompt
    return parts


def cache_bytes(config: V41Config) -> dict[str, float]:
    """The stored state: bytes per token of history and per request (fixed), deepinfer.model.deepseek_v41.caches'."""
    from deepinfer.model.deepseek_v41 import caches

    return {"history_bytes_per_token": caches.history_bytes_per_token(config), "fixed_bytes_per_request": caches.fixed_bytes_per_request(config)}
