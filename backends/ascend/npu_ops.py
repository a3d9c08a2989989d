"""torch_npu fast paths of the ascend backend: CANN's fused operators behind the registry's ops.

Used on Ascend hardware only, and only when asked for: the plugin registers them only when it is not
interpreting, and each registration's `when` requires the backend option npu_fast_paths (default
"off": the interpreter-checked Triton kernels serve every op until `deepinfer conformance --backend
ascend --backend-option npu_fast_paths=on` has passed on an Ascend device). torch_npu is imported
inside the wrappers (and inside the `when` predicates), never at import time, so this module
imports on any machine. Every wrapper has exactly its op's signature.

Which kernel serves an op is decided once, when the ops are resolved, never per call: a fast path
registers for the contexts it fully serves (the chip, the installed torch_npu's operators, the
activation dtype, ep_size 1, and for gate, prefill and mla_decode the model's routing parameters
and head sizes, `ResolveContext.model`), and is not chosen otherwise. A wrapper never hands a call
to another kernel: what its fused op does not take (an empty batch, a weight of another dtype) it
serves itself, and a call outside what it was chosen for is a ValueError, not a detour.
  npu_fast_paths=off - no fast path: the Triton kernels serve everything (default);
  npu_fast_paths=on  - the fast paths whose results follow the op's contract;
  npu_fast_paths=all - also those marked level="all" below (see their DEVIATIONS entries).

NOT RUN ON HARDWARE. There was no Ascend device where this was written: the argument lists follow
torch_npu's documented API and the way vllm-ascend calls these ops, the tests check the wrappers
against a fake torch_npu that computes the semantics as documented here. Arguments we are not
sure of are marked "UNVERIFIED" in comments and listed in docs/backends/ascend.md; run
`deepinfer conformance --backend ascend --backend-option npu_fast_paths=all` on a real host before
relying on any of them.

Every place a fast path departs from the reference is an entry of DEVIATIONS below (op, the
deviation, Why / How / Future plan), as vllm-ascend's patch/__init__.py documents its patches.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from deepinfer.distributed.expert_parallel import ep_size_of
from deepinfer.ops import gemm as gemm_ops
from deepinfer.ops import kv_cache_format, quant
from deepinfer.ops.moe import check_combine_add
from deepinfer.registry import ModelFacts, Registration, ResolveContext
from deepinfer_ascend import device as _device
from deepinfer_ascend.options import NPU_FAST_PATHS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Deviation:
    op: str
    npu_op: str
    what: str
    why: str
    how: str
    future: str


# ---------------------------------------------------------------------------------------------
# DEVIATIONS: every departure of a fast path from the op's reference, with Why / How / Future plan.
DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        op="mla_decode",
        npu_op="npu_fused_infer_attention_score",
        what="Only under npu_fast_paths=all. The one [num_blocks, 128, C+R] latent cache is passed "
        "as two strided views (latent part, rope part) where the op is used with two separate caches. "
        "seq_lens is read back to the host (.tolist()) on every call. Chosen only for block size 128, "
        "C 512, R 64, bf16/fp16, heads in {1,2,4,...,128}, no sliding window (the model's facts). "
        "Never chosen for an FP8 cache (kv_cache_dtype=fp8: the model's facts say so at resolve; the Triton kernel serves it), "
        "and a call with one is refused.",
        why="vllm-ascend keeps separate contiguous latent and rope caches; whether aclnn's fused attention "
        "reads non-contiguous key views in place, copies them (the whole cache, every layer, every step) "
        "or rejects them could not be checked without hardware. actual_seq_lengths_kv is an int[] "
        "(host) argument in torch_npu's schema, so the lengths must be host integers.",
        how="Registered with level='all': npu_fast_paths=on keeps the Triton kernel, which reads the fused "
        "cache natively; a model outside the op's MLA mode never gets this path (decided at resolve).",
        future="Measure on an A2/A3/950 host. If the views are accepted in place, move it to level 'on'; "
        "if not, let the backend declare a split cache layout (two tensors) to the engine's cache "
        "allocation, and pass host-side seq lens from the scheduler's metadata (no read-back).",
    ),
    Deviation(
        op="prefill",
        npu_op="npu_fused_infer_attention_score",
        what="Head dims Dqk > Dv (DeepSeek: 192 / 128): v is zero-padded to Dqk and the output sliced "
        "back. cu_seqlens_q / cu_seqlens_k are read to the host. Causality uses sparse_mode=3 "
        "(bottom-right aligned) with the op's 2048x2048 compressed mask. Not chosen for sliding windows "
        "or float32/float64 activations; requests without new tokens are left out of the op's call "
        "(their keys gathered away), an empty call returns an empty output.",
        why="The op's value head dim must equal the query/key one outside its absorbed-MLA mode "
        "(UNVERIFIED for 192/128); its TND layout takes cumulative lengths as int[] (host); the "
        "band mode's alignment for a sliding window over a cached prefix is not documented clearly "
        "enough to match the contract's.",
        how="Zero columns of v add nothing to the output, so padding is exact; prefill already reads "
        "lengths on the host in the engine, so the read-back costs no extra synchronisation there.",
        future="Try query_rope/key_rope (nope 128 + rope 64) with value 128 on hardware, which avoids "
        "the padding; add sliding windows through sparse_mode=4 once checked against the contract.",
    ),
    Deviation(
        op="grouped_gemm",
        npu_op="npu_grouped_matmul",
        what="Dense bf16/fp16 only (registered for the dense format: the Triton kernel serves fp8_block and "
        "the MX formats). Weights are passed as the transposed view [E, K, N] of our [E, N, K]; a weight "
        "of another dtype than x is cast to x's first (one rounding per weight; never in the engine, "
        "whose weights have the activation dtype). The masked layout runs every row (group_list "
        "= max_m per expert, counts) and the rows at or past masked_m are computed and ignored.",
        why="vllm-ascend transposes expert weights to [E, K, N] at load time; whether the op reads a "
        "transposed view without a copy is UNVERIFIED. The op takes one group list over contiguous "
        "rows, and the masked layout's valid rows are not contiguous across experts.",
        how="group_list_type 0 (cumulative ends = expert_offsets[1:]) for the contiguous layout, "
        "type 1 (counts = max_m) for the masked one; unspecified rows are unspecified in the contract.",
        future="Transpose expert weights once at load time if the view costs a copy; block-scaled fp8 "
        "(950) once its argument layout is verified.",
    ),
    Deviation(
        op="gate",
        npu_op="npu_moe_gating_top_k",
        what="Chosen only for a model whose routing the op serves (ResolveContext.model): sigmoid with "
        "renormalize (norm_type=1, the op divides by sum + 1e-20) or softmax without bias or groups "
        "(renormalize and routed_scaling_factor applied in torch after the op). sqrtsoftplus, sigmoid "
        "without renormalize, softmax with groups or bias, group shapes outside the op's limits, or "
        "unknown routing keep the Triton gate; a call with other parameters is an error.",
        why="The op has no sqrtsoftplus and renormalises sigmoid weights itself; its grouping is used "
        "by vllm-ascend only for sigmoid. Its tie order and its fill value for losing groups (-inf "
        "in DeepSeek's reference, which the contract follows) are UNVERIFIED; ids compare exactly.",
        how="group_select_mode=1 (top-2 sum) with a bias, 0 (max) without, as the contract says; "
        "`gating_supported` decides at resolve time from the model's facts.",
        future="Run the gate conformance cases (ties, negative biased scores) on hardware; drop the "
        "fast path for any combination whose ids differ.",
    ),
    Deviation(
        op="dispatch",
        npu_op="npu_moe_init_routing_v2",
        what="The layout is the contract's only if the op sorts slots by (expert id, slot index), i.e. "
        "a stable sort, and if expanded_row_idx (row_idx_type=0) maps slot -> row (our row_of_slot). "
        "Registered for ep_size 1 only (the EP kernels serve expert-parallel groups); an empty batch "
        "returns empty outputs without calling the op.",
        why="The contract fixes the layout (ids compare exactly). The op's documentation describes a "
        "sort by expert id with the source index as tie-break, and vllm-ascend consumes "
        "expanded_row_idx as the scatter index; neither is verified on hardware.",
        how="expert_offsets = [0, cumsum(counts)] from expert_tokens_num_type=1; row_of_slot = "
        "expanded_row_idx; no host synchronisation.",
        future="If the op's order is not stable, disable this fast path (GEMM and combine would "
        "tolerate any order within an expert, the exact dispatch contract does not); if the index "
        "is the inverse map, invert it with one scatter.",
    ),
    Deviation(
        op="combine",
        npu_op="npu_moe_token_unpermute",
        what="topk_weights are cast to expert_out's dtype (bf16: a relative rounding of 2^-9 per weight). "
        "The op's summation order over k and its accumulation dtype are UNVERIFIED. `add` (a shared expert's "
        "output) is added to the op's result by a second launch: the routed sum is rounded to the output dtype "
        "before it, one rounding more than the contract's.",
        why="The op takes probs in the tokens' dtype (as vllm-ascend passes them), and has no addend.",
        how="sorted_indices = row_of_slot (the same index convention as dispatch's expanded_row_idx); out += add in place.",
        future="Pass float32 probs if the op accepts them; check batch invariance on hardware; a fused "
        "unpermute with an addend (or the Triton combine) would round once.",
    ),
    Deviation(
        op="rms_norm",
        npu_op="npu_rms_norm / npu_add_rms_norm",
        what="With a residual, the op may normalise the float32 sum where the reference normalises the "
        "sum rounded to the input dtype (a difference within one rounding of bf16). A weight or a "
        "residual of another dtype than x is cast to x's first (the op takes one dtype; the engine's "
        "have x's).",
        why="AddRmsNorm fuses the add and the norm without a round trip through the input dtype.",
        how="npu_rms_norm(x, weight, eps) -> (out, rstd); npu_add_rms_norm(x, residual, weight, eps) "
        "-> (out, rstd, x + residual).",
        future="None needed unless conformance shows otherwise.",
    ),
    Deviation(
        op="linear",
        npu_op="npu_quant_matmul",
        what="950 only. fp8_block: activations quantised in torch by quant.quantize_act_fp8 (bit-exact), "
        "then an fp8 x fp8 matmul with per-128x128-block weight scales and per-token-group "
        "activation scales (group_sizes=[1, 128, 128], UNVERIFIED). mxfp4: only under "
        "npu_fast_paths=all, because it quantises activations to MXFP8 (A8W4) where the contract is "
        "W4A16. Registered for fp8_block and mxfp4 only: the Triton kernel serves the other formats. "
        "out_dtype float16/bfloat16 only (the op's documented output_dtype); float32 is refused with an error.",
        why="A2/A3 have no fp8 or fp4 matmul; the 950's MX matmul takes quantised activations on both "
        "sides. The MX scale layout torch_npu expects (plain [K/32, N] or paired [K/64, N, 2]) and "
        "the fp4 packing order are UNVERIFIED.",
        how="Chip gating in `when` (MXFP4 never registers on A2/A3); MXFP8 activation quantisation per "
        "the OCP MX spec (shared exponent floor(log2 amax) - 8, saturating e4m3).",
        future="W4A16 through npu_weight_quant_batchmatmul with MX FP4 weights if CANN offers it on 950; "
        "npu_dynamic_quant-style fused activation quantisation once it is shown bit-exact.",
    ),
    Deviation(
        op="sample",
        npu_op="npu_top_k_top_p (not registered)",
        what="No fast path: the Triton sampling kernel serves sample on every chip.",
        why="npu_top_k_top_p does not implement the contract's keep rules: its top-p removes tokens "
        "whose ascending cumulative probability is <= 1 - p (so values tied with the threshold can "
        "fall either side by sort position; the contract keeps every q >= the last value of the "
        "shortest prefix reaching top_p), it takes k in [1, 1024] only (the contract: k <= 0 or "
        ">= V is off), has no min-p, and works on the temperature-scaled logits. The sampled tokens "
        "must compare exactly and keep our stateless-hash Gumbel noise.",
        how="-",
        future="Use it only if a later torch_npu documents tie-inclusive thresholds matching the contract "
        "(then: mask from the op, our Gumbel noise and argmax on top).",
    ),
)

PRIORITY = 10  # above the Triton kernels (priority 0), where a fast path's `when` holds
ALL_CHIPS = ("A2", "A3", "950")
HALF = (torch.bfloat16, torch.float16)
LEVELS = ("on", "all")  # the npu_fast_paths values that enable a fast path of each level


def _npu():
    import torch_npu  # hardware only; the tests inject a fake module

    return torch_npu


def _has(npu_fn: str) -> bool:
    try:
        return hasattr(_npu(), npu_fn)
    except Exception:  # torch_npu missing or broken: no fast path
        return False


def _when(npu_fn: str, chips: tuple[str, ...], *, level: str = "on", serves: Callable[[ResolveContext], bool] | None = None):
    """The static predicate of a fast path (never raises): npu_fast_paths enables its level, it serves
    the context (`serves`: the model's facts), the chip has it and torch_npu has the operator."""

    def when(ctx: ResolveContext) -> bool:
        choice = NPU_FAST_PATHS.value(ctx)
        if choice == "off" or (level == "all" and choice != "all"):
            return False
        if serves is not None and not serves(ctx):
            return False
        try:
            chip = _device.current().chip
        except Exception as exc:  # the chip cannot be read: no fast path (the Triton kernels will say why)
            log.warning("ascend: cannot read the chip (%s: %s); torch_npu fast paths stay off", type(exc).__name__, exc)
            return False
        return chip in chips and _has(npu_fn)

    when.__qualname__ = f"when[{npu_fn} on {'/'.join(chips)}, npu_fast_paths={'/'.join(LEVELS[LEVELS.index(level):])}]"
    return when


def _not_chosen_for(op: str, what: str) -> ValueError:
    """A call outside the context the fast path was resolved for (a caller whose calls contradict
    the ModelFacts it resolved the ops with)."""
    return ValueError(f"ascend torch_npu {op}: {what}; this fast path was chosen for other calls (ResolveContext.model)")


# ---------------------------------------------------------------------------------------------
# Attention

MLA_BLOCK_SIZE = 128
MLA_LATENT, MLA_ROPE = 512, 64
MLA_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
MASK_SIZE = 2048  # sparse_mode 2/3/4 take a compressed 2048x2048 causal mask


@functools.lru_cache(maxsize=8)
def causal_mask(device: torch.device) -> torch.Tensor:
    """The compressed mask sparse_mode=3 expects: [2048, 2048] bool, True above the diagonal (masked)."""
    return torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=device).triu_(1)


def mla_decode(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    softmax_scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    batch, num_queries, heads, latent = q_nope.shape
    rope = q_rope.shape[-1]
    if sliding_window is not None:
        raise _not_chosen_for("mla_decode", f"sliding_window={sliding_window}")
    if kv_cache_format.is_fp8(kv_cache):
        # The fused op has no row format with an inline float32 scale per token (its antiquant modes
        # take separate scale tensors), and .to(dtype) would read the scale bytes as values. Resolve
        # already keeps this path from an FP8 cache (ModelFacts.kv_cache_fp8); a direct call is refused.
        raise _not_chosen_for("mla_decode", "an FP8 KV cache (kv_cache_dtype=fp8)")
    if kv_cache.dim() != 3 or kv_cache.shape[1] != MLA_BLOCK_SIZE or (latent, rope) != (MLA_LATENT, MLA_ROPE) or heads not in MLA_HEADS:
        raise _not_chosen_for("mla_decode", f"cache {tuple(kv_cache.shape)}, {heads} heads, latent {latent} + rope {rope}")
    if batch == 0:
        return q_nope.new_empty(0, num_queries, heads, latent)
    npu = _npu()
    q_rope, kv_cache = q_rope.to(q_nope.dtype), kv_cache.to(q_nope.dtype)  # no-ops in the engine (one dtype)
    # [num_blocks, 1 (kv heads), block_size, C] and [..., R]: strided views of the one cache (no copy).
    k_nope = kv_cache[..., :latent].unsqueeze(1)
    k_rope = kv_cache[..., latent:].unsqueeze(1)
    kv_lens = seq_lens.tolist()  # int[] argument: a host read-back (see DEVIATIONS)
    if num_queries == 1:
        # [B, 1, H, D] and [B, H, 1, D] are the same memory.
        query, query_rope = q_nope.reshape(batch, heads, 1, latent), q_rope.reshape(batch, heads, 1, rope)
        layout, sparse_mode, mask, q_lens = "BNSD", 0, None, None
    else:
        # MTP / speculative verification: TND with cumulative query ends, bottom-right causal mask.
        query, query_rope = q_nope.reshape(batch * num_queries, heads, latent), q_rope.reshape(batch * num_queries, heads, rope)
        layout, sparse_mode, mask = "TND", 3, causal_mask(q_nope.device)
        q_lens = list(range(num_queries, batch * num_queries + 1, num_queries))
    # As vllm-ascend's MLA decode calls it: key and value are the same latent cache.
    # UNVERIFIED: acceptance of non-contiguous (strided) key/key_rope views in paged mode.
    out, _ = npu.npu_fused_infer_attention_score(
        query,
        k_nope,
        k_nope,
        query_rope=query_rope,
        key_rope=k_rope,
        num_heads=heads,
        num_key_value_heads=1,
        input_layout=layout,
        atten_mask=mask,
        sparse_mode=sparse_mode,
        scale=softmax_scale,
        antiquant_mode=0,
        antiquant_scale=None,
        block_table=block_table,
        block_size=kv_cache.shape[1],
        actual_seq_lengths=q_lens,
        actual_seq_lengths_kv=kv_lens,
    )
    return out.reshape(batch, num_queries, heads, latent)


def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    *,
    softmax_scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    tokens, heads, dqk = q.shape
    dv = v.shape[-1]
    if sliding_window is not None:
        raise _not_chosen_for("prefill", f"sliding_window={sliding_window}")
    if not prefill_head_dims_served(dqk, dv):
        raise _not_chosen_for("prefill", f"head dims {dqk}/{dv}")
    if tokens == 0:
        return q.new_empty(0, heads, dv)
    k, v = k.to(q.dtype), v.to(q.dtype)  # no-ops in the engine (one dtype)
    q_ends, k_ends = cu_seqlens_q[1:].tolist(), cu_seqlens_k[1:].tolist()  # TND: cumulative int[]
    q_starts, k_starts = [0, *q_ends[:-1]], [0, *k_ends[:-1]]
    kept = [i for i, (a, b) in enumerate(zip(q_starts, q_ends)) if b > a]
    if len(kept) < len(q_ends):
        # Requests without new tokens (not a case the op documents) have no output rows: leave them
        # out, with their keys, and the rest keep their rows in order.
        rows = torch.cat([torch.arange(k_starts[i], k_ends[i]) for i in kept]).to(k.device)
        k, v = k.index_select(0, rows), v.index_select(0, rows)
        q_lens, k_lens = [q_ends[i] - q_starts[i] for i in kept], [k_ends[i] - k_starts[i] for i in kept]
        q_ends = torch.tensor(q_lens).cumsum(0).tolist()
        k_ends = torch.tensor(k_lens).cumsum(0).tolist()
    npu = _npu()
    value = v if dv == dqk else F.pad(v, (0, dqk - dv))  # zero columns: exact (see DEVIATIONS)
    out, _ = npu.npu_fused_infer_attention_score(
        q,
        k,
        value,
        num_heads=heads,
        num_key_value_heads=heads,
        input_layout="TND",
        atten_mask=causal_mask(q.device),
        sparse_mode=3,  # right-down causal: query i of a request sits at key position k_len - q_len + i
        scale=softmax_scale,
        actual_seq_lengths=q_ends,
        actual_seq_lengths_kv=k_ends,
    )
    return out if dv == dqk else out[..., :dv].contiguous()


# ---------------------------------------------------------------------------------------------
# GEMM


def grouped_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    expert_offsets: torch.Tensor | None = None,
    masked_m: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    fmt: str = "dense",
) -> torch.Tensor:
    gemm_ops.check_grouped_args(x, weight, weight_scale, fmt, expert_offsets, masked_m)
    if fmt != "dense" or x.dtype not in HALF:
        raise _not_chosen_for("grouped_gemm", f"format {fmt}, activations {x.dtype}")
    npu = _npu()
    experts, n, _ = weight.shape
    w = weight.to(x.dtype).transpose(1, 2)  # [E, K, N] view (UNVERIFIED: read without a copy); the cast: see DEVIATIONS
    if expert_offsets is not None:
        rows, group_list, group_list_type = x, expert_offsets[1:].to(torch.int64), 0  # cumulative ends
    else:
        _, max_m, k = x.shape
        rows = x.reshape(experts * max_m, k)
        group_list, group_list_type = torch.full((experts,), max_m, dtype=torch.int64, device=x.device), 1  # counts
    (out,) = npu.npu_grouped_matmul(
        [rows],
        [w],
        group_list=group_list,
        group_list_type=group_list_type,
        split_item=2,  # one output tensor
        group_type=0,  # groups along M
        output_dtype=x.dtype,
    )
    return out if expert_offsets is not None else out.view(experts, -1, n)


def quantize_act_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX FP8 (e4m3) activations: per 32 values X = floor(log2 amax) - 8 (8 = e4m3's emax), clamped
    to [-127, 127] (-127 for an all-zero block), elements = saturate(v / 2^X) to e4m3 (round to
    nearest even). Returns (x_fp8 [..., K] float8_e4m3fn, scale uint8 [..., K/32] e8m0)."""
    k = x.shape[-1]
    blocks = x.float().unflatten(-1, (k // quant.MX_BLOCK, quant.MX_BLOCK))
    amax = blocks.abs().amax(dim=-1)
    _, exponent = torch.frexp(amax)  # amax = m * 2^exponent, m in [0.5, 1)
    shared = torch.where(amax > 0, exponent - 1 - 8, -127).clamp(-127, 127)
    scaled = blocks / torch.exp2(shared.float()).unsqueeze(-1)  # a power of two: exact
    values = scaled.clamp(-quant.FP8_MAX, quant.FP8_MAX).to(quant.FP8_DTYPE).flatten(-2)
    return values, (shared + 127).to(torch.uint8)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    weight_scale: torch.Tensor | None = None,
    fmt: str = "dense",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    gemm_ops.check_linear_args(x, weight, weight_scale, fmt, out_dtype)
    if x.dtype not in HALF:
        raise _not_chosen_for("linear", f"activations {x.dtype}")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in HALF:
        # npu_quant_matmul's output_dtype is documented for int8, float16 and bfloat16 only.
        raise ValueError(
            f"ascend torch_npu linear[{fmt}]: out_dtype {out_dtype} is not served (npu_quant_matmul returns float16 or bfloat16); "
            "the Triton linear serves it (backend option npu_fast_paths=off)"
        )
    npu = _npu()
    if fmt == "fp8_block":
        x_q, x_scale = quant.quantize_act_fp8(x)  # the contract's quantiser, bit-exact, on the device
        # UNVERIFIED argument layout of block-scaled fp8 on the 950: x2 [K, N] (transposed view), scale
        # [ceil(K/128), ceil(N/128)], pertoken_scale [M, ceil(K/128)], group_sizes [group_m, group_n, group_k].
        return npu.npu_quant_matmul(
            x_q,
            weight.t(),
            weight_scale.float().t(),
            pertoken_scale=x_scale,
            output_dtype=out_dtype,
            group_sizes=[1, quant.FP8_BLOCK, quant.FP8_BLOCK],
        )
    if fmt == "mxfp4":
        x_q, x_scale = quantize_act_mxfp8(x)  # A8W4: the deviation that makes this path opt-in
        # UNVERIFIED: the fp4 packing order (ours: even k in the low nibble), and whether MX scales
        # must be [K/32, N] (passed here) or the paired [K/64, N, 2] layout.
        return npu.npu_quant_matmul(
            x_q,
            weight.t(),
            weight_scale.t(),
            pertoken_scale=x_scale,
            output_dtype=out_dtype,
            x2_dtype=npu.float4_e2m1fn_x2,
            scale_dtype=npu.float8_e8m0fnu,
            pertoken_scale_dtype=npu.float8_e8m0fnu,
            group_sizes=[1, 1, quant.MX_BLOCK],
        )
    raise _not_chosen_for("linear", f"format {fmt}")


# ---------------------------------------------------------------------------------------------
# MoE routing


def gating_supported(num_experts: int, top_k: int, score_func: str, correction_bias: bool, n_group: int, topk_group: int, renormalize: bool) -> bool:
    """The parameter combinations `npu_moe_gating_top_k` serves (see DEVIATIONS); correction_bias:
    whether one is passed."""
    if score_func == "softmax":
        return not correction_bias and n_group == 1
    if score_func != "sigmoid" or not renormalize:
        return False
    # vllm-ascend's limits for the fused gate: more than 2 experts per group, k_group <= group_count,
    # top_k within the kept groups (and the op's k <= 32, UNVERIFIED).
    per_group = num_experts // n_group if n_group >= 1 and num_experts % n_group == 0 else 0
    return per_group > 2 and 1 <= topk_group <= n_group and 1 <= top_k <= min(32, topk_group * per_group)


def gate(
    logits: torch.Tensor,
    *,
    top_k: int,
    score_func: str = "softmax",
    correction_bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = False,
    routed_scaling_factor: float = 1.0,
    hash_table: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if hash_table is not None:  # npu_moe_gating_top_k selects; it cannot take given experts
        raise _not_chosen_for("gate", "hash routing (hash_table)")
    if not gating_supported(logits.shape[-1], top_k, score_func, correction_bias is not None, n_group, topk_group, renormalize):
        raise _not_chosen_for("gate", f"score_func {score_func}, renormalize {renormalize}, groups {n_group}/{topk_group}, top_k {top_k}")
    npu = _npu()
    logits = logits.float()  # the contract's router output is float32 already
    sigmoid = score_func == "sigmoid"
    weights, ids, _ = npu.npu_moe_gating_top_k(
        logits,
        k=top_k,
        bias=None if correction_bias is None else correction_bias.to(logits.dtype),
        k_group=topk_group,
        group_count=n_group,
        group_select_mode=1 if correction_bias is not None else 0,  # 1: sum of the top 2; 0: max
        renorm=0,  # 0: scores first, then top-k
        norm_type=1 if sigmoid else 0,  # 1: sigmoid (weights renormalised by the op); 0: softmax
        out_flag=False,
        routed_scaling_factor=routed_scaling_factor if sigmoid else 1.0,
        eps=1e-20,
    )
    if not sigmoid:
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights * routed_scaling_factor
    return weights.float(), ids.to(torch.int32)


def dispatch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    num_experts: int,
    ep_group: object | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if ep_size_of(ep_group) > 1:
        raise _not_chosen_for("dispatch", f"an expert-parallel group of {ep_size_of(ep_group)} ranks (resolve with ep_size > 1)")
    if topk_ids.numel() == 0:  # no slots: nothing to sort (not a case the op documents)
        return x.new_empty(0, x.shape[-1]), torch.zeros(num_experts + 1, dtype=torch.int32, device=x.device), topk_ids.new_empty(0, dtype=torch.int32)
    npu = _npu()
    topk_ids = topk_ids.to(torch.int32)
    slots = topk_ids.numel()
    expert_x, expanded_row_idx, counts, _ = npu.npu_moe_init_routing_v2(
        x,
        topk_ids,
        scale=None,
        offset=None,
        active_num=slots,
        expert_capacity=-1,
        expert_num=num_experts,
        drop_pad_mode=0,  # no dropping, no padding
        expert_tokens_num_type=1,  # counts per expert
        expert_tokens_num_flag=True,
        quant_mode=-1,  # no quantisation
        active_expert_range=[0, num_experts],
        row_idx_type=0,  # UNVERIFIED: 0 = scatter index, slot -> row of expert_x
    )
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=x.device)
    offsets[1:] = counts.cumsum(0)
    return expert_x, offsets, expanded_row_idx.to(torch.int32)


def combine(
    expert_out: torch.Tensor,
    topk_weights: torch.Tensor,
    row_of_slot: torch.Tensor,
    *,
    add: torch.Tensor | None = None,
    ep_group: object | None = None,
) -> torch.Tensor:
    if ep_size_of(ep_group) > 1:
        raise _not_chosen_for("combine", f"an expert-parallel group of {ep_size_of(ep_group)} ranks (resolve with ep_size > 1)")
    check_combine_add(add, expert_out, topk_weights)
    if topk_weights.numel() == 0:  # no slots: every output row is an empty sum (plus the addend)
        out = expert_out.new_zeros(topk_weights.shape[0], expert_out.shape[-1])
        return out if add is None else out.copy_(add)
    npu = _npu()
    out = npu.npu_moe_token_unpermute(
        expert_out,
        row_of_slot.to(torch.int32),
        probs=topk_weights.to(expert_out.dtype),  # UNVERIFIED: whether float32 probs are accepted
        padded_mode=False,
        restore_shape=None,
    )
    return out if add is None else out.add_(add)  # a second rounding (DEVIATIONS)


# ---------------------------------------------------------------------------------------------
# Norms


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    npu = _npu()
    weight = weight.to(x.dtype)  # no-op in the engine; otherwise one rounding (see DEVIATIONS)
    if residual is None:
        out, _rstd = npu.npu_rms_norm(x, weight, eps)
        return out, None
    out, _rstd, h = npu.npu_add_rms_norm(x, residual.to(x.dtype), weight, eps)
    return out, h


# ---------------------------------------------------------------------------------------------


def prefill_head_dims_served(dqk: int, dv: int) -> bool:
    """Head dims the fused attention serves outside its MLA mode (v zero-padded to dqk)."""
    return dv <= dqk and dqk % 16 == 0 and dqk <= 512  # UNVERIFIED limit of the op's head dim


def _serves_mla_decode(ctx: ResolveContext) -> bool:
    m = ctx.model
    return (m.sliding_window == 0 and m.kv_block_size == MLA_BLOCK_SIZE and (m.kv_lora_rank, m.qk_rope_head_dim) == (MLA_LATENT, MLA_ROPE)
            and m.num_heads in MLA_HEADS and m.kv_cache_fp8 is False)  # fmt: skip  (an FP8 cache or an unknown one: the Triton kernel)


def _serves_prefill(ctx: ResolveContext) -> bool:
    m = ctx.model
    return m.sliding_window == 0 and m.qk_head_dim is not None and m.v_head_dim is not None and prefill_head_dims_served(m.qk_head_dim, m.v_head_dim)


def _serves_gate(ctx: ResolveContext) -> bool:
    m: ModelFacts = ctx.model
    facts = (m.num_experts, m.top_k, m.score_func, m.correction_bias, m.n_group, m.topk_group, m.renormalize)
    return None not in facts and gating_supported(*facts)


def _local(ctx: ResolveContext) -> bool:
    return ctx.ep_size == 1


def registrations() -> list[Registration]:
    """The fast paths, for `Registry.register_all` (the plugin calls this only on hardware)."""
    fia = "npu_fused_infer_attention_score"
    return [
        Registration(
            op="mla_decode", fn=mla_decode, dtypes=HALF, when=_when(fia, ALL_CHIPS, level="all", serves=_serves_mla_decode), priority=PRIORITY,
            note=f"torch_npu {fia} (paged MLA, block 128; npu_fast_paths=all: strided latent/rope views of the one cache)",
        ),
        Registration(
            op="prefill", fn=prefill, dtypes=HALF, when=_when(fia, ALL_CHIPS, serves=_serves_prefill), priority=PRIORITY,
            note=f"torch_npu {fia} (TND, sparse_mode 3; v zero-padded when Dv < Dqk)",
        ),
        Registration(
            op="grouped_gemm", fn=grouped_gemm, formats=("dense",), dtypes=HALF, when=_when("npu_grouped_matmul", ALL_CHIPS), priority=PRIORITY,
            note="torch_npu npu_grouped_matmul (group_list_type 0 cumsum / 1 counts)",
        ),
        Registration(
            op="linear", fn=linear, formats=("fp8_block",), dtypes=HALF, when=_when("npu_quant_matmul", ("950",)), priority=PRIORITY,
            note="torch_npu npu_quant_matmul (fp8 per-block, 950 only)",
        ),
        Registration(
            op="linear", fn=linear, formats=("mxfp4",), dtypes=HALF, when=_when("npu_quant_matmul", ("950",), level="all"), priority=PRIORITY,
            note="torch_npu npu_quant_matmul (MXFP8 x MXFP4, 950 only; npu_fast_paths=all: quantises activations)",
        ),
        Registration(
            op="gate", fn=gate, dtypes=(*HALF, torch.float32), when=_when("npu_moe_gating_top_k", ALL_CHIPS, serves=_serves_gate), priority=PRIORITY,
            note="torch_npu npu_moe_gating_top_k (models routing by sigmoid+renorm or plain softmax)",
        ),
        Registration(
            op="dispatch", fn=dispatch, dtypes=(*HALF, torch.float32), when=_when("npu_moe_init_routing_v2", ALL_CHIPS, serves=_local), priority=PRIORITY,
            note="torch_npu npu_moe_init_routing_v2 (local experts)",
        ),
        Registration(
            op="combine", fn=combine, dtypes=(*HALF, torch.float32), when=_when("npu_moe_token_unpermute", ALL_CHIPS, serves=_local), priority=PRIORITY,
            note="torch_npu npu_moe_token_unpermute (local experts)",
        ),
        Registration(
            op="rms_norm", fn=rms_norm, dtypes=(*HALF, torch.float32), when=_when("npu_add_rms_norm", ALL_CHIPS), priority=PRIORITY,
            note="torch_npu npu_rms_norm / npu_add_rms_norm",
        ),
    ]
