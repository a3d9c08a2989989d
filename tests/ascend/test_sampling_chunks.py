"""The ascend `sample` kernel's small-batch path (each row cut into chunks over several programs)
under the Triton interpreter: every row's token equals the row path's (one program per row) and the
reference's, bit for bit, so the op stays batch-invariant although the path follows the batch.
Greedy, temperature only, top-k, top-p, min-p, their combinations, -inf logits and ties; the
whole-row fallbacks forced with tiny candidate segments; a row alone (chunked) and inside a batch
large enough for the row path; and the chunked kernels through Triton's real front end (the
interpreter is lenient where a compiler is not).

TRITON_INTERPRET=1 comes from tests/conftest.py; the simulated chip is the default 910B (48 vector
cores) unless a test sets DEEPINFER_ASCEND_SIM_CHIP (conftest.py here clears a chip set earlier).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch

V = 2000  # 8 chunks of 256 logits a row for B = 1, 2 and 5 on the simulated 910B
# (temperature, top_k, top_p, min_p)
ROWS = [
    (0.0, 0, 1.0, 0.0),  # greedy
    (1.0, 0, 1.0, 0.0),  # temperature only
    (0.05, 0, 1.0, 0.0),
    (0.7, 20, 1.0, 0.0),  # top-k
    (1.0, 1, 1.0, 0.0),
    (1.0, 0, 0.9, 0.0),  # top-p
    (0.6, 0, 0.5, 0.0),
    (1.0, 0, 0.01, 0.0),
    (1.0, 0, 1.0, 0.1),  # min-p
    (0.8, 50, 0.9, 0.05),  # combined
    (1.3, 700, 0.8, 0.0),
    (1.0, 1999, 0.99, 0.0),
    (0.0, 5, 0.5, 0.2),  # greedy ignores the filters
]
MASKED = (3, 5, 8)  # rows with half their logits -inf


@pytest.fixture(autouse=True)
def simulated_910b(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ASCEND_SIM_CHIP", "910B")  # 48 vector cores: the chunk counts below


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def inputs(g, rows, vocab=V, masked=(), scale=3.0):
    B = len(rows)
    logits = scale * torch.randn(B, vocab, generator=g)
    for r in masked:
        logits[r, torch.rand(vocab, generator=g) < 0.5] = float("-inf")
    t, k, p, m = zip(*rows)
    return dict(
        logits=logits,
        temperature=torch.tensor(t, dtype=torch.float32),
        top_k=torch.tensor(k, dtype=torch.int32),
        top_p=torch.tensor(p, dtype=torch.float32),
        min_p=torch.tensor(m, dtype=torch.float32),
        seeds=torch.randint(-(2**62), 2**62, (B,), generator=g),
        positions=torch.randint(0, 2**20, (B,), generator=g),
    )


def row_path(kw, **sizes):
    """The row path's tokens (one program per row), checked against the reference's."""
    from deepinfer.ops.sampling import sample as ref_sample
    from deepinfer_ascend.kernels import sampling as S
    from deepinfer_ascend.kernels import sampling_math as M

    paths = torch.zeros(kw["logits"].shape[0], dtype=torch.int32)
    tokens = S._sample(**kw, paths=paths, chunks=0, **sizes)
    ref = ref_sample(**kw)
    assert tokens.dtype == torch.int64 and torch.equal(tokens, ref), (tokens.tolist(), ref.tolist(), paths.tolist())
    assert not any(p & M.PATH_CHUNKED for p in paths.tolist()), paths.tolist()
    return tokens


def chunked(kw, chunks=None, **sizes):
    """The chunked path's tokens (the automatic chunk count, or `chunks` forced) and PATH_* flags."""
    from deepinfer_ascend.kernels import sampling as S
    from deepinfer_ascend.kernels import sampling_math as M

    paths = torch.zeros(kw["logits"].shape[0], dtype=torch.int32)
    tokens = S._sample(**kw, paths=paths, chunks=chunks, **sizes)
    flags = paths.tolist()
    assert all(p & M.PATH_CHUNKED for p in flags), flags
    return tokens, flags


def same_tokens(kw, chunks=None, **sizes):
    """The chunked path's tokens equal the row path's and the reference's; returns its flags."""
    want = row_path(kw, **sizes)
    got, flags = chunked(kw, chunks, **sizes)
    assert got.dtype == torch.int64 and torch.equal(got, want), (got.tolist(), want.tolist(), flags)
    return flags


@functools.lru_cache(maxsize=None)
def every_kind_of_row():
    """ROWS with their row-path tokens (equal to the reference's), computed once."""
    kw = inputs(gen(100), ROWS, masked=MASKED)
    return kw, row_path(kw)


@pytest.mark.parametrize("B", [1, 2, 5])
def test_chunked_rows_equal_the_row_path_and_the_reference(B):
    """Every kind of row, B rows a call (8 chunks a row): the tokens of the whole batch through
    the row path, which equal the reference's."""
    kw, want = every_kind_of_row()
    for start in range(0, len(ROWS), B):
        got, flags = chunked({n: v[start : start + B] for n, v in kw.items()})
        assert torch.equal(got, want[start : start + B]), (start, got.tolist(), want[start : start + B].tolist(), flags)


def test_a_mixed_batch_over_uneven_chunks():
    """All the kinds of rows in one batch, forced into 3 chunks of 768 logits (the last 464) with
    512-logit tiles: a partial tile at every chunk's end, rows sharing programs."""
    from deepinfer_ascend.kernels import sampling_math as M

    kw, want = every_kind_of_row()
    got, flags = chunked(kw, chunks=3)
    assert torch.equal(got, want), (got.tolist(), want.tolist(), flags)
    seen = 0
    for p in flags:
        seen |= p
    need = M.PATH_TOPK_CANDIDATES | M.PATH_TOPP_CANDIDATES | M.PATH_TOKEN_CANDIDATES
    assert seen & need == need, flags


def test_ties_and_rows_of_minus_inf():
    """Duplicated maxima (greedy and top-k = 1 pick among them by index and noise), ties at the
    top-k threshold, a row of -inf, a row with one finite logit, on integer logits."""
    vocab = 700
    logits = torch.randint(-3, 4, (6, vocab), generator=gen(3)).float()
    logits[4] = float("-inf")
    logits[5] = float("-inf")
    logits[5, 523] = 0.5
    kw = dict(
        logits=logits,
        temperature=torch.tensor([0.0, 1.0, 1.0, 0.9, 1.0, 1.0]),
        top_k=torch.tensor([0, 1, 50, 3, 4, 2], dtype=torch.int32),
        top_p=torch.tensor([1.0, 1.0, 1.0, 0.6, 0.5, 0.9]),
        min_p=torch.tensor([0.0, 0.0, 0.0, 0.0, 0.1, 0.0]),
        seeds=torch.arange(6, dtype=torch.int64),
        positions=torch.arange(6, dtype=torch.int64),
    )
    want = row_path(kw)
    got, flags = chunked(kw)
    assert torch.equal(got, want), (got.tolist(), want.tolist(), flags)
    for r in (0, 1, 5):
        got, flags = chunked({n: v[r : r + 1] for n, v in kw.items()})
        assert got[0] == want[r], (r, got.tolist(), want.tolist(), flags)


def test_overflowing_segments_take_the_whole_row_searches():
    """One candidate slot per lane: the segments overflow, so the top-k and top-p thresholds come
    from the whole-row searches and the token from the chunked token pass."""
    from deepinfer_ascend.kernels import sampling_math as M

    rows = [ROWS[i] for i in (3, 5, 10, 11)]
    flags = same_tokens(inputs(gen(9), rows, masked=(0, 1)), CAND_R=1)
    assert any(p & M.PATH_TOPK_ROWS for p in flags) and any(p & M.PATH_TOPP_ROWS for p in flags), flags
    assert any(not p & M.PATH_TOKEN_CANDIDATES for p in flags), flags


def test_a_row_alone_and_in_a_large_batch_get_the_same_token():
    """Batch invariance across the two paths: a row alone is chunked; among 49 rows (more than
    half the 48 vector cores; greedy and temperature-only neighbours) it takes the row path. Its
    token does not change."""
    from deepinfer_ascend.kernels import sampling as S
    from deepinfer_ascend.kernels import sampling_math as M

    probes = [1, 3, 6, 8, 9]
    kw, _ = every_kind_of_row()
    batch = inputs(gen(22), [ROWS[j % 3] for j in range(49)])
    places = [0, 11, 23, 36, 48]
    for i, at in zip(probes, places):
        for n, v in kw.items():
            batch[n][at] = v[i]
    paths = torch.zeros(49, dtype=torch.int32)
    in_batch = S._sample(**batch, paths=paths)
    assert not any(p & M.PATH_CHUNKED for p in paths.tolist()), paths.tolist()
    for i, at in zip(probes, places):
        alone, flags = chunked({n: v[i : i + 1] for n, v in kw.items()})
        assert alone[0] == in_batch[at], (i, alone.tolist(), in_batch[at].item(), flags)


def test_chunked_kernels_pass_the_triton_front_end():
    """The chunked kernels build to TTIR (CUDA target, no device needed) with both simulated chips' tiles."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, os.path.abspath(__file__), "frontend"], env=env, capture_output=True, text=True, timeout=600)
    if "NO CUDA BACKEND" in res.stdout:
        pytest.fail("this Triton has no CUDA backend to build TTIR with; the test extra's triton has one")
    assert res.returncode == 0, f"stdout:\n{res.stdout[-4000:]}\nstderr:\n{res.stderr[-8000:]}"
    assert "FRONT END OK" in res.stdout, res.stdout[-4000:]


def frontend() -> None:
    """Build every chunked kernel with the sizes the wrapper picks for one row and for the most
    chunks, on each simulated chip."""
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
    from deepinfer.triton_common import next_power_of_2
    from deepinfer_ascend.kernels import sampling as S
    from deepinfer_ascend.kernels import sampling_chunked as C

    device.interpreting = lambda: True  # the simulated chip's sizes, while Triton compiles for real
    options = backend.parse_options({})

    def build(fn, constexprs, **signature):
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        sig = {**signature, **{name: "constexpr" for name in constexprs}}
        ASTSource(fn=fn, signature=sig, constexprs=constexprs).make_ir(
            target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context
        )

    i32, pf, pi = "i32", "*fp32", "*i32"
    rules = dict(logits_ptr=pf, stride_row=i32, temp_ptr=pf, topk_ptr=pi, topp_ptr=pf, minp_ptr=pf)
    hash_in = dict(seed_ptr=pi, pos_ptr=pi)
    items = dict(B=i32, V=i32, CH=i32, NCH=i32)
    rows = dict(B=i32, V=i32, NCH=i32)
    for chip in ("910B", "950"):
        os.environ["DEEPINFER_ASCEND_SIM_CHIP"] = chip
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
    print("FRONT END OK", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] != ["frontend"]:
        sys.exit("usage: python test_sampling_chunks.py frontend")
    frontend()
