"""Multi-head latent attention (MLA), DeepSeek V2/V3, over the paged latent KV cache.

Per token the cache holds the normalised latent c = kv_a_layernorm(W_kv_a x)[:C] and the rotated
shared key k_pe = RoPE(W_kv_a x)[C:]. Prefill steps run the naive path (up-project the whole
context with kv_b_proj into per-head keys and values, then var-len causal attention); decode steps
run the absorbed path (W_UK folded into the query, attention in the latent space, W_UV after).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.model.config import ModelConfig
from deepinfer.model.linear import FusedLinear, LinearWeight
from deepinfer.model.weights import LINEAR, PARAM, TensorSpec, WeightStore
from deepinfer.ops import kv_cache_format

LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the RMSNorm default, not config.rms_norm_eps (as DeepSeek and HF do)


@dataclass
class StepContext:
    """Per-step facts every layer shares, computed once per forward."""

    positions: torch.Tensor  # [T] int64
    cos_sin_cache: torch.Tensor
    is_prefill: bool
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    # prefill: every sequence's whole context (cached prefix + new tokens), as cache slots
    context_slots: torch.Tensor | None = None  # [Tk] int64
    cu_seqlens_k: torch.Tensor | None = None  # [B+1] int32
    # decode: B sequences of S new tokens each
    decode_shape: tuple[int, int] | None = None
    # decode with different counts per sequence (speculative verification): per count S, the
    # sequences that bring S tokens and those tokens' rows; each group is one mla_decode call
    decode_groups: list[tuple[int, torch.Tensor, torch.Tensor]] | None = None


def attention_specs(config: ModelConfig, prefix: str) -> dict[str, TensorSpec]:
    c = config
    heads, hidden = c.num_attention_heads, c.hidden_size
    specs = {}
    if c.q_lora_rank is None:
        specs[f"{prefix}q_proj.weight"] = TensorSpec((heads * c.qk_head_dim, hidden), LINEAR)
    else:
        specs[f"{prefix}q_a_proj.weight"] = TensorSpec((c.q_lora_rank, hidden), LINEAR)
        specs[f"{prefix}q_a_layernorm.weight"] = TensorSpec((c.q_lora_rank,), PARAM)
        specs[f"{prefix}q_b_proj.weight"] = TensorSpec((heads * c.qk_head_dim, c.q_lora_rank), LINEAR)
    specs[f"{prefix}kv_a_proj_with_mqa.weight"] = TensorSpec((c.kv_lora_rank + c.qk_rope_head_dim, hidden), LINEAR)
    specs[f"{prefix}kv_a_layernorm.weight"] = TensorSpec((c.kv_lora_rank,), PARAM)
    specs[f"{prefix}kv_b_proj.weight"] = TensorSpec((heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank), LINEAR)
    specs[f"{prefix}o_proj.weight"] = TensorSpec((hidden, heads * c.v_head_dim), LINEAR)
    return specs


class MLAttention:
    def __init__(self, config: ModelConfig, weights: WeightStore, prefix: str, dtype: torch.dtype):
        c = self.config = config
        self.heads = c.num_attention_heads
        q_in = weights.linear(f"{prefix}q_proj" if c.q_lora_rank is None else f"{prefix}q_a_proj")
        if c.q_lora_rank is not None:
            self.q_a_norm = weights.tensor(f"{prefix}q_a_layernorm.weight")
            self.q_b_proj = weights.linear(f"{prefix}q_b_proj")
        kv_a = weights.linear(f"{prefix}kv_a_proj_with_mqa")
        # q_proj (or q_a_proj) and kv_a_proj read the same input: one GEMM, one launch per layer fewer
        # (where the formats allow one weight; FusedLinear says when)
        self.q_kv_a = FusedLinear.of([q_in, kv_a])
        self.q_kv_a_widths = [q_in.out_features, kv_a.out_features]
        self.kv_a_norm = weights.tensor(f"{prefix}kv_a_layernorm.weight")
        self.kv_b_proj: LinearWeight = weights.linear(f"{prefix}kv_b_proj")
        self.o_proj = weights.linear(f"{prefix}o_proj")
        # The absorbed path needs kv_b_proj per head in the model dtype (FP8 is dequantised once
        # here, as vLLM does): W_UK [H, nope, C] and W_UV [H, v, C].
        w_kv_b = self.kv_b_proj.dequantized(dtype).view(self.heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        self.w_uk = w_kv_b[:, : c.qk_nope_head_dim]
        self.w_uv = w_kv_b[:, c.qk_nope_head_dim :]
        self._w_uk_by_head: torch.Tensor | None = None  # W_UK^T per head [H, C, nope], deterministic mode only
        self.softmax_scale = c.softmax_scale

    def __call__(self, ops, x: torch.Tensor, kv_cache: torch.Tensor, step: StepContext) -> torch.Tensor:
        c, tokens = self.config, x.shape[0]
        q, kv_a = self.q_kv_a(ops, x).split(self.q_kv_a_widths, dim=-1)
        if c.q_lora_rank is not None:
            q_latent, _ = ops.rms_norm(q.contiguous(), self.q_a_norm, eps=LORA_NORM_EPS)
            q = self.q_b_proj(ops, q_latent)
        q_nope, q_pe = q.view(tokens, self.heads, c.qk_head_dim).split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        kv_c, k_pe = kv_a.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv_c, _ = ops.rms_norm(kv_c.contiguous(), self.kv_a_norm, eps=LORA_NORM_EPS)
        q_pe = ops.rope(q_pe.contiguous(), step.positions, step.cos_sin_cache, interleaved=c.rope_interleave)
        k_pe = ops.rope(k_pe.unsqueeze(1).contiguous(), step.positions, step.cos_sin_cache, interleaved=c.rope_interleave).squeeze(1)
        ops.kv_cache_write(kv_c, k_pe, kv_cache, step.slot_mapping)
        if step.is_prefill:
            out = self._naive(ops, q_nope, q_pe, kv_cache, step)
        else:
            out = self._absorbed(ops, q_nope, q_pe, kv_cache, step)
        return self.o_proj(ops, out.reshape(tokens, self.heads * c.v_head_dim))

    def _naive(self, ops, q_nope, q_pe, kv_cache, step: StepContext) -> torch.Tensor:
        """Materialise per-head K and V for each sequence's whole context from the cache; [T, H, v]."""
        c = self.config
        block_size = kv_cache.shape[1]
        rows = kv_cache_format.dequantize_rows(kv_cache[step.context_slots // block_size, step.context_slots % block_size], q_nope.dtype)  # [Tk, C+R]
        context_len = rows.shape[0]
        kv = self.kv_b_proj(ops, rows[:, : c.kv_lora_rank].contiguous()).view(context_len, self.heads, -1)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k_pe = rows[:, None, c.kv_lora_rank :].expand(context_len, self.heads, c.qk_rope_head_dim)
        k = torch.cat((k_nope, k_pe), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        return ops.prefill(q, k, v.contiguous(), step.cu_seqlens_q, step.cu_seqlens_k, softmax_scale=self.softmax_scale)

    def _absorbed(self, ops, q_nope, q_pe, kv_cache, step: StepContext) -> torch.Tensor:
        """Attention in the latent space: q_nope @ W_UK per head, mla_decode, then W_UV; [T, H, v]."""
        c = self.config
        q_latent = self._absorb_uk(ops, q_nope)
        if step.decode_groups is not None:
            latent_out = torch.empty_like(q_latent)
            for size, seqs, rows in step.decode_groups:
                latent_out[rows] = ops.mla_decode(
                    q_latent[rows].view(-1, size, self.heads, c.kv_lora_rank),
                    q_pe[rows].view(-1, size, self.heads, c.qk_rope_head_dim),
                    kv_cache,
                    step.block_tables[seqs],
                    step.seq_lens[seqs],
                    softmax_scale=self.softmax_scale,
                ).view(-1, self.heads, c.kv_lora_rank)
            return self._absorb_uv(ops, latent_out)
        batch, per_seq = step.decode_shape
        latent_out = ops.mla_decode(
            q_latent.reshape(batch, per_seq, self.heads, c.kv_lora_rank),
            q_pe.reshape(batch, per_seq, self.heads, c.qk_rope_head_dim),
            kv_cache,
            step.block_tables,
            step.seq_lens,
            softmax_scale=self.softmax_scale,
        )
        return self._absorb_uv(ops, latent_out.reshape(-1, self.heads, c.kv_lora_rank))

    # The per-head absorption products are torch glue (torch.einsum, a batched matmul over heads),
    # as vLLM does it. A batched matmul's reduction order follows the token count, so deterministic
    # mode runs them as grouped_gemm's masked layout instead (one "expert" per head, every token a
    # row of each), whose kernels are batch-invariant.

    def _absorb_uk(self, ops, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, nope] @ W_UK per head -> [T, H, C]."""
        if not ops.deterministic:
            return torch.einsum("thd,hdc->thc", q_nope, self.w_uk)
        if self._w_uk_by_head is None:
            self._w_uk_by_head = self.w_uk.transpose(1, 2).contiguous()
        return self._per_head(ops, q_nope, self._w_uk_by_head)

    def _absorb_uv(self, ops, latent: torch.Tensor) -> torch.Tensor:
        """latent [T, H, C] @ W_UV^T per head -> [T, H, v]."""
        if not ops.deterministic:
            return torch.einsum("thc,hvc->thv", latent, self.w_uv)
        return self._per_head(ops, latent, self.w_uv)

    def _per_head(self, ops, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [T, H, K] times weight [H, N, K] per head, as grouped_gemm's masked layout -> [T, H, N]."""
        tokens = x.shape[0]
        rows = torch.full((self.heads,), tokens, dtype=torch.int32, device=x.device)
        out = ops.grouped_gemm(x.transpose(0, 1).contiguous(), weight, masked_m=rows, fmt="dense")
        return out.transpose(0, 1)
