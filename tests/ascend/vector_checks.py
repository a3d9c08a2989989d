"""Checks of the ascend backend's vector kernels under the Triton interpreter, for both simulated
chips (910B: 48 vector cores, 192 KB unified buffer; 950: 64 / 256 KB), on shapes beyond the golden
set: more tiles than vector cores (the persistent loops), odd and non-power-of-two sizes, the
chunked long row, ties, -inf rows, strided views, float64 (handed to the reference), and the sample
kernel's fallback searches forced with tiny candidate slots. Everything is compared with the op
references in deepinfer.ops; ids and tokens exactly. One family per test file:
test_misc_kernels.py (rms_norm, rope, silu_and_mul), test_moe_kernels.py (gate, dispatch, combine),
test_sampling_kernels.py (sample, apply_token_bitmask, rejection_sample).

Triton decides at import whether kernels are interpreted, and the simulated chip is read from the
environment, so each (family, chip) runs in a fresh subprocess: this file as a script,
`python vector_checks.py FAMILY` with TRITON_INTERPRET=1 and DEEPINFER_ASCEND_SIM_CHIP set.

The interpreter is lenient where a compiler is not (a variable given different shapes in the two
branches of an `if` runs fine there), so every kernel also goes through Triton's real front end
(`python vector_checks.py FAMILY frontend`: Python AST -> TTIR, for a CUDA target, no device
needed) with each chip's tile sizes. The sample kernel's chunked small-batch path has its checks in
test_sampling_chunks.py (in process) and only its front-end build here (FRONT_END_FAMILIES); so has the decode_plan
kernel (test_decode_plan_kernel.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

CHIPS = ("910B", "950")
FAMILIES = ("misc", "moe", "sampling")
FRONT_END_FAMILIES = (*FAMILIES, "sampling_chunked", "decode_plan")


# ---------------------------------------------------------------------------------------------
# the pytest side


def run_checks(family: str, chip: str) -> None:
    """The family's checks under the interpreter on the simulated chip; fails the calling test."""
    from waits import HANG_S  # (here, not at the top: the script side runs without tests/ on its path)

    env = {**os.environ, "TRITON_INTERPRET": "1", "DEEPINFER_ASCEND_SIM_CHIP": chip}
    res = subprocess.run([sys.executable, os.path.abspath(__file__), family], env=env, capture_output=True, text=True, timeout=HANG_S)
    assert res.returncode == 0, f"stdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-8000:]}"
    assert f"ALL OK {family} {chip}" in res.stdout, res.stdout[-4000:]


def run_frontend(family: str, chip: str) -> None:
    """The family's kernels through Triton's front end with the simulated chip's tiles."""
    from waits import HANG_S  # (here, not at the top: the script side runs without tests/ on its path)

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["DEEPINFER_ASCEND_SIM_CHIP"] = chip
    res = subprocess.run([sys.executable, os.path.abspath(__file__), family, "frontend"], env=env, capture_output=True, text=True, timeout=HANG_S)
    if "NO CUDA BACKEND" in res.stdout:
        import pytest  # (the script side needs no pytest)

        pytest.fail("this Triton has no CUDA backend to build TTIR with; the test extra's triton has one")
    assert res.returncode == 0, f"stdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-8000:]}"
    assert f"FRONT END OK {family} {chip}" in res.stdout, res.stdout[-4000:]


# ---------------------------------------------------------------------------------------------
# the checks (run in the subprocess)

TOL = None  # filled in main(): {dtype: (rtol, atol)}


def _close(out, ref, dtype, reduction=1):
    import torch

    rtol, atol = TOL[dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, ref.dtype, out.shape, ref.shape)
    torch.testing.assert_close(out.double(), ref.double(), rtol=rtol, atol=atol * reduction)


def _golden(fn, *args, dtype, **kwargs):
    """The reference in float64 on float64-upcast inputs, cast to the case dtype (as the golden set)."""
    import torch

    up = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    kw = {n: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for n, v in kwargs.items()}
    res = fn(*up, **kw)
    if isinstance(res, tuple):
        return tuple(None if r is None else (r.to(dtype) if r.is_floating_point() else r) for r in res)
    return res.to(dtype)


def check_norm_rope_act(gen):
    import torch

    from deepinfer.ops.activation import silu_and_mul as ref_silu
    from deepinfer.ops.norm import rms_norm as ref_norm
    from deepinfer.ops.rope import rope as ref_rope
    from deepinfer.ops.rope import rope_cos_sin_cache
    from deepinfer_ascend.kernels.activation import silu_and_mul
    from deepinfer_ascend.kernels.norm import rms_norm
    from deepinfer_ascend.kernels.rope import rope

    # rms_norm: one row; many short rows (row tiles, > cores); the chunked long row; 3-D; float64
    norm_cases = [
        ((1, 7), torch.float32, False), ((130, 96), torch.bfloat16, True), ((3, 9000), torch.float32, True), ((2, 3, 64), torch.float16, False),
        ((4, 40), torch.float64, True),
    ]
    for shape, dtype, res in norm_cases:
        x = torch.randn(*shape, generator=gen).to(dtype)
        w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype)
        r = torch.randn(*shape, generator=gen).to(dtype) if res else None
        out, h = rms_norm(x, w, eps=1e-5, residual=r)
        g_out, g_h = _golden(ref_norm, x, w, eps=1e-5, residual=r, dtype=dtype)
        _close(out, g_out, dtype)
        if res:
            assert torch.equal(h, ref_norm(x, w, eps=1e-5, residual=r)[1]), "h = x + residual in x's dtype"
        else:
            assert h is None
    # strided rows (a column slice)
    big = torch.randn(6, 80, generator=gen)
    out, _ = rms_norm(big[:, 8:72], torch.ones(64))
    _close(out, _golden(ref_norm, big[:, 8:72], torch.ones(64), dtype=torch.float32)[0], torch.float32)

    # rope: both layouts, heads not a power of two, more tiles than cores, a head-strided view
    for interleaved in (True, False):
        for T, H, D, dtype in [(1, 1, 64, torch.float32), (37, 5, 64, torch.bfloat16), (9, 3, 6, torch.float32), (4, 2, 32, torch.float64)]:
            cache = rope_cos_sin_cache(D, 512, 10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})
            pos = torch.randint(0, 512, (T,), generator=gen)
            x = torch.randn(T, H, D, generator=gen).to(dtype)
            out = rope(x, pos, cache, interleaved=interleaved)
            _close(out, _golden(ref_rope, x, pos, cache, interleaved=interleaved, dtype=dtype), dtype, reduction=2)
        xv = torch.randn(5, 4, 2, 64, generator=gen)[:, :, 1, :]  # head stride 128, token stride 512
        pos = torch.randint(0, 512, (5,), generator=gen)
        plain = rope_cos_sin_cache(64, 512, 10000.0)
        golden = _golden(ref_rope, xv, pos, plain, interleaved=interleaved, dtype=torch.float32)
        _close(rope(xv, pos, plain, interleaved=interleaved), golden, torch.float32, reduction=2)

    # silu_and_mul: tiny, column tiles of a wide row, 3-D, wide range, float64
    silu_cases = [
        ((1, 10), torch.float32, 1.0), ((33, 6000), torch.bfloat16, 1.0), ((2, 3, 20), torch.float16, 1.0), ((17, 64), torch.float32, 60.0),
        ((3, 8), torch.float64, 1.0),
    ]
    for shape, dtype, scale in silu_cases:
        x = (scale * torch.randn(*shape, generator=gen)).to(dtype)
        _close(silu_and_mul(x), _golden(ref_silu, x, dtype=dtype), dtype)
    assert silu_and_mul(torch.empty(0, 8)).shape == (0, 4)


def check_moe(gen):
    import torch

    from deepinfer.ops.moe import _gate_canonicalize
    from deepinfer.ops.moe import combine as ref_combine
    from deepinfer.ops.moe import dispatch as ref_dispatch
    from deepinfer.ops.moe import gate as ref_gate
    from deepinfer_ascend.kernels.moe import combine, dispatch, gate

    def same_gate(kw, golden=True):
        w, ids = gate(**kw)
        ref = ref_gate(**{**kw, "logits": kw["logits"].double()}) if golden else ref_gate(**kw)
        a = _gate_canonicalize(kw, {"topk_weights": w, "topk_ids": ids})
        b = _gate_canonicalize(kw, {"topk_weights": ref[0].float(), "topk_ids": ref[1]})
        assert ids.dtype == torch.int32 and w.dtype == torch.float32
        assert torch.equal(a["topk_ids"], b["topk_ids"]), (a["topk_ids"], b["topk_ids"])
        _close(a["topk_weights"], b["topk_weights"], torch.float32)

    # V3 routing over more token tiles than vector cores; V2 groups by max; sqrt-softplus; top-1
    bias = 0.3 * torch.randn(256, generator=gen)
    same_gate(dict(logits=2 * torch.randn(60, 256, generator=gen), top_k=8, score_func="sigmoid", correction_bias=bias,
                   n_group=8, topk_group=4, renormalize=True, routed_scaling_factor=2.5))
    same_gate(dict(logits=2 * torch.randn(5, 160, generator=gen), top_k=6, score_func="softmax", n_group=8, topk_group=3, routed_scaling_factor=16.0))
    same_gate(dict(logits=8 * torch.randn(9, 72, generator=gen), top_k=5, score_func="sqrtsoftplus",
                   correction_bias=0.2 * torch.randn(72, generator=gen), renormalize=True))
    same_gate(dict(logits=torch.randn(3, 10, generator=gen), top_k=1, score_func="softmax"))
    # ties everywhere (integer logits, a bias of halves): equal scores go to the lowest index, in
    # experts and in groups, exactly as the reference's stable sort; float32 in both
    for with_bias in (False, True):
        kw = dict(logits=torch.randint(-2, 3, (23, 64), generator=gen).float(), top_k=6, score_func="sigmoid", n_group=8, topk_group=3, renormalize=True)
        if with_bias:
            kw["correction_bias"] = 0.5 * torch.randint(-1, 2, (64,), generator=gen).float()
        same_gate(kw, golden=False)
    # float64 logits: the reference's float64 result
    kw = dict(logits=torch.randn(4, 32, generator=gen, dtype=torch.float64), top_k=4, score_func="softmax")
    w, ids = gate(**kw)
    assert w.dtype == torch.float64 and torch.equal(ids, ref_gate(**kw)[1])

    # dispatch: more count tiles than cores and several scan blocks (S = 3520 slots: 55 tiles of 64),
    # E not a multiple of the expert chunk, skewed routing with empty experts, float64 rows as bits
    routing_cases = [
        (220, 16, 200, 8, torch.bfloat16, False), (40, 8, 16, 300, torch.float32, True),
        (3, 2, 5, 17, torch.float64, False), (1, 1, 1, 8, torch.float32, False),
    ]
    for T, K, E, D, dtype, skew in routing_cases:
        if skew:
            ids = torch.randint(0, 3, (T, K), generator=gen).to(torch.int32) * 5  # experts 0, 5, 10 only
        else:
            if K <= E:
                ids = torch.rand(T, E, generator=gen).argsort(dim=-1)[:, :K].to(torch.int32)
            else:
                ids = torch.randint(0, E, (T, K), generator=gen).to(torch.int32)
        x = torch.randn(T, D, generator=gen).to(dtype)
        got = dispatch(x, ids, num_experts=E)
        want = ref_dispatch(x, ids, num_experts=E)
        for g, w_ in zip(got, want):
            assert g.dtype == w_.dtype and torch.equal(g, w_), (T, K, E, D, dtype)
        if T * K > 1000:
            continue
        # combine inverts it (float32 accumulation in k order)
        weights = torch.rand(T, K, generator=gen)
        eo = torch.randn(T * K, D, generator=gen).to(dtype)
        out = combine(eo, weights, got[2])
        _close(out, _golden(ref_combine, eo, weights, got[2], dtype=dtype), dtype, reduction=K)
    # combine: wide rows (several column tiles per token)
    T, K, D = 6, 4, 5000
    rows = torch.randperm(T * K, generator=gen).to(torch.int32)
    eo = torch.randn(T * K, D, generator=gen).to(torch.bfloat16)
    w = torch.rand(T, K, generator=gen)
    _close(combine(eo, w, rows), _golden(ref_combine, eo, w, rows, dtype=torch.bfloat16), torch.bfloat16, reduction=K)
    # combine with a shared expert's row (a strided view) added after the K terms, rounded once with them
    add = (3 * torch.randn(T, D + 5, generator=gen)).to(torch.bfloat16)[:, :D]
    _close(combine(eo, w, rows, add=add), _golden(ref_combine, eo, w, rows, add=add, dtype=torch.bfloat16), torch.bfloat16, reduction=K + 1)
    e_x, offs, ros = dispatch(torch.randn(0, 4), torch.empty(0, 2, dtype=torch.int32), num_experts=3)
    assert e_x.shape == (0, 4) and offs.tolist() == [0, 0, 0, 0] and ros.numel() == 0


def sample_inputs(gen, vocab, rows, masked=(), scale=3.0):
    """`sample`'s arguments for rows of (temperature, top_k, top_p, min_p): scaled normal logits
    (the `masked` rows with about half of them -inf), random seeds and positions."""
    import torch

    B = len(rows)
    logits = scale * torch.randn(B, vocab, generator=gen)
    for r in masked:
        logits[r, torch.rand(vocab, generator=gen) < 0.5] = float("-inf")
    t, k, p, m = zip(*rows)
    return dict(
        logits=logits,
        temperature=torch.tensor(t, dtype=torch.float32),
        top_k=torch.tensor(k, dtype=torch.int32),
        top_p=torch.tensor(p, dtype=torch.float32),
        min_p=torch.tensor(m, dtype=torch.float32),
        seeds=torch.randint(-(2**62), 2**62, (B,), generator=gen),
        positions=torch.randint(0, 2**20, (B,), generator=gen),
    )


def ties_and_minus_inf_rows(gen, finite_at):
    """`sample`'s arguments for six rows of integer logits in [-3, 3] over 700 tokens (duplicated
    maxima, ties at the top-k threshold): greedy, top-k 1 and 50, top-k with top-p, a row of -inf,
    and a row of -inf but one finite logit at `finite_at`."""
    import torch

    logits = torch.randint(-3, 4, (6, 700), generator=gen).float()
    logits[4] = float("-inf")
    logits[5] = float("-inf")
    logits[5, finite_at] = 0.5
    return dict(
        logits=logits,
        temperature=torch.tensor([0.0, 1.0, 1.0, 0.9, 1.0, 1.0]),
        top_k=torch.tensor([0, 1, 50, 3, 4, 2], dtype=torch.int32),
        top_p=torch.tensor([1.0, 1.0, 1.0, 0.6, 0.5, 0.9]),
        min_p=torch.tensor([0.0, 0.0, 0.0, 0.0, 0.1, 0.0]),
        seeds=torch.arange(6, dtype=torch.int64),
        positions=torch.arange(6, dtype=torch.int64),
    )


def check_sampling(gen):
    import torch

    from deepinfer.ops.sampling import apply_token_bitmask as ref_bitmask
    from deepinfer.ops.sampling import sample as ref_sample
    from deepinfer.ops.sampling import sampling_uniform
    from deepinfer_ascend.kernels import sampling as S
    from deepinfer_ascend.kernels import sampling_math as M

    # the hash, bit for bit, both ways of multiplying (halves in int32, native uint32)
    seeds = torch.tensor([0, -1, 2**63 - 1, -(2**63), 123456789012345, 7], dtype=torch.int64)
    pos = torch.tensor([0, 2**40 + 5, -3, 7, 2**31, 2**32 - 1], dtype=torch.int64)
    want = sampling_uniform(seeds, pos, 3001).view(torch.int32)
    for native in (False, True):
        assert torch.equal(S.uniform(seeds, pos, 3001, native_u32=native).view(torch.int32), want), native

    seen = 0

    def same_tokens(kw, **sizes):
        nonlocal seen
        paths = torch.zeros(kw["logits"].shape[0], dtype=torch.int32)
        out = S._sample(**kw, paths=paths, **sizes)
        ref = ref_sample(**kw)
        assert out.dtype == torch.int64 and torch.equal(out, ref), (out.tolist(), ref.tolist(), paths.tolist(), sizes)
        for p in paths.tolist():
            seen |= p
        return paths

    rows = [
        (0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 20, 1.0, 0.0), (1.0, 1, 1.0, 0.0), (1.0, 0, 0.9, 0.0),
        (0.6, 0, 0.5, 0.0), (1.0, 0, 1.0, 0.1), (0.8, 50, 0.9, 0.05), (0.0, 5, 0.5, 0.2), (2.0, 0, 0.95, 0.0),
        (1.0, 5, 0.3, 0.0), (0.05, 0, 1.0, 0.0), (1.0, 2999, 0.99, 0.0), (1.0, 0, 0.0, 0.0), (1.0, 0, 1.0, 1.0),
        (1.0, 0, 0.01, 0.0), (1.3, 700, 0.8, 0.0), (1e-3, 3, 0.7, 0.0),
    ]
    # vocabulary 3000 > the 2048 candidate slots: top-p rows go through the estimated lower bound
    kw = sample_inputs(gen, 3000, rows, masked=(2, 4, 9))
    same_tokens(kw)
    # the whole-row fallbacks (candidates overflow with one slot per lane)
    few = [2, 4, 7, 9, 12]
    paths = same_tokens({n: v[few] for n, v in kw.items()}, CAND_R=1)
    assert any(p & M.PATH_TOPK_ROWS for p in paths.tolist()) and any(p & M.PATH_TOPP_ROWS for p in paths.tolist()), paths.tolist()
    # ties: duplicated maxima (greedy and top-k = 1 pick among them by index / noise), ties at the
    # top-k threshold (all kept), a row of -inf, a row of one finite value
    kw = ties_and_minus_inf_rows(gen, finite_at=123)
    same_tokens(kw)
    same_tokens(kw, CAND_R=1)
    # more rows than vector cores (the persistent row loop), a vocabulary smaller than a tile
    same_tokens(sample_inputs(gen, 40, [rows[(i % 2) + 10 * (i % 7 == 3)] for i in range(70)]))
    need = M.PATH_TOPK_CANDIDATES | M.PATH_TOPK_ROWS | M.PATH_TOPP_CANDIDATES | M.PATH_TOPP_ROWS | M.PATH_TOKEN_CANDIDATES
    assert seen & need == need, seen
    # all_greedy (the caller's promise): every row's greedy token whatever its parameters, ties and -inf rows included
    kw = ties_and_minus_inf_rows(gen, finite_at=123)
    want = ref_sample(**{**kw, "temperature": torch.zeros_like(kw["temperature"])})
    assert torch.equal(S.sample(**kw, all_greedy=True), want) and torch.equal(ref_sample(**kw, all_greedy=True), want)

    # rejection_sample's accept kernel: more requests than vector cores (the persistent request loop),
    # a request of 21 rows (more than a 16-row step), drafts equal to the drawn tokens for a prefix of
    # each request, drafts that differ from them in the high 32 bits only. The rows' tokens come from
    # the reference's sample here (the sample kernel is checked above, the whole op by conformance).
    import types

    from deepinfer.ops.rejection_sampling import rejection_sample as ref_rejection
    from deepinfer_ascend.kernels import rejection_sampling as R

    counts = torch.tensor([21] + [1 + i % 4 for i in range(69)])
    kw = sample_inputs(gen, 40, [rows[i % 8] for i in range(70)])
    per_request = {n: kw[n] for n in ("temperature", "top_k", "top_p", "min_p", "seeds", "positions")}
    cu_rows = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    owner = torch.repeat_interleave(torch.arange(70), counts)
    index = torch.arange(len(owner)) - cu_rows[:-1].long()[owner]
    logits = 3.0 * torch.randn(len(owner), 40, generator=gen)
    drawn = ref_sample(logits, *(v[owner] for n, v in per_request.items() if n != "positions"), per_request["positions"][owner] + index)
    accepted = torch.randint(0, 5, (70,), generator=gen)
    accepted[0] = 18
    drafts = torch.where(index < accepted[owner], drawn, drawn + (torch.arange(len(owner)) % 2 + 1) * 2**32 * (owner % 3 == 0) + (owner % 3 != 0))
    call = dict(logits=logits, draft_tokens=drafts, cu_rows=cu_rows, **per_request)
    kernels, R._sampling = R._sampling, types.SimpleNamespace(sample=ref_sample)
    try:
        out = R.rejection_sample(**call)
    finally:
        R._sampling = kernels
    want = ref_rejection(**call)
    assert out.dtype == torch.int64 and torch.equal(out, want), (out.tolist(), want.tolist())
    assert (out == -1).any() and (out[: counts[0]] != -1).sum() == 19

    # apply_token_bitmask: bit 31 (words of -1 and of INT32_MIN), a partial last word, several
    # dtypes, a strided view (in place through a copy), float64
    for rows_, V, dtype in [(3, 33, torch.float32), (5, 1003, torch.bfloat16), (2, 4099, torch.float16), (2, 70, torch.float64)]:
        W = (V + 31) // 32
        mask = torch.randint(-(2**31), 2**31, (rows_, W), generator=gen, dtype=torch.int64).to(torch.int32)
        mask[0, 0] = -1
        mask[-1, -1] = -(2**31)
        logits = torch.randn(rows_, V, generator=gen).to(dtype)
        want = ref_bitmask(logits.clone(), mask)
        got = S.apply_token_bitmask(logits, mask)
        assert got.data_ptr() == logits.data_ptr() and torch.equal(got, want), (rows_, V, dtype)
    base = torch.randn(4, 200, generator=gen)
    view = base[:, ::2]
    mask = torch.randint(-(2**31), 2**31, (4, 4), generator=gen, dtype=torch.int64).to(torch.int32)
    want = ref_bitmask(view.clone(), mask)
    S.apply_token_bitmask(view, mask)
    assert torch.equal(view, want)


def frontend(family: str) -> None:
    """Build the family's kernels' TTIR with the tile sizes the wrappers pick on the simulated chip."""
    try:
        from triton._C.libtriton import ir
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.compiler.compiler import make_backend

        target = GPUTarget("cuda", 90, 32)
        backend = make_backend(target)
    except Exception as e:  # noqa: BLE001
        print(f"NO CUDA BACKEND: {e}")
        return
    import deepinfer_ascend.device as device
    from deepinfer_ascend.kernels import activation, moe, norm, rope
    from deepinfer_ascend.kernels import rejection_sampling as R
    from deepinfer_ascend.kernels import sampling as S
    from deepinfer_ascend.kernels.common import tile_elems

    device.interpreting = lambda: True  # the simulated chip's sizes, while Triton compiles for real
    options = backend.parse_options({})

    def build(fn, constexprs, **signature):
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        sig = {**signature, **{name: "constexpr" for name in constexprs}}
        source = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
        source.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)

    i32, f32 = "i32", "fp32"
    if family == "misc":
        for dt in ("bf16", "fp32"):
            p = "*" + dt
            for has_res, chunked in ((True, True), (False, False)):
                block_d = tile_elems(norm._BYTES_PER_ELEM) if chunked else 512
                block_t = 1 if chunked else tile_elems(norm._BYTES_PER_ELEM) // 512
                build(norm._rms_norm_kernel, dict(HAS_RES=has_res, BLOCK_T=block_t, BLOCK_D=block_d, CHUNKED=chunked),
                      x_ptr=p, r_ptr=p, w_ptr=p, out_ptr=p, h_ptr=p, T=i32, D=i32, stride_x=i32, stride_r=i32, stride_o=i32, stride_h=i32, eps=f32)
            for inter in (True, False):
                build(rope._rope_kernel, dict(INTERLEAVED=inter, BLOCK_H=tile_elems(rope._BYTES_PER_PAIR) // 32, BLOCK_HALF=32),
                      x_ptr=p, pos_ptr="*i64", cs_ptr="*fp32", out_ptr=p, T=i32, H=i32, HALF=i32,
                      stride_xt=i32, stride_xh=i32, stride_ot=i32, stride_oh=i32, stride_cs=i32)
            build(activation._silu_and_mul_kernel, dict(BLOCK_T=tile_elems(activation._BYTES_PER_ELEM) // 2048, BLOCK_I=2048),
                  x_ptr=p, out_ptr=p, T=i32, I=i32, stride_x=i32, stride_o=i32)
    elif family == "sampling_chunked":
        _build_chunked_sample_kernels(build, i32)
    elif family == "decode_plan":
        _build_decode_plan_kernel(build, i32)
    elif family == "moe":
        for dt in ("bf16", "fp32"):
            p = "*" + dt
            build(moe._dispatch_copy_kernel, dict(K=8, COUNT_S=moe._COUNT_S, BLOCK_K=8, BLOCK_D=1024),
                  x_ptr=p, ids_ptr="*i32", rank_ptr="*i32", prefix_ptr="*i32", offsets_ptr="*i32", out_ptr=p, row_of_slot_ptr="*i32",
                  T=i32, D=i32, E=i32, stride_x=i32, stride_out=i32)
            for has_add in (False, True):
                build(moe._combine_kernel, dict(K=8, HAS_ADD=has_add, BLOCK_D=2048),
                      src_ptr=p, w_ptr="*fp32", row_of_slot_ptr="*i32", add_ptr=p, out_ptr=p, T=i32, D=i32, stride_src=i32, stride_add=i32, stride_out=i32)
        # (V4's hash routing: sqrtsoftplus over the table's experts, renormalised, no bias or groups)
        for score, bias, groups, hashed in ((0, False, 1, False), (1, True, 8, False), (2, True, 1, False), (0, False, 8, False), (2, False, 1, True)):
            gate_sizes = dict(BLOCK_T=tile_elems(moe._GATE_BYTES_PER_ELEM) // 256, BLOCK_E=256, BLOCK_G=8, BLOCK_K=8)
            build(moe._gate_kernel, dict(TOP_K=8, SCORE=score, HASH=hashed, HAS_BIAS=bias, N_GROUP=groups, TOPK_GROUP=min(4, groups), RENORM=bias or hashed,
                                         **gate_sizes),
                  logits_ptr="*fp32", bias_ptr="*fp32", w_ptr="*fp32", ids_ptr="*i32", table_ptr="*i64", tok_ids_ptr="*i64",
                  T=i32, E=i32, stride_t=i32, group_size=i32, scale=f32, stride_table=i32)
        build(moe._dispatch_count_kernel, dict(BLOCK_S=moe._COUNT_S, BLOCK_E=moe._CHUNK_E), ids_ptr="*i32", rank_ptr="*i32", counts_ptr="*i32", S=i32, E=i32)
        build(moe._dispatch_scan_kernel, dict(BLOCK_N=moe._SCAN_N, BLOCK_E=moe._CHUNK_E),
              counts_ptr="*i32", prefix_ptr="*i32", offsets_ptr="*i32", E=i32, n_tiles=i32)
    else:
        for dt in ("bf16", "fp32"):
            build(S._bitmask_kernel, dict(BLOCK_W=64), logits_ptr="*" + dt, mask_ptr="*i32", R=i32, V=i32, W=i32, stride_l=i32, stride_m=i32)
        for native in (False, True):
            build(S._uniform_kernel, dict(BLOCK=1024, NATIVE_U32=native), seed_ptr="*i32", pos_ptr="*i32", out_ptr="*fp32", V=i32)
            build(S._sample_kernel, {**S._sample_sizes(), "NATIVE_U32": native, "RECORD_PATH": native},
                  logits_ptr="*fp32", stride_row=i32, temp_ptr="*fp32", topk_ptr="*i32", topp_ptr="*fp32", minp_ptr="*fp32",
                  seed_ptr="*i32", pos_ptr="*i32", out_ptr="*i64", path_ptr="*i32", B=i32, V=i32)
        build(R._accept_kernel, dict(BLOCK=R._ACCEPT_BLOCK), sampled_ptr="*i32", draft_ptr="*i32", cu_ptr="*i32", out_ptr="*i32", B=i32)
    print(f"FRONT END OK {family} {os.environ.get('DEEPINFER_ASCEND_SIM_CHIP', '910B')}", flush=True)


def _build_chunked_sample_kernels(build, i32: str) -> None:
    """Every kernel of the sample kernel's chunked path with the sizes its wrapper picks on the
    simulated chip for one row and for the most chunks."""
    import deepinfer_ascend.device as device
    from deepinfer.triton_common import next_power_of_2
    from deepinfer_ascend.kernels import sampling as S
    from deepinfer_ascend.kernels import sampling_chunked as C

    pf, pi = "*fp32", "*i32"
    rules = dict(logits_ptr=pf, stride_row=i32, temp_ptr=pf, topk_ptr=pi, topp_ptr=pf, minp_ptr=pf)
    hash_in = dict(seed_ptr=pi, pos_ptr=pi)
    items = dict(B=i32, V=i32, CH=i32, NCH=i32)
    rows = dict(B=i32, V=i32, NCH=i32)
    sz = S._sample_sizes()
    block, search = sz["BLOCK"], dict(SEARCH_L=sz["SEARCH_L"], NT=sz["NT"], ROUNDS=sz["ROUNDS"])
    for nch_p in (next_power_of_2(device.current().num_vectorcore), 256):  # one row; the most chunks
        groups = min(block, max(8, block // nch_p))
        seg = sz["CAND_R"] * sz["CAND_L"] // nch_p
        rb = max(1, min(nch_p, sz["CAND_L"] // seg))
        for native in (False, True):
            build(C._chunk_scan_kernel, dict(BLOCK=block, G=groups, NATIVE_U32=native),
                  **rules, **hash_in, cmax_ptr=pf, cidx_ptr=pi, ckmin_ptr=pi, gkey_ptr=pi, cbest_ptr=pf, cbidx_ptr=pi, **items)
            build(C._row_finish_kernel, dict(SEG=seg, NCH_P=nch_p, RB=rb, NATIVE_U32=native, **search),
                  **rules, **hash_in, seg_x_ptr=pf, seg_i_ptr=pi, seg_n_ptr=pi, plan_f_ptr=pf, plan_i_ptr=pi, **rows)
            build(C._chunk_token_kernel, dict(BLOCK=block, NATIVE_U32=native),
                  **rules, **hash_in, plan_f_ptr=pf, plan_i_ptr=pi, cbest_ptr=pf, cbidx_ptr=pi, **items)
            build(C._row_token_kernel, dict(NCH_P=nch_p, RECORD_PATH=native),
                  plan_i_ptr=pi, cbest_ptr=pf, cbidx_ptr=pi, out_ptr="*i64", path_ptr=pi, B=i32, NCH=i32)
        build(C._chunk_sums_kernel, dict(BLOCK=block, G=groups, SEG=seg, NCH_P=nch_p, NT=sz["NT"]),
              **rules, cmax_ptr=pf, ckmin_ptr=pi, gkey_ptr=pi, s_limbs_ptr=pi, coarse_ptr=pf,
              seg_x_ptr=pf, seg_i_ptr=pi, seg_n_ptr=pi, plan_i_ptr=pi, **items)
        build(C._row_plan_kernel, dict(SEG=seg, NCH_P=nch_p, **search),
              **rules, cmax_ptr=pf, cidx_ptr=pi, ckmin_ptr=pi, cbest_ptr=pf, cbidx_ptr=pi, s_limbs_ptr=pi, coarse_ptr=pf,
              seg_x_ptr=pf, seg_i_ptr=pi, seg_n_ptr=pi, plan_f_ptr=pf, plan_i_ptr=pi, **rows)
        build(C._chunk_mass_kernel, dict(BLOCK=block, NT=sz["NT"]), **rules, plan_f_ptr=pf, plan_i_ptr=pi, q_limbs_ptr=pi, approx_ptr=pf, **items)
        build(C._chunk_collect_kernel, dict(BLOCK=block, SEG=seg, NCH_P=nch_p, NT=sz["NT"]),
              logits_ptr=pf, stride_row=i32, topp_ptr=pf, plan_f_ptr=pf, plan_i_ptr=pi, q_limbs_ptr=pi, approx_ptr=pf,
              seg_x_ptr=pf, seg_i_ptr=pi, seg_n_ptr=pi, **items)


def _build_decode_plan_kernel(build, i32: str) -> None:
    """decode_plan's launches as its wrapper makes them for DeepSeek-V4-Flash (window 128 over pages of 64, the CSA ratio
    4 with its overlapping ring, then HCA's 128 with its plain one), for DeepSeek-V4.1 (an entry table alone) and for a
    compressor kind without a table, with the tile the simulated chip gives."""
    from deepinfer_ascend.kernels import decode_plan as P
    from deepinfer_ascend.kernels.common import tile_elems

    pointers = dict(positions_ptr="*i64", tables_ptr="*i32", slot_mapping_ptr="*i64", state_slots_ptr="*i32", positions_out="*i64",
                    token_seq_out="*i32", window_out="*i32", entries_out="*i32", visible_out="*i32", ring_rows_out="*i64",
                    window_starts_out="*i64", prev_starts_out="*i64", entry_positions_out="*i64", pool_rows_out="*i64", group_rows_out="*i32")  # fmt: skip
    scalars = dict(B=i32, W=i32, stride_tables=i32, groups=i32, table_start=i32, table=i32, kind=i32)
    sizes = dict(BLOCK_SIZE=64, BLOCK=min(P._MAX_BLOCK, tile_elems(P._BYTES_PER_ELEM)), ROW_BLOCK=P._ROW_BLOCK)
    no_kind = dict(KIND_RATIO=0, KIND_OVERLAP=False, KIND_RING=0, KIND_POOL_ROWS=1)
    launches = [
        dict(WINDOW=128, RATIO=4, ENTRY_ROWS=16, ENTRY_STRIDE=1, KIND_RATIO=4, KIND_OVERLAP=True, KIND_RING=8, KIND_POOL_ROWS=16, FIRST=True),
        dict(WINDOW=0, RATIO=128, ENTRY_ROWS=1, ENTRY_STRIDE=2, KIND_RATIO=128, KIND_OVERLAP=False, KIND_RING=128, KIND_POOL_ROWS=1, FIRST=False),
        dict(WINDOW=0, RATIO=2, ENTRY_ROWS=32, ENTRY_STRIDE=1, **no_kind, FIRST=True),
        dict(WINDOW=0, RATIO=0, ENTRY_ROWS=1, ENTRY_STRIDE=1, KIND_RATIO=4, KIND_OVERLAP=True, KIND_RING=12, KIND_POOL_ROWS=16, FIRST=False),
    ]
    for constexprs in launches:
        build(P._decode_plan_kernel, {**constexprs, **sizes}, **pointers, **scalars)
    build(P._decode_plan_kernel, {**launches[1], **sizes}, **pointers, **{**scalars, "table_start": "i64"})  # a table past 2^31 entries


def main(family: str) -> None:
    global TOL
    import torch

    assert os.environ.get("TRITON_INTERPRET") == "1"
    TOL = {torch.float64: (1e-10, 1e-12), torch.float32: (1.3e-6, 1e-6), torch.bfloat16: (1.6e-2, 1e-3), torch.float16: (1e-3, 1e-4)}
    from deepinfer_ascend.device import current

    chip = os.environ.get("DEEPINFER_ASCEND_SIM_CHIP", "910B")
    print("simulated", current(), flush=True)
    gen = torch.Generator().manual_seed(20261130)
    {"misc": check_norm_rope_act, "moe": check_moe, "sampling": check_sampling}[family](gen)
    print(f"ALL OK {family} {chip}", flush=True)


if __name__ == "__main__":
    if sys.argv[2:] == ["frontend"] and sys.argv[1] in FRONT_END_FAMILIES:
        frontend(sys.argv[1])
    elif len(sys.argv) == 2 and sys.argv[1] in FAMILIES:
        main(sys.argv[1])
    else:
        sys.exit(f"usage: python vector_checks.py {{{','.join(FAMILIES)}}} | {{{','.join(FRONT_END_FAMILIES)}}} frontend")
