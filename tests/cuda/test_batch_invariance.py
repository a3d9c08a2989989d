"""Deterministic mode's cuda kernels are batch-invariant, checked under the Triton interpreter.

For every op the cuda backend implements, the kernel deterministic mode resolves (the registry with
`ResolveContext(deterministic=True)`) runs on one request alone and inside batches of other requests
(other sizes, other positions, longer and shorter lists, block tables and entry tables), and the
request's outputs must be the same bits (torch.equal). prefill: the same request's queries whole and
in chunks over the earlier part as cached keys. linear / grouped_gemm: the same rows beside
different numbers of rows on other experts, contiguous and masked.

What the interpreter can and cannot show. It runs numpy on the CPU: a split count, split-K, K step,
tile config or combine path chosen from the batch changes the bits here too, and these checks catch
it (the default kernels of linear, grouped_gemm, mla_decode and sparse_attention fail them). Two
kinds of difference exist on a GPU only: another reduction tree for a tl.sum over a tile whose shape
or warps follow the batch (rms_norm's rows per program, the gate's and compress_kv's token tiles,
hc_pre's fused-or-split choice), and an FMA contracted on one code path and not on another
(prefill's mask-free key blocks). numpy reduces every row of a tile the same way whatever its shape
and never fuses a multiply-add, so for those ops these checks pass for the default kernels as well
and the invariance rests on how the kernels are built (each module's docstring says why); they
still catch a block structure or a split that moves with the batch.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops import kv_cache_format, quant
from deepinfer.ops.rope import rope_cos_sin_cache
from deepinfer.plugins import load_plugins
from deepinfer.registry import ResolveContext

from triton_mode import require_interpreter

CPU = torch.device("cpu")
DTYPES = (torch.float32, torch.bfloat16)
# (requests or rows before the one checked, after it): alone is (0, 0)
LAYOUTS = ((1, 0), (0, 3), (17, 2))


@pytest.fixture(scope="module")
def reg():
    require_interpreter()
    plugins = load_plugins()
    options = plugins.require("cuda", interpret=True).resolve_options(None)
    return plugins.registry("cuda", interpret=True, options=options), options


def kernel(reg, op: str, dtype: torch.dtype, fmt: str | None = None, deterministic: bool = True):
    registry, options = reg
    ctx = ResolveContext(backend="cuda", device=CPU, dtype=dtype, options=options, deterministic=deterministic)
    chosen = registry.choose(ctx, op, fmt)
    assert chosen is not None, f"no cuda kernel for {op}[{fmt}] in {dtype}"
    assert chosen.batch_invariant or not deterministic
    return chosen.fn


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def same(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got, want), f"{what}: {int((got != want).sum())} of {want.numel()} values differ"


def around(g, req: torch.Tensor, before: int, after: int, **kw) -> torch.Tensor:
    """req's rows (dim 0) with `before` random rows in front and `after` behind."""

    def rows(n):
        return randn(g, n, *req.shape[1:], dtype=req.dtype, **kw)

    return torch.cat([rows(before), req, rows(after)])


# ---------------------------------------------------------------------------------------------- which kernels


SEPARATE = {"linear", "grouped_gemm", "mla_decode", "rms_norm", "gate", "prefill", "sparse_attention", "indexer_topk", "compress_kv", "hc_pre",
            "hc_pre_delayed", "hc_head", "candidate_blocks", "indexer_topk_in_blocks"}  # fmt: skip
AS_THEY_ARE = {
    "rope", "head_norm_rope", "silu_and_mul", "clamped_silu_and_mul", "kv_cache_write", "norm_rope_kv_write", "dispatch", "combine", "sample",
    "apply_token_bitmask", "hc_post", "rejection_sample", "apply_penalties", "apply_token_bias", "gather_logprobs",
    "cache_round", "cache_pack", "cache_unpack", "engram_hash", "engram_gate_add", "decode_plan",
}  # fmt: skip


def test_default_kernels_still_chosen_without_deterministic(reg):
    """Every op (format, dtype) the cuda backend serves has a batch-invariant kernel; without
    deterministic mode the default one is chosen: a separate kernel where deterministic mode has
    its own, the same one where the default is batch-invariant as it is."""
    registry, _ = reg
    assert set(registry.kernels["cuda"]) == SEPARATE | AS_THEY_ARE
    for op in sorted(SEPARATE | AS_THEY_ARE):
        for fmt in registry.ops[op].formats or (None,):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                default = kernel(reg, op, dtype, fmt, deterministic=False)
                invariant = kernel(reg, op, dtype, fmt)
                if op in SEPARATE:
                    assert default is not invariant and "invariant" not in default.__qualname__, (op, fmt, dtype)
                    assert "invariant" in invariant.__qualname__, (op, fmt, dtype)
                else:
                    assert default is invariant, (op, fmt, dtype)


# ---------------------------------------------------------------------------------------------- row-wise ops


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(reg, dtype):
    fn, g = kernel(reg, "rms_norm", dtype), gen(1)
    x, r, w = randn(g, 2, 96, dtype=dtype), randn(g, 2, 96, dtype=dtype), randn(g, 96, dtype=dtype)
    out, h = fn(x, w, eps=1e-6, residual=r)
    for before, after in LAYOUTS:
        got, got_h = fn(around(g, x, before, after), w, eps=1e-6, residual=around(g, r, before, after))
        same(got[before : before + 2], out, f"out {before, after}")
        same(got_h[before : before + 2], h, f"h {before, after}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope(reg, dtype):
    fn, g = kernel(reg, "rope", dtype), gen(2)
    cache = rope_cos_sin_cache(32, 64, 10000.0, dtype=dtype)
    x, pos = randn(g, 2, 3, 32, dtype=dtype), torch.tensor([5, 41])
    for interleaved in (True, False):
        out = fn(x, pos, cache, interleaved=interleaved)
        for before, after in LAYOUTS:
            p = torch.cat([torch.randint(0, 64, (before,), generator=g), pos, torch.randint(0, 64, (after,), generator=g)])
            same(fn(around(g, x, before, after), p, cache, interleaved=interleaved)[before : before + 2], out, f"{interleaved} {before, after}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_norm_rope(reg, dtype):
    """Two tokens' heads, normed and rotated (and rotated only), give the same bits beside other tokens."""
    fn, g = kernel(reg, "head_norm_rope", dtype), gen(2)
    cache = rope_cos_sin_cache(16, 64, 10000.0)
    x, pos = randn(g, 2, 3, 48, dtype=dtype, scale=5.0), torch.tensor([5, 41])
    for eps in (1e-6, None):
        out = fn(x.clone(), pos, cache, eps=eps)
        for before, after in LAYOUTS:
            p = torch.cat([torch.randint(0, 64, (before,), generator=g), pos, torch.randint(0, 64, (after,), generator=g)])
            same(fn(around(g, x, before, after), p, cache, eps=eps)[before : before + 2], out, f"{eps} {before, after}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["silu_and_mul", "clamped_silu_and_mul"])
def test_activations(reg, op, dtype):
    fn, g = kernel(reg, op, dtype), gen(3)
    kw = {"limit": 2.0} if op == "clamped_silu_and_mul" else {}
    x = randn(g, 2, 2 * 80, dtype=dtype, scale=2.0)
    out = fn(x, **kw)
    for before, after in LAYOUTS:
        same(fn(around(g, x, before, after, scale=2.0), **kw)[before : before + 2], out, f"{before, after}")


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, kv_cache_format.FP8_DTYPE])
def test_kv_cache_write(reg, cache_dtype):
    dtype = torch.float32 if cache_dtype == torch.float32 else torch.bfloat16
    fn, g = kernel(reg, "kv_cache_write", dtype), gen(4)
    C, R, blocks, page = 64, 16, 6, 16
    width = kv_cache_format.row_width(C + R, cache_dtype)
    kv_c, k_pe, slots = randn(g, 2, C, dtype=dtype), randn(g, 2, R, dtype=dtype), torch.tensor([7, 50])
    alone = fn(kv_c, k_pe, torch.zeros(blocks, page, width, dtype=cache_dtype), slots).view(-1, width)[slots]
    others = [s for s in range(blocks * page) if s not in (7, 50)]
    for before, after in LAYOUTS:
        pick = torch.randperm(len(others), generator=g)[: before + after]
        other = torch.tensor(others)[pick]
        s = torch.cat([other[:before], slots, other[before:]])
        s[before + 2 :][::3] = -1  # padding rows write nothing
        cache = torch.zeros(blocks, page, width, dtype=cache_dtype)
        fn(around(g, kv_c, before, after), around(g, k_pe, before, after), cache, s)
        same(cache.view(-1, width)[slots].view(torch.uint8), alone.view(torch.uint8), f"{before, after}")


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, kv_cache_format.FP8_DTYPE])
def test_norm_rope_kv_write(reg, cache_dtype):
    """A compressor's two entries (float32, as compress_kv gives them) write the same pool rows beside other entries and skipped rows."""
    dtype = torch.float32 if cache_dtype == torch.float32 else torch.bfloat16
    fn, g = kernel(reg, "norm_rope_kv_write", dtype), gen(6)
    D, blocks, page = 64, 6, 4
    width = kv_cache_format.row_width(D, cache_dtype)
    x, weight, table = randn(g, 2, D, scale=3.0), 1 + randn(g, D, scale=0.3), rope_cos_sin_cache(16, 64, 10000.0)
    positions, slots = torch.tensor([8, 60]), torch.tensor([7, 20])
    alone = fn(x, weight, positions, table, torch.zeros(blocks, page, width, dtype=cache_dtype), slots, eps=1e-6).view(-1, width)[slots]
    others = [s for s in range(blocks * page) if s not in (7, 20)]
    for before, after in LAYOUTS:
        other = torch.tensor(others)[torch.randperm(len(others), generator=g)[: before + after]]
        s = torch.cat([other[:before], slots, other[before:]])
        s[before + 2 :][::3] = -1  # skipped rows write nothing
        p = torch.cat([torch.randint(0, 64, (before,), generator=g), positions, torch.randint(0, 64, (after,), generator=g)])
        cache = torch.zeros(blocks, page, width, dtype=cache_dtype)
        fn(around(g, x, before, after), weight, p, table, cache, s, eps=1e-6)
        same(cache.view(-1, width)[slots].view(torch.uint8), alone.view(torch.uint8), f"{before, after}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_hc_post(reg, dtype):
    fn, g = kernel(reg, "hc_post", dtype), gen(5)
    y, x = randn(g, 2, 64, dtype=dtype), randn(g, 2, 4, 64, dtype=dtype)
    post, comb = torch.rand(2, 4, generator=g) * 2, torch.softmax(randn(g, 2, 4, 4), dim=-1)
    out = fn(y, x, post, comb)
    for before, after in LAYOUTS:
        got = fn(around(g, y, before, after), around(g, x, before, after), around(g, post, before, after), around(g, comb, before, after))
        same(got[before : before + 2], out, f"{before, after}")


@pytest.mark.parametrize("normed", [False, True], ids=["plain", "norm_weight"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_hc_pre(reg, dtype, normed):
    # K = 4 x 512: 16 split segments of 128 (2 fused ones of 1024). Under the interpreter the default kernel
    # takes the fused launch from 64 tokens on (4 "SMs" x 16-token tiles), the split one below: 70 tokens
    # cross it; the invariant kernel takes the split launch at every T. With norm_weight the row's statistics
    # follow the collapse's fixed chunks.
    fn, g = kernel(reg, "hc_pre", dtype), gen(6)
    N, D, W = 4, 512, 24
    kw = {"fn": randn(g, W, N * D, scale=(N * D) ** -0.5), "base": randn(g, W, scale=0.5), "scale": torch.tensor([0.5, 0.4, 1.1]),
          "norm_eps": 1e-6, "hc_eps": 1e-6, "sinkhorn_iters": 20}  # fmt: skip
    if normed:
        kw["norm_weight"] = 1.0 + randn(g, D, scale=0.3)
    x = randn(g, 2, N, D, dtype=dtype)
    want = fn(x, **kw)
    for before, after in ((1, 0), (40, 28)):
        got = fn(around(g, x, before, after), **kw)
        for name, a, b in zip(("out", "post", "comb"), got, want):
            same(a[before : before + 2], b, f"{name} {before, after}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_hc_head(reg, dtype):
    # hc_pre's split launch with the head's 4 mixing logits and its norm folded in: K = 4 x 512 as test_hc_pre's, 70 tokens
    # cross the default kernel's fused threshold (there the norm is its own kernel); the invariant kernel stays split.
    fn, g = kernel(reg, "hc_head", dtype), gen(7)
    N, D = 4, 512
    kw = {"fn": randn(g, N, N * D, scale=(N * D) ** -0.5), "base": randn(g, N, scale=0.5), "scale": torch.tensor([0.7]),
          "norm_weight": 1.0 + randn(g, D, scale=0.3), "norm_eps": 1e-6, "hc_eps": 1e-6}  # fmt: skip
    x = randn(g, 2, N, D, dtype=dtype)
    want = fn(x, **kw)
    for before, after in ((1, 0), (40, 28)):
        same(fn(around(g, x, before, after), **kw)[before : before + 2], want, f"{before, after}")


# ---------------------------------------------------------------------------------------------- MoE


# The fixed token tile's padding rows renormalise 0 / 0 (numpy warns; those rows are never stored).
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "route",
    [
        {"top_k": 6, "score_func": "softmax", "renormalize": True},
        {"top_k": 4, "score_func": "sqrtsoftplus", "n_group": 4, "topk_group": 2, "renormalize": True, "routed_scaling_factor": 2.5},
    ],
)
def test_gate(reg, dtype, route):
    fn, g = kernel(reg, "gate", dtype), gen(7)
    E = 64
    bias = randn(g, E, scale=0.1) if route["score_func"] == "sqrtsoftplus" else None
    logits = randn(g, 2, E, dtype=dtype, scale=2.0)
    w, ids = fn(logits, correction_bias=bias, **route)
    for before, after in LAYOUTS:
        got_w, got_ids = fn(around(g, logits, before, after, scale=2.0), correction_bias=bias, **route)
        same(got_w[before : before + 2], w, f"weights {before, after}")
        same(got_ids[before : before + 2], ids, f"ids {before, after}")


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_hash_routing(reg, dtype):
    """V4's hash routing: two tokens' table rows and weights beside other tokens (their ids too)."""
    fn, g = kernel(reg, "gate", dtype), gen(7)
    E, V, K = 64, 50, 6
    table = torch.rand(V, E, generator=g).argsort(dim=-1)[:, :K]
    route = {"top_k": K, "score_func": "sqrtsoftplus", "renormalize": True, "routed_scaling_factor": 1.5, "hash_table": table}
    logits, tok = randn(g, 2, E, dtype=dtype, scale=2.0), torch.tensor([7, 31])
    w, ids = fn(logits, token_ids=tok, **route)
    for before, after in LAYOUTS:
        others = torch.cat([torch.randint(0, V, (before,), generator=g), tok, torch.randint(0, V, (after,), generator=g)])
        got_w, got_ids = fn(around(g, logits, before, after, scale=2.0), token_ids=others, **route)
        same(got_w[before : before + 2], w, f"weights {before, after}")
        same(got_ids[before : before + 2], ids, f"ids {before, after}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_dispatch_and_combine(reg, dtype):
    dispatch, combine, g = kernel(reg, "dispatch", dtype), kernel(reg, "combine", dtype), gen(8)
    E, K, D = 8, 3, 48

    def run(x, ids, w, at):
        expert_x, _, row_of_slot = dispatch(x, ids, num_experts=E)
        mine = row_of_slot[at * K : (at + 2) * K].long()
        # what the experts would return: any function of each row alone
        return expert_x[mine], combine(expert_x * 1.5 - 0.25, w, row_of_slot)[at : at + 2]

    x, ids, w = randn(g, 2, D, dtype=dtype), torch.tensor([[3, 0, 5], [5, 1, 3]], dtype=torch.int32), torch.rand(2, K, generator=g)
    rows, out = run(x, ids, w, 0)
    for before, after in LAYOUTS:
        other_ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(before + after)]).to(torch.int32)
        all_ids = torch.cat([other_ids[:before], ids, other_ids[before:]])
        got_rows, got = run(around(g, x, before, after), all_ids, torch.cat([torch.rand(before, K), w, torch.rand(after, K)]), before)
        same(got_rows, rows, f"dispatched rows {before, after}")
        same(got, out, f"combined {before, after}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_grouped_gemm(reg, dtype, layout):
    # 3 rows of expert 1. Beside them: nothing, or rows on other experts (and on expert 1 before
    # them), up to more than 64 rows per expert, where the default plan takes the large tiles
    # (another BLOCK_K: another order of the sums over K, which the interpreter shows).
    fn, g = kernel(reg, "grouped_gemm", dtype, "dense"), gen(9)
    E, N, Kd = 3, 64, 256
    weight = randn(g, E, N, Kd, dtype=dtype, scale=0.05)
    x = randn(g, 3, Kd, dtype=dtype)
    for counts in ((0, 0, 0), (5, 2, 0), (0, 1, 130), (80, 70, 90)):  # other rows per expert (expert 1's go first)
        if layout == "contiguous":
            parts = [randn(g, counts[0], Kd, dtype=dtype), randn(g, counts[1], Kd, dtype=dtype), x, randn(g, counts[2], Kd, dtype=dtype)]
            sizes = torch.tensor([counts[0], counts[1] + 3, counts[2]])
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)]).to(torch.int32)
            got = fn(torch.cat(parts), weight, expert_offsets=offsets)
            start = counts[0] + counts[1]
        else:
            max_m = max(counts[0], counts[1] + 3, counts[2])
            xm = randn(g, E, max_m, Kd, dtype=dtype)
            xm[1, counts[1] : counts[1] + 3] = x
            masked = torch.tensor([counts[0], counts[1] + 3, counts[2]], dtype=torch.int32)
            got = fn(xm, weight, masked_m=masked)[1]
            start = counts[1]
        if counts == (0, 0, 0):
            want = got[start : start + 3]
        same(got[start : start + 3], want, f"{layout} {counts}")


@pytest.mark.parametrize("dtype, fmt", [(torch.float32, "dense"), (torch.bfloat16, "dense"), (torch.bfloat16, "fp8_block"), (torch.bfloat16, "fp8_block32")])
def test_linear(reg, dtype, fmt):
    # 3 rows alone, then among 4, 20 and 133 rows: the default plan changes tiles at 64 rows.
    fn, g = kernel(reg, "linear", dtype, fmt), gen(10)
    w = randn(g, 128, 256, scale=0.05)
    quantize = quant.quantize_weight_fp8_block32 if fmt == "fp8_block32" else quant.quantize_weight_fp8_block
    weights = {"weight": w.to(dtype)} if fmt == "dense" else dict(zip(("weight", "weight_scale"), quantize(w)), fmt=fmt)
    x = randn(g, 3, 256, dtype=dtype)
    want = fn(x, **weights)
    for before, after in ((1, 0), (0, 17), (70, 60)):
        same(fn(around(g, x, before, after), **weights)[before : before + 3], want, f"{before, after}")


# ---------------------------------------------------------------------------------------------- sampling


def test_sample(reg):
    fn, g = kernel(reg, "sample", torch.float32), gen(11)
    V = 5000  # two chunks of the vocabulary
    logits = randn(g, 2, V, scale=3.0)
    params = {
        "temperature": torch.tensor([0.8, 1.3]), "top_k": torch.tensor([40, 0]), "top_p": torch.tensor([0.9, 1.0]),
        "min_p": torch.tensor([0.0, 0.05]), "seeds": torch.tensor([123, 7]), "positions": torch.tensor([9, 30]),
    }  # fmt: skip
    want = fn(logits, **params)
    for before, after in ((1, 0), (3, 2)):  # (the interpreter takes ~0.4 s per filtered row)
        n = before + after
        other = {
            "temperature": torch.rand(n, generator=g) * torch.randint(0, 2, (n,), generator=g), "top_k": torch.randint(0, 50, (n,), generator=g),
            "top_p": 0.5 + 0.5 * torch.rand(n, generator=g), "min_p": 0.1 * torch.rand(n, generator=g),
            "seeds": torch.randint(0, 1000, (n,), generator=g), "positions": torch.randint(0, 100, (n,), generator=g),
        }  # fmt: skip
        mixed = {k: torch.cat([other[k][:before].to(v.dtype), v, other[k][before:].to(v.dtype)]) for k, v in params.items()}
        same(fn(around(g, logits, before, after, scale=3.0), **mixed)[before : before + 2], want, f"{before, after}")


def _verify_requests(g, counts: list[int], vocab: int) -> dict:
    """rejection_sample's inputs for requests of the given row counts, random parameters and drafts."""
    n, rows = len(counts), sum(counts)
    return {
        "logits": randn(g, rows, vocab, scale=3.0), "draft_tokens": torch.randint(0, vocab, (rows,), generator=g),
        "cu_rows": torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32),
        # greedy or temperature-only rows (the filters' invariance is test_sample's; they cost ~0.3 s a row here)
        "temperature": torch.randint(0, 2, (n,), generator=g) * (0.5 + torch.rand(n, generator=g)), "top_k": torch.zeros(n, dtype=torch.int32),
        "top_p": torch.ones(n), "min_p": torch.zeros(n),
        "seeds": torch.randint(0, 1000, (n,), generator=g), "positions": torch.randint(0, 100, (n,), generator=g),
    }  # fmt: skip


def _joined(parts: list[dict]) -> dict:
    counts = [int(c) for p in parts for c in (p["cu_rows"][1:] - p["cu_rows"][:-1])]
    joined = {k: torch.cat([p[k] for p in parts]) for k in parts[0] if k != "cu_rows"}
    return {**joined, "cu_rows": torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)}


def test_rejection_sample(reg):
    from deepinfer.ops.sampling import sample

    fn, g = kernel(reg, "rejection_sample", torch.float32), gen(13)
    V = 200
    probe = {**_verify_requests(g, [3], V), "temperature": torch.tensor([0.8])}
    params = [probe[k] for k in ("temperature", "top_k", "top_p", "min_p", "seeds", "positions")]
    probe["draft_tokens"][0] = sample(probe["logits"][:1], *params)[0]  # the first draft accepted: the second row decides
    want = fn(**probe)
    assert want[0] == probe["draft_tokens"][0]
    for before, after in (([2], []), ([1], [1, 2])):  # neighbouring requests' row counts
        got = fn(**_joined([_verify_requests(g, before, V), probe, _verify_requests(g, after, V)]))
        same(got[sum(before) : sum(before) + 3], want, f"{before, after}")


def test_apply_token_bitmask(reg):
    fn, g = kernel(reg, "apply_token_bitmask", torch.float32), gen(12)
    V = 300
    logits, mask = randn(g, 2, V), torch.randint(-(2**31), 2**31, (2, (V + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
    want = fn(logits.clone(), mask)
    for before, after in LAYOUTS:
        other = torch.randint(-(2**31), 2**31, (before + after, mask.shape[1]), generator=g, dtype=torch.int64).to(torch.int32)
        got = fn(around(g, logits, before, after), torch.cat([other[:before], mask, other[before:]]))
        same(got[before : before + 2], want, f"{before, after}")


# ---------------------------------------------------------------------------------------------- attention


def _prefill(fn, parts, window, scale=0.2):
    """parts: (q, k, v) per request, packed; returns the packed output."""
    q, k, v = (torch.cat([p[i] for p in parts]) for i in range(3))
    cu_q = torch.tensor([0] + [p[0].shape[0] for p in parts]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + [p[1].shape[0] for p in parts]).cumsum(0).to(torch.int32)
    return fn(q, k, v, cu_q, cu_k, softmax_scale=scale, sliding_window=window)


@pytest.mark.parametrize("dtype, window", [(torch.float32, None), (torch.bfloat16, 24)])
def test_prefill_batches_and_chunks(reg, dtype, window):
    # One request of 100 queries (Dqk 48 = 32 + 16: the split dot; the default table's 64-query
    # blocks), alone, beside other requests (a cached prefix among them), and in chunks: 38 queries,
    # then 62 over the first 38 keys as a cached prefix, then 30 + 32 + 38 with another batch around.
    fn, g = kernel(reg, "prefill", dtype), gen(13)
    H, Dqk, Dv, T = 2, 48, 32, 100
    q, k, v = randn(g, T, H, Dqk, dtype=dtype), randn(g, T, H, Dqk, dtype=dtype), randn(g, T, H, Dv, dtype=dtype)

    def other(nq, nk):
        return randn(g, nq, H, Dqk, dtype=dtype), randn(g, nk, H, Dqk, dtype=dtype), randn(g, nk, H, Dv, dtype=dtype)

    want = _prefill(fn, [(q, k, v)], window)
    same(_prefill(fn, [other(70, 70), (q, k, v), other(5, 40)], window)[70:170], want, "batched")
    same(_prefill(fn, [other(3, 3), other(1, 200), (q, k, v)], window)[4:104], want, "batched after a decode-like request")
    for cuts, around_it in (((38,), (0, 0)), ((30, 62), (1, 2))):
        got, start = [], 0
        for end in (*cuts, T):
            before = [other(n + 3, n + 10) for n in range(around_it[0])]
            after = [other(n + 9, n + 9) for n in range(around_it[1])]
            out = _prefill(fn, [*before, (q[start:end], k[:end], v[:end]), *after], window)
            skip = sum(b[0].shape[0] for b in before)
            got.append(out[skip : skip + end - start])
            start = end
        same(torch.cat(got), want, f"chunks at {cuts}")


def _mla(g, dtype, seq_lens, heads=4, latent=64, rope=16, page=64, width=None):
    pages = [-(-n // page) for n in seq_lens]
    blocks = sum(pages) + 2
    order = torch.randperm(blocks, generator=g)
    table = torch.zeros(len(seq_lens), width or max(pages), dtype=torch.int32)
    start = 0
    for b, count in enumerate(pages):
        table[b, :count] = order[start : start + count]
        start += count
    return {
        "q_nope": randn(g, len(seq_lens), 1, heads, latent, dtype=dtype), "q_rope": randn(g, len(seq_lens), 1, heads, rope, dtype=dtype),
        "kv_cache": randn(g, blocks, page, latent + rope, dtype=dtype), "block_table": table, "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
    }  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_decode(reg, dtype):
    # A 600-token request alone, beside 9 short ones and beside a longer one with a wider block
    # table (the default kernel cuts the request at 320 tokens alone, at 512 there).
    fn, g = kernel(reg, "mla_decode", dtype), gen(14)
    alone = _mla(g, dtype, [600])
    want = fn(**alone, softmax_scale=0.1)
    for lens, at in (([50] * 9 + [600], 9), ([900, 600, 3], 1)):
        batch = _mla(g, dtype, lens)
        table_row = batch["block_table"][at]
        # the request's own pages: its queries and its tokens' rows, at its pages of this batch
        batch["q_nope"][at], batch["q_rope"][at] = alone["q_nope"][0], alone["q_rope"][0]
        for i in range(-(-600 // 64)):
            batch["kv_cache"][table_row[i]] = alone["kv_cache"][alone["block_table"][0, i]]
        same(fn(**batch, softmax_scale=0.1)[at : at + 1], want, f"{lens}")


def _lists(g, n_valid, width, rows):
    """A query's row list: n_valid distinct rows in [0, rows), -1 padded to width."""
    ids = torch.full((width,), -1, dtype=torch.int32)
    ids[:n_valid] = torch.randperm(rows, generator=g)[:n_valid].to(torch.int32)
    return ids


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_attention(reg, dtype):
    # One query: 100 window rows and 200 compressed entries (the default kernel splits them in two
    # when alone, not in a batch), padded to the widths of batches of longer lists, at other places.
    fn, g = kernel(reg, "sparse_attention", dtype), gen(15)
    H, D, rows, xrows = 4, 64, 400, 300
    kv, xkv, sinks = randn(g, rows, D, dtype=dtype), randn(g, xrows, D, dtype=dtype), randn(g, H)
    q = randn(g, 1, H, D, dtype=dtype)
    win, ext = _lists(g, 100, 100, rows), _lists(g, 200, 200, xrows)
    want = fn(q, kv, win[None], sinks, softmax_scale=0.125, extra_kv=xkv, extra_indices=ext[None])
    for (before, after), (width, xwidth) in (((1, 0), (160, 200)), ((0, 3), (100, 290)), ((6, 0), (130, 250))):
        n = before + after
        wl = torch.stack([_lists(g, int(torch.randint(1, width + 1, (1,), generator=g)), width, rows) for _ in range(n)])
        xl = torch.stack([_lists(g, int(torch.randint(0, xwidth + 1, (1,), generator=g)), xwidth, xrows) for _ in range(n)])
        pad_w = torch.cat([win, torch.full((width - 100,), -1, dtype=torch.int32)])
        pad_x = torch.cat([ext, torch.full((xwidth - 200,), -1, dtype=torch.int32)])
        indices = torch.cat([wl[:before], pad_w[None], wl[before:]])
        extra = torch.cat([xl[:before], pad_x[None], xl[before:]])
        got = fn(around(g, q, before, after), kv, indices, sinks, softmax_scale=0.125, extra_kv=xkv, extra_indices=extra)
        same(got[before : before + 1], want, f"{before, after} widths {width, xwidth}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_topk(reg, dtype):
    # A sequence of 40 entries with two queries, alone and beside sequences with up to 150 entries
    # (its table padded to their width), at another place in the batch.
    fn, g = kernel(reg, "indexer_topk", dtype), gen(16)
    H, D, pool = 16, 32, 400
    keys = randn(g, pool, D, dtype=dtype)
    mine = torch.randperm(pool, generator=g)[:40].to(torch.int32)
    q, w = randn(g, 2, H, D, dtype=dtype), randn(g, 2, H, scale=0.1)
    nv = torch.tensor([38, 40], dtype=torch.int32)

    def run(tables, at, width, q_all, w_all, seq, vis):
        t = torch.full((len(tables), width), -1, dtype=torch.int32)
        for b, rows in enumerate(tables):
            t[b, : len(rows)] = rows
        return fn(q_all, w_all, keys, t, seq, vis, top_k=8)

    want = run([mine], 0, 40, q, w, torch.zeros(2, dtype=torch.int32), nv)
    others = [torch.randperm(pool, generator=g)[:n].to(torch.int32) for n in (150, 7, 90)]
    got = run([others[0], mine, others[1]], 1, 160, around(g, q, 3, 1), around(g, w, 3, 1, scale=0.1),
              torch.tensor([0, 0, 0, 1, 1, 2], dtype=torch.int32), torch.tensor([150, 120, 3, 38, 40, 7], dtype=torch.int32))  # fmt: skip
    same(got[3:5], want, "beside longer tables")
    got = run([mine, others[2]], 0, 90, around(g, q, 0, 3), around(g, w, 0, 3, scale=0.1),
              torch.tensor([0, 0, 1, 1, 1], dtype=torch.int32), torch.tensor([38, 40, 90, 60, 1], dtype=torch.int32))  # fmt: skip
    same(got[0:2], want, "first in the batch")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ratio, overlap", [(4, True), (8, False)])
def test_compress_kv(reg, dtype, ratio, overlap):
    fn, g = kernel(reg, "compress_kv", dtype), gen(17)
    D = 32
    width = 2 * D if overlap else D
    rows = 64
    kv, gate = randn(g, rows, width, dtype=dtype), randn(g, rows, width, dtype=dtype, scale=3.0)
    bias = randn(g, ratio, width, scale=0.5)
    starts = torch.tensor([ratio, 5 * ratio])
    prevs = torch.tensor([0, 4 * ratio]) if overlap else starts
    want = fn(kv, gate, bias, starts, prevs, ratio=ratio, overlap=overlap)
    for before, after in LAYOUTS:
        o_starts = torch.randint(0, rows - ratio, (before + after,), generator=g)
        o_prevs = torch.where(o_starts >= ratio, o_starts - ratio, -1) if overlap else o_starts
        s = torch.cat([o_starts[:before], starts, o_starts[before:]])
        p = torch.cat([o_prevs[:before], prevs, o_prevs[before:]])
        same(fn(kv, gate, bias, s, p, ratio=ratio, overlap=overlap)[before : before + 2], want, f"{before, after}")


def test_decode_plan(reg):
    """Two sequences' tables (window rows, entry tables, visible counts, ring plans) alone and beside other sequences and
    padding rows, over block tables of one width (a device graph's)."""
    from deepinfer.ops.decode_plan import OUTPUTS, RING_FIELDS, split_entry_rows

    fn, g = kernel(reg, "decode_plan", torch.float32), gen(21)
    width, block_size, ratios = 6, 16, (4, 32)
    params = dict(block_size=block_size, window=8, ratios=ratios, rings=((4, True, 8), (32, False, 32)), groups=2)

    def sequences(positions: torch.Tensor, states: torch.Tensor):
        tables = torch.randint(0, 500, (len(positions), width), generator=g, dtype=torch.int32)
        slots = tables.long().gather(1, (positions // block_size)[:, None])[:, 0] * block_size + positions % block_size
        return positions, tables, slots, states

    def rows(inputs, at: int) -> list[torch.Tensor]:
        out = dict(zip(OUTPUTS, fn(*inputs, **params)))
        tables = split_entry_rows(out["entry_rows"], len(inputs[0]), block_size, width, ratios)
        return [out["positions"][at : at + 2], out["window_rows"][at : at + 2], *(t[at : at + 2] for t in tables), out["num_visible"][:, at : at + 2],
                *(out[name][:, at : at + 2] for name in RING_FIELDS)]  # fmt: skip

    mine = sequences(torch.tensor([31, 95]), torch.tensor([3, 5], dtype=torch.int32))  # windows of 4 and of 32 close at 31 and 95
    want = rows(mine, 0)
    for before, after in LAYOUTS:
        n = before + after
        states = torch.randint(-1, 9, (n,), generator=g, dtype=torch.int32)  # -1: rows without a state slot
        positions, tables, slots, states = sequences(torch.randint(0, width * block_size, (n,), generator=g), states)
        slots[::3] = -1  # padding rows among them
        inputs = [torch.cat([o[:before], m, o[before:]]) for o, m in zip((positions, tables, slots, states), mine)]
        for got, expected in zip(rows(inputs, before), want):
            same(got, expected, f"{before, after}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_decode_queries_alone_or_among_s(reg, dtype):
    """Speculative verification: S = 6 queries of a request (16 heads: 96 rows, another tile plan
    for the default kernel than one query's 16) give each query the bits it gets alone, as the
    decode step of its position (seq_len = its position + 1)."""
    fn, g = kernel(reg, "mla_decode", dtype), gen(16)
    s, heads = 6, 16
    inputs = _mla(g, dtype, [600], heads=heads)
    inputs["q_nope"] = randn(g, 1, s, heads, 64, dtype=dtype)
    inputs["q_rope"] = randn(g, 1, s, heads, 16, dtype=dtype)
    together = fn(**inputs, softmax_scale=0.1)
    for i in range(s):
        alone = dict(inputs, q_nope=inputs["q_nope"][:, i : i + 1], q_rope=inputs["q_rope"][:, i : i + 1],
                     seq_lens=torch.tensor([600 - s + i + 1], dtype=torch.int32))  # fmt: skip
        same(together[:, i : i + 1], fn(**alone, softmax_scale=0.1), f"query {i}")
