"""fp8_block `linear` and masked `grouped_gemm` at prefill sizes through cuBLAS's block-scaled FP8 GEMM (torch._scaled_mm with 1 x 128 activation
and 128 x 128 weight scales: DeepSeek's FP8 recipe, which cuBLAS runs natively on SM90 since CUDA 12.9).

Why: the tl kernel promotes each 128-K group in the warps that issue the next MMAs, so at prefill sizes it reaches
380-770 TFLOP/s on V4-Flash's projections; cuBLAS's block-scaled kernel (the promotion inside its own warp-specialised
schedule) runs them at 940-1170, 620-1030 with the quantiser, and its outputs equalled the tl kernel's bit for bit at
every shape timed (H200, 2026-12-07, docs/measurements/2026-12-07/h200_round13/a/probe.txt).

Semantics: the op's fp8_block (deepinfer.ops.gemm): x quantised per token and 128 columns by gemm.py's quantiser (the
scales laid out with each group's rows contiguous, the layout cuBLAS reads), the e4m3 products of each 128-K group
scaled by the row's activation scale and the weight block's scale, summed in float32. cuBLAS sums in its own order,
so the result agrees with the reference within the op's tolerance, not bit for bit, and it is not batch-invariant
(its kernel choice depends on the row count): deterministic mode keeps gemm.py's invariant kernel.

Served: bf16/fp16 x of at least MIN_ROWS rows (decode sizes stay on the tl kernel's split-K tiles), a contiguous
weight with K a multiple of 512 (cuBLAS reads the weight scales' K blocks in fours) and N a multiple of 128, output
in x's dtype; grouped_gemm's masked layout with at most MAX_GROUPS groups of at least MIN_ROWS rows each (V4's grouped
output projection, wo_a: 8 groups of every token), one cuBLAS call per group over all max_m rows (rows past
masked_m[e] are unspecified by the op, so no count is read back to the host) and at least MIN_MASKED_ROWS rows a group.
Everything else runs the tl kernel. Chosen by backend option fp8_path=auto (the default) or cublas on an SM90 GPU whose
torch runs the block-scaled GEMM (`blockwise_unusable` tries one small call and says why not: auto then keeps the tl
kernel, cublas is that error).
"""

from __future__ import annotations

from functools import cache

import torch

from deepinfer.ops import gemm as gemm_ops
from deepinfer_cuda.kernels import gemm
from deepinfer_cuda.kernels.common import Registration, capability
from deepinfer_cuda.options import FP8_PATH

MAX_GROUPS = 16  # a masked call of more groups (decode's experts) stays one tl launch
MIN_ROWS = 1024  # below this the tl kernel's decode tiles (split-K over the SMs) are the ones tuned for the shape
# wo_a, 8 groups x 4096 -> 1024 (H200): at 8192 rows a group the per-group calls took 1.33 ms against the tl kernel's
# one launch's 0.97; at 16384, 1.54 against 2.14
MIN_MASKED_ROWS = 16384
_K_MULTIPLE = 4 * gemm.FP8_GROUP  # the weight scales' K blocks are read in fours (stride L4 = round_up(K / 128, 4))


def not_served(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None, masked: bool = False) -> str | None:
    """Why cuBLAS does not serve this call (None: it does); those calls run the tl kernel. masked: grouped_gemm's
    masked layout (x [E, max_m, K], weight [E, N, K])."""
    n, k = weight.shape[-2], weight.shape[-1]
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"x is {x.dtype}, not bfloat16/float16"
    if (out_dtype or x.dtype) != x.dtype:
        return f"out_dtype {out_dtype} differs from x's {x.dtype}"
    rows = x.shape[1] if masked else x.numel() // max(k, 1)
    least = MIN_MASKED_ROWS if masked else MIN_ROWS
    if rows < least:
        return f"fewer than {least} rows{' a group' if masked else ''} (the tl kernel measured faster)"
    if masked and weight.shape[0] > MAX_GROUPS:
        return f"{weight.shape[0]} groups, more than {MAX_GROUPS} (one tl launch serves them)"
    if weight.dim() != (3 if masked else 2) or not weight.is_contiguous():
        return f"the weight is not one contiguous {'[E, N, K]' if masked else '[N, K]'} tensor"
    if k % _K_MULTIPLE or n % gemm.FP8_GROUP:
        return f"K={k} is not a multiple of {_K_MULTIPLE} or N={n} of {gemm.FP8_GROUP}"
    return None


def linear(
    x: torch.Tensor, weight: torch.Tensor, *, weight_scale: torch.Tensor | None = None, fmt: str = "dense", out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    gemm_ops.check_linear_args(x, weight, weight_scale, fmt, out_dtype)
    weight, weight_scale = gemm._weight_operands(weight, weight_scale, fmt)
    if not_served(x, weight, out_dtype) is not None:
        return gemm.launch_gemm(x, weight, weight_scale, fmt, gemm._LINEAR, out_dtype=out_dtype)
    out = torch.empty(x.numel() // x.shape[-1], weight.shape[0], dtype=x.dtype, device=x.device)
    _cublas_mm(x.reshape(-1, x.shape[-1]), weight, weight_scale, out)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def grouped_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    expert_offsets: torch.Tensor | None = None,
    masked_m: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    fmt: str = "dense",
) -> torch.Tensor:
    experts = gemm_ops.check_grouped_args(x, weight, weight_scale, fmt, expert_offsets, masked_m)
    weight, weight_scale = gemm._weight_operands(weight, weight_scale, fmt)
    if expert_offsets is not None:  # the contiguous layout's group sizes live on the device: the tl kernel's in-kernel map
        gemm_ops.check_index_vector("expert_offsets", expert_offsets, experts + 1, x.device)
        return gemm.launch_gemm(x, weight, weight_scale, fmt, gemm._CONTIGUOUS, offsets=expert_offsets)
    gemm_ops.check_index_vector("masked_m", masked_m, experts, x.device)
    if not_served(x, weight, None, masked=True) is not None:
        return gemm.launch_gemm(x, weight, weight_scale, fmt, gemm._MASKED, masked_m=masked_m)
    out = torch.empty(experts, x.shape[1], weight.shape[1], dtype=x.dtype, device=x.device)
    for e in range(experts):
        _cublas_mm(x[e], weight[e], weight_scale[e], out[e])
    return out


def _cublas_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out: torch.Tensor) -> None:
    """out [M, N] = x [M, K] (rows with unit column stride) @ weight [N, K]^T in fp8_block, by cuBLAS."""
    xq, xs = gemm.quantize_act_fp8(x, scale_rows_contiguous=True)
    # weight_scale [N/128, K/128] row-major: its transpose is the [K/128, N/128] K-block-minor view cuBLAS reads
    torch._scaled_mm(xq, weight.T, scale_a=xs, scale_b=weight_scale.T, out_dtype=out.dtype, out=out)


linear.__qualname__, grouped_gemm.__qualname__ = "linear_fp8_cublas", "grouped_gemm_fp8_cublas"


@cache
def _blockwise_error(index: int) -> str | None:
    """One 1024 x 512 x 128 block-scaled call on device `index`: None if cuBLAS ran it, else the error's first line."""
    dev = torch.device("cuda", index)
    xq = torch.zeros(MIN_ROWS, _K_MULTIPLE, device=dev).to(torch.float8_e4m3fn)
    w = torch.zeros(gemm.FP8_GROUP, _K_MULTIPLE, device=dev).to(torch.float8_e4m3fn)
    xs = torch.ones(_K_MULTIPLE // gemm.FP8_GROUP, MIN_ROWS, device=dev).T
    ws = torch.ones(1, _K_MULTIPLE // gemm.FP8_GROUP, device=dev)
    try:
        torch._scaled_mm(xq, w.T, scale_a=xs, scale_b=ws.T, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as exc:
        return str(exc).splitlines()[0][:200]
    return None


def blockwise_unusable(device: torch.device | None) -> str | None:
    if device is None or device.type != "cuda" or capability(device) != (9, 0):
        return "fp8_path=cublas runs on SM90 GPUs only"
    error = _blockwise_error(device.index if device.index is not None else torch.cuda.current_device())
    if error is not None:
        return f"fp8_path=cublas, but torch {torch.__version__} (CUDA {torch.version.cuda}) cannot run a block-scaled FP8 GEMM: {error}"
    return None


def _chosen(ctx) -> bool:
    path = FP8_PATH.value(ctx)
    return path == "cublas" or (path == "auto" and blockwise_unusable(ctx.device) is None)


_NOTE = ("cuBLAS block-scaled FP8 (torch._scaled_mm, 1x128 activation and 128x128 weight scales) after gemm.py's quantiser, "
         f"for calls of at least {MIN_ROWS} rows (a group), K a multiple of 512 and N of 128; masked layout only, at most "
         f"{MAX_GROUPS} groups of at least {MIN_MASKED_ROWS} rows; else the tl kernel (fp8_path=auto|cublas)")
_FP8 = dict(formats=("fp8_block",), dtypes=(torch.bfloat16, torch.float16), when=_chosen, priority=2,
            unusable=lambda ctx: blockwise_unusable(ctx.device), note=_NOTE)
REGISTRATIONS = [Registration(op="linear", fn=linear, **_FP8), Registration(op="grouped_gemm", fn=grouped_gemm, **_FP8)]
