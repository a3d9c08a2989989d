"""The cuda backend's linear / grouped_gemm kernels and fused fp8 quantiser under the Triton interpreter.

Shapes beyond the golden set, every format (dense, fp8_block, mxfp4 through each of its paths, the
register dequant path of every mx format) and layout (linear, contiguous, masked): random sizes, partial blocks, experts with zero tokens, padding
rows, masked_m = 0, float32 with ieee precision, mixed weight dtypes, linear's out_dtype, split-K; compared with the op
references in deepinfer.ops (computed in float64 from the same inputs, as the golden set is) within
the op's tolerance. The quantiser must match deepinfer.ops.quant.quantize_act_fp8 bit for bit.

tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported; tests/triton_mode.py fails
these tests loudly if the kernels in this process are not interpreted.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops import gemm as ref
from deepinfer.ops import quant

from triton_mode import kernel_module, require_interpreter


@pytest.fixture(scope="module")
def kg():
    require_interpreter()
    return kernel_module("deepinfer_cuda.kernels.gemm")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(*shape, seed: int, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen(seed)) * scale).to(dtype)


def weight_in(fmt: str, *lead: int, n: int, k: int, seed: int, dtype=torch.float32) -> dict:
    w = rand(*lead, n, k, seed=seed, scale=0.05)
    if fmt == "dense":
        return {"weight": w.to(dtype)}
    quantize = {
        "fp8_block": quant.quantize_weight_fp8_block,
        "mxfp4": quant.quantize_weight_mxfp4,
        "mxfp8": quant.quantize_weight_mxfp8,
        "mxfp4_a8": quant.quantize_weight_mxfp4,
        "fp8_block32": quant.quantize_weight_fp8_block32,
    }[fmt]
    q, s = quantize(w)
    return {"weight": q, "weight_scale": s, "fmt": fmt}


def as_float64(kw: dict) -> dict:
    """What the golden run does: float tensors (activations, dense weights, fp8 scales) upcast."""
    return {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != quant.FP8_DTYPE else v) for k, v in kw.items()}


def assert_matches(op_name: str, got: torch.Tensor, kw: dict, rows_ok: torch.Tensor | None = None):
    spec = {"linear": ref.linear, "grouped_gemm": ref.grouped_gemm}[op_name]
    want = spec(**as_float64(kw))
    x = kw["x"]
    out_dtype = kw.get("out_dtype") or x.dtype  # linear's out_dtype: the output's dtype and tolerance
    assert got.dtype == out_dtype and got.shape == want.shape
    tol = ref.GEMM_TOLERANCES[out_dtype]
    if op_name == "grouped_gemm":  # rows the op leaves unspecified compare as zeros
        got = ref._grouped_gemm_canonicalize(kw, {"out": got})["out"]
    err = (got.double() - want).abs()
    bound = tol.atol * x.shape[-1] + tol.rtol * want.abs()
    assert torch.isfinite(got.double()).all()
    assert (err <= bound).all(), f"max err {err.max().item():.3g}, worst err/bound {(err / bound).max().item():.3g}"


# ---------------------------------------------------------------------------------------------- quantiser


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
# rows 1, 2, 4, 6-8 and 33: every row tile the quantiser takes (its rows' power-of-two bucket, up to 16)
@pytest.mark.parametrize("shape", [(7, 200), (2, 3, 384), (1, 128), (5, 1), (2, 130), (4, 256), (33, 128)])
def test_quantiser_is_bit_exact(kg, dtype, shape):
    x = rand(*shape, seed=sum(shape), dtype=torch.float32)
    # a large dynamic range, tiny values (e4m3 subnormals after scaling), an all-zero group
    x = x * torch.exp(rand(*shape, seed=1, scale=4.0))
    x[..., :1] *= 1e3
    if shape[-1] >= 256:
        x[..., 128:256] = 0
    x = x.clamp(-6e4, 6e4).to(dtype)  # finite in float16 too
    q, s = kg.quantize_act_fp8(x)
    rq, rs = quant.quantize_act_fp8(x)
    assert q.dtype == quant.FP8_DTYPE and s.dtype == torch.float32
    assert q.shape == rq.shape and s.shape == rs.shape
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.parametrize("shape", [(7, 200), (2, 3, 384), (1, 128)])
def test_quantiser_lays_out_the_scales_with_each_groups_rows_contiguous_on_request(kg, shape):
    """scale_rows_contiguous (the Gluon fp8 kernel's layout, DeepGEMM's MN-major): the same values as a [..., groups]
    view of a [groups, rows] tensor."""
    x = rand(*shape, seed=sum(shape), scale=3.0).to(torch.bfloat16)
    q, s = kg.quantize_act_fp8(x, scale_rows_contiguous=True)
    rq, rs = quant.quantize_act_fp8(x)
    rows = x.numel() // x.shape[-1]
    assert s.shape == rs.shape and s.stride(-1) == rows and s.stride(-2) == 1
    assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


def test_quantiser_rounds_every_e4m3_tie_to_even(kg):
    # amax 448 gives scale 1.0 exactly: the values are cast as they are. Take every e4m3 magnitude,
    # the midpoints between neighbours (ties), and points just either side of them.
    grid = torch.arange(0, 127, dtype=torch.uint8).view(quant.FP8_DTYPE).float()  # 0 .. 448
    mids = (grid[:-1] + grid[1:]) / 2
    near = torch.cat([mids, torch.nextafter(mids, torch.zeros(())), torch.nextafter(mids, torch.full((), 1e9)), grid])
    vals = torch.cat([near, -near])
    groups = -(-vals.numel() // 127)
    body = torch.zeros(groups * 127)
    body[: vals.numel()] = vals
    x = torch.cat([torch.full((groups, 1), 448.0), body.view(groups, 127)], dim=1)
    q, s = kg.quantize_act_fp8(x)
    rq, rs = quant.quantize_act_fp8(x)
    assert torch.equal(s, rs) and (s == 1.0).all()
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


# ---------------------------------------------------------------------------------------------- linear


@pytest.mark.parametrize(
    "t,n,k,dtype,wdtype",
    [
        (1, 48, 64, torch.float32, torch.float32),
        (19, 80, 200, torch.float32, torch.float32),
        (64, 256, 512, torch.bfloat16, torch.bfloat16),
        (3, 40, 96, torch.float16, torch.float16),
        (9, 33, 130, torch.bfloat16, torch.float32),  # mixed: the product runs in float32
        (2, 48, 1024, torch.bfloat16, torch.bfloat16),  # few programs: split-K
        (2, 24, 1000, torch.float32, torch.float32),  # split-K, partial K block
    ],
)
def test_linear_dense(kg, t, n, k, dtype, wdtype):
    kw = {"x": rand(t, k, seed=t + n + k, dtype=dtype), **weight_in("dense", n=n, k=k, seed=k, dtype=wdtype)}
    assert_matches("linear", kg.linear(**kw), kw)


@pytest.mark.parametrize(
    "t,n,k,dtype,wdtype,out_dtype",
    [
        (1, 160, 256, torch.bfloat16, torch.float32, torch.float32),  # the MoE router at decode: float32 FMAs, split-K
        (9, 33, 130, torch.bfloat16, torch.float32, torch.float32),  # partial K block
        (5, 48, 96, torch.bfloat16, torch.bfloat16, torch.float32),  # bf16 operands: the accumulator stored unrounded
        (4, 40, 72, torch.float32, torch.float32, torch.bfloat16),
    ],
)
def test_linear_out_dtype(kg, t, n, k, dtype, wdtype, out_dtype):
    kw = {"x": rand(t, k, seed=t + n + k, dtype=dtype), **weight_in("dense", n=n, k=k, seed=k, dtype=wdtype), "out_dtype": out_dtype}
    got = kg.linear(**kw)
    assert_matches("linear", got, kw)  # held to out_dtype's tolerance
    if wdtype == out_dtype == torch.float32:  # the router: the launch a float32 copy of x gets, without the copy
        assert torch.equal(got, kg.linear(kw["x"].float(), kw["weight"]))


def test_a_16_bit_x_against_a_float32_weight_takes_the_tensor_cores_on_a_gpu(kg, monkeypatch):
    """The routers' dot (16-bit x, float32 dense weight): on a GPU bfloat16 x takes bf16x3 (exact products) and float16
    x tf32x3 (x exact in tf32); float32 x, 16-bit weights and other formats keep ieee; the interpreter's dot is numpy's
    (ieee) either way."""
    x16, x32 = torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, 8)
    w32, w16 = torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.bfloat16)
    assert kg.f32_dot_precision(x16, w32, "dense") == "ieee"  # interpreted here
    monkeypatch.setattr(kg, "interpreting", lambda: False)
    assert kg.f32_dot_precision(x16, w32, "dense") == "bf16x3"
    assert kg.f32_dot_precision(x16.half(), w32, "dense") == "tf32x3"
    assert {kg.f32_dot_precision(x32, w32, "dense"), kg.f32_dot_precision(x16, w16, "dense"), kg.f32_dot_precision(x16, w32, "fp8_block")} == {"ieee"}


@pytest.mark.parametrize("t,n,k", [(5, 256, 512), (64, 96, 1000)])
def test_the_bf16x3_router_dot_keeps_float32_products(kg, monkeypatch, t, n, k):
    """The GPU's bf16x3 branch of the dense kernel, run in the interpreter as its float32 twin ("bf16x3_upcast": the
    same three weight parts): within float32's summation error of the float64 product, where one bfloat16 part alone
    (the weight rounded to bfloat16) is off by about 2^-9 relative."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(t, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g) * k**-0.5
    monkeypatch.setattr(kg, "f32_dot_precision", lambda *a: "bf16x3_upcast")
    got = kg.linear(x=x, weight=w, out_dtype=torch.float32)
    want = x.double() @ w.double().T
    err = (got.double() - want).abs().max().item()
    assert err < 1e-5, err
    coarse = (x.double() @ w.to(torch.bfloat16).double().T - want).abs().max().item()
    assert coarse > 100 * err  # the test can tell a single bfloat16 part from the three


@pytest.mark.parametrize(
    "t,n,k,dtype",
    [
        (4, 128, 256, torch.bfloat16),
        (17, 96, 384, torch.float32),
        (64, 256, 512, torch.float16),
        (2, 200, 1000, torch.bfloat16),  # partial blocks on both edges and a partial last K group
    ],
)
def test_linear_fp8_block(kg, t, n, k, dtype):
    kw = {"x": rand(t, k, seed=n * k, scale=3.0, dtype=dtype), **weight_in("fp8_block", n=n, k=k, seed=t)}
    assert_matches("linear", kg.linear(**kw), kw)


@pytest.fixture(params=["dot_scaled", "upcast", "register"])
def mx_path(request, kg, monkeypatch):
    monkeypatch.setattr(kg, "MXFP4_AUTO_PATH", request.param)
    return request.param


@pytest.mark.parametrize(
    "t,n,k,dtype",
    [
        (5, 64, 128, torch.bfloat16),
        (33, 96, 96, torch.bfloat16),  # K not a multiple of the K block
        (2, 40, 512, torch.float16),
        (3, 48, 160, torch.float32),  # float32 activations: always the upcast path
    ],
)
def test_linear_mxfp4(kg, mx_path, t, n, k, dtype):
    kw = {"x": rand(t, k, seed=n + k, dtype=dtype), **weight_in("mxfp4", n=n, k=k, seed=t)}
    assert_matches("linear", kg.linear(**kw), kw)


def test_mxfp4_special_scales(kg, mx_path):
    # e8m0 extremes that still give finite products: 2^-127 (a float32 subnormal factor) and 2^4
    w = weight_in("mxfp4", n=32, k=64, seed=3)
    w["weight_scale"][:8] = 0
    w["weight_scale"][8:16] = 131
    kw = {"x": rand(16, 64, seed=4, dtype=torch.bfloat16), **w}
    assert_matches("linear", kg.linear(**kw), kw)


@pytest.mark.parametrize(
    "t,n,k,dtype",
    [
        (3, 80, 112, torch.bfloat16),  # N and K not multiples of 32: partial edge blocks
        (33, 96, 160, torch.bfloat16),
        (2, 40, 512, torch.float16),  # few programs: split-K
        (3, 48, 100, torch.float32),  # float32 activations: always the upcast path
    ],
)
def test_linear_fp8_block32(kg, mx_path, t, n, k, dtype):
    # W8A16 (V4.1's FP8, e8m0 per 32x32 block): x unquantised, on mxfp4's path
    x = rand(t, k, seed=n + k, dtype=dtype)
    x[:, 3] *= 300.0  # a large column
    kw = {"x": x, **weight_in("fp8_block32", n=n, k=k, seed=t)}
    assert_matches("linear", kg.linear(**kw), kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_block32_every_blocks_scale_reads_back(kg, mx_path, dtype):
    """Random e4m3 bytes under an e8m0 byte that differs in every 32x32 block (N 72, K 100: partial
    edge blocks), read back one weight at a time by one-hot activations: exact products, so a weight
    row or column that took another block's scale shows."""
    weight = torch.randint(0, 256, (72, 100), generator=gen(75), dtype=torch.uint8)
    weight[(weight & 0x7F) == 0x7F] = 0  # e4m3fn's NaN
    low, high = (112, 133) if dtype == torch.float16 else (100, 140)  # fp16: weights of 2^-24 .. 3 * 448 * 2^5, in range
    scale = torch.randint(low, high, (3, 4), generator=gen(76), dtype=torch.uint8)
    x = (torch.eye(100)[::3] * 3.0).to(dtype)
    kw = {"x": x, "weight": weight.view(quant.FP8_DTYPE), "weight_scale": scale, "fmt": "fp8_block32"}
    got = kg.linear(**kw)
    want = ref.linear(**as_float64(kw))
    assert torch.equal(got.double(), want.to(dtype).double())


# ---------------------------------------------------------------------------------------------- grouped_gemm


FMTS = ["dense", "fp8_block", "mxfp4", "mxfp8", "mxfp4_a8", "fp8_block32"]


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize(
    "counts,pad,n,k,dtype",
    [
        ([5, 0, 35, 1, 0, 19, 10, 0], 5, 96, 160, torch.bfloat16),  # empty experts, padding rows
        ([0, 0, 0, 23], 0, 64, 256, torch.float32),  # every token on the last expert
        ([0, 0, 0], 4, 32, 64, torch.bfloat16),  # no token at all, padding only
        ([40, 24], 0, 136, 320, torch.float16),
    ],
)
def test_grouped_gemm_contiguous(kg, fmt, counts, pad, n, k, dtype):
    if fmt == "fp8_block" and dtype == torch.float32 and k == 256:
        k = 200  # partial K group too
    e = len(counts)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    m = int(offsets[-1]) + pad
    kw = {"x": rand(m, k, seed=m + k, dtype=dtype), **weight_in(fmt, e, n=n, k=k, seed=e), "expert_offsets": offsets}
    assert_matches("grouped_gemm", kg.grouped_gemm(**kw), kw)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize(
    "masked,max_m,n,k,dtype",
    [
        ([3, 0, 16, 9], 16, 64, 192, torch.bfloat16),  # masked_m 0, one expert full
        ([0, 0], 8, 32, 64, torch.float32),  # nothing valid
        ([33, 1, 64], 64, 48, 256, torch.float32),
    ],
)
def test_grouped_gemm_masked(kg, fmt, masked, max_m, n, k, dtype):
    e = len(masked)
    kw = {
        "x": rand(e, max_m, k, seed=max_m + k, dtype=dtype),
        **weight_in(fmt, e, n=n, k=k, seed=n),
        "masked_m": torch.tensor(masked, dtype=torch.int32),
    }
    assert_matches("grouped_gemm", kg.grouped_gemm(**kw), kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantiser_reads_a_transposed_view_in_place(kg, dtype):
    """The grouped output projection's heads by group: [G, T, K] as a view of [T, G * K], whose rows do not
    flatten; the quantiser reads it where it lies (two-level row strides), the same bits as a copy's."""
    heads = rand(5, 3 * 256, seed=3, scale=4.0).to(dtype)
    view = heads.view(5, 3, 256).transpose(0, 1)
    assert view.stride(0) < view.stride(1)
    q, s = kg.quantize_act_fp8(view)
    rq, rs = quant.quantize_act_fp8(view.contiguous())
    assert q.shape == rq.shape and torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.parametrize("fmt", ["dense", "fp8_block"])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_grouped_output_projection_over_the_heads_view(kg, fmt, tokens):
    """V4's wo_a: the masked layout over the [G, T, K] view of the attention output, every row valid. The products
    are the op's, and without split-K the output lies in x's memory order ([T, G, N]: the caller's transpose back
    to [T, G * N] is a view, no copy); with split-K (the small decode grids) it keeps the plain layout."""
    groups, k, n = 4, 256, 64
    heads = rand(tokens, groups * k, seed=tokens, dtype=torch.bfloat16)
    x = heads.view(tokens, groups, k).transpose(0, 1)
    kw = {"x": x, **weight_in(fmt, groups, n=n, k=k, seed=7), "masked_m": torch.full((groups,), tokens, dtype=torch.int32)}
    got = kg.grouped_gemm(**kw)
    assert_matches("grouped_gemm", got, kw)
    plan = kg.plan_gemm(x, kw["weight"], fmt, kg._MASKED)
    if tokens > 1:  # (one token: both orders are one)
        assert (got.stride(0) < got.stride(1)) == (plan.split == 1) and got.transpose(0, 1).is_contiguous() == (plan.split == 1)


def test_offsets_of_any_integer_dtype(kg):
    offsets = torch.tensor([0, 3, 3, 9], dtype=torch.int64)
    kw = {"x": rand(12, 64, seed=1, dtype=torch.float32), **weight_in("dense", 3, n=32, k=64, seed=2), "expert_offsets": offsets}
    assert_matches("grouped_gemm", kg.grouped_gemm(**kw), kw)
    kw = {"x": rand(2, 4, 64, seed=1, dtype=torch.float32), **weight_in("dense", 2, n=32, k=64, seed=2), "masked_m": torch.tensor([4, 1], dtype=torch.int16)}
    assert_matches("grouped_gemm", kg.grouped_gemm(**kw), kw)


def test_many_experts_decode_split(kg):
    # 40 experts of 1..3 tokens (decode-like, the small variant) and the expert search over E_POW2 = 64
    counts = [(i * 7) % 4 for i in range(40)]
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    m = int(offsets[-1])
    kw = {"x": rand(m, 64, seed=5, dtype=torch.float32), **weight_in("dense", 40, n=16, k=64, seed=6), "expert_offsets": offsets}
    assert_matches("grouped_gemm", kg.grouped_gemm(**kw), kw)


def test_decode_grid_has_no_more_row_tiles_than_rows(kg):
    # one token's top-6 over 64 experts: the grid holds 6 row tiles (each expert with rows takes no more
    # tiles than rows), not 1 + 64 mostly empty ones; every row is still computed, wherever its expert sits
    counts = [1 if e in (2, 4, 25, 26, 57, 63) else 0 for e in range(64)]
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    kw = {"x": rand(6, 64, seed=7, dtype=torch.float32), **weight_in("dense", 64, n=16, k=64, seed=8), "expert_offsets": offsets}
    assert kg.plan_gemm(kw["x"], kw["weight"], "dense", kg._CONTIGUOUS).num_m_tiles == 6
    assert_matches("grouped_gemm", kg.grouped_gemm(**kw), kw)


@pytest.mark.parametrize("layout", ["linear", "contiguous", "masked"])
def test_split_partials_sum_in_kernel_as_the_reduce_kernel_does(kg, monkeypatch, layout):
    """Split-K: the tile's last program sums the partials (no second launch), bit for bit as the
    separate reduce kernel, and leaves every arrival counter at zero for the next launch."""
    x = rand(3, 1024, seed=9, dtype=torch.float32)
    if layout == "linear":
        kw = {"x": x, **weight_in("dense", n=48, k=1024, seed=10)}
        run, plan = kg.linear, kg.plan_gemm(x, kw["weight"], "dense", kg._LINEAR)
    elif layout == "contiguous":
        kw = {"x": x, **weight_in("dense", 4, n=48, k=1024, seed=10), "expert_offsets": torch.tensor([0, 1, 1, 3, 3], dtype=torch.int32)}
        run, plan = kg.grouped_gemm, kg.plan_gemm(x, kw["weight"], "dense", kg._CONTIGUOUS)
    else:
        kw = {"x": rand(2, 3, 1024, seed=9), **weight_in("dense", 2, n=48, k=1024, seed=10), "masked_m": torch.tensor([3, 1], dtype=torch.int32)}
        run, plan = kg.grouped_gemm, kg.plan_gemm(kw["x"], kw["weight"], "dense", kg._MASKED)
    assert plan.split > 1
    fused = run(**kw)
    assert int(kg.arrival_counters(x.device, "gemm").count_nonzero()) == 0
    monkeypatch.setattr(kg, "ARRIVALS", 0)  # too few counters: the second kernel sums
    second = run(**kw)
    if layout == "masked":  # rows past masked_m are left unwritten (either way)
        fused, second = torch.cat([fused[0, :3], fused[1, :1]]), torch.cat([second[0, :3], second[1, :1]])
    assert torch.equal(fused, second)
    if layout != "masked":
        assert_matches("linear" if layout == "linear" else "grouped_gemm", fused, kw)


def test_bad_arguments_raise(kg):
    x = rand(4, 64, seed=0)
    w = weight_in("dense", 2, n=16, k=64, seed=0)["weight"]
    with pytest.raises(ValueError):
        kg.grouped_gemm(x, w)
    with pytest.raises(ValueError):
        kg.grouped_gemm(x, w, expert_offsets=torch.tensor([0, 4], dtype=torch.int32))
    with pytest.raises(ValueError):
        kg.linear(x, w[0], fmt="fp8_block")
    with pytest.raises(ValueError):
        kg.linear(x.double(), w[0].double())
    for out_dtype in (torch.float64, torch.int32):
        with pytest.raises(ValueError, match="out_dtype"):
            kg.linear(x, w[0], out_dtype=out_dtype)


def test_shape_only_choices(kg):
    # float32 operands in shared memory: stages drop, then the K block halves, until they fit
    x32, w32 = torch.empty(64, 1024), torch.empty(256, 1024)
    bk, st = kg._fit_shared_memory("dense", x32, w32, True, 64, 64, 256, 4)
    assert st * (64 * bk * 4 + bk * 64 * 4) <= kg.SHARED_MEMORY_BUDGET and st >= 2
    # the fp8 K block stays one scale group
    bk, st = kg._fit_shared_memory("fp8_block", x32.bfloat16(), w32.to(quant.FP8_DTYPE), False, 128, 256, 128, 8)
    assert bk == 128 and st < 8
    assert kg._variant("dense", 16) == "dense_small" and kg._variant("fp8_block", 4096) == "fp8_block_large"
    # large decode batches (65-256 rows per expert) have an fp8 entry of their own; the other formats keep two
    assert [kg._variant("fp8_block", r) for r in (64, 65, 256, 257)] == ["fp8_block_small", "fp8_block_medium", "fp8_block_medium", "fp8_block_large"]
    assert kg._variant("dense", 256) == "dense_large"
    # no tensor descriptors under the interpreter or for float32 x with fp8 weights
    assert not kg._use_tma({"tma": True}, "dense", x32.bfloat16(), w32.bfloat16(), 1024, 1)


def test_registrations_have_the_op_signatures(kg):
    from deepinfer.registry import Registry

    reg = Registry()
    for r in kg.REGISTRATIONS:
        reg.register_kernel("cuda", r.op, r.fn, formats=r.formats, dtypes=r.dtypes, note=r.note)
    assert {name for name, ks in reg.kernels["cuda"].items() if ks} == {"linear", "grouped_gemm"}
    assert all(kg.mxfp4_path() in r.note for r in kg.REGISTRATIONS if r.when is None)  # the forced mxfp4 paths (option mxfp4_path) name theirs



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mxfp8_activation_quantiser_is_bit_exact(kg, dtype):
    x = rand(37, 320, seed=5, dtype=torch.float64)
    x[:, 7] *= 1e4  # one large column: the other 31 of its group become small or subnormal e4m3
    x[3] *= 1e-30
    x[4] = 0.0  # all-zero groups: X = -127
    x = x.to(dtype)
    q, s = kg.quantize_act_mxfp8(x)
    want_q, want_s = quant.quantize_act_mxfp8(x)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4_a8"])  # W8A8 MX; W4A8 MX (mxfp4 weights, MX FP8 activations)
@pytest.mark.parametrize(
    "t,n,k,dtype",
    [
        (5, 128, 128, torch.bfloat16),
        (33, 96, 480, torch.bfloat16),  # K not a multiple of the K block, N not of BLOCK_N
        (2, 40, 512, torch.float16),
        (3, 48, 160, torch.float32),
    ],
)
def test_linear_mx_activation_formats(kg, fmt, t, n, k, dtype):
    """Both operands MX: the activation quantised in-kernel, the swapped block-scaled dot (MX_MODE 2)."""
    x = rand(t, k, seed=n + k, dtype=dtype)
    x[:, 3] *= 300.0  # a large column (the activation's group scale follows it)
    kw = {"x": x, **weight_in(fmt, n=n, k=k, seed=t)}
    assert kg._mx_mode(fmt, x) == kg._MX_NATIVE
    assert_matches("linear", kg.linear(**kw), kw)


def test_plan_reads_shapes_only_and_the_launch_applies_it(kg, monkeypatch):
    """plan_gemm reads shapes, dtypes and the device, never values (meta tensors plan the same);
    the grid it plans covers the rows; launch_gemm hands exactly that plan to a launcher."""
    x, w = rand(2, 16, 1024, seed=1, dtype=torch.bfloat16), weight_in("dense", 2, n=32, k=1024, seed=2)["weight"]
    masked = kg.plan_gemm(x, w, "dense", kg._MASKED)
    assert masked == kg.plan_gemm(x.to("meta"), w.to("meta"), "dense", kg._MASKED)
    assert (masked.m_arg, masked.experts, masked.num_m_tiles) == (16, 2, -(-16 // masked.block_m))
    assert masked.dot_f32 and not masked.tma  # the interpreter: float32 dots, no tensor descriptors
    # decode-sized: too few (expert, tile) programs for the interpreter's 4 "SMs", so split-K
    assert masked.split > 1 and masked.split * masked.iters_per_split >= -(-1024 // masked.block_k)
    flat = kg.plan_gemm(x.reshape(32, 1024), w, "dense", kg._CONTIGUOUS)
    assert flat.num_m_tiles == -(-32 // flat.block_m) + 2 and flat.m_arg == 32  # + E: one partial tile per expert
    plans = []
    real = kg._launch_pointers
    monkeypatch.setattr(kg, "_launch_pointers", lambda plan, *args: (plans.append(plan), real(plan, *args)))
    kw = {"x": x, "weight": w, "masked_m": torch.tensor([16, 5], dtype=torch.int32)}
    assert_matches("grouped_gemm", kg.grouped_gemm(**kw), kw)
    assert plans == [masked]


# ---------------------------------------------------------------------------------------------- register dequant path
# MX_MODE 3 (SM90's default for every mx format; backend option mxfp4_path=register forces it anywhere):
# the weight tile dequantised in registers (e2m1 / e4m3 bits placed into bf16's, times a power of two per
# 32 k) is the dot's left operand, x^T the right one; mxfp8 and mxfp4_a8 take x's MX FP8 values as bf16
# (`mxfp8_act_values`). Under the interpreter the bf16 multiply runs in float32 on the same bits and
# factors (MX_DQ 1): the bit layout, the factor exponents and the accumulator's 2^64 shift are the GPU's.


REG_FMTS = ["mxfp4", "mxfp8", "mxfp4_a8", "fp8_block32"]



@pytest.fixture(scope="module")
def reg_ops(kg):
    linear, grouped_gemm = kg._gemm_ops(mx_path="register")
    return {"linear": linear, "grouped_gemm": grouped_gemm}


def test_register_path_is_planned_as_mx_mode_3(kg):
    x = torch.empty(4, 96, dtype=torch.bfloat16)
    for fmt in REG_FMTS:
        w = weight_in(fmt, n=32, k=96, seed=1)["weight"]
        plan = kg.plan_gemm(x, w, fmt, kg._LINEAR, "register")
        assert plan.mx_mode == kg._MX_REGISTER and plan.mx_dq == 1  # interpreter: float32 arithmetic on the bf16 bits
    assert kg.plan_gemm(x.half(), weight_in("mxfp4", n=32, k=96, seed=1)["weight"], "mxfp4", kg._LINEAR, "register").mx_dq == 2


@pytest.mark.parametrize("fmt", REG_FMTS)
@pytest.mark.parametrize(
    "t,n,k,dtype",
    [
        (5, 64, 128, torch.bfloat16),
        (33, 96, 96, torch.bfloat16),  # K (96) not a multiple of BLOCK_K (128), N not of BLOCK_N
        (2, 40, 512, torch.float16),  # few programs: split-K
        (3, 48, 160, torch.float32),
    ],
)
def test_register_path_linear(kg, reg_ops, fmt, t, n, k, dtype):
    x = rand(t, k, seed=n + k, dtype=dtype)
    x[:, 3] *= 300.0  # a large column
    kw = {"x": x, **weight_in(fmt, n=n, k=k, seed=t)}
    assert_matches("linear", reg_ops["linear"](**kw), kw)


@pytest.mark.parametrize("fmt", REG_FMTS)
@pytest.mark.parametrize(
    "counts,pad,n,k,dtype",
    [
        ([5, 0, 35, 1, 0, 19, 10, 0], 5, 96, 160, torch.bfloat16),  # empty experts, padding rows, K % BLOCK_K != 0
        ([0, 0, 0, 23], 0, 64, 256, torch.float16),  # every token on the last expert
        ([0, 0, 0], 4, 32, 64, torch.bfloat16),  # no token at all, padding only
        ([100, 70], 0, 72, 128, torch.bfloat16),  # more rows than a large tile: the "large" variant
    ],
)
def test_register_path_grouped_contiguous(kg, reg_ops, fmt, counts, pad, n, k, dtype):
    e = len(counts)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    m = int(offsets[-1]) + pad
    kw = {"x": rand(m, k, seed=m + k, dtype=dtype), **weight_in(fmt, e, n=n, k=k, seed=e), "expert_offsets": offsets}
    assert_matches("grouped_gemm", reg_ops["grouped_gemm"](**kw), kw)


@pytest.mark.parametrize("fmt", REG_FMTS)
@pytest.mark.parametrize(
    "masked,max_m,n,k,dtype",
    [
        ([3, 0, 16, 9], 16, 64, 192, torch.bfloat16),  # masked_m 0, one expert full, K % BLOCK_K != 0
        ([0, 0], 8, 32, 64, torch.bfloat16),  # nothing valid
        ([16, 16], 16, 128, 1024, torch.bfloat16),  # decode-shaped: split-K, fixed-order reduce
        ([7, 1, 2], 8, 48, 256, torch.float16),
    ],
)
def test_register_path_grouped_masked(kg, reg_ops, fmt, masked, max_m, n, k, dtype):
    e = len(masked)
    kw = {
        "x": rand(e, max_m, k, seed=max_m + k, dtype=dtype),
        **weight_in(fmt, e, n=n, k=k, seed=n),
        "masked_m": torch.tensor(masked, dtype=torch.int32),
    }
    if masked == [16, 16]:
        assert kg.plan_gemm(kw["x"], kw["weight"], fmt, kg._MASKED, "register").split > 1
    assert_matches("grouped_gemm", reg_ops["grouped_gemm"](**kw), kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_register_path_every_e2m1_code_and_scale_extremes(kg, reg_ops, dtype):
    """Each weight row holds every byte (so every code in both nibbles: zero, the subnormal 0.5, the
    signs) under scales from 2^-127 (byte 0) to 2^16; x one-hot columns read the weights back."""
    n, k = 16, 512
    packed = torch.arange(256, dtype=torch.uint8).repeat(n, 1)  # [16, 256]: K/2 = 256
    scale = torch.tensor([127, 0, 100, 120, 126, 128, 130, 135, 143, 110, 127, 127, 64, 192, 125, 131], dtype=torch.uint8)
    scale = scale[:, None].expand(n, k // 32).contiguous()
    if dtype == torch.float16:
        scale = scale.clamp(104, 127)  # fp16 weights (|w| >= 2^-24) and outputs in range
    x = torch.eye(k)[::7].to(dtype)  # 74 rows, each picking one k
    x = torch.cat([x, rand(3, k, seed=9, dtype=dtype)])
    kw = {"x": x, "weight": packed, "weight_scale": scale, "fmt": "mxfp4"}
    assert_matches("linear", reg_ops["linear"](**kw), kw)


def test_mxfp8_act_values_is_the_reference_quantise_dequantise(kg):
    x = rand(37, 320, seed=5, dtype=torch.float64)
    x[:, 7] *= 1e4  # a large column: the rest of its group becomes small or subnormal e4m3
    x[3] *= 1e-30
    x[4] = 0.0  # all-zero groups
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        xd = x.to(dtype)
        want = quant.dequantize_mxfp8(*quant.quantize_act_mxfp8(xd), dtype=torch.float64)
        got = kg.mxfp8_act_values(xd)
        assert got.dtype == torch.bfloat16 and torch.equal(got.double(), want)


def test_the_invariant_plan_takes_one_entry_for_every_row_count(kg, monkeypatch):
    """Deterministic mode's plan on an SM90 device: sm90's dense_invariant tiles (swept for batch
    1 to 256) at 1 row and at 256, one split; a format without an _invariant entry takes its decode
    entry, also for every row count."""
    import deepinfer_cuda.tuning as tuning
    from deepinfer_cuda.tuning import sm90

    monkeypatch.setattr(tuning, "capability", lambda device: (9, 0))
    w = weight_in("dense", n=256, k=1024, seed=3, dtype=torch.bfloat16)["weight"]
    plans = [kg.plan_gemm(rand(rows, 1024, seed=rows, dtype=torch.bfloat16), w, "dense", kg._LINEAR, invariant=True) for rows in (1, 64, 256)]
    entry = sm90.CONFIGS["gemm"]["dense_invariant"]
    assert all((p.block_m, p.block_n, p.block_k, p.split) == (entry["BLOCK_M"], entry["BLOCK_N"], entry["BLOCK_K"], plans[0].split) for p in plans)
    fp8 = weight_in("fp8_block", n=256, k=1024, seed=4)
    small = sm90.CONFIGS["gemm"]["fp8_block_small"]
    for rows in (1, 256):
        plan = kg.plan_gemm(rand(rows, 1024, seed=rows, dtype=torch.bfloat16), fp8["weight"], "fp8_block", kg._LINEAR, invariant=True)
        assert (plan.block_m, plan.block_n) == (small["BLOCK_M"], small["BLOCK_N"])
