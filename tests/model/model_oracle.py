"""Tiny random DeepseekV3 / DeepseekV2 checkpoints written by transformers (the oracle), and a
minimal driver that runs deepinfer's model over ForwardBatch steps on a paged latent cache."""

from __future__ import annotations

import torch

from deepinfer.model.forward_batch import ForwardBatch

VOCAB = 1000

# Both configs: 3 layers (the first dense), MoE with groups, YaRN, 4 heads, small dims.
V3_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3, n_group=4,
    topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=512,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    num_nextn_predict_layers=0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
)
V2_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3, n_group=4,
    topk_group=2, topk_method="group_limited_greedy", first_k_dense_replace=1, routed_scaling_factor=1.5,
    norm_topk_prob=False, max_position_embeddings=512,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707},
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
)

# Prompts of different lengths: 1 token, within one page, across several pages (block size 4).
PROMPTS = [[5], [17, 3, 998, 41, 7], [int(t) for t in torch.randint(2, VOCAB, (23,), generator=torch.Generator().manual_seed(1))]]


def _reinit(model, seed: int) -> None:
    """O(1) activations (projections ~ N(0, 1/fan_in)), non-trivial norms, and a spread router bias."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))  # spread: groups really change the choice


def build_hf(model_type: str, folder, seed: int, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    base = V3_CONFIG if model_type == "deepseek_v3" else V2_CONFIG
    config = AutoConfig.for_model(model_type, **{**base, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _reinit(model, seed)
    model.save_pretrained(folder)
    return model


@torch.no_grad()
def hf_last_logits(hf_model, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0, -1].float()


@torch.no_grad()
def hf_greedy(hf_model, ids: list[int], steps: int) -> list[int]:
    """Greedy continuation by full recomputation (no HF cache): the plainest oracle."""
    ids, out = list(ids), []
    for _ in range(steps):
        token = int(hf_last_logits(hf_model, ids).argmax())
        out.append(token)
        ids.append(token)
    return out


class PagedRunner:
    """Sequences over a paged latent cache whose pages are handed out in a shuffled order."""

    def __init__(self, model, num_blocks: int = 96, block_size: int = 4, seed: int = 0):
        self.model, self.block_size = model, block_size
        self.caches = [torch.zeros(model.kv_cache_shape(num_blocks, block_size), dtype=model.dtype) for _ in range(model.num_layers)]
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]], is_prefill: bool, logits_for: list[int] | None = None) -> torch.Tensor:
        """Run one step with `chunks` (sequence id -> new tokens); logits of each listed sequence's last new token."""
        ids, positions, slots, cu, seq_lens, tables, last_row = [], [], [], [0], [], [], {}
        for sid, tokens in chunks.items():
            start, pages = self.lens.get(sid, 0), self.pages.setdefault(sid, [])
            for p in range(start, start + len(tokens)):
                if p // self.block_size >= len(pages):
                    pages.append(self.free.pop())
                slots.append(pages[p // self.block_size] * self.block_size + p % self.block_size)
                positions.append(p)
            ids += tokens
            cu.append(len(ids))
            last_row[sid] = len(ids) - 1
            self.lens[sid] = start + len(tokens)
            seq_lens.append(self.lens[sid])
            tables.append(list(pages))
        width = max(len(t) for t in tables)
        wanted = list(chunks) if logits_for is None else logits_for
        batch = ForwardBatch(
            is_prefill=is_prefill,
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
            logits_indices=torch.tensor([last_row[s] for s in wanted], dtype=torch.int64),
            max_query_len=max(len(t) for t in chunks.values()),
            max_seq_len=max(seq_lens),
        )
        return self.model.forward(batch, self.caches)

    def greedy(self, prompts: list[list[int]], steps: int) -> list[list[int]]:
        """Prefill every prompt in one step, then decode all sequences together, one token per step."""
        logits = self.step({i: p for i, p in enumerate(prompts)}, is_prefill=True)
        out = [[int(t)] for t in logits.argmax(-1)]
        for _ in range(steps - 1):
            logits = self.step({i: [o[-1]] for i, o in enumerate(out)}, is_prefill=False)
            for o, t in zip(out, logits.argmax(-1)):
                o.append(int(t))
        return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())
