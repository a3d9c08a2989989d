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

import pytest
import torch

from ascend.vector_checks import CHIPS, run_frontend, sample_inputs, ties_and_minus_inf_rows

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
    kw = sample_inputs(gen(100), V, ROWS, masked=MASKED)
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
    kw = ties_and_minus_inf_rows(gen(3), finite_at=523)
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
    flags = same_tokens(sample_inputs(gen(9), V, rows, masked=(0, 1)), CAND_R=1)
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
    batch = sample_inputs(gen(22), V, [ROWS[j % 3] for j in range(49)])
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


@pytest.mark.parametrize("chip", CHIPS)
def test_chunked_kernels_pass_the_triton_front_end(chip):
    """The chunked kernels build to TTIR (CUDA target, no device needed) with the chip's tiles, for
    one row and for the most chunks (the builds are in vector_checks.py, with the other families')."""
    run_frontend("sampling_chunked", chip)
