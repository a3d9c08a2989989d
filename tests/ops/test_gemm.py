"""linear and grouped_gemm against float64 computations written out per expert, row and block."""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops import quant
from deepinfer.ops.gemm import _grouped_gemm_canonicalize, grouped_gemm, linear


def seeded(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def fp8_product_by_blocks(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The fp8_block formula as written: sum over 128-column groups g of
    x_scale[t, g] * w_scale[n // 128, g] * (x_q[t, g] . w_q[n, g]), in float64."""
    x_q, x_scale = quant.quantize_act_fp8(x)
    xq, wq = x_q.double(), w_fp8.double()
    out = torch.zeros(x.shape[0], w_fp8.shape[0], dtype=torch.float64)
    for g in range(x_scale.shape[1]):
        cols = slice(128 * g, 128 * (g + 1))
        dots = xq[:, cols] @ wq[:, cols].T  # [T, N], exact in float64 (fp8 x fp8 over 128 terms)
        out += x_scale[:, g, None].double() * w_scale[:, g].double().repeat_interleave(128)[None, : w_fp8.shape[0]] * dots
    return out


def fp8_block32_values(w_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8_block32 as written: w[n, k] = e4m3 value * 2^(scale[n // 32, k // 32] - 127), in float64, element by element."""
    n, k = w_fp8.shape
    rows, cols = torch.arange(n)[:, None] // 32, torch.arange(k)[None, :] // 32
    return w_fp8.double() * torch.exp2(scale.double()[rows, cols] - 127)


def product_by_rows(x: torch.Tensor, weight: torch.Tensor, weight_scale, fmt: str) -> torch.Tensor:
    """x [T, K] times one expert's weight, in float64: dequantise, then one dot per output row."""
    if fmt == "fp8_block":
        return fp8_product_by_blocks(x, weight, weight_scale)
    if fmt == "fp8_block32":  # W8A16: x as given
        w = fp8_block32_values(weight, weight_scale)
    else:
        w = quant.dequantize_mxfp4(weight, weight_scale, torch.float64) if fmt == "mxfp4" else weight.double()
    xd = x.double()
    return torch.stack([xd @ w[n] for n in range(w.shape[0])], dim=1) if x.shape[0] else xd.new_zeros(0, w.shape[0])


def stored_weight(fmt: str, *lead: int, n: int, k: int, seed: int) -> dict:
    w = seeded(*lead, n, k, seed=seed, scale=0.05).float()
    if fmt == "dense":
        return {"weight": w}
    quantize = {"fp8_block": quant.quantize_weight_fp8_block, "fp8_block32": quant.quantize_weight_fp8_block32}.get(fmt, quant.quantize_weight_mxfp4)
    weight, scale = quantize(w)
    return {"weight": weight, "weight_scale": scale, "fmt": fmt}


def expert_slice(kw: dict, e: int) -> dict:
    return {"weight": kw["weight"][e], "weight_scale": None if "weight_scale" not in kw else kw["weight_scale"][e], "fmt": kw.get("fmt", "dense")}


def assert_close_to(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype):
    """Within the output dtype's rounding, relative to the largest expected value (empty is fine)."""
    rtol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    assert out.dtype == dtype and out.shape == expected.shape
    if expected.numel():
        assert (out.double() - expected).abs().max() <= rtol * expected.abs().max()


# ------------------------------------------------------------------------------------------------
# linear


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_mxfp4_a8_is_the_mx_fp8_activation_times_the_mxfp4_weight(dtype):
    """W4A8 MX: the mxfp4 weight as stored, the activation through quantize_act_mxfp8 (per token and 32
    columns), the product summed per 32-column group of e4m3 x e2m1 codes times both e8m0 scales."""
    x = seeded(5, 320, seed=1).to(dtype)
    kw = stored_weight("mxfp4", n=96, k=320, seed=2)
    out = linear(x, kw["weight"], weight_scale=kw["weight_scale"], fmt="mxfp4_a8")
    x_q, x_s = quant.quantize_act_mxfp8(x)
    w_codes = quant.dequantize_mxfp4(kw["weight"], torch.full_like(kw["weight_scale"], 127), torch.float64)
    xs = torch.exp2(x_s.double() - 127)
    ws = torch.exp2(kw["weight_scale"].double() - 127)
    expected = torch.zeros(5, 96, dtype=torch.float64)
    for g in range(320 // 32):
        cols = slice(32 * g, 32 * (g + 1))
        expected += xs[:, g, None] * ws[None, :, g] * (x_q[:, cols].double() @ w_codes[:, cols].T)
    assert_close_to(out, expected, dtype)
    # the same weight as W4A16 differs by the activation rounding
    assert not torch.equal(out, linear(x, kw["weight"], weight_scale=kw["weight_scale"], fmt="mxfp4"))
    with pytest.raises(ValueError, match="multiple of 32"):
        linear(x[:, :48], kw["weight"][:, :24], weight_scale=kw["weight_scale"][:, :1], fmt="mxfp4_a8")



@pytest.mark.parametrize("fmt", ["dense", "fp8_block", "mxfp4", "fp8_block32"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_linear_matches_rowwise_float64(fmt, dtype):
    x = seeded(5, 320, seed=1).to(dtype)
    kw = stored_weight(fmt, n=200, k=320, seed=2)  # fp8: a 2x3 scale grid, both edges partial (fp8_block32: 7x10, N's partial)
    out = linear(x, **kw)
    assert out.shape == (5, 200)
    assert_close_to(out, product_by_rows(x, kw["weight"], kw.get("weight_scale"), fmt), dtype)


def test_linear_dense_single_token_and_low_precision_weight():
    x = seeded(1, 64, seed=3).float()
    w = seeded(8, 64, seed=4).to(torch.bfloat16)
    expected = torch.tensor([[sum(x[0, k].item() * w[n, k].item() for k in range(64)) for n in range(8)]], dtype=torch.float64)
    assert_close_to(linear(x, w), expected, torch.float32)


def test_linear_out_dtype_rounds_the_accumulation_once_to_it():
    """The MoE router's call: bf16 x times a float32 weight in float32 is the product of x's exact values (what an
    upcast copy of x gave), and bf16 operands returned in float32 keep the bits a bf16 output would round away."""
    x = seeded(3, 256, seed=7).to(torch.bfloat16)
    w = seeded(16, 256, seed=8).float()
    out = linear(x, w, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and torch.equal(out, linear(x.float(), w))
    assert linear(x, w).dtype == torch.bfloat16  # default: x's dtype, as before
    wide = linear(x, w.bfloat16(), out_dtype=torch.float32)
    assert torch.equal(wide, x.float() @ w.bfloat16().float().T) and not torch.equal(wide, linear(x, w.bfloat16()).float())
    golden = linear(x.double(), w.double(), out_dtype=torch.float32)  # the golden run: float64 products, stored as float32
    assert golden.dtype == torch.float32 and torch.equal(golden, (x.double() @ w.double().T).float())


def test_linear_fp8_quantises_activations_even_in_the_float64_golden_run():
    # Large dynamic range: a few columns 1000x the rest, so most groups' small values lose bits.
    x = seeded(3, 384, seed=5)
    x[:, [7, 200, 301]] *= 1e3
    x = x.to(torch.bfloat16)
    kw = stored_weight("fp8_block", n=64, k=384, seed=6)
    golden = linear(x.double(), kw["weight"], weight_scale=kw["weight_scale"].double(), fmt="fp8_block")
    expected = fp8_product_by_blocks(x, kw["weight"], kw["weight_scale"])
    assert torch.allclose(golden, expected, rtol=1e-12, atol=1e-12 * expected.abs().max().item())
    # ...and the quantisation is really there: the unquantised product is measurably different.
    unquantised = x.double() @ quant.dequantize_weight_fp8_block(kw["weight"], kw["weight_scale"], torch.float64).T
    assert (unquantised - expected).abs().max() > 1e-4 * expected.abs().max()


def test_linear_fp8_block32_keeps_the_activation_and_reads_partial_blocks():
    """W8A16: no activation quantisation, even with a large dynamic range (the float64 golden run computes with x's
    exact values); N 72 and K 100 end in partial 32x32 blocks, each block's e8m0 byte its own."""
    x = seeded(3, 100, seed=13)
    x[:, [5, 77]] *= 1e3
    weight = torch.randint(0, 256, (72, 100), generator=torch.Generator().manual_seed(14), dtype=torch.uint8)
    weight[(weight & 0x7F) == 0x7F] = 0  # e4m3fn's NaN
    scale = torch.randint(110, 140, (3, 4), generator=torch.Generator().manual_seed(15), dtype=torch.uint8)
    out = linear(x, weight.view(quant.FP8_DTYPE), weight_scale=scale, fmt="fp8_block32")
    expected = x @ fp8_block32_values(weight.view(quant.FP8_DTYPE), scale).T
    assert torch.allclose(out, expected, rtol=1e-12, atol=1e-12 * expected.abs().max().item())


# ------------------------------------------------------------------------------------------------
# grouped_gemm


@pytest.mark.parametrize("fmt", ["dense", "fp8_block", "mxfp4", "fp8_block32"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_grouped_gemm_contiguous_matches_per_expert_loops(fmt, dtype):
    counts = [4, 0, 9, 0, 0, 1, 2, 0]  # empty experts, including the last; 5 padding rows follow
    offsets = torch.tensor([0, 4, 4, 13, 13, 13, 14, 16, 16], dtype=torch.int32)
    x = seeded(21, 256, seed=7).to(dtype)
    kw = stored_weight(fmt, 8, n=96, k=256, seed=8)
    out = grouped_gemm(x, expert_offsets=offsets, **kw)
    assert out.shape == (21, 96)
    start = 0
    for e, count in enumerate(counts):
        rows = slice(start, start + count)
        assert_close_to(out[rows], product_by_rows(x[rows], **expert_slice(kw, e)), dtype)
        start += count
    assert (out[16:] == 0).all()  # the reference writes zeros in the padding rows


@pytest.mark.parametrize("fmt", ["dense", "fp8_block", "mxfp4", "fp8_block32"])
def test_grouped_gemm_all_tokens_on_one_expert_equals_linear(fmt):
    x = seeded(11, 128, seed=9).to(torch.bfloat16)
    kw = stored_weight(fmt, 4, n=64, k=128, seed=10)
    offsets = torch.tensor([0, 0, 0, 11, 11], dtype=torch.int64)
    out = grouped_gemm(x, expert_offsets=offsets, **kw)
    assert torch.equal(out, linear(x, **expert_slice(kw, 2)))


@pytest.mark.parametrize("fmt", ["dense", "fp8_block", "mxfp4", "fp8_block32"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_grouped_gemm_masked_matches_per_expert_loops(fmt, dtype):
    masked_m = torch.tensor([0, 6, 2, 6], dtype=torch.int32)  # an empty expert and a full one (max_m = 6)
    x = seeded(4, 6, 160, seed=11).to(dtype)
    kw = stored_weight(fmt, 4, n=130, k=160, seed=12)
    out = grouped_gemm(x, masked_m=masked_m, **kw)
    assert out.shape == (4, 6, 130)
    for e, m in enumerate(masked_m.tolist()):
        assert_close_to(out[e, :m], product_by_rows(x[e, :m], **expert_slice(kw, e)), dtype)
        assert (out[e, m:] == 0).all()


def test_canonicalize_zeroes_only_the_unspecified_rows():
    offsets = torch.tensor([0, 2, 5], dtype=torch.int32)
    out = seeded(8, 3, seed=13).float()
    out[6, 1] = float("nan")  # a kernel may leave garbage, NaN included, in padding rows
    canon = _grouped_gemm_canonicalize({"expert_offsets": offsets}, {"out": out})["out"]
    assert torch.equal(canon[:5], out[:5]) and (canon[5:] == 0).all()

    masked_m = torch.tensor([0, 3, 1], dtype=torch.int32)
    out = seeded(3, 3, 4, seed=14).to(torch.bfloat16)
    out[2, 2, 0] = float("inf")
    canon = _grouped_gemm_canonicalize({"masked_m": masked_m}, {"out": out})["out"]
    for e, m in enumerate([0, 3, 1]):
        assert torch.equal(canon[e, :m], out[e, :m]) and (canon[e, m:] == 0).all()


def test_canonicalized_garbage_compares_equal_to_the_reference():
    x = seeded(2, 5, 64, seed=15).float()
    kw = stored_weight("dense", 2, n=16, k=64, seed=16)
    masked_m = torch.tensor([5, 1], dtype=torch.int32)
    ref = grouped_gemm(x, masked_m=masked_m, **kw)
    kernel_like = ref.clone()
    kernel_like[1, 1:] = torch.nan  # rows a kernel never wrote
    canon = lambda o: _grouped_gemm_canonicalize({"masked_m": masked_m}, {"out": o})["out"]  # noqa: E731
    assert torch.equal(canon(kernel_like), canon(ref))


# ------------------------------------------------------------------------------------------------
# errors


def fp8(n, k, *lead):
    return quant.quantize_weight_fp8_block(seeded(*lead, n, k).float())


BAD_LINEAR = [
    ("unknown weight format", dict(x=torch.ones(2, 64), weight=torch.ones(8, 64), fmt="int8")),
    ("takes no weight_scale", dict(x=torch.ones(2, 64), weight=torch.ones(8, 64), weight_scale=torch.ones(1, 1))),
    ("needs a weight_scale", dict(x=torch.ones(2, 64), weight=fp8(8, 64)[0], fmt="fp8_block")),
    ("weight must be", dict(x=torch.ones(2, 64), weight=torch.ones(8, 32))),
    ("weight must be", dict(x=torch.ones(2, 64), weight=fp8(8, 64)[0])),  # fp8 weight passed as dense
    ("weight_scale must be", dict(x=torch.ones(2, 200), weight=fp8(300, 200)[0], weight_scale=torch.ones(2, 1), fmt="fp8_block")),
    ("multiple of 32", dict(x=torch.ones(2, 48), weight=torch.zeros(8, 24, dtype=torch.uint8), weight_scale=torch.zeros(8, 1, dtype=torch.uint8), fmt="mxfp4")),
    ("weight_scale must be",
     dict(x=torch.ones(2, 64), weight=torch.zeros(8, 32, dtype=torch.uint8), weight_scale=torch.zeros(8, 1, dtype=torch.uint8), fmt="mxfp4")),
    ("x must be", dict(x=torch.ones(1, 2, 64), weight=torch.ones(8, 64))),
    ("x must be", dict(x=torch.ones(2, 64, dtype=torch.int32), weight=torch.ones(8, 64))),
    ("weight_scale must be",  # fp8_block32: [ceil(N/32), ceil(K/32)] e8m0 bytes
     dict(x=torch.ones(2, 100), weight=fp8(40, 100)[0], weight_scale=torch.zeros(2, 3, dtype=torch.uint8), fmt="fp8_block32")),
    ("weight_scale must be", dict(x=torch.ones(2, 100), weight=fp8(40, 100)[0], weight_scale=torch.ones(2, 4), fmt="fp8_block32")),
    ("out_dtype must be", dict(x=torch.ones(2, 64), weight=torch.ones(8, 64), out_dtype=torch.float64)),
    ("out_dtype must be", dict(x=torch.ones(2, 64), weight=torch.ones(8, 64), out_dtype=torch.int32)),
]


@pytest.mark.parametrize("message, kwargs", BAD_LINEAR, ids=[f"{i}-{m}" for i, (m, _) in enumerate(BAD_LINEAR)])
def test_linear_rejects_bad_inputs(message, kwargs):
    with pytest.raises(ValueError, match=message):
        linear(**kwargs)


W3 = torch.ones(3, 8, 64)
BAD_GROUPED = [
    ("exactly one of", dict(x=torch.ones(4, 64), weight=W3)),
    ("exactly one of", dict(x=torch.ones(3, 4, 64), weight=W3, expert_offsets=torch.tensor([0, 1, 2, 4]), masked_m=torch.tensor([1, 1, 1]))),
    ("expert_offsets must", dict(x=torch.ones(4, 64), weight=W3, expert_offsets=torch.tensor([1, 2, 3, 4]))),
    ("expert_offsets must", dict(x=torch.ones(4, 64), weight=W3, expert_offsets=torch.tensor([0, 3, 2, 4]))),
    ("expert_offsets must", dict(x=torch.ones(4, 64), weight=W3, expert_offsets=torch.tensor([0, 1, 2, 5]))),
    ("length 4", dict(x=torch.ones(4, 64), weight=W3, expert_offsets=torch.tensor([0, 2, 4]))),
    ("integer vector", dict(x=torch.ones(4, 64), weight=W3, expert_offsets=torch.tensor([0.0, 1.0, 2.0, 4.0]))),
    ("masked_m values", dict(x=torch.ones(3, 4, 64), weight=W3, masked_m=torch.tensor([1, 5, 0]))),
    ("masked layout", dict(x=torch.ones(2, 4, 64), weight=W3, masked_m=torch.tensor([1, 1, 0]))),
    ("x must be", dict(x=torch.ones(3, 4, 64), weight=W3, expert_offsets=torch.tensor([0, 1, 2, 4]))),
    ("\\[E, N, K\\]", dict(x=torch.ones(4, 64), weight=torch.ones(8, 64), expert_offsets=torch.tensor([0, 4]))),
    ("weight_scale must be",
     dict(x=torch.ones(4, 64), weight=fp8(8, 64, 3)[0], weight_scale=fp8(8, 64, 2)[1], fmt="fp8_block", expert_offsets=torch.tensor([0, 1, 2, 4]))),
]


@pytest.mark.parametrize("message, kwargs", BAD_GROUPED, ids=[f"{i}-{m}" for i, (m, _) in enumerate(BAD_GROUPED)])
def test_grouped_gemm_rejects_bad_inputs(message, kwargs):
    with pytest.raises(ValueError, match=message):
        grouped_gemm(**kwargs)
