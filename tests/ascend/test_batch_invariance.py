"""Deterministic mode on the ascend backend: every op resolves to a batch-invariant Triton kernel,
and a request's output is bit for bit the same alone and inside batches of other requests.

Each test runs the kernel deterministic mode resolves (`open_runtime("ascend", interpret=True,
deterministic=True)`, community Triton's interpreter, a simulated 910B) on one request alone and
beside 1, 3, 17 neighbours of other sizes and contents (90 for the GEMMs: the request in a second
64-row tile; 9 for mla_decode, whose 24 split items a request the interpreter pays one by one, 7
for prefill), the request at another position each time, and compares its output with
`torch.equal`: token, page and expert-row layouts, list widths padded to the batch, prefill whole
vs chunked over its cached prefix, float32 and bfloat16.

The tests can fail. The interpreter shows the default mla_decode's and sparse_attention's split
counts moving a request's bits (`test_the_default_*_splits_follow_the_batch`). It cannot show the
rest: its tl.dot and tl.sum are numpy's, whose per-row sums do not depend on the tile's height, and
the fused and split hc_pre launches run the same numpy operations. There the launch records
(`Launches`) hold the kernels to what decides a reduction's order on hardware: every watched
kernel's compile-time arguments (tile sizes, split and path flags) must be the same for every
batch, and `test_the_default_plans_follow_the_batch` shows that they catch the default kernels'
row-count-dependent tiles (GEMM BLOCK_M, rms_norm / gate BLOCK_T, compress_kv BLOCK_E) and
hc_pre's fused/split switch.

TRITON_INTERPRET=1 comes from tests/conftest.py; the simulated chip is set per test (conftest.py
here clears it between tests).
"""

from __future__ import annotations

import functools

import pytest
import torch

CHIP = "910B"
NEIGHBOURS = (1, 3, 17)


@functools.lru_cache(maxsize=None)
def _table(dtype: torch.dtype, deterministic: bool, ep_size: int = 1):
    from deepinfer.runtime import open_runtime

    return open_runtime("ascend", interpret=True, deterministic=deterministic, dtype=dtype, ep_size=ep_size, options={"sim_chip": CHIP}).ops


def ops(dtype: torch.dtype = torch.float32, deterministic: bool = True):
    """The resolved op table (cached); the simulated chip set again (conftest clears it per test)."""
    from deepinfer_ascend import device

    table = _table(dtype, deterministic)
    device.simulate(CHIP)
    return table


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def place(n: int) -> int:
    """Where the probe request sits among n neighbours: last, first, in between (past a 64-row tile for many)."""
    return {0: 0, 1: 1, 3: 0}.get(n, n // 2 if n < 64 else n - 10)


class Launches:
    """Records the compile-time arguments (tile sizes, split and path flags: the upper-case keyword
    arguments) of every launch of the watched kernels. What decides a reduction's order on hardware
    must be the same for every batch, also where the interpreter computes the same bits anyway."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch
        self.log: list = []

    def watch(self, module, *names: str) -> "Launches":
        for name in names:
            self.monkeypatch.setattr(module, name, _Spy(getattr(module, name), name, self.log))
        return self


class _Spy:
    def __init__(self, kernel, name, log):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def call(*args, **kwargs):
            self.log.append((self.name, {k: v for k, v in kwargs.items() if k.isupper()}))
            return launch(*args, **kwargs)

        return call


@pytest.fixture
def launches(monkeypatch):
    return Launches(monkeypatch)


def assert_invariant(run, neighbours=NEIGHBOURS, launches: Launches | None = None):
    """run(n) -> the probe's output (a tensor or a tuple) among n neighbours; n = 0: alone. With
    `launches`, the watched kernels' compile-time arguments must not change either."""

    def go(n):
        if launches is not None:
            launches.log.clear()
        out = run(n)
        return out, (list(launches.log) if launches is not None else None)

    alone, plan = go(0)
    for n in neighbours:
        got, got_plan = go(n)
        assert got_plan == plan, f"the launches' compile-time arguments differ beside {n} neighbours:\n{plan}\n{got_plan}"
        for a, b in zip(alone if isinstance(alone, tuple) else (alone,), got if isinstance(got, tuple) else (got,)):
            assert a.shape == b.shape and torch.equal(a, b), f"the probe's output differs beside {n} neighbours"


def differs_somewhere(run, neighbours=NEIGHBOURS) -> bool:
    alone = run(0)
    return any(not torch.equal(alone, run(n)) for n in neighbours)


# ---------------------------------------------------------------------------------------------
# resolution


def test_deterministic_mode_resolves_every_op_to_an_invariant_kernel():
    from deepinfer.registry import all_ops

    for dtype in (torch.float32, torch.bfloat16):
        table = ops(dtype)
        for name, spec in all_ops().items():
            if spec.out_of_tree:
                continue
            for fmt in spec.formats or (None,):
                kernel = table.registration(name, fmt)
                assert kernel is not None and kernel.batch_invariant and kernel.backend == "ascend", (name, fmt, dtype)
    ep = _table(torch.bfloat16, True, ep_size=2)
    for name in ("dispatch", "combine"):  # the EP exchange's kernels (all_to_all_single moves rows, adds nothing)
        assert ep.registration(name).batch_invariant and "all_to_all" in ep.registration(name).note


def test_default_mode_still_picks_the_default_kernels():
    from deepinfer_ascend.kernels import compressor, gemm, hyper_connection, mla_decode, moe, norm, prefill, sparse_attention

    table = ops(torch.bfloat16, deterministic=False)
    chosen = {
        "rms_norm": norm.rms_norm, "gate": moe.gate, "mla_decode": mla_decode.mla_decode, "prefill": prefill.prefill,
        "sparse_attention": sparse_attention.sparse_attention, "hc_pre": hyper_connection.hc_pre, "hc_post": hyper_connection.hc_post,
        "hc_head": hyper_connection.hc_head,
        "compress_kv": compressor.compress_kv, "dispatch": moe.dispatch,
    }  # fmt: skip
    for name, fn in chosen.items():
        assert table.registration(name).fn is fn, name
    for fmt in gemm.gemm_ops.FORMATS:
        assert table.registration("linear", fmt).fn is gemm.linear and table.registration("grouped_gemm", fmt).fn is gemm.grouped_gemm
    # and the invariant registrations sit below them
    det = ops(torch.bfloat16)
    assert det.registration("linear", "dense").fn is gemm.linear_invariant and det.registration("linear", "dense").priority < 0
    assert det.registration("mla_decode").fn is mla_decode.mla_decode_invariant
    assert det.registration("prefill").fn is prefill.prefill_invariant and det.registration("dispatch").fn is moe.dispatch
    assert det.registration("hc_head").fn is hyper_connection.hc_head_invariant


def test_invariant_plans():
    """What the invariant registrations fix, where the interpreter cannot show it (tile heights)."""
    from deepinfer_ascend.kernels import gemm, mla_decode

    ops()
    a = gemm.plan_tiles("dense", 0, torch.bfloat16, torch.bfloat16, gemm.INVARIANT_ROWS)
    assert a == (64, 128) and gemm.plan_tiles("dense", 0, torch.bfloat16, torch.bfloat16, 1) != a  # the default follows the rows
    p1 = mla_decode.plan(1, 16, 64, 64 * 40, 512, 64, 2, invariant=True)
    p2 = mla_decode.plan(300, 16, 64, 64 * 2, 512, 64, 2, invariant=True)
    assert p1["num_splits"] == p2["num_splits"] == 24 and p1["MIN_SPLIT_TILES"] == p2["MIN_SPLIT_TILES"] > 0


# ---------------------------------------------------------------------------------------------
# GEMMs


def _weight(g, dtype, *lead, n, k, fmt):
    from deepinfer.ops import quant

    w = torch.randn(*lead, n, k, generator=g) * 0.1
    if fmt == "dense":
        return {"weight": w.to(dtype), "fmt": fmt}
    quantise = {"fp8_block": quant.quantize_weight_fp8_block, "mxfp4": quant.quantize_weight_mxfp4, "mxfp8": quant.quantize_weight_mxfp8,
                "mxfp4_a8": quant.quantize_weight_mxfp4, "fp8_block32": quant.quantize_weight_fp8_block32}[fmt]  # fmt: skip
    weight, scale = quantise(w)
    return {"weight": weight, "weight_scale": scale, "fmt": fmt}


GEMM_CASES = [("dense", torch.float32), ("dense", torch.bfloat16), ("fp8_block", torch.bfloat16), ("mxfp4", torch.bfloat16),
              ("mxfp8", torch.bfloat16), ("mxfp4_a8", torch.bfloat16), ("fp8_block32", torch.bfloat16)]  # fmt: skip
GEMM_NEIGHBOURS = (1, 3, 17, 90)  # 91 rows: the probe in the second 64-row tile
K, N = 256, 64


def _linear_run(table, fmt, dtype):
    g = gen(1)
    w = _weight(g, dtype, n=N, k=K, fmt=fmt)
    probe = randn(g, 2, K, dtype=dtype)

    def run(n):
        others = randn(gen(100 + n), n, K, dtype=dtype)
        at = place(n)
        x = torch.cat([others[:at], probe, others[at:]])
        return table.linear(x, **w)[at : at + 2]

    return run


def _gemm_launches(launches):
    from deepinfer_ascend.kernels import gemm

    return launches.watch(gemm, "_gemm_kernel", "_quant_act_fp8_kernel")


@pytest.mark.parametrize("fmt,dtype", GEMM_CASES)
def test_linear(fmt, dtype, launches):
    assert_invariant(_linear_run(ops(dtype), fmt, dtype), GEMM_NEIGHBOURS, _gemm_launches(launches))


def _grouped_run(table, fmt, dtype, layout):
    """The probe: 3 rows of expert 2 (of 4); the other experts, and expert 2 around the probe, get
    other rows, so the probe's place in its expert's rows and every expert's count change."""
    experts = 4
    g = gen(2)
    w = _weight(g, dtype, experts, n=N, k=K, fmt=fmt)
    probe = randn(g, 3, K, dtype=dtype)

    def run(n):
        gn = gen(200 + n)
        counts = torch.randint(0, min(n, 20) + 1, (experts,), generator=gn).tolist()
        if n > 64:
            counts[2] = n  # the probe past its expert's first 64-row tile
        before = min(counts[2], place(n))
        if layout == "contiguous":
            blocks = [randn(gn, c, K, dtype=dtype) for c in counts]
            blocks[2] = torch.cat([blocks[2][:before], probe, blocks[2][before:]])
            offsets = torch.tensor([0] + [b.shape[0] for b in blocks]).cumsum(0).to(torch.int32)
            out = table.grouped_gemm(torch.cat(blocks + [randn(gn, 5, K, dtype=dtype)]), expert_offsets=offsets, **w)  # + padding rows
            start = int(offsets[2]) + before
        else:
            counts[2] += 3
            max_m = max(counts) + n % 7
            x = randn(gn, experts, max_m, K, dtype=dtype)
            x[2, before : before + 3] = probe
            x[2, before + 3 : counts[2]] = randn(gn, counts[2] - before - 3, K, dtype=dtype)
            out = table.grouped_gemm(x, masked_m=torch.tensor(counts, dtype=torch.int32), **w)[2]
            start = before
        return out[start : start + 3]

    return run


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
@pytest.mark.parametrize("fmt,dtype", GEMM_CASES)
def test_grouped_gemm(fmt, dtype, layout, launches):
    # (quantised weights: fewer batches, their in-kernel decode is slow to interpret)
    assert_invariant(_grouped_run(ops(dtype), fmt, dtype, layout), (3, 17, 90) if fmt == "dense" else (3, 17), _gemm_launches(launches))


# The default GEMM's row tiles (BLOCK_M 16..128 from the rows per expert) do not move a row's bits
# here: the interpreter's tl.dot is a numpy matmul whose per-element sum does not depend on the
# tile's height. On the cube unit it may: the launch records catch the default's tiles instead
# (`test_the_default_plans_follow_the_batch`).


# ---------------------------------------------------------------------------------------------
# attention


def _paged(g, lengths, page, width, dtype, fill=None):
    """A paged cache holding each request's tokens (fill[i]: request i's [L, W] rows, else random)
    in randomly placed pages, and its block table."""
    pages = [-(-length // page) for length in lengths]
    cols = max(pages)
    num_blocks = sum(pages) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    cache = randn(g, num_blocks, page, width, dtype=torch.float32)
    table = torch.zeros(len(lengths), cols, dtype=torch.int32)
    taken = 0
    for b, (length, count) in enumerate(zip(lengths, pages)):
        ids = order[taken : taken + count]
        taken += count
        table[b, :count] = torch.tensor(ids, dtype=torch.int32)
        rows = fill[b] if fill is not None and fill[b] is not None else randn(g, length, width)
        flat = cache[ids].reshape(-1, width)
        flat[:length] = rows.float()
        cache[ids] = flat.reshape(count, page, width)
    return cache, table


def _mla_run(table, dtype, *, s=1, window=None, fp8=False, probe_len=600, longest=300):
    """The probe request (probe_len tokens) beside shorter ones and one of 1500 tokens (a wider
    block table), its pages placed elsewhere each time. 128-token pages (the ascend block size)."""
    from deepinfer.ops import kv_cache_format

    heads, c, r, page = 4, 64, 16, 128
    g = gen(3)
    probe_rows = randn(g, probe_len, c + r)
    q_nope = randn(g, 1, s, heads, c, dtype=dtype)
    q_rope = randn(g, 1, s, heads, r, dtype=dtype)

    def run(n):
        gn = gen(300 + n)
        lengths = torch.randint(s, longest, (n,), generator=gn).tolist()
        if n:
            lengths[-1] = 1500  # a much longer neighbour (a wider block table)
        at = place(n)
        lengths.insert(at, probe_len)
        fill = [None] * len(lengths)
        fill[at] = probe_rows
        cache, bt = _paged(gn, lengths, page, c + r, dtype, fill)
        cache = kv_cache_format.quantize_rows(cache) if fp8 else cache.to(dtype)
        qn = randn(gn, n + 1, s, heads, c, dtype=dtype)
        qr = randn(gn, n + 1, s, heads, r, dtype=dtype)
        qn[at], qr[at] = q_nope[0], q_rope[0]
        out = table.mla_decode(qn, qr, cache, bt, torch.tensor(lengths, dtype=torch.int32), softmax_scale=0.125, sliding_window=window)
        return out[at]

    return run


@pytest.mark.parametrize("dtype,neighbours", [(torch.float32, (1, 3, 9)), (torch.bfloat16, (3,))])
def test_mla_decode(dtype, neighbours, launches):
    # (a 910B runs 24 split items per request, which the interpreter pays for one by one)
    assert_invariant(_mla_run(ops(dtype), dtype), neighbours, _mla_launches(launches))


def _mla_launches(launches):
    from deepinfer_ascend.kernels import mla_decode

    return launches.watch(mla_decode, "_mla_decode_split_kernel", "_mla_decode_combine_kernel")


def test_mla_decode_window_mtp_and_fp8_cache(launches):
    _mla_launches(launches)
    assert_invariant(_mla_run(ops(torch.bfloat16), torch.bfloat16, s=2, window=300, probe_len=520), (3,), launches)
    assert_invariant(_mla_run(ops(torch.bfloat16), torch.bfloat16, fp8=True, probe_len=300), (1,), launches)


def test_the_default_mla_decode_splits_follow_the_batch():
    assert differs_somewhere(_mla_run(ops(torch.float32, deterministic=False), torch.float32))


def _prefill_run(table, dtype, *, window=None):
    """The probe: 120 tokens, whole or in chunks (each over the probe's earlier tokens as its cached
    prefix), among requests with and without cached prefixes."""
    heads, dqk, dv, length = 2, 48, 32, 120
    g = gen(4)
    q_all, k_all, v_all = randn(g, length, heads, dqk, dtype=dtype), randn(g, length, heads, dqk, dtype=dtype), randn(g, length, heads, dv, dtype=dtype)

    def run_chunks(n, cuts):
        gn = gen(400 + n)
        outs = []
        for lo, hi in zip([0, *cuts], [*cuts, length]):
            reqs = [(randn(gn, ql, heads, dqk, dtype=dtype), randn(gn, ql + kc, heads, dqk, dtype=dtype), randn(gn, ql + kc, heads, dv, dtype=dtype))
                    for ql, kc in zip(torch.randint(1, 24, (n,), generator=gn).tolist(), torch.randint(0, 24, (n,), generator=gn).tolist())]  # fmt: skip
            at = place(n)
            reqs.insert(at, (q_all[lo:hi], k_all[:hi], v_all[:hi]))
            cu_q = torch.tensor([0] + [r[0].shape[0] for r in reqs]).cumsum(0).to(torch.int32)
            cu_k = torch.tensor([0] + [r[1].shape[0] for r in reqs]).cumsum(0).to(torch.int32)
            out = table.prefill(torch.cat([r[0] for r in reqs]), torch.cat([r[1] for r in reqs]), torch.cat([r[2] for r in reqs]), cu_q, cu_k,
                                softmax_scale=0.15, sliding_window=window)  # fmt: skip
            outs.append(out[int(cu_q[at]) : int(cu_q[at + 1])])
        return torch.cat(outs)

    return run_chunks


@pytest.mark.parametrize("dtype,window", [(torch.float32, None), (torch.bfloat16, 40)])
def test_prefill_whole_chunked_and_batched(dtype, window):
    # (no launch records: the whole and chunked runs launch different numbers of times; the
    # prefill kernel's tiles come from the head dims and dtype only, and the invariant one takes
    # the masked loop for every key block, which the interpreter computes like the mask-free one)
    run = _prefill_run(ops(dtype), dtype, window=window)
    whole = run(0, [])
    for n, cuts in [(1, []), (3, [37]), (7, [37, 90]), (0, [1, 65, 119])]:
        assert torch.equal(run(n, cuts), whole), f"prefill: {n} neighbours, chunks cut at {cuts}"


def _sparse_run(table, dtype, *, fp8=False):
    """The probe token lists 40 window rows (the first 6 of them -1, before position 0) and 300
    compressed entries; its neighbours list up to 64 and 400, so both lists are padded wider."""
    from deepinfer.ops import kv_cache_format

    heads, d, pool = 4, 64, 1200
    g = gen(5)
    kv, xkv = randn(g, pool, d), randn(g, pool, d)
    kv, xkv = (kv_cache_format.quantize_rows(kv), xkv.to(dtype)) if fp8 else (kv.to(dtype), xkv.to(dtype))
    sinks = randn(g, heads)
    q = randn(g, 1, heads, d, dtype=dtype)
    win = torch.cat([torch.full((6,), -1), torch.randperm(pool, generator=g)[:34]]).to(torch.int32)
    ent = torch.randperm(pool, generator=g)[:300].to(torch.int32)

    def run(n):
        gn = gen(500 + n)
        wins = [torch.randperm(pool, generator=gn)[: int(w)].to(torch.int32) for w in torch.randint(1, 65, (n,), generator=gn)]
        ents = [torch.randperm(pool, generator=gn)[: int(e)].to(torch.int32) for e in torch.randint(0, 401, (n,), generator=gn)]
        at = place(n)
        wins.insert(at, win)
        ents.insert(at, ent)
        pad = lambda lists: torch.nn.utils.rnn.pad_sequence(lists, batch_first=True, padding_value=-1)  # noqa: E731
        qs = randn(gn, n + 1, heads, d, dtype=dtype)
        qs[at] = q[0]
        out = table.sparse_attention(qs, kv, pad(wins), sinks, softmax_scale=0.125, extra_kv=xkv, extra_indices=pad(ents))
        return out[at]

    return run


def _sparse_launches(launches):
    from deepinfer_ascend.kernels import sparse_attention

    return launches.watch(sparse_attention, "_sparse_attention_kernel", "_sparse_attention_combine_kernel")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention(dtype, launches):
    assert_invariant(_sparse_run(ops(dtype), dtype), NEIGHBOURS, _sparse_launches(launches))


def test_sparse_attention_fp8_cache(launches):
    assert_invariant(_sparse_run(ops(torch.bfloat16), torch.bfloat16, fp8=True), (3,), _sparse_launches(launches))


def test_the_default_sparse_attention_splits_follow_the_batch():
    assert differs_somewhere(_sparse_run(ops(torch.float32, deterministic=False), torch.float32))


@pytest.mark.parametrize("fp8", [False, True])
def test_kv_cache_write(fp8):
    dtype = torch.bfloat16
    table = ops(dtype)
    g = gen(6)
    latent, rope = randn(g, 3, 64), randn(g, 3, 16)

    def run(n):
        gn = gen(600 + n)
        cache = torch.zeros(8, 16, 96 if fp8 else 80, dtype=torch.float8_e4m3fn if fp8 else dtype)
        slots = torch.randperm(128, generator=gn)[: n + 3]
        at = place(n)
        kv_c = torch.cat([randn(gn, at, 64), latent, randn(gn, n - at, 64)]).to(dtype)
        k_pe = torch.cat([randn(gn, at, 16), rope, randn(gn, n - at, 16)]).to(dtype)
        table.kv_cache_write(kv_c, k_pe, cache, slots)
        rows = cache.reshape(128, -1)[slots[at : at + 3]]
        return rows.view(torch.uint8) if fp8 else rows

    assert_invariant(run)


# ---------------------------------------------------------------------------------------------
# row-wise and elementwise ops


def _rows_run(fn, probe, make):
    """fn(x) -> out [T, ...]; the probe's rows among n random rows."""

    def run(n):
        others = make(gen(700 + n), n)
        at = place(n)
        out = fn(torch.cat([others[:at], probe, others[at:]]))
        return tuple(o[at : at + probe.shape[0]] for o in out) if isinstance(out, tuple) else out[at : at + probe.shape[0]]

    return run


def _rms_norm_case(table, dtype, d):
    g = gen(7)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    probe = randn(g, 2, 2 * d, dtype=dtype)  # x and residual side by side
    return _rows_run(lambda xr: table.rms_norm(xr[:, :d], w, eps=1e-6, residual=xr[:, d:]), probe, lambda gn, n: randn(gn, n, 2 * d, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [256, 5000])  # one tile of many rows; the chunked two-pass row
def test_rms_norm(dtype, d, launches):
    from deepinfer_ascend.kernels import norm

    launches.watch(norm, "_rms_norm_kernel")
    table = ops(dtype)
    g = gen(7)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    probe = randn(g, 2, 2 * d, dtype=dtype)  # x and residual side by side
    make = lambda gn, n: randn(gn, n, 2 * d, dtype=dtype)  # noqa: E731
    many = NEIGHBOURS if d == 256 else (1, 3)  # (the chunked row is one tile whatever T: fewer batches)
    assert_invariant(_rms_norm_case(table, dtype, d), many, launches)
    assert_invariant(_rows_run(lambda xr: table.rms_norm(xr[:, :d], w, eps=1e-6)[0], probe, make), many, launches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_activations(dtype):
    from deepinfer.ops.rope import rope_cos_sin_cache

    table = ops(dtype)
    g = gen(8)
    cache = rope_cos_sin_cache(32, 256, 10000.0, None)
    for interleaved in (True, False):
        probe = randn(g, 2, 3 * 32 + 1, dtype=dtype)  # 3 heads of 32, then the position in the last column

        def fn(xp, interleaved=interleaved):
            return table.rope(xp[:, :96].reshape(-1, 3, 32), xp[:, 96].float().abs().long() % 256, cache, interleaved=interleaved)

        assert_invariant(_rows_run(fn, probe, lambda gn, n: randn(gn, n, 97, dtype=dtype)))
    tail_table = rope_cos_sin_cache(16, 256, 10000.0, None)
    for eps in (1e-6, None):  # head_norm_rope: 3 heads of 32 (rope on the last 16), normed or not, in place

        def heads(xp, eps=eps):
            return table.head_norm_rope(xp[:, :96].reshape(-1, 3, 32).contiguous(), xp[:, 96].float().abs().long() % 256, tail_table, eps=eps)

        assert_invariant(_rows_run(heads, probe, lambda gn, n: randn(gn, n, 97, dtype=dtype)))
    probe = randn(g, 3, 2 * 300, dtype=dtype, scale=8.0)
    make = lambda gn, n: randn(gn, n, 600, dtype=dtype, scale=8.0)  # noqa: E731
    assert_invariant(_rows_run(table.silu_and_mul, probe, make))
    assert_invariant(_rows_run(lambda x: table.clamped_silu_and_mul(x, limit=7.0), probe, make))


def _gate_case(table, score_func):
    g = gen(9)
    bias = torch.randn(64, generator=g) * 0.1 if score_func != "softmax" else None
    kw = dict(top_k=6, score_func=score_func, correction_bias=bias, n_group=8 if bias is not None else 1, topk_group=3 if bias is not None else 1,
              renormalize=score_func != "softmax", routed_scaling_factor=2.5)  # fmt: skip
    probe = randn(g, 2, 64, scale=2.0)
    return _rows_run(lambda x: table.gate(x, **kw), probe, lambda gn, n: randn(gn, n, 64, scale=2.0))


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_gate(score_func, launches):
    from deepinfer_ascend.kernels import moe

    assert_invariant(_gate_case(ops(torch.bfloat16), score_func), (1, 3, 17, 40), launches.watch(moe, "_gate_kernel"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_and_combine(dtype):
    """The probe token's expert rows are its own row, bit for bit, wherever they land; combine sums
    its K rows in the same order wherever they sit among other tokens' rows."""
    table = ops(dtype)
    g = gen(10)
    experts, k, d = 16, 4, 48
    x_probe = randn(g, 1, d, dtype=dtype)
    ids_probe = torch.randperm(experts, generator=g)[:k].to(torch.int32)[None]
    w_probe = torch.rand(1, k, generator=g)
    y_probe = randn(g, k, d, dtype=dtype)  # what the experts return for the probe's k slots

    def run(n):
        gn = gen(1000 + n)
        at = place(n)
        x = torch.cat([randn(gn, at, d, dtype=dtype), x_probe, randn(gn, n - at, d, dtype=dtype)])
        ids = torch.argsort(torch.rand(n + 1, experts, generator=gn), dim=1)[:, :k].to(torch.int32)  # distinct experts per token
        ids[at] = ids_probe[0]
        weights = torch.rand(n + 1, k, generator=gn)
        weights[at] = w_probe[0]
        expert_x, _, row_of_slot = table.dispatch(x, ids, num_experts=experts)
        mine = row_of_slot.reshape(n + 1, k)[at].long()
        expert_out = randn(gn, expert_x.shape[0], d, dtype=dtype)
        expert_out[mine] = y_probe
        out = table.combine(expert_out, weights, row_of_slot)
        return expert_x[mine], out[at]

    assert_invariant(run)


def test_sample_and_bitmask():
    table = ops(torch.float32)
    g = gen(11)
    vocab = 500
    logits = randn(g, 1, vocab, scale=3.0)
    params = (torch.tensor([0.8]), torch.tensor([40], dtype=torch.int32), torch.tensor([0.9]), torch.tensor([0.01]),
              torch.tensor([1234], dtype=torch.int64), torch.tensor([57], dtype=torch.int64))  # fmt: skip
    mask = torch.randint(-(2**31), 2**31 - 1, (1, -(-vocab // 32)), generator=g, dtype=torch.int64).to(torch.int32)

    def run(n):
        gn = gen(1100 + n)
        at = place(n)
        lg = randn(gn, n + 1, vocab, scale=3.0)
        lg[at] = logits[0]
        mk = torch.randint(-(2**31), 2**31 - 1, (n + 1, mask.shape[1]), generator=gn, dtype=torch.int64).to(torch.int32)
        mk[at] = mask[0]
        masked = table.apply_token_bitmask(lg.clone(), mk)
        m = n + 1
        others = (torch.rand(m, generator=gn) * 1.5, torch.randint(0, 100, (m,), generator=gn, dtype=torch.int32), torch.rand(m, generator=gn),
                  torch.rand(m, generator=gn) * 0.1, torch.randint(0, 2**40, (m,), generator=gn), torch.randint(0, 4096, (m,), generator=gn))  # fmt: skip
        for o, p in zip(others, params):
            o[at] = p[0]
        tokens = table.sample(masked, *others)
        return masked[at], tokens[at : at + 1]

    assert_invariant(run, (3,))


def test_rejection_sample():
    """A 3-row request (its first draft accepted) among n one- or two-row requests: its tokens do not change."""
    from deepinfer.ops.sampling import sample

    table = ops(torch.float32)
    g = gen(12)
    vocab = 200
    logits = randn(g, 3, vocab, scale=3.0)
    params = (torch.tensor([0.8]), torch.tensor([0], dtype=torch.int32), torch.tensor([1.0]), torch.tensor([0.0]),
              torch.tensor([4321], dtype=torch.int64), torch.tensor([57], dtype=torch.int64))  # fmt: skip
    drafts = torch.tensor([int(sample(logits[:1], *params)[0]), 5, -1])  # the first draft accepted: the second row decides

    def run(n):
        gn = gen(1200 + n)
        at = place(n)
        counts = torch.randint(1, 3, (n + 1,), generator=gn)
        counts[at] = 3
        cu_rows = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
        first = int(cu_rows[at])
        lg = randn(gn, int(counts.sum()), vocab, scale=3.0)
        lg[first : first + 3] = logits
        dr = torch.randint(0, vocab, (lg.shape[0],), generator=gn)
        dr[first : first + 3] = drafts
        # greedy or temperature-only neighbours (the filters' invariance is test_sample_and_bitmask's)
        m = n + 1
        others = (torch.randint(0, 2, (m,), generator=gn) * (0.5 + torch.rand(m, generator=gn)), torch.zeros(m, dtype=torch.int32), torch.ones(m),
                  torch.zeros(m), torch.randint(0, 2**40, (m,), generator=gn), torch.randint(0, 4096, (m,), generator=gn))  # fmt: skip
        for o, p in zip(others, params):
            o[at] = p[0]
        tokens = table.rejection_sample(lg, dr, cu_rows, *others)
        assert tokens[first] == drafts[0]
        return tokens[first : first + 3]

    assert_invariant(run, (1, 3))


# ---------------------------------------------------------------------------------------------
# DeepSeek-V4's ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_topk(dtype):
    """The probe query (64 visible entries of 70 in its sequence) beside queries of sequences with
    up to 300 entries (the entry table is padded to the widest)."""
    table = ops(dtype)
    heads, d, pool, top_k = 4, 32, 900, 16
    g = gen(12)
    keys = randn(g, pool, d, dtype=dtype)
    q, w = randn(g, 1, heads, d, dtype=dtype), randn(g, 1, heads)
    rows = torch.randperm(pool, generator=g)[:70].to(torch.int32)

    def run(n):
        gn = gen(1200 + n)
        at = place(n)
        seqs = [torch.randperm(pool, generator=gn)[: int(e)].to(torch.int32) for e in torch.randint(1, 301, (n,), generator=gn)]
        seqs.insert(at, rows)
        entry_rows = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=-1)
        visible = torch.tensor([min(len(s), int(v)) for s, v in zip(seqs, torch.randint(1, 301, (n + 1,), generator=gn))], dtype=torch.int32)
        visible[at] = 64
        qs, ws = randn(gn, n + 1, heads, d, dtype=dtype), randn(gn, n + 1, heads)
        qs[at], ws[at] = q[0], w[0]
        ids = table.indexer_topk(qs, ws, keys, entry_rows, torch.arange(n + 1, dtype=torch.int32), visible, top_k=top_k)
        return ids[at]

    assert_invariant(run)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def _compress_case(table, dtype, ratio, overlap):
    d = 40
    width = 2 * d if overlap else d
    g = gen(13)
    mine_kv, mine_gate = randn(g, 3 * ratio, width, dtype=dtype), randn(g, 3 * ratio, width, dtype=dtype)
    bias = randn(g, ratio, width)

    def run(n):
        gn = gen(1300 + n)
        at = place(n)
        kv = torch.cat([randn(gn, at * ratio, width, dtype=dtype), mine_kv, randn(gn, (n - at) * ratio, width, dtype=dtype)])
        gate = torch.cat([randn(gn, at * ratio, width, dtype=dtype), mine_gate, randn(gn, (n - at) * ratio, width, dtype=dtype)])
        starts = torch.arange(n + 3, dtype=torch.int32) * ratio  # the probe's windows: entries at .. at + 2
        prevs = torch.where(torch.rand(n + 3, generator=gn) < 0.5, starts - ratio, torch.full_like(starts, -1)).clamp(min=-1)
        prevs[at : at + 3] = torch.tensor([-1, at * ratio, (at + 1) * ratio], dtype=torch.int32)
        return table.compress_kv(kv, gate, bias, starts, prevs, ratio=ratio, overlap=overlap)[at : at + 3]

    return run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio,overlap", [(4, True), (8, False)])
def test_compress_kv(dtype, ratio, overlap, launches):
    from deepinfer_ascend.kernels import compressor

    assert_invariant(_compress_case(ops(dtype), dtype, ratio, overlap), NEIGHBOURS, launches.watch(compressor, "_compress_kv_kernel"))


def _hc_pre_case(table, dtype):
    n_streams, d = 2, 600  # K = 1200: two reduction segments (the second one partial)
    g = gen(14)
    width = (2 + n_streams) * n_streams
    fn, base, scale = randn(g, width, n_streams * d, scale=0.05), randn(g, width, scale=0.1), torch.tensor([0.9, 1.1, 0.7])
    probe = randn(g, 1, n_streams, d, dtype=dtype)
    make = lambda gn, n: randn(gn, n, n_streams, d, dtype=dtype)  # noqa: E731
    return _rows_run(lambda x: table.hc_pre(x, fn, base, scale, norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=5), probe, make)


def _hc_head_case(table, dtype):
    n_streams, d = 2, 600  # K = 1200: two reduction segments (the second one partial), as _hc_pre_case
    g = gen(16)
    fn, base, scale = randn(g, n_streams, n_streams * d, scale=0.05), randn(g, n_streams, scale=0.1), torch.tensor([0.9])
    norm_weight = 1 + 0.1 * torch.randn(d, generator=g)
    probe = randn(g, 1, n_streams, d, dtype=dtype)
    make = lambda gn, n: randn(gn, n, n_streams, d, dtype=dtype)  # noqa: E731
    return _rows_run(lambda x: table.hc_head(x, fn, base, scale, norm_weight, norm_eps=1e-6, hc_eps=1e-6), probe, make)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_head(dtype, launches):
    """As hc_pre: past the 48 vector cores' worth of token tiles the default kernel takes its fused launch."""
    from deepinfer_ascend.kernels import hyper_connection

    launches.watch(hyper_connection, "_hc_pre_kernel", "_hc_pre_mix_kernel")
    assert_invariant(_hc_head_case(ops(dtype), dtype), (1, 3, 200) if dtype == torch.float32 else (1, 3), launches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_pre_and_hc_post(dtype, launches):
    """200 neighbours make more token tiles than a 910B's 48 vector cores, where the default hc_pre
    switches to its fused launch (the same numpy operations under the interpreter: the launch
    records show the switch)."""
    from deepinfer_ascend.kernels import hyper_connection

    table = ops(dtype)
    launches.watch(hyper_connection, "_hc_pre_kernel", "_hc_pre_mix_kernel")
    assert_invariant(_hc_pre_case(table, dtype), (1, 3, 200) if dtype == torch.float32 else (1, 3), launches)
    n_streams, d = 4, 96
    g = gen(15)
    probe = randn(g, 1, n_streams, d, dtype=dtype)
    make = lambda gn, n: randn(gn, n, n_streams, d, dtype=dtype)  # noqa: E731
    y_probe = randn(g, 1, d, dtype=dtype)
    post, comb = torch.rand(1, n_streams, generator=g) * 2, torch.rand(1, n_streams, n_streams, generator=g)

    def post_run(n):
        gn = gen(1400 + n)
        at = place(n)
        cat = lambda a, b: torch.cat([b[:at], a, b[at:]])  # noqa: E731
        out = table.hc_post(cat(y_probe, randn(gn, n, d, dtype=dtype)), cat(probe, make(gn, n)), cat(post, torch.rand(n, n_streams, generator=gn)),
                            cat(comb, torch.rand(n, n_streams, n_streams, generator=gn)))  # fmt: skip
        return out[at]

    launches.watch(hyper_connection, "_hc_post_kernel")
    assert_invariant(post_run, NEIGHBOURS, launches)


# ---------------------------------------------------------------------------------------------
# the checks can fail: the default kernels' batch-dependent plans


@pytest.mark.parametrize("op", ["linear", "grouped_gemm", "rms_norm", "gate", "hc_pre", "hc_head", "compress_kv"])
def test_the_default_plans_follow_the_batch(op, launches):
    """The same batches through the default kernels: their outputs agree under the interpreter, but
    their tiles (GEMM BLOCK_M, rms_norm's and the gate's BLOCK_T, compress_kv's BLOCK_E) or launch
    path (hc_pre fused vs split) follow the batch, which the launch records catch. mla_decode's and
    sparse_attention's split counts move the bits themselves (the tests above)."""
    from deepinfer_ascend.kernels import compressor, gemm, hyper_connection, moe, norm

    table = ops(torch.float32, deterministic=False)
    run, neighbours = {
        "linear": lambda: (_linear_run(table, "dense", torch.float32), GEMM_NEIGHBOURS),
        "grouped_gemm": lambda: (_grouped_run(table, "dense", torch.float32, "contiguous"), GEMM_NEIGHBOURS),
        "rms_norm": lambda: (_rms_norm_case(table, torch.float32, 256), NEIGHBOURS),
        "gate": lambda: (_gate_case(table, "softmax"), NEIGHBOURS),
        "hc_pre": lambda: (_hc_pre_case(table, torch.float32), (200,)),
        "hc_head": lambda: (_hc_head_case(table, torch.float32), (200,)),
        "compress_kv": lambda: (_compress_case(table, torch.float32, 4, True), NEIGHBOURS),
    }[op]()
    watched = {"linear": (gemm, "_gemm_kernel"), "grouped_gemm": (gemm, "_gemm_kernel"), "rms_norm": (norm, "_rms_norm_kernel"), "gate": (moe, "_gate_kernel"),
               "hc_pre": (hyper_connection, "_hc_pre_kernel"), "hc_head": (hyper_connection, "_hc_pre_kernel"),
               "compress_kv": (compressor, "_compress_kv_kernel")}[op]  # fmt: skip
    launches.watch(*watched)
    with pytest.raises(AssertionError, match="compile-time arguments differ"):
        assert_invariant(run, neighbours, launches)


def test_mla_decode_queries_alone_or_among_s():
    """Speculative verification: S = 6 queries of a request (16 heads) give each query the bits it
    gets alone, as the decode step of its position (seq_len = its position + 1)."""
    fn = ops(torch.bfloat16).mla_decode
    g = gen(17)
    s, heads, c, r, page, n = 6, 16, 64, 16, 128, 300
    pages = -(-n // page)
    cache = randn(g, pages + 1, page, c + r, dtype=torch.bfloat16)
    table = torch.arange(pages, 0, -1, dtype=torch.int32)[None]
    q_nope, q_rope = randn(g, 1, s, heads, c, dtype=torch.bfloat16), randn(g, 1, s, heads, r, dtype=torch.bfloat16)
    together = fn(q_nope, q_rope, cache, table, torch.tensor([n], dtype=torch.int32), softmax_scale=0.1)
    for i in range(s):
        alone = fn(q_nope[:, i : i + 1], q_rope[:, i : i + 1], cache, table, torch.tensor([n - s + i + 1], dtype=torch.int32), softmax_scale=0.1)
        assert torch.equal(together[:, i : i + 1], alone), f"query {i}"
