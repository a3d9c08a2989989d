"""The cuda backend's sample, apply_token_bitmask and rejection_sample (its accept kernel) kernels under the Triton interpreter (CPU).

`sample` must give the reference's tokens bit for bit for equal logits: rows mixing every
parameter (greedy, temperature, top-k, top-p, min-p and their combinations), vocabularies that
are not multiples of the chunk, exact ties, -inf (masked) logits; small chunks force many chunks
per row, small segments and capacities force the second chunk pass and the whole-row fallback, and
every path must agree with the others. Batch invariance: a row's token does not depend on the
other rows. apply_token_bitmask: bit 31 (the sign
bit), vocabularies not a multiple of 32, every float dtype, in place.

tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported, so the kernels run in the
interpreter; with TRITON_INTERPRET=0 on a GPU the same tests run the compiled kernels (inputs built on
the CPU, moved to the GPU, results compared on the CPU). tests/triton_mode.py fails these tests
loudly if the kernels can run neither way.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops import sampling as ref

from triton_mode import kernel_module, require_interpreter_or_gpu

# paths: candidates gathered by the first chunk pass (CANDIDATES) or by the second (CANDIDATES_2)
GREEDY, UNFILTERED, CANDIDATES, FALLBACK, CANDIDATES_2 = 0, 1, 2, 3, 4


class _OnDevice:
    """The kernel module with CPU tensors in and out: they move to the kernels' device (the CPU in
    the interpreter, a GPU when compiled) and back."""

    def __init__(self, module, dev: torch.device):
        self.module, self.dev = module, dev

    def __getattr__(self, name):
        return getattr(self.module, name)

    def _sample(self, *args, paths=None, **kw):
        p = None if paths is None else paths.to(self.dev)
        out = self.module._sample(*[a.to(self.dev) for a in args], paths=p, **kw)
        if paths is not None:
            paths.copy_(p.cpu())
        return out.cpu()

    def sample(self, *args):
        return self.module.sample(*[a.to(self.dev) for a in args]).cpu()

    def apply_token_bitmask(self, logits, bitmask):
        if self.dev.type == "cpu":
            return self.module.apply_token_bitmask(logits, bitmask)
        on_dev = logits.to(self.dev)
        got = self.module.apply_token_bitmask(on_dev, bitmask.to(self.dev))
        assert got.data_ptr() == on_dev.data_ptr()  # in place
        return logits.copy_(on_dev.cpu())


@pytest.fixture(scope="module")
def k():
    dev = require_interpreter_or_gpu()
    return _OnDevice(kernel_module("deepinfer_cuda.kernels.sampling"), dev)


def _rows(B: int, V: int, seed: int, kind: str):
    g = torch.Generator().manual_seed(seed)
    if kind == "peaked":
        logits = torch.randn(B, V, generator=g) * 2 + torch.randn(B, V, generator=g).pow(4)
    elif kind == "flat":
        logits = torch.randn(B, V, generator=g) * 0.3
    elif kind == "ties":
        logits = (torch.randn(B, V, generator=g) * 2).round()
    else:  # masked: half the vocabulary forbidden
        logits = torch.randn(B, V, generator=g) * 3
        logits[torch.rand(B, V, generator=g) < 0.5] = float("-inf")
    temperature = torch.where(torch.rand(B, generator=g) < 0.15, 0.0, torch.rand(B, generator=g) * 1.5 + 0.2)
    top_k = torch.where(torch.rand(B, generator=g) < 0.5, torch.randint(1, 200, (B,), generator=g), 0).to(torch.int32)
    top_p = torch.where(torch.rand(B, generator=g) < 0.5, torch.rand(B, generator=g) * 0.9 + 0.05, 1.0)
    min_p = torch.where(torch.rand(B, generator=g) < 0.3, torch.rand(B, generator=g) * 0.3, 0.0)
    seeds = torch.randint(-(2**62), 2**62, (B,), generator=g)
    positions = torch.randint(0, 1 << 20, (B,), generator=g)
    return [logits, temperature, top_k, top_p, min_p, seeds, positions]


def _every_parameter_rows(V: int = 1003):
    """One row per combination the docstring names, on the same logits (ties included)."""
    g = torch.Generator().manual_seed(V)
    base = torch.randn(V, generator=g) * 2
    base[7] = base[11] = base.max() + 1.0  # a tie at the top: greedy takes index 7
    base[V - 5 :] = float("-inf")
    rows = [
        # temperature, top_k, top_p, min_p
        (0.0, 0, 1.0, 0.0), (0.0, 5, 0.5, 0.3),  # greedy: filters ignored
        (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0),  # temperature only
        (1.0, 1, 1.0, 0.0), (1.0, 2, 1.0, 0.0), (1.0, 20, 1.0, 0.0), (1.0, V, 1.0, 0.0), (1.0, -1, 1.0, 0.0),
        (1.0, 0, 0.9, 0.0), (1.3, 0, 0.5, 0.0), (1.0, 0, 0.0, 0.0),
        (1.0, 0, 1.0, 0.1), (0.5, 0, 1.0, 0.5), (1.0, 0, 1.0, 1.0),
        (1.0, 50, 0.9, 0.0), (0.8, 10, 0.95, 0.05), (2.0, 30, 1.0, 0.2), (1.0, 0, 0.8, 0.1), (0.05, 3, 0.3, 0.0),
    ]
    B = len(rows)
    logits = base.repeat(B, 1)
    t, kk, p, m = (torch.tensor(c) for c in zip(*rows))
    seeds, positions = torch.arange(B, dtype=torch.int64) * 7919 - 3, torch.arange(B, dtype=torch.int64) + 100
    return [logits, t.float(), kk.to(torch.int32), p.float(), m.float(), seeds, positions]


def test_every_parameter_combination(k):
    args = _every_parameter_rows()
    paths = torch.empty(len(args[0]), dtype=torch.int32)
    got = k._sample(*args, paths=paths)
    assert got.dtype == torch.int64
    assert torch.equal(got, ref.sample(*args))
    assert got[0] == 7 and got[1] == 7  # greedy: lowest index among the maxima
    assert {GREEDY, UNFILTERED} <= set(paths.tolist()) and {CANDIDATES, CANDIDATES_2} & set(paths.tolist())


@pytest.mark.parametrize("kind", ["peaked", "flat", "ties", "masked"])
def test_random_rows_small_tiles(k, kind):
    # V = 1003 in 4 chunks of 256, a 256-candidate capacity (flat rows overflow it)
    args = _rows(12, 1003, seed=["peaked", "flat", "ties", "masked"].index(kind) + 20, kind=kind)
    paths = torch.empty(12, dtype=torch.int32)
    got = k._sample(*args, block=256, cap=256, tile_c=64, paths=paths)
    assert torch.equal(got, ref.sample(*args)), (got, ref.sample(*args), paths)


def test_default_tiles_and_a_large_vocabulary(k):
    args = _rows(6, 9000, seed=5, kind="peaked")
    args[1][:] = torch.tensor([0.0, 1.0, 0.8, 1.0, 1.2, 0.6])
    args[2][:] = torch.tensor([0, 0, 40, 0, 5, 0], dtype=torch.int32)
    args[3][:] = torch.tensor([1.0, 1.0, 0.9, 0.9, 1.0, 0.5])
    args[4][:] = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.1, 0.05])
    assert torch.equal(k.sample(*args), ref.sample(*args))


def test_fallback_agrees_with_candidates(k):
    # room for 32 candidates: most filtered rows take the whole-row fallback.
    args = _rows(8, 200, seed=12, kind="peaked")
    args[1] = args[1].clamp(min=0.3)  # no greedy rows
    wide, narrow = torch.empty(8, dtype=torch.int32), torch.empty(8, dtype=torch.int32)
    a = k._sample(*args, block=256, cap=256, tile_c=64, paths=wide)
    b = k._sample(*args, block=32, cap=32, tile_c=32, paths=narrow)
    assert torch.equal(a, b) and torch.equal(a, ref.sample(*args))
    assert CANDIDATES in wide.tolist() and FALLBACK in narrow.tolist()


@pytest.mark.parametrize("kind", ["peaked", "ties", "masked"])
def test_chunkings_agree(k, kind):
    # The same rows cut into 1, 4 and 16 chunks, with 16 or 32 group maxima per chunk and
    # segments of 8 to 64 slots (overflowing ones push rows to the second chunk pass): every
    # chunking gives the reference's tokens.
    args = _rows(8, 1003, seed=40 + ["peaked", "ties", "masked"].index(kind), kind=kind)
    args[1][:3] = torch.tensor([0.9, 1.1, 0.7])  # no greedy rows among the filtered ones below
    args[2][:3] = torch.tensor([10, 30, 0], dtype=torch.int32)
    args[3][:3] = torch.tensor([0.9, 1.0, 0.8])
    want = ref.sample(*args)
    seen = set()
    for block, n_groups, seg in ((1024, 32, 64), (256, 32, 16), (64, 16, 8)):
        paths = torch.empty(8, dtype=torch.int32)
        got = k._sample(*args, block=block, n_groups=n_groups, seg=seg, cap=256, tile_c=64, paths=paths)
        assert torch.equal(got, want), (block, got, want, paths)
        seen |= set(paths.tolist())
    assert {CANDIDATES, CANDIDATES_2} <= seen


@pytest.mark.parametrize("programs", [8, 24])
def test_second_pass_programs_sharing_a_rows_chunks(k, monkeypatch, programs):
    # 8 rows in 16 chunks: 8 programs (one a row) or 24 (3 a row, chunks g, g + 3, ...) do the
    # second chunk pass that 128 did; the same tokens, overflowed rows among them.
    args = _rows(8, 1003, seed=42, kind="masked")
    args[1][:3] = torch.tensor([0.9, 1.1, 0.7])
    args[2][:3] = torch.tensor([10, 30, 0], dtype=torch.int32)
    args[3][:3] = torch.tensor([0.9, 1.0, 0.8])
    monkeypatch.setattr(k, "PASS2_PROGRAMS", programs)
    paths = torch.empty(8, dtype=torch.int32)
    got = k._sample(*args, block=64, n_groups=16, seg=8, cap=256, tile_c=64, paths=paths)
    assert torch.equal(got, ref.sample(*args)), (got, paths)
    assert CANDIDATES_2 in paths.tolist()


@pytest.mark.parametrize("programs", [8, 24])
def test_first_pass_programs_sharing_a_rows_chunks(k, programs):
    # greedy (one with filters set, which greedy ignores), temperature-only and filtered rows, 16
    # chunks each, done by 8 first-pass programs (one a row: each loops over its row's 16 chunks) or
    # 24 (chunks g, g + 3, ...): the reference's tokens either way.
    args = _rows(8, 1003, seed=44, kind="ties")
    args[1][:4] = torch.tensor([0.0, 0.0, 0.8, 1.3])
    args[2][:4] = torch.tensor([0, 5, 0, 0], dtype=torch.int32)
    args[3][:4] = torch.tensor([1.0, 0.5, 1.0, 1.0])
    args[4][:4] = 0.0
    args[1][4:] = torch.tensor([0.9, 1.1, 0.7, 1.0])
    args[2][4:] = torch.tensor([10, 30, 0, 0], dtype=torch.int32)
    args[3][4:] = torch.tensor([0.9, 1.0, 0.8, 1.0])
    args[4][7] = 0.1
    got = k._sample(*args, block=64, n_groups=16, seg=8, cap=256, tile_c=64, pass1_programs=programs)
    assert torch.equal(got, ref.sample(*args)), got


def test_deepseek_vocabulary_paths(k):
    # V = 129280 in chunks of 4096 with 64 group maxima each (the H200's configuration): top-k (with
    # top-p, with min-p) gathers in the first chunk pass, top-p alone in the second; peaked rows.
    args = _rows(4, 129280, seed=9, kind="peaked")
    args[0] = args[0] * 2
    args[1][:] = torch.tensor([1.0, 0.8, 1.0, 0.6])
    args[2][:] = torch.tensor([50, 20, 0, 0], dtype=torch.int32)
    args[3][:] = torch.tensor([0.9, 1.0, 0.9, 1.0])
    args[4][:] = torch.tensor([0.0, 0.05, 0.0, 0.1])
    paths = torch.empty(4, dtype=torch.int32)
    got = k._sample(*args, block=4096, n_groups=64, seg=256, cap=4096, tile_c=128, paths=paths)
    assert torch.equal(got, ref.sample(*args))
    assert paths.tolist() == [CANDIDATES, CANDIDATES, CANDIDATES_2, CANDIDATES]


def test_batch_invariance(k):
    args = _rows(6, 400, seed=3, kind="ties")
    whole = k._sample(*args, block=256)
    perm = torch.randperm(6, generator=torch.Generator().manual_seed(0))
    shuffled = k._sample(*[a[perm] for a in args], block=256)
    assert torch.equal(shuffled, whole[perm])
    for i in (0, 5):
        assert k._sample(*[a[i : i + 1] for a in args], block=256).item() == whole[i].item()


def test_all_forbidden_row_and_bf16_logits(k):
    args = _rows(3, 100, seed=1, kind="peaked")
    args[0][1] = float("-inf")  # every token forbidden: the reference's argmax over -inf is 0
    args[0] = args[0].to(torch.bfloat16)
    assert torch.equal(k.sample(*args), ref.sample(*args))


def test_all_greedy_is_the_argmax_whatever_the_parameters(k):
    """all_greedy (the caller's promise, eager steps of greedy requests): two launches, every row's token the reference's
    greedy one (lowest index on ties; an all -inf row 0) although the rows' parameters ask for sampling; small chunks too."""
    for kind, V, block in (("ties", 1003, 256), ("masked", 129280, None), ("peaked", 3000, 256)):
        args = _rows(6, V, seed=5, kind=kind)
        args[0][2] = float("-inf")
        greedy = [args[0], torch.zeros(6), *args[2:]]
        want = ref.sample(*greedy)
        assert torch.equal(want, args[0].argmax(-1))
        assert torch.equal(ref.sample(*args, all_greedy=True), want)
        kw = {} if block is None else {"block": block}
        paths = torch.empty(6, dtype=torch.int32)
        assert torch.equal(k._sample(*args, all_greedy=True, paths=paths, **kw), want)
        assert paths.tolist() == [GREEDY] * 6


# ---------------------------------------------------------------------------------------------- apply_token_bitmask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V", [33, 1003, 64])
def test_bitmask(k, dtype, V):
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(3, V, generator=g).to(dtype)
    words = torch.randint(-(2**31), 2**31, (3, (V + 31) // 32), generator=g, dtype=torch.int64).to(torch.int32)
    words[0, 0] = -(2**31)  # only bit 31 set
    words[1, :] = -1  # everything allowed
    want = ref.apply_token_bitmask(logits.clone(), words)
    got = k.apply_token_bitmask(logits, words)
    assert got.data_ptr() == logits.data_ptr()  # in place
    assert torch.equal(got, want)


def test_bitmask_shape_check(k):
    with pytest.raises(ValueError):
        k.apply_token_bitmask(torch.zeros(2, 40), torch.zeros(2, 1, dtype=torch.int32))


# ---------------------------------------------------------------------------------------------- registration and fallback


def test_registrations(k):
    from deepinfer.registry import all_ops, check_signature

    ops = all_ops()
    assert {r.op for r in k.REGISTRATIONS} == {"sample", "apply_token_bitmask"}
    for r in k.REGISTRATIONS:
        check_signature(ops[r.op], r.fn, "cuda")


# ---------------------------------------------------------------------------------------------- rejection_sample


@pytest.fixture(scope="module")
def rk():
    dev = require_interpreter_or_gpu()
    return kernel_module("deepinfer_cuda.kernels.rejection_sampling"), dev


def test_rejection_sample_accept_kernel(rk, monkeypatch):
    """The accept kernel over many requests, one of 21 rows (more than a 16-row step), drafts equal to
    the drawn tokens for a prefix of each request, drafts off in the high 32 bits only. The rows'
    tokens come from the reference's sample (the sample kernel is tested above, the op by conformance)."""
    from types import SimpleNamespace

    from deepinfer.ops.rejection_sampling import rejection_sample as ref_rejection

    module, dev = rk
    def on_cpu(logits, **kw):
        return ref.sample(logits.cpu(), **{k: t.cpu() for k, t in kw.items()}).to(dev)

    monkeypatch.setattr(module, "_sampling", SimpleNamespace(sample=on_cpu))
    g = torch.Generator().manual_seed(21)
    counts = torch.tensor([21] + [1 + i % 4 for i in range(29)])
    B, T, V = len(counts), int(counts.sum()), 40
    kw = dict(zip(["logits", "temperature", "top_k", "top_p", "min_p", "seeds", "positions"], _rows(B, V, seed=21, kind="peaked")))
    kw["logits"] = torch.randn(T, V, generator=g) * 3
    kw["cu_rows"] = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    owner = torch.repeat_interleave(torch.arange(B), counts)
    index = torch.arange(T) - kw["cu_rows"][:-1].long()[owner]
    per_row = [kw[k][owner] for k in ("temperature", "top_k", "top_p", "min_p", "seeds")]
    drawn = ref.sample(kw["logits"], *per_row, kw["positions"][owner] + index)
    accepted = torch.randint(0, 5, (B,), generator=g)
    accepted[0] = 18
    off = torch.where(owner % 3 == 0, (index % 2 + 1) * 2**32, 1)
    kw["draft_tokens"] = torch.where(index < accepted[owner], drawn, drawn + off)
    got = module.rejection_sample(**{k: v.to(dev) for k, v in kw.items()}).cpu()
    assert got.dtype == torch.int64 and torch.equal(got, ref_rejection(**kw))
    assert (got[:21] != -1).sum() == 19 and (got == -1).any()


def test_rejection_sample_registration(rk):
    from deepinfer.registry import all_ops, check_signature

    module, _ = rk
    assert [(r.op, r.batch_invariant) for r in module.REGISTRATIONS] == [("rejection_sample", True)]
    check_signature(all_ops()["rejection_sample"], module.rejection_sample, "cuda")
