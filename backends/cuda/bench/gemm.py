"""Benchmarks of `grouped_gemm` and `linear` (dense bf16, fp8_block, mxfp4, mxfp8, mxfp4_a8) at DeepSeek shapes.

Prefill shapes are compute-bound (FLOP rate against the bf16 matmul ceiling); decode shapes
(<= 64 tokens per expert) stream the weights (bytes = weights + scales + activations + outputs,
against copy bandwidth). Peers:
- bf16 grouped: `torch._grouped_mm(x, w_t, offs=ends)` with w_t = weight.transpose(1, 2) ([E, K, N],
  a view, column-major as cuBLAS/CUTLASS grouped GEMMs like it), offs the int32 row ends; the
  masked layout's peer is the batched 3-D x 3-D form.
- fp8 grouped: `torch._scaled_grouped_mm` with row-wise scales when this torch has it and it runs,
  else a loop of `torch._scaled_mm` per expert with per-tensor scales (a rate reference: neither is
  block-scaled); which one ran is recorded in the case state.
- linear: torch.nn.functional.linear (cuBLAS); fp8: `torch._scaled_mm` with per-tensor scales;
  mxfp4 decode: F.linear on the dequantised bf16 weight (reads 3.8x the bytes); mxfp8 and mxfp4_a8
  (MX activations, added 2026-11-30, not yet run on a GPU) likewise.
The fp8 cases include the fused activation quantiser (the op takes bf16 activations); one more case
times the GEMM alone on pre-quantised activations, as DeepGEMM reports it. Rows ending ", gluon" call the SM90 Gluon
kernel of their format (fp8_path=gluon, mxfp4_path=gluon) directly; V4-Flash's expert GEMMs at prefill size (w13, w2)
have a bf16 row beside their mxfp4 one, the comparison the MXFP4 target is stated in.

`python -m deepinfer_cuda.bench.gemm [--check [--quick] [--only TEXT]] [--sweep [VARIANT ...]] [--bench]`
on a GPU: correctness against the references (every format and layout, each mxfp4 path, the TMA
kernel, the quantiser bit for bit, CUDA-graph capture with new offsets on replay), a sweep of tile
configurations for the tuning tables, and these cases through the bench runner. `--sweep fp8_v4_prefill` times
V4-Flash's prefill fp8 projections (V4_PREFILL_CASES: not in CASES) against candidate tiles, with each shape's torch
peer and its activation quantiser alone; `deepinfer bench compile --arch sm90 --sweep fp8_v4_prefill` compiles the candidates.
`--sweep mla_gluon_bf16` times the bf16 Gluon mla_decode's tuning switches at 128 heads beside the tl kernel (SWEEP's
comment). Every sweep ends with one table of its rows (`sweep_table`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from deepinfer.ops import quant
from deepinfer_cuda.bench.common import BenchCase

OPS = ("grouped_gemm", "linear")  # what this bench module covers: the runner finds it by this
TABLE_ORDER = 30  # where its rows sit in `deepinfer bench ops`: attention first, misc last


def _gen(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(0)


def _weights(fmt: str, e: int | None, n: int, k: int, device: torch.device) -> dict:
    """Weights in `fmt`: [E, N, K] (or [N, K] when e is None), random with unit-scale products."""
    shape = (n, k) if e is None else (e, n, k)
    g = _gen(device)
    if fmt == "dense":
        return {"weight": (torch.randn(shape, device=device, generator=g, dtype=torch.bfloat16) * k**-0.5)}
    out = {"fmt": fmt}
    # quantise expert by expert: the float32 temporaries stay small
    ws, ss = [], []
    for i in range(1 if e is None else e):
        w = torch.randn(n, k, device=device, generator=g) * k**-0.5
        quantise = {"fp8_block": quant.quantize_weight_fp8_block, "mxfp8": quant.quantize_weight_mxfp8}.get(fmt, quant.quantize_weight_mxfp4)
        q, s = quantise(w)  # mxfp4 and mxfp4_a8 share the e2m1 weight layout
        ws.append(q)
        ss.append(s)
    out["weight"] = ws[0] if e is None else torch.stack(ws)
    out["weight_scale"] = ss[0] if e is None else torch.stack(ss)
    return out


def _nbytes(*ts) -> float:
    return float(sum(t.numel() * t.element_size() for t in ts if t is not None))


# ---------------------------------------------------------------------------------------------
# grouped_gemm


def _routed_offsets(e: int, tokens: int, top_k: int, device: torch.device) -> torch.Tensor:
    """expert_offsets of `tokens` tokens each routed to the top_k of e random scores (a fixed seed, drawn on the CPU):
    rows per expert about tokens * top_k / e, spread as a router's are, not all equal."""
    scores = torch.rand(tokens, e, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(scores.topk(top_k, dim=1).indices.flatten(), minlength=e)
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(device=device, dtype=torch.int32)


def _grouped_setup(fmt: str, e: int, per_expert: int, n: int, k: int, masked: bool, prequantise: bool = False, path: str | None = None,
                   routed: tuple[int, int] | None = None, transposed: bool = False):
    """routed (tokens, top_k): contiguous rows split over the experts by `_routed_offsets`, not per_expert each.
    transposed (masked): x [E, per_expert, K] a view of [per_expert, E, K], as V4's grouped output projection reads its heads."""
    def setup(device: torch.device) -> dict:
        g = _gen(device)
        s = _weights(fmt, e, n, k, device)
        s["path"] = path
        if masked and transposed:
            s["x"] = torch.randn(per_expert, e, k, device=device, generator=g, dtype=torch.bfloat16).transpose(0, 1)
            s["masked_m"] = torch.full((e,), per_expert, dtype=torch.int32, device=device)
        elif masked:
            s["x"] = torch.randn(e, per_expert, k, device=device, generator=g, dtype=torch.bfloat16)
            s["masked_m"] = torch.full((e,), per_expert, dtype=torch.int32, device=device)
        elif routed:
            s["expert_offsets"] = _routed_offsets(e, *routed, device)
            s["x"] = torch.randn(routed[0] * routed[1], k, device=device, generator=g, dtype=torch.bfloat16)
        else:
            s["x"] = torch.randn(e * per_expert, k, device=device, generator=g, dtype=torch.bfloat16)
            s["expert_offsets"] = torch.arange(0, e + 1, device=device, dtype=torch.int32) * per_expert
        s["rows"] = routed[0] * routed[1] if routed and not masked else e * per_expert
        s["n"], s["k"] = n, k
        if prequantise:
            _prequantise(s)
        _grouped_peer_setup(s, fmt, masked)
        return s

    return setup


def _prequantise(s: dict) -> None:
    """The fp8 activations made ahead (cases timing the GEMM alone): s["prequantised"] in the layout the case's kernel
    takes (the Gluon kernel's scales have each group's rows contiguous), and for a Gluon case also the tl kernel's
    (s["prequantised_tl"], its reference row)."""
    from deepinfer_cuda.kernels.gemm import quantize_act_fp8

    s["prequantised"] = quantize_act_fp8(s["x"], scale_rows_contiguous=s.get("path") == "gluon")
    if s.get("path") == "gluon":
        s["prequantised_tl"] = quantize_act_fp8(s["x"])


def _grouped_peer_setup(s: dict, fmt: str, masked: bool) -> None:
    w = s["weight"]
    if fmt == "dense":
        s["peer_w"] = w.transpose(1, 2)  # [E, K, N], column-major
        s["peer_offs"] = None if masked else s["expert_offsets"][1:].contiguous()
        return
    if fmt != "fp8_block":
        return
    x = s["x"].reshape(-1, s["k"])
    s["peer_xq"] = x.to(torch.float8_e4m3fn)
    s["peer_offs"] = s["expert_offsets"][1:].contiguous() if not masked else None
    s["peer_kind"] = "loop"
    if hasattr(torch, "_scaled_grouped_mm") and not masked:
        try:
            s["peer_sa"] = torch.ones(x.shape[0], device=x.device, dtype=torch.float32)
            s["peer_sb"] = torch.ones(w.shape[0], w.shape[1], device=x.device, dtype=torch.float32)
            s["peer_w"] = w.transpose(1, 2)
            torch._scaled_grouped_mm(s["peer_xq"], s["peer_w"], s["peer_sa"], s["peer_sb"], offs=s["peer_offs"], out_dtype=torch.bfloat16)
            s["peer_kind"] = "_scaled_grouped_mm"
        except Exception as exc:  # noqa: BLE001 - recorded; the loop serves
            s["peer_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    s["peer_one"] = torch.ones((), device=x.device, dtype=torch.float32)


def _grouped_kernel(s: dict):
    from deepinfer_cuda.kernels import gemm

    if s.get("path") == "gluon" and "prequantised" in s:  # the Gluon fp8_block GEMM alone
        layout = gemm._MASKED if "masked_m" in s else gemm._CONTIGUOUS
        return _gluon_module(s["fmt"])._run(s["x"], s["weight"], s["weight_scale"], layout, offsets=s.get("expert_offsets"),
                                            masked_m=s.get("masked_m"), prequantised=s["prequantised"])
    if s.get("path") == "gluon":  # the SM90 Gluon kernel of the weight's format (fp8_path / mxfp4_path=gluon)
        return _gluon_module(s["fmt"]).grouped_gemm(
            s["x"], s["weight"], expert_offsets=s.get("expert_offsets"), masked_m=s.get("masked_m"), weight_scale=s["weight_scale"], fmt=s["fmt"]
        )
    if "prequantised" in s:
        layout = gemm._MASKED if "masked_m" in s else gemm._CONTIGUOUS
        return gemm.launch_gemm(
            s["x"], s["weight"], s["weight_scale"], "fp8_block", layout,
            offsets=s.get("expert_offsets"), masked_m=s.get("masked_m"), prequantised=s["prequantised"],
        )
    return gemm.grouped_gemm(
        s["x"], s["weight"], expert_offsets=s.get("expert_offsets"), masked_m=s.get("masked_m"),
        weight_scale=s.get("weight_scale"), fmt=s.get("fmt", "dense"),
    )


def _gluon_module(fmt: str):
    """The module of the SM90 Gluon kernel for `fmt` (its functions serve what they can, the tl kernel the rest)."""
    if fmt == "fp8_block":
        from deepinfer_cuda.kernels import gemm_fp8_gluon

        return gemm_fp8_gluon
    from deepinfer_cuda.kernels import gemm_mxfp4_gluon

    return gemm_mxfp4_gluon


def _grouped_peer(s: dict):
    fmt = s.get("fmt", "dense")
    if fmt == "dense":
        if s["peer_offs"] is None:  # masked: batched [E, m, K] x [E, K, N]
            return torch._grouped_mm(s["x"], s["peer_w"])
        return torch._grouped_mm(s["x"], s["peer_w"], offs=s["peer_offs"])
    if s["peer_kind"] == "_scaled_grouped_mm":
        return torch._scaled_grouped_mm(s["peer_xq"], s["peer_w"], s["peer_sa"], s["peer_sb"], offs=s["peer_offs"], out_dtype=torch.bfloat16)
    per = s["rows"] // s["weight"].shape[0]
    one = s["peer_one"]
    return [
        torch._scaled_mm(s["peer_xq"][i * per : (i + 1) * per], s["weight"][i].T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        for i in range(s["weight"].shape[0])
    ]


def _grouped_flops(s: dict) -> float:
    return 2.0 * s["rows"] * s["n"] * s["k"]


def _grouped_bytes(s: dict) -> float:
    out_bytes = s["rows"] * s["n"] * 2
    return _nbytes(s["weight"], s.get("weight_scale"), s["x"]) + out_bytes


def _grouped_case(name, fmt, e, per_expert, n, k, *, masked=False, bound="compute", prequantise=False, peer=True, path=None, routed=None,
                  transposed=False):
    peer_name = {"dense": "torch._grouped_mm", "fp8_block": "torch fp8 (_scaled_grouped_mm rowwise | _scaled_mm loop)"}.get(fmt, "-")
    return BenchCase(
        op="grouped_gemm",
        name=name,
        setup=_grouped_setup(fmt, e, per_expert, n, k, masked, prequantise, path, routed, transposed),
        kernel=_grouped_kernel,
        peer=_grouped_peer if peer and fmt in ("dense", "fp8_block") else None,
        peer_name=peer_name,
        flops=_grouped_flops,
        bytes=_grouped_bytes,
        bound=bound,
    )


# ---------------------------------------------------------------------------------------------
# linear


def _linear_setup(fmt: str, t: int, n: int, k: int, path: str | None = None, prequantise: bool = False):
    def setup(device: torch.device) -> dict:
        s = _weights(fmt, None, n, k, device)
        s["path"] = path
        s["x"] = torch.randn(t, k, device=device, generator=_gen(device), dtype=torch.bfloat16)
        s["t"], s["n"], s["k"] = t, n, k
        if prequantise:
            _prequantise(s)
        if fmt == "fp8_block":  # per-tensor fp8 peer
            s["peer_xq"] = s["x"].to(torch.float8_e4m3fn)
            s["peer_one"] = torch.ones((), device=device, dtype=torch.float32)
        elif fmt in ("mxfp4", "mxfp4_a8"):
            s["peer_w"] = quant.dequantize_mxfp4(s["weight"], s["weight_scale"], torch.bfloat16)
        elif fmt == "mxfp8":
            s["peer_w"] = quant.dequantize_mxfp8(s["weight"], s["weight_scale"], torch.bfloat16)
        return s

    return setup


def _linear_kernel(s: dict):
    from deepinfer_cuda.kernels import gemm

    if s.get("path") == "gluon" and "prequantised" in s:  # the Gluon fp8_block GEMM alone
        return _gluon_module(s["fmt"])._run(s["x"], s["weight"], s["weight_scale"], gemm._LINEAR, prequantised=s["prequantised"])
    if s.get("path") == "gluon":
        return _gluon_module(s["fmt"]).linear(s["x"], s["weight"], weight_scale=s["weight_scale"], fmt=s["fmt"])
    if "prequantised" in s:
        return gemm.launch_gemm(s["x"], s["weight"], s["weight_scale"], s["fmt"], gemm._LINEAR, prequantised=s["prequantised"])
    return gemm.linear(s["x"], s["weight"], weight_scale=s.get("weight_scale"), fmt=s.get("fmt", "dense"))


def _tl_fp8(s: dict, prequantised=None):
    """gemm.py's tl kernel (fp8_path=tl) on an fp8_block case's operands, grouped or linear: the Gluon sweep's reference
    (its output, and with `prequantised` in the tl kernel's scale layout its GEMM alone)."""
    from deepinfer_cuda.kernels import gemm

    layout = gemm._MASKED if "masked_m" in s else gemm._CONTIGUOUS if "expert_offsets" in s else gemm._LINEAR
    return gemm.launch_gemm(s["x"], s["weight"], s["weight_scale"], "fp8_block", layout, offsets=s.get("expert_offsets"), masked_m=s.get("masked_m"),
                            prequantised=prequantised)


def _linear_peer(s: dict):
    fmt = s.get("fmt", "dense")
    if fmt == "dense":
        return F.linear(s["x"], s["weight"])
    if fmt == "fp8_block":
        return torch._scaled_mm(s["peer_xq"], s["weight"].T, scale_a=s["peer_one"], scale_b=s["peer_one"], out_dtype=torch.bfloat16)
    return F.linear(s["x"], s["peer_w"])


def _linear_flops(s: dict) -> float:
    return 2.0 * s["t"] * s["n"] * s["k"]


def _linear_bytes(s: dict) -> float:
    return _nbytes(s["weight"], s.get("weight_scale"), s["x"]) + s["t"] * s["n"] * 2


def _linear_case(name, fmt, t, n, k, *, bound, path=None, prequantise=False, peer=True):
    peer_name = {
        "dense": "F.linear (cuBLAS)",
        "fp8_block": "torch._scaled_mm per-tensor",
        "mxfp4": "F.linear on dequantised bf16 weight",
        "mxfp8": "F.linear on dequantised bf16 weight",
        "mxfp4_a8": "F.linear on dequantised bf16 weight",
    }[fmt]
    return BenchCase(
        op="linear", name=name, setup=_linear_setup(fmt, t, n, k, path, prequantise), kernel=_linear_kernel, peer=_linear_peer if peer else None,
        peer_name=peer_name, flops=_linear_flops, bytes=_linear_bytes, bound=bound,
    )


CASES = [
    # prefill, compute-bound
    _grouped_case("bf16 contiguous 8x4096 tok, 7168->4096", "dense", 8, 4096, 4096, 7168),
    _grouped_case("bf16 contiguous 8x4096 tok, 2048->7168 (down)", "dense", 8, 4096, 7168, 2048),
    _grouped_case("bf16 contiguous 64x768 tok, 2048->2816", "dense", 64, 768, 2816, 2048),
    _grouped_case("fp8_block contiguous 8x4096 tok, 7168->4096", "fp8_block", 8, 4096, 4096, 7168),
    _grouped_case("fp8_block contiguous 8x4096 tok, 7168->4096, GEMM only", "fp8_block", 8, 4096, 4096, 7168, prequantise=True, peer=False),
    _linear_case("bf16 4096x7168->7168", "dense", 4096, 7168, 7168, bound="compute"),
    _linear_case("fp8_block 4096x7168->7168", "fp8_block", 4096, 7168, 7168, bound="compute"),
    # the SM90 Gluon fp8_block kernel (fp8_path=gluon) on the same shapes
    _grouped_case("fp8_block contiguous 8x4096 tok, 7168->4096, gluon", "fp8_block", 8, 4096, 4096, 7168, peer=False, path="gluon"),
    # (and its GEMM alone on pre-quantised activations, as DeepGEMM reports its figures)
    _grouped_case("fp8_block contiguous 8x4096 tok, 7168->4096, GEMM only, gluon", "fp8_block", 8, 4096, 4096, 7168, prequantise=True, peer=False,
                  path="gluon"),
    _linear_case("fp8_block 4096x7168->7168, gluon", "fp8_block", 4096, 7168, 7168, bound="compute", path="gluon"),
    # DeepSeek-V3's experts at prefill (8192 tokens x top 8 over 256 experts: 256 rows each), the tl kernel beside the Gluon one
    *(_grouped_case(f"fp8_block contiguous 256x256 tok, {k}->{n} (V3 {w}){suffix}", "fp8_block", 256, 256, n, k, peer=False, path=path)
      for w, n, k in (("w13", 4096, 7168), ("w2", 7168, 2048)) for suffix, path in (("", None), (", gluon", "gluon"))),
    # V4-Flash's experts at prefill (8192 tokens x top 6 over 256 experts: 192 rows each), bf16 beside mxfp4 (SM90: Gluon)
    _grouped_case("bf16 contiguous 256x192 tok, 4096->4096 (V4 w13)", "dense", 256, 192, 4096, 4096),
    _grouped_case("mxfp4 contiguous 256x192 tok, 4096->4096 (V4 w13), gluon", "mxfp4", 256, 192, 4096, 4096, peer=False, path="gluon"),
    # the same rows as a router splits them (each token's top 6 of 256 random scores: about 192 +- 14 an expert)
    _grouped_case("mxfp4 contiguous 8192x6 tok routed over 256, 4096->4096 (V4 w13), gluon", "mxfp4", 256, 192, 4096, 4096, peer=False,
                  path="gluon", routed=(8192, 6)),
    _grouped_case("bf16 contiguous 256x192 tok, 2048->4096 (V4 w2)", "dense", 256, 192, 4096, 2048),
    _grouped_case("mxfp4 contiguous 256x192 tok, 2048->4096 (V4 w2), gluon", "mxfp4", 256, 192, 4096, 2048, peer=False, path="gluon"),
    # V4-Flash's experts at decode batch 256 (256 x top 6 over 256 experts: 6 rows each), the Gluon kernel's decode entry
    _grouped_case("mxfp4 contiguous 256x6 tok, 4096->4096 (V4 w13 decode B256), gluon", "mxfp4", 256, 6, 4096, 4096, bound="memory", peer=False, path="gluon"),
    # decode, weight streaming
    _grouped_case("bf16 masked 64x16 tok, 2048->2816", "dense", 64, 16, 2816, 2048, masked=True, bound="memory"),
    _grouped_case("bf16 contiguous 64x16 tok, 2048->2816", "dense", 64, 16, 2816, 2048, bound="memory"),
    _grouped_case("fp8_block masked 64x16 tok, 2048->2816", "fp8_block", 64, 16, 2816, 2048, masked=True, bound="memory", peer=False),
    _grouped_case("fp8_block masked 64x16 tok, 2048->2816, gluon", "fp8_block", 64, 16, 2816, 2048, masked=True, bound="memory", peer=False, path="gluon"),
    _linear_case("fp8_block decode 256x4096->1024, gluon", "fp8_block", 256, 1024, 4096, bound="memory", path="gluon"),
    _linear_case("fp8_block decode 256x4096->1024", "fp8_block", 256, 1024, 4096, bound="memory"),
    _linear_case("bf16 decode 16x7168->36864", "dense", 16, 36864, 7168, bound="memory"),
    _linear_case("mxfp4 decode 16x7168->36864", "mxfp4", 16, 36864, 7168, bound="memory"),
    # MX activations (W8A8 / W4A8): Triton's emulation on SM90, the block-scaled MMA on SM100
    _linear_case("mxfp8 4096x7168->7168", "mxfp8", 4096, 7168, 7168, bound="compute"),
    _linear_case("mxfp8 decode 16x7168->36864", "mxfp8", 16, 36864, 7168, bound="memory"),
    _linear_case("mxfp4_a8 4096x7168->7168", "mxfp4_a8", 4096, 7168, 7168, bound="compute"),
    _linear_case("mxfp4_a8 decode 16x7168->36864", "mxfp4_a8", 16, 36864, 7168, bound="memory"),
]


# ---------------------------------------------------------------------------------------------
# DeepSeek-V4-Flash's fp8_block GEMMs in a prefill chunk


class V4Gemm(NamedTuple):
    """One fp8_block GEMM of a V4-Flash layer at prefill: x [rows, k] times [n, k] (masked: `groups` of them over a
    transposed [groups, rows, k] view), run by the layers whose attention is one of `kinds` (None: every layer)."""

    name: str
    layout: str  # "linear" | "masked"
    groups: int
    n: int
    k: int
    kinds: tuple[str, ...] | None


def v4_prefill_fp8_gemms(shape: dict | None = None) -> list[V4Gemm]:
    """The fp8_block GEMMs of one V4 layer (`shape`: a config dict, V4-Flash's by default), as the model runs them:
    wq_a and wkv fused (one GEMM, model/linear.py's FusedLinear), wq_b, the grouped wo_a (grouped_gemm's masked layout,
    one group of heads an "expert"), wo_b, the CSA layers' indexer wq_b, and the shared expert's fused w1|w3 and w2.
    The compressors' wkv|wgate and the indexer's weights_proj are bf16 (bench/v4_weights.py), the routed experts mxfp4."""
    from deepinfer.bench.e2e_v4 import V4_FLASH
    from deepinfer.model.deepseek_v4.config import CSA

    c = shape or V4_FLASH
    hidden, q_rank, heads, dim, groups = c["hidden_size"], c["q_lora_rank"], c["num_attention_heads"], c["head_dim"], c["o_groups"]
    shared = c["moe_intermediate_size"] * c["n_shared_experts"]
    return [
        V4Gemm("wq_a+wkv", "linear", 1, q_rank + dim, hidden, None),
        V4Gemm("wq_b", "linear", 1, heads * dim, q_rank, None),
        V4Gemm("wo_a", "masked", groups, c["o_lora_rank"], heads * dim // groups, None),
        V4Gemm("wo_b", "linear", 1, hidden, groups * c["o_lora_rank"], None),
        V4Gemm("indexer wq_b", "linear", 1, c["index_n_heads"] * c["index_head_dim"], q_rank, (CSA,)),
        V4Gemm("shared w1|w3", "linear", 1, 2 * shared, hidden, None),
        V4Gemm("shared w2", "linear", 1, hidden, shared, None),
    ]


V4_PREFILL_TOKENS = 8192  # one prefill chunk of 8192 tokens (the engine's token budget below 70 GiB and `deepinfer serve`'s)


def _v4_prefill_case(g: V4Gemm, tokens: int = V4_PREFILL_TOKENS) -> BenchCase:
    if g.layout == "masked":
        name = f"fp8_block V4 prefill {g.name} masked {g.groups}x{tokens} tok, {g.k}->{g.n}"
        return _grouped_case(name, "fp8_block", g.groups, tokens, g.n, g.k, masked=True, transposed=True)
    return _linear_case(f"fp8_block V4 prefill {g.name} {tokens}x{g.k}->{g.n}", "fp8_block", tokens, g.n, g.k, bound="compute")


# timed by `--sweep fp8_v4_prefill` only (not in CASES: `deepinfer bench ops` stays as it was)
V4_PREFILL_CASES = [_v4_prefill_case(g) for g in v4_prefill_fp8_gemms()]

V4_GLUON_TOKENS = 16384  # the rows of V4's prefill GEMMs in the Gluon fp8_block sweep (two 8192-token chunks at once)

# timed by `--sweep fp8_gluon_large` only: the SM90 Gluon fp8_block kernel's GEMM alone (pre-quantised activations, as
# the 926 TFLOP/s of the tl kernel's "GEMM only" row) at 8 experts x 4096 rows, 7168 -> 4096, and at V4-Flash's linear
# prefill GEMMs (wo_a's masked x is laid out expert-minor, which the Gluon kernel leaves to the tl kernel)
GLUON_SWEEP_CASES = [
    next(c for c in CASES if c.name == "fp8_block contiguous 8x4096 tok, 7168->4096, GEMM only, gluon"),
] + [
    _linear_case(f"fp8_block V4 prefill {g.name} {V4_GLUON_TOKENS}x{g.k}->{g.n}, GEMM only, gluon", "fp8_block", V4_GLUON_TOKENS, g.n, g.k,
                 bound="compute", path="gluon", prequantise=True, peer=False)
    for g in v4_prefill_fp8_gemms() if g.layout == "linear"
]


# ---------------------------------------------------------------------------------------------
# On a GPU: correctness, tile sweep, bench


def check(device: torch.device, quick: bool = False, only: str | None = None) -> int:
    """Every format and layout against the references on the GPU; returns the number of failures.

    quick: float32 activations, the mxfp4 upcast path and the TMA kernel only."""
    from deepinfer.ops import gemm as ref
    from deepinfer_cuda.kernels import gemm as kg

    failures = 0

    def report(name, ok, detail=""):
        nonlocal failures
        failures += not ok
        print(f"check {'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)

    g = torch.Generator(device=device).manual_seed(1)

    # the quantiser, bit for bit (the reference run on the CPU and on the GPU)
    for shape, dtype in [] if only else [((4096, 7168), torch.bfloat16), ((37, 200), torch.float32), ((5, 3, 384), torch.float16)]:
        x = torch.randn(shape, device=device, generator=g) * torch.exp(torch.randn(shape, device=device, generator=g) * 3)
        x = x.clamp(-6e4, 6e4).to(dtype)
        q, s = kg.quantize_act_fp8(x)
        for where, (rq, rs) in (("cpu", quant.quantize_act_fp8(x.cpu())), ("gpu", quant.quantize_act_fp8(x))):
            same = torch.equal(q.view(torch.uint8).cpu(), rq.view(torch.uint8).cpu()) and torch.equal(s.cpu(), rs.cpu())
            if where == "cpu":
                report(f"quantiser {tuple(shape)} {dtype} vs reference on the cpu", same)
            else:  # torch's own CUDA ops differ from its CPU ops in a few elements (seen 2026-11-30)
                print(f"info quantiser {tuple(shape)} {dtype} equals the reference run on the gpu: {same}")
    grid = torch.arange(0, 127, dtype=torch.uint8).view(quant.FP8_DTYPE).float()
    mids = (grid[:-1] + grid[1:]) / 2
    vals = torch.cat([mids, torch.nextafter(mids, torch.zeros(())), torch.nextafter(mids, torch.full((), 1e9)), grid])
    vals = torch.cat([vals, -vals])
    groups = -(-vals.numel() // 127)
    body = torch.zeros(groups * 127)
    body[: vals.numel()] = vals
    x = torch.cat([torch.full((groups, 1), 448.0), body.view(groups, 127)], dim=1).to(device)
    q, s = kg.quantize_act_fp8(x)
    rq, rs = quant.quantize_act_fp8(x.cpu())
    if not only:
        report("quantiser e4m3 ties", torch.equal(q.view(torch.uint8).cpu(), rq.view(torch.uint8)) and torch.equal(s.cpu(), rs))

    def weights(fmt, lead, n, k, dtype=torch.bfloat16):
        w = torch.randn(*lead, n, k, device=device, generator=g) * 0.05
        if fmt == "dense":
            return {"weight": w.to(dtype)}
        q, sc = (quant.quantize_weight_fp8_block if fmt == "fp8_block" else quant.quantize_weight_mxfp4)(w)
        return {"weight": q, "weight_scale": sc, "fmt": fmt}

    def compare(name, op, kw):
        if only and only not in name:
            return
        try:
            got = getattr(kg, op)(**kw)
            torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001
            report(name, False, f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
            return
        wide = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != quant.FP8_DTYPE else v) for k, v in kw.items()}
        want = getattr(ref, op)(**wide)
        if op == "grouped_gemm":
            got = ref._grouped_gemm_canonicalize(kw, {"out": got})["out"]
        tol = ref.GEMM_TOLERANCES[kw["x"].dtype]
        err = (got.double() - want).abs()
        bound = tol.atol * kw["x"].shape[-1] + tol.rtol * want.abs()
        ok = bool(torch.isfinite(got.double()).all()) and bool((err <= bound).all())
        report(name, ok, f"max err {err.max().item():.3g} err/bound {(err / bound).max().item():.3g}")

    def x_of(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=device, generator=g).to(dtype)

    paths = list(kg.MXFP4_PATHS)
    for fmt in ("dense", "fp8_block", "mxfp4"):
        shapes = [(1, 200, 320), (16, 576, 7168), (64, 256, 1000 if fmt != "mxfp4" else 992), (300, 768, 1024)]
        plan = ((torch.bfloat16, shapes), (torch.float16, shapes[1:3]), (torch.float32, shapes[2:4]))
        if quick:
            plan = ((torch.float32, shapes[2:4]),) + (((torch.bfloat16, shapes[1:2]),) if fmt == "mxfp4" else ())
        for dtype, todo in plan:
            for t, n, k in todo:
                for mx in paths if fmt == "mxfp4" else [None]:
                    kg.MXFP4_AUTO_PATH = mx
                    compare(f"linear {fmt} {dtype} {t}x{k}->{n} mxfp4_path={mx}", "linear", {"x": x_of(t, k, dtype=dtype), **weights(fmt, (), n, k)})
        kg.MXFP4_AUTO_PATH = None
        for counts, pad in [([5, 0, 350, 1, 0, 190, 100, 0], 7), ([0, 0, 0, 1023], 0), ([16] * 64, 0), ([0] * 4, 3)][2 if quick else 0 : 3 if quick else 4]:
            e = len(counts)
            offs = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=device)
            m = int(offs[-1]) + pad
            for dtype in (torch.float32,) if quick else (torch.bfloat16, torch.float32):
                compare(f"grouped contiguous {fmt} {dtype} counts={counts[:8]} pad={pad}", "grouped_gemm",
                        {"x": x_of(m, 512, dtype=dtype), **weights(fmt, (e,), 384, 512), "expert_offsets": offs})
        for masked, max_m in [([3, 0, 16, 9], 16), ([0, 0], 8), ([130, 1, 256, 0], 256)][2 if quick else 0 :]:
            e = len(masked)
            for dtype in (torch.float32,) if quick else (torch.bfloat16, torch.float32):
                compare(f"grouped masked {fmt} {dtype} masked_m={masked}", "grouped_gemm",
                        {"x": x_of(e, max_m, 640, dtype=dtype), **weights(fmt, (e,), 320, 640),
                         "masked_m": torch.tensor(masked, dtype=torch.int32, device=device)})
    # the tensor-descriptor (TMA) kernel of the large tiles, forced on
    from deepinfer_cuda.tuning import config as table_config

    for ws in ("ws", "kp") if quick else ("",):
        def forced(op, v, dev, _ws=ws):
            cfg = {**table_config(op, v, dev), "tma": True}
            if _ws:
                cfg.update(warp_specialize=_ws == "ws", k_pairs=_ws == "kp")
            return cfg

        kg.config = forced
        try:
            for fmt in ("dense", "fp8_block"):
                for dtype in (torch.bfloat16, torch.float16):
                    inputs = {"x": x_of(1030, 1024, dtype=dtype), **weights(fmt, (), 768, 1024, dtype)}
                    compare(f"TMA ws={ws} linear {fmt} {dtype} 1030x1024->768", "linear", inputs)
                counts = [5, 0, 350, 1, 0, 190, 100, 0]
                offs = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=device)
                inputs = {"x": x_of(int(offs[-1]) + 9, 512), **weights(fmt, (8,), 320, 512), "expert_offsets": offs}
                compare(f"TMA ws={ws} grouped contiguous {fmt}", "grouped_gemm", inputs)
                compare(f"TMA ws={ws} grouped masked {fmt}", "grouped_gemm", {"x": x_of(4, 256, 640), **weights(fmt, (4,), 320, 640),
                        "masked_m": torch.tensor([130, 1, 256, 0], dtype=torch.int32, device=device)})
        finally:
            kg.config = table_config
    # mixed dense dtypes
    compare("linear dense bf16 x, fp32 weight", "linear", {"x": x_of(40, 256), **weights("dense", (), 96, 256, torch.float32)})

    # CUDA graph capture: no host synchronisation in either layout
    if only:
        return failures
    try:
        offs = torch.tensor([0, 3, 3, 40], dtype=torch.int32, device=device)
        kw_c = {"x": x_of(48, 512), **weights("fp8_block", (3,), 256, 512), "expert_offsets": offs}
        kw_m = {"x": x_of(3, 16, 512), **weights("dense", (3,), 256, 512), "masked_m": torch.tensor([3, 0, 16], dtype=torch.int32, device=device)}
        for kw in (kw_c, kw_m):
            kg.grouped_gemm(**kw)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [kg.grouped_gemm(**kw) for kw in (kw_c, kw_m)]
        offs.copy_(torch.tensor([0, 10, 20, 30], dtype=torch.int32, device=device))
        graph.replay()
        torch.cuda.synchronize(device)
        want = kg.grouped_gemm(**kw_c)
        same = torch.equal(ref._grouped_gemm_canonicalize(kw_c, {"out": outs[0]})["out"], ref._grouped_gemm_canonicalize(kw_c, {"out": want})["out"])
        report("CUDA graph capture + replay with new offsets", same)
    except Exception as exc:  # noqa: BLE001
        report("CUDA graph capture", False, f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
    return failures


def _opts(cfgs, extras):
    return [(c, x) for c in cfgs for x in extras]


# variant -> [(config overrides, options)]; options: tma (tensor-descriptor kernel), ws (warp
# specialisation of its K loop), mx (the mxfp4 path forced: "dot_scaled" or "upcast"; the register path has
# its own tuning variants, swept at V4-Flash expert shapes on 2026-12-01: docs/measurements/2026-12-01/v4_fp8_mxfp4_h200/)
SWEEP = {
    "fp8_block_large": _opts([dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4)], [{"tma": True}, {"tma": True, "ws": True}, {"tma": True, "kp": True}])
    + _opts([dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)], [{"tma": True, "kp": True}])
    + _opts(
        [
            dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=4),
            dict(BLOCK_M=128, BLOCK_N=256, num_warps=8, num_stages=3),
            dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=5),
        ],
        [{"tma": True}],
    ),
    "mxfp4_small": _opts(
        [
            dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4),
            dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=256, num_warps=8, num_stages=4),
            dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=512, num_warps=4, num_stages=3),
        ],
        [{"mx": "dot_scaled"}, {"mx": "upcast"}],
    ),
    "dense_large": _opts([dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)], [{"tma": True}, {"tma": True, "ws": True}])
    + _opts(
        [
            dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4),
            dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
        ],
        [{"tma": True}],
    ),
    "fp8_block_small": _opts(
        [
            dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=5),
            dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=4),
            dict(BLOCK_M=64, BLOCK_N=256, num_warps=8, num_stages=4),
        ],
        [{}],
    ),
    "dense_small": _opts(
        [
            dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=4),
            dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4),
        ],
        [{}],
    ),
    # the SM90 Gluon expert kernel's decode entry at V4-Flash's batch-256 shape: bytes in flight per SM (stages x CTAs per
    # SM x weight rows per tile), for GPUs whose copy bandwidth the H100-tuned entry leaves unused (the H200: 2.4 of 4.2 TB/s)
    "mxfp4_gluon_small": _opts(
        [
            dict(BLOCK_N=128, num_stages=8, ctas_per_sm=2),
            dict(BLOCK_N=128, num_stages=6, ctas_per_sm=2),
            dict(BLOCK_N=64, num_stages=8, ctas_per_sm=3),
            dict(BLOCK_N=64, num_stages=12, ctas_per_sm=3),
            dict(BLOCK_N=64, num_stages=16, ctas_per_sm=2),
            dict(BLOCK_N=128, num_stages=4, ctas_per_sm=3),
            dict(BLOCK_N=128, num_stages=8, ctas_per_sm=2, BLOCK_K=256),
        ],
        [{}],
    ),
    # its prefill entry at V4-Flash's prefill shape (192 rows an expert: a 128-token tile computes a third of its second
    # tile for nothing): the table's 128 x 256, the former 128 x 128, and 256-token tiles (one tile an expert: each weight
    # tile dequantised once, a quarter of the MMAs padding; stages as shared memory allows); the table's tile with tail
    # tiles (each expert's remainder of at most 64 rows in a 64-row tile of a second launch; the table's choice since 2026-12-07);
    # the persistent form of it (one program per SM walking tiles; its max |out - table's| must be 0: it was on an H100),
    # also with the 4 stages its smaller scale buffers leave room for
    "mxfp4_gluon_large": _opts(
        [
            dict(BLOCK_M=128, BLOCK_N=256, num_warps=8, num_stages=3, tail_tiles=True),
            dict(BLOCK_M=128, BLOCK_N=256, num_warps=8, num_stages=3, tail_tiles=True, persistent=True),
            dict(BLOCK_M=128, BLOCK_N=256, num_warps=8, num_stages=4, tail_tiles=True, persistent=True),
            dict(BLOCK_M=128, BLOCK_N=256, num_warps=8, num_stages=3, tail_tiles=False),
            dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4, tail_tiles=False),
            dict(BLOCK_M=256, BLOCK_N=128, num_warps=8, num_stages=4, tail_tiles=False),
            dict(BLOCK_M=256, BLOCK_N=64, num_warps=4, num_stages=3, tail_tiles=False),
        ],
        [{}],
    ),
}

# V4-Flash's prefill fp8 projections (`v4_prefill_fp8_gemms`, 8192 rows: V4_PREFILL_CASES), the table's tile against tiles
# chosen per shape: 8192 rows are 64 row tiles of 128 (or 128 of 64), so every shape fills the 132 SMs (at 128 x 128:
# 768 tiles for wq_a+wkv's N 1536, 5.8 waves; 2048 for wo_b and the shared expert, 15.5; 4096 for wo_a and the indexer's
# wq_b, 31.0; 16384 for wq_b, 124.1) and split-K never applies (the planner splits under 2 programs an SM). What differs
# is K: wq_b and the indexer's wq_b have K 1024, 8 steps of 128, so each tile's pipeline fill and epilogue (the store of
# its output tile) are not hidden behind a long main loop as at K 4096-8192: a 128 x 128 tile of 8 warps holds an SM
# alone (221 registers a thread, 128 KiB at 4 stages), so nothing overlaps them. Hence tiles of which two fit an SM
# (sm90 compile check, Triton 3.9, no spills: 64 x 128 w4 s4 184 registers and 96 KiB, 128 x 64 w4 s4 222 and 97 KiB,
# 64 x 128 w4 s2 with k_pairs 168 and 96 KiB), against the long-K levers: k_pairs (two 128-K groups a step), warp
# specialisation, the 64 x 128 decode-batch tile at 5 stages (fp8_block_medium's: one a SM) and a wider GROUP_M (x rows
# reused from L2 over more N tiles). Left out: 128 x 256 and 256 x 128 at 8 warps (spill 336 and 1272 bytes), 128 x 128
# at 3 stages without k_pairs (its registers keep it one a SM all the same).
_V4_PREFILL_SWEEP = (
    _opts([dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4)], [{"tma": True}, {"tma": True, "ws": True}])
    + _opts([dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)], [{"tma": True, "kp": True}])
    + _opts([dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4, GROUP_M=16)], [{"tma": True}])
    + _opts(
        [
            dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=4),
            dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=5),
            dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=4),
        ],
        [{"tma": True}],
    )
    + _opts([dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2)], [{"tma": True, "kp": True}])
)
SWEEP["fp8_v4_prefill"] = _V4_PREFILL_SWEEP

# The SM90 Gluon fp8_block kernel's prefill entry (gemm_fp8_gluon.py's schedule options; each must give the tl kernel's
# output bit for bit, and each row shows its difference from the table's and the tl kernel's): the table's 128 x 256 tile
# (two column halves) with the TMA store epilogue (3 stages: fit_stages), the same without it (4 stages), the former
# entry's 128 x 128 (232 registers a consumer, 6 stages), the same at 240, the overlapped K loop (the next group's wgmma
# issued before this group's promotion), with the TMA store too (5 stages), and the 256 x 128 tile (two 64-row waves a
# consumer, 4 stages). Timed on an H100 2026-12-07 (docs/measurements/2026-12-07/h100_round14/c/fp8g_sweep.txt:
# the tuning table's comment). sm90 compile check (`deepinfer bench compile --arch sm90 --sweep fp8_gluon_large`): no
# spills and the overlapped loops' wgmmas asynchronous under Triton 3.9 and 3.6, but for the 256 x 128 tile under 3.6: 4
# bytes spilled once, in the consumers' prologue (not in the K loop).
SWEEP["fp8_gluon_large"] = _opts(
    [
        dict(BLOCK_M=128, BLOCK_N=256, num_stages=4, consumer_regs=240, tma_store=True),
        dict(BLOCK_M=128, BLOCK_N=256, num_stages=4, consumer_regs=240, tma_store=False),
        dict(BLOCK_M=128, BLOCK_N=128, num_stages=6, consumer_regs=232, tma_store=False),
        dict(BLOCK_M=128, BLOCK_N=128, num_stages=6, consumer_regs=240, tma_store=False),
        dict(BLOCK_M=128, BLOCK_N=128, num_stages=6, consumer_regs=240, overlap=True, tma_store=False),
        dict(BLOCK_M=128, BLOCK_N=128, num_stages=6, consumer_regs=240, overlap=True, tma_store=True),
        dict(BLOCK_M=256, BLOCK_N=128, num_stages=4, consumer_regs=240, waves=2, tma_store=False),
    ],
    [{}],
)

# The SM90 Gluon mla_decode over the bf16 cache (mla_decode_gluon.py: its tuning entry mla_decode/gluon_bf16's switches;
# swept on an H100, 2026-12-07: docs/backends/cuda.md) at 128 heads, against the tl kernel's output and time (bench/attention_decode.py's
# ", gluon" cases, timed as `deepinfer bench ops` times them: B128 on the stream, B32 and B1 from CUDA graph replays):
# - the table's entry (the seesaw schedule with early release, 232 / 40 registers: mla_decode_gluon_seesaw.py, each
#   attention warpgroup scoring whole tiles, alternately, for [64, 64] score wgmmas and one handshake a tile; each releases
#   the other's stage before it waits for its own), against the split-keys schedule it replaced (H100 2026-12-07: 284.5
#   against 330.7 us at B128) and the seesaw without early release;
# - no register split of either schedule is a candidate: at 240 / 24 the loader spills 8 bytes, and setmaxnreg takes
#   multiples of 8;
# - more or fewer splits where the plan's limit binds: at B1 ctx8192 (2 programs a split) splits of >= 128 and 512 tokens
#   give 43 and 16 splits against the table's 32 (132 SMs; >= 64 tokens gives 43 too); B32 ctx2048 keeps 2 and B128
#   ctx4096 1 whatever these say (pick_splits fills the SMs first);
# - the balanced persistent grid over the early-release seesaw (mla_decode_gluon_balanced.py: one CTA per SM, a share of
#   the flattened (request, key tile) work each, cut on the device), at the table's segment overhead of 1 tile and at 0
#   (B128 ctx4096: 126 and 125 tiles at most a share against 128 a SM): slower at every case on an H100 (2026-12-07).
# sm90 compile check (`deepinfer bench compile --arch sm90 --sweep mla_gluon_bf16`): every candidate's wgmmas
# asynchronous, none spilling.
SWEEP["mla_gluon_bf16"] = _opts(
    [
        {},
        {"schedule": "split_keys"},
        {"schedule": "seesaw"},
        {"min_tokens_per_split": 128},
        {"min_tokens_per_split": 512},
        {"balanced": True},
        {"balanced": True, "balanced_overhead_tiles": 0},
    ],
    [{}],
)

# The FP8 Gluon mla_decode at 16 heads (attention_decode.py's fp8cache rows, which take it): the table's kernel (both
# warpgroups scoring half of each tile, 64-row wgmmas three quarters padding) against the keys-as-M kernel
# (mla_decode_fp8_gluon_keys_m.py: keys as the wgmma's M, heads as its N; the table's since 2026-12-07), B64 / B128 / B256 ctx4096.
# sm90 compile check (`deepinfer bench compile --arch sm90 --sweep mla_gluon_fp8`).
SWEEP["mla_gluon_fp8"] = _opts([{}, {"keys_as_m": True}], [{}])

# the tuning entries a variant's configs stand in for, where not the entry of its own name: V4's prefill shapes plan
# fp8_block_large, or at K <= 1024 fp8_block_large_short_k (kernels/gemm.py's _shape_entry)
SWEEP_ENTRIES = {"fp8_v4_prefill": ("fp8_block_large", "fp8_block_large_short_k"), "mla_gluon_bf16": ("gluon_bf16",), "mla_gluon_fp8": ("gluon_fp8",)}
# the op of a variant's tuning entries, where not gemm
SWEEP_OPS = {"mla_gluon_bf16": "mla_decode", "mla_gluon_fp8": "mla_decode"}

# the case each variant is swept on (a fragment of its name), or the cases
SWEEP_CASES = {
    "fp8_v4_prefill": tuple(case.name for case in V4_PREFILL_CASES),
    "fp8_gluon_large": tuple(case.name for case in GLUON_SWEEP_CASES),
    "mla_gluon_bf16": ("B128_ctx4096_H128_S1_bf16_page64, gluon", "B32_ctx2048_H128_S1_bf16_page64, gluon", "B1_ctx8k_H128_S1_bf16_page64, gluon"),
    "mla_gluon_fp8": ("B64_ctx4096_H16_S1_fp8cache_page64", "B128_ctx4096_H16_S1_fp8cache_page64", "B256_ctx4096_H16_S1_fp8cache_page64"),
    "mxfp4_gluon_small": "V4 w13 decode B256",
    "mxfp4_gluon_large": ("256x192 tok, 4096->4096 (V4 w13), gluon", "8192x6 tok routed over 256, 4096->4096 (V4 w13), gluon"),
    "dense_large": "bf16 contiguous 8x4096 tok, 7168->4096",
    "fp8_block_large": "GEMM only",
    "fp8_block_small": "fp8_block masked 64x16",
    "mxfp4_small": "mxfp4 decode",
    "dense_small": "bf16 contiguous 64x16",
}


def sweep(device: torch.device, variants=None) -> list[dict]:
    results = []
    for variant in variants or SWEEP:
        results += _sweep_variant(variant, device)  # the case's tensors are freed on return
        torch.cuda.empty_cache()
    print(sweep_table(results), flush=True)
    return results


def sweep_table(results: list[dict]) -> str:
    """The sweep's rows as one table: case, config (or reference row), microseconds, rate, and the largest differences
    from the table config's output and from the tl kernel's (blank where not compared)."""
    def num(x, fmt):
        return "" if x is None else format(x, fmt)

    lines = [f"{'variant':16s} {'case':44s} {'config':64s} {'us':>9s} {'rate':>9s} {'unit':7s} {'max|d table|':>12s} {'max|d tl|':>10s}"]
    for r in results:
        cfg = r["cfg"] if isinstance(r["cfg"], str) else (" ".join(f"{k}={v}" for k, v in {**r["cfg"], **r["extra"]}.items()) or "table")
        us = None if r["ms"] is None else r["ms"] * 1e3
        lines.append(f"{r['variant'][:16]:16s} {r['case'][:44]:44s} {cfg[:64]:64s} {num(us, '9.1f'):>9s} {num(r['rate'], '9.1f'):>9s} "
                     f"{r.get('unit', ''):7s} {num(r['max_diff'], '12.3g'):>12s} {num(r.get('max_diff_tl'), '10.3g'):>10s}")
    return "\n".join(lines)


def _sweep_variant(variant: str, device: torch.device) -> list[dict]:
    """Each of the variant's SWEEP configs timed on each of its SWEEP_CASES cases."""
    results = []
    for case in sweep_cases(variant):
        results += _sweep_case(variant, case, device)  # the case's tensors are freed on return
        torch.cuda.empty_cache()
    return results


def sweep_cases(variant: str) -> list[BenchCase]:
    """The cases `variant` is swept on: for each SWEEP_CASES fragment, the first case (CASES, then V4_PREFILL_CASES,
    GLUON_SWEEP_CASES and attention_decode.py's CASES) whose name holds it."""
    from deepinfer_cuda.bench import attention_decode

    fragments = SWEEP_CASES[variant]
    pool = CASES + V4_PREFILL_CASES + GLUON_SWEEP_CASES + attention_decode.CASES
    return [next(c for c in pool if fragment in c.name) for fragment in ((fragments,) if isinstance(fragments, str) else fragments)]


def sweep_entries(variant: str) -> tuple[str, ...]:
    """The tuning entries a variant's configs replace (SWEEP_ENTRIES; else the entry of its name)."""
    return SWEEP_ENTRIES.get(variant, (variant,))


def sweep_override(cfg: dict, extra: dict) -> dict:
    """What one SWEEP config sets over the table's entry: its tile keys and the TMA kernel's flags (off unless named)."""
    return {**cfg, "tma": extra.get("tma", False), "warp_specialize": extra.get("ws", False), "k_pairs": extra.get("kp", False)}


def _timer(case):
    """How `deepinfer bench ops` times `case`: from CUDA graph replays (case.graph: decode-sized calls) or on the stream,
    both with L2 flushed before each timed replay or call (do_bench)."""
    from deepinfer_cuda.bench.common import time_ms
    from deepinfer_cuda.bench.runner import graph_time_ms

    return graph_time_ms if getattr(case, "graph", False) else (lambda fn: time_ms(fn, warmup_ms=10, rep_ms=40))


def _mla_tl_kernel(case):
    """For a bf16 Gluon mla_decode case (attention_decode.py's ", gluon" rows), the tl kernel on its inputs; else None."""
    if case.op == "mla_decode" and case.name.endswith(", gluon"):
        from deepinfer_cuda.bench import attention_decode

        return attention_decode._mla_kernel
    return None


def _tl_reference(case, state: dict):
    """The tl kernel's output on a Gluon case's inputs (a Gluon fp8_block GEMM's or a bf16 Gluon mla_decode's), else None."""
    if state.get("path") == "gluon" and state.get("fmt") == "fp8_block":
        return _tl_fp8(state)
    mla_tl = _mla_tl_kernel(case)
    return None if mla_tl is None else mla_tl(state)


def _sweep_case(variant: str, case, device: torch.device) -> list[dict]:
    """Each of the variant's SWEEP configs timed on `case` (as `deepinfer bench ops` times it), its output compared with
    the table config's (the largest difference: a config that skipped rows would time fast; the Gluon fp8_block kernel's
    options must give 0) and, for a Gluon case, with the tl kernel's, then the table's config restored."""
    from deepinfer_cuda.kernels import gemm as kg
    from deepinfer_cuda.kernels import gemm_fp8_gluon as fp8_gluon
    from deepinfer_cuda.kernels import gemm_mxfp4_gluon as gluon
    from deepinfer_cuda.kernels import mla_decode_fp8_gluon, mla_decode_gluon
    from deepinfer_cuda.tuning import config as table_config

    results = []
    state = case.setup(device)
    amount = case.flops(state) if case.bound == "compute" else case.bytes(state)
    unit = "TFLOP/s" if case.bound == "compute" else "TB/s"
    want = case.kernel(state)
    tl_want = _tl_reference(case, state)
    entries = sweep_entries(variant)
    timer = _timer(case)
    # restored as found (a test may have patched the table)
    saved = kg.config, gluon.config, fp8_gluon.config, mla_decode_gluon.config, mla_decode_fp8_gluon.config
    for cfg, extra in SWEEP[variant]:
        op = SWEEP_OPS.get(variant, "gemm")
        full = {**table_config(op, entries[0], device), **(sweep_override(cfg, extra) if op == "gemm" else cfg)}
        patched = lambda op, v, dev, _full=full: dict(_full) if v in entries else table_config(op, v, dev)  # noqa: E731
        kg.config = gluon.config = fp8_gluon.config = mla_decode_gluon.config = mla_decode_fp8_gluon.config = patched
        kg.MXFP4_AUTO_PATH = extra.get("mx")
        diff = tl_diff = None
        try:
            if isinstance(want, torch.Tensor):  # NaN in the block the output will likely reuse: rows a config skips show as NaN, not stale
                torch.empty_like(want).fill_(float("nan"))
            got = case.kernel(state)
            torch.cuda.synchronize(device)
            if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor):
                diff = (got.float() - want.float()).abs().max().item()
            if isinstance(got, torch.Tensor) and tl_want is not None:
                tl_diff = (got.float() - tl_want.float()).abs().max().item()
            del got
            ms = timer(lambda: case.kernel(state))
            rate = amount / (ms * 1e-3) / 1e12
            line = f"{ms:8.4f} ms {rate:8.2f} {unit}" + ("" if diff is None else f"  max |out - table's| {diff:.3g}")
            line += "" if tl_diff is None else f"  max |out - tl kernel's| {tl_diff:.3g}"
        except Exception as exc:  # noqa: BLE001
            ms, rate, line = None, None, f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        print(f"sweep {variant:16s} {case.name[:56]:56s} {cfg} {extra} {line}", flush=True)
        results.append({"variant": variant, "case": case.name, "cfg": cfg, "extra": extra, "ms": ms, "rate": rate, "unit": unit, "max_diff": diff,
                        "max_diff_tl": tl_diff})
    kg.config, gluon.config, fp8_gluon.config, mla_decode_gluon.config, mla_decode_fp8_gluon.config = saved
    kg.MXFP4_AUTO_PATH = None
    results += _sweep_references(variant, case, state, amount, unit)
    return results


def _sweep_references(variant: str, case, state: dict, amount: float, unit: str) -> list[dict]:
    """Rows beside a case's configs: its torch peer (a rate reference: torch._scaled_mm is per-tensor scaled, not
    block-scaled), for an fp8_block call through the op the activation quantiser alone (its share of each row), for a
    Gluon mla_decode case the tl kernel (timed as the case)."""
    from deepinfer_cuda.kernels import gemm as kg

    rows = []
    timed = []
    if case.peer is not None:
        timed.append((f"peer {case.peer_name}", lambda: case.peer(state), amount))
    if state.get("fmt") == "fp8_block" and "prequantised" not in state and state.get("path") is None:
        timed.append(("fp8 activation quantiser alone", lambda: kg.quantize_act_fp8(state["x"]), None))
    if "prequantised_tl" in state:  # a Gluon case of the GEMM alone: the tl kernel's GEMM alone beside it
        timed.append(("tl kernel (fp8_path=tl), GEMM alone", lambda: _tl_fp8(state, state["prequantised_tl"]), amount))
    if (mla_tl := _mla_tl_kernel(case)) is not None:
        timed.append(("tl kernel (mla_decode_path=tl)", lambda: mla_tl(state), amount))
    timer = _timer(case)
    for label, fn, work in timed:
        try:
            ms = timer(fn)
            rate = None if work is None else work / (ms * 1e-3) / 1e12
            line = f"{ms:8.4f} ms" + ("" if rate is None else f" {rate:8.2f} {unit}")
        except Exception as exc:  # noqa: BLE001 - a peer this torch lacks is a row, not the end of the sweep
            ms, rate, line = None, None, f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        print(f"sweep {variant:16s} {case.name[:56]:56s} {label} {line}", flush=True)
        rows.append({"variant": variant, "case": case.name, "cfg": label, "extra": {}, "ms": ms, "rate": rate, "unit": unit, "max_diff": None})
    return rows


def main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(description="grouped_gemm / linear on a GPU: check, sweep, bench")
    p.add_argument("--check", action="store_true")
    p.add_argument("--quick", action="store_true", help="with --check: float32, the mxfp4 upcast path and the TMA kernel only")
    p.add_argument("--only", default=None, help="with --check: only the checks whose name holds this text")
    p.add_argument("--sweep", nargs="*", default=None, help="variants to sweep (all when none named)")
    p.add_argument("--bench", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device("cuda")
    out: dict = {}
    failures = 0
    if args.check:
        failures = check(device, args.quick, args.only)
        print(f"check: {failures} failure(s)", flush=True)
    if args.sweep is not None:
        out["sweep"] = sweep(device, args.sweep or None)
    if args.bench:
        from deepinfer_cuda.bench.runner import run

        out["bench"] = run(modules=["gemm"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
