"""Benchmarks of DeepSeek-V4's hyper-connections and clipped SwiGLU at V4-Flash sizes: hc_pre, hc_head, hc_post, clamped_silu_and_mul.

hc_pre / hc_post: N = 4 residual streams of D = 4096 per token (bf16), the mixing projection fn
[(2+N)N = 24, N*D = 16384] float32, 20 Sinkhorn iterations; T = 1, 16 and 64 (decode batches; hc_post
1 and 64), 1024 and 8192 tokens (prefill chunks).
  - hc_pre bytes: x read once, fn / base / scale read once, the layer input (bf16) and post / comb
    (float32) written. Flops: 2 * T * N*D * (24 + 2) (the projection, the sum of squares and the
    collapse), the Sinkhorn iterations' few hundred per token left out. About 21 flop/byte at any T
    (fn is 1.5 MB: at T = 1 it is all the traffic): memory-bound.
  - hc_head (the head's collapse and final norm; T = 1 and 64, the sampled rows of decode batches, and
    1024): x read once, the head's fn [N, N*D] / base / scale and the norm weight read, the normed
    bf16 row written. Flops: 2 * T * N*D * (N + 2). Its peer, the reference, is the torch glue the
    V4 head ran before the op (flatten, rms, the mixing, sigmoid, the weighted sum) and rms_norm.
  - hc_post bytes: y and the N streams read, the N output streams written, post / comb read.
    Flops: 10 per output element (post * y plus N multiply-adds). Memory-bound.
clamped_silu_and_mul: the routed experts' gate/up rows [T, 2 x 2048] bf16 with limit 10 (V4's
swiglu_limit): T = 384 and 1536 (decode batches 64 and 256, top-6) and 49152 (a prefill chunk of
8192 tokens, top-6). Bytes: x read, out written; flops: 6 per output (two clamps, exp, add, divide,
multiply). Memory-bound.

The peers are the reference ops themselves (torch, float32 arithmetic as the op docstrings specify;
no host synchronisation, so the decode-sized ones are graph-timed like the kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_cuda.bench.common import BenchCase

OPS = ("hc_pre", "hc_head", "hc_post", "clamped_silu_and_mul")  # what this bench module covers: the runner finds it by this
TABLE_ORDER = 80  # where its rows sit in `deepinfer bench ops`: after the V4 attention ops

STREAMS, HIDDEN = 4, 4096
MIX = (2 + STREAMS) * STREAMS
NORM_EPS, HC_EPS, SINKHORN_ITERS = 1e-6, 1e-6, 20
MOE_INTER, SWIGLU_LIMIT = 2048, 10.0


@dataclass(frozen=True)
class GraphCase(BenchCase):
    """Decode-sized: timed from a CUDA graph replay (kernels and peers are graph-safe)."""

    graph: bool = True


def _gen(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(0)


def _hc_setup(tokens: int):
    def setup(device: torch.device) -> dict:
        g = _gen(device)
        return {
            "x": torch.randn(tokens, STREAMS, HIDDEN, device=device, dtype=torch.bfloat16, generator=g),
            "y": torch.randn(tokens, HIDDEN, device=device, dtype=torch.bfloat16, generator=g),
            "fn": torch.randn(MIX, STREAMS * HIDDEN, device=device, generator=g) * (STREAMS * HIDDEN) ** -0.5,
            "base": 0.5 * torch.randn(MIX, device=device, generator=g),
            "scale": 1 + 0.2 * torch.randn(3, device=device, generator=g),
            "post": 2 * torch.rand(tokens, STREAMS, device=device, generator=g),
            "comb": torch.softmax(torch.randn(tokens, STREAMS, STREAMS, device=device, generator=g), dim=-1),
            "norm_weight": 1 + 0.1 * torch.randn(HIDDEN, device=device, generator=g),  # the block's RMSNorm (attn_norm / ffn_norm)
            "head_fn": torch.randn(STREAMS, STREAMS * HIDDEN, device=device, generator=g) * (STREAMS * HIDDEN) ** -0.5,
            "head_base": 0.5 * torch.randn(STREAMS, device=device, generator=g),
            "head_scale": 1 + 0.2 * torch.randn(1, device=device, generator=g),
        }

    return setup


def _pre_args(s: dict) -> tuple:
    return s["x"], s["fn"], s["base"], s["scale"]


_PRE_KW = dict(norm_eps=NORM_EPS, hc_eps=HC_EPS, sinkhorn_iters=SINKHORN_ITERS)


def _pre_kernel(s: dict):
    from deepinfer_cuda.kernels.hyper_connection import hc_pre

    return hc_pre(*_pre_args(s), **_PRE_KW)


def _pre_peer(s: dict):
    from deepinfer.ops.hyper_connection import hc_pre

    return hc_pre(*_pre_args(s), **_PRE_KW)


def _pre_normed_kernel(s: dict):
    from deepinfer_cuda.kernels.hyper_connection import hc_pre

    return hc_pre(*_pre_args(s), **_PRE_KW, norm_weight=s["norm_weight"])


def _pre_normed_peer(s: dict):
    from deepinfer.ops.hyper_connection import hc_pre

    return hc_pre(*_pre_args(s), **_PRE_KW, norm_weight=s["norm_weight"])


def _pre_bytes(s: dict) -> float:
    x, tokens = s["x"], s["x"].shape[0]
    params = (s["fn"].numel() + s["base"].numel() + s["scale"].numel()) * 4
    return x.numel() * x.element_size() + params + tokens * (HIDDEN * x.element_size() + (STREAMS + STREAMS * STREAMS) * 4)


def _pre_flops(s: dict) -> float:
    return 2.0 * s["x"].numel() * (MIX + 2)


def _head_args(s: dict) -> tuple:
    return s["x"], s["head_fn"], s["head_base"], s["head_scale"], s["norm_weight"]


def _head_kernel(s: dict):
    from deepinfer_cuda.kernels.hyper_connection import hc_head

    return hc_head(*_head_args(s), norm_eps=NORM_EPS, hc_eps=HC_EPS)


def _head_peer(s: dict):
    from deepinfer.ops.hyper_connection import hc_head

    return hc_head(*_head_args(s), norm_eps=NORM_EPS, hc_eps=HC_EPS)


def _head_bytes(s: dict) -> float:
    x, tokens = s["x"], s["x"].shape[0]
    params = (s["head_fn"].numel() + s["head_base"].numel() + s["head_scale"].numel() + s["norm_weight"].numel()) * 4
    return x.numel() * x.element_size() + params + tokens * HIDDEN * x.element_size()


def _head_flops(s: dict) -> float:
    return 2.0 * s["x"].numel() * (STREAMS + 2)


def _post_args(s: dict) -> tuple:
    return s["y"], s["x"], s["post"], s["comb"]


def _post_kernel(s: dict):
    from deepinfer_cuda.kernels.hyper_connection import hc_post

    return hc_post(*_post_args(s))


def _post_peer(s: dict):
    from deepinfer.ops.hyper_connection import hc_post

    return hc_post(*_post_args(s))


def _post_bytes(s: dict) -> float:
    x, y = s["x"], s["y"]
    return 2 * x.numel() * x.element_size() + y.numel() * y.element_size() + (s["post"].numel() + s["comb"].numel()) * 4


def _post_flops(s: dict) -> float:
    return 10.0 * s["x"].numel()


def _act_setup(tokens: int):
    def setup(device: torch.device) -> dict:
        g = _gen(device)
        return {"x": 4 * torch.randn(tokens, 2 * MOE_INTER, device=device, dtype=torch.bfloat16, generator=g)}  # some values past the limit

    return setup


def _act_kernel(s: dict):
    from deepinfer_cuda.kernels.clamped_activation import clamped_silu_and_mul

    return clamped_silu_and_mul(s["x"], limit=SWIGLU_LIMIT)


def _act_peer(s: dict):
    from deepinfer.ops.activation import clamped_silu_and_mul

    return clamped_silu_and_mul(s["x"], limit=SWIGLU_LIMIT)


def _act_bytes(s: dict) -> float:
    x = s["x"]
    return 1.5 * x.numel() * x.element_size()  # [T, 2I] read, [T, I] written


def _act_flops(s: dict) -> float:
    return 3.0 * s["x"].numel()  # 6 per output, half as many outputs as inputs


HC_PRE = (_pre_kernel, _pre_peer, "torch reference (deepinfer.ops.hyper_connection)", _pre_flops, _pre_bytes)
HC_PRE_NORMED = (_pre_normed_kernel, _pre_normed_peer, "torch reference (hc_pre then rms_norm, one op)", _pre_flops, _pre_bytes)
HC_HEAD = (_head_kernel, _head_peer, "torch reference (the V4 head's former glue, then rms_norm)", _head_flops, _head_bytes)
HC_POST = (_post_kernel, _post_peer, "torch reference (deepinfer.ops.hyper_connection)", _post_flops, _post_bytes)
ACT = (_act_kernel, _act_peer, "torch reference (deepinfer.ops.activation)", _act_flops, _act_bytes)


def _case(tokens: int):
    """Graph-timed up to decode sizes (launch overhead would otherwise be the figure)."""
    return GraphCase if tokens <= 256 else BenchCase


CASES = [
    *[_case(t)("hc_pre", f"T{t}_N4_D4096_bf16", _hc_setup(t), *HC_PRE) for t in (1, 16, 64, 1024, 8192)],
    # with the block's norm applied in the collapse (norm_weight): compare with the rows above
    *[_case(t)("hc_pre", f"T{t}_N4_D4096_bf16_normed", _hc_setup(t), *HC_PRE_NORMED) for t in (1, 64, 256, 8192)],
    *[_case(t)("hc_head", f"T{t}_N4_D4096_bf16", _hc_setup(t), *HC_HEAD) for t in (1, 64, 1024)],
    *[_case(t)("hc_post", f"T{t}_N4_D4096_bf16", _hc_setup(t), *HC_POST) for t in (1, 64, 1024, 8192)],
    GraphCase("clamped_silu_and_mul", "T384_I2048_bf16_decode_B64_top6", _act_setup(384), *ACT),
    GraphCase("clamped_silu_and_mul", "T1536_I2048_bf16_decode_B256_top6", _act_setup(1536), *ACT),
    BenchCase("clamped_silu_and_mul", "T49152_I2048_bf16_prefill_T8192_top6", _act_setup(49152), *ACT),
]
