"""The SM90 Gluon prefill (FlashAttention-3's schedule; registered for nothing until it has run on a GPU): on a CPU, which
calls it serves, that it is not registered, its fallback to the tl kernel, and its schedule (the kernel's prologue in
Python, `program_plan`, and the tile loop emulated in torch) against the op's reference; on an SM90 GPU
(TRITON_INTERPRET=0 pytest tests/cuda/test_prefill_gluon.py), its output against the reference (deepinfer.ops) on var-len
causal batches, 16 and 128 heads, cached prefixes, 192/128 and 128/128 heads, within the conformance tolerance for bf16
and a tighter bound. Its tunings (`Tuning`: key tile and ring depth, the register split, the persistent kernel of
prefill_gluon_persistent.py; all but the default not yet run on a GPU): on a CPU what each needs, the persistent
kernel's work order (its tl sorting kernel interpreted against `lpt_order`, every (query tile, head) an item exactly
once) and its barrier protocol (modelled in Python, run in random interleavings), and the sweep's table; on the GPU
each against the reference and, where it keeps the default's key tile, the default's bits.
Its compilation for sm90 is tests/cuda/test_compile_check.py's (`bench compile --case "prefill gluon"`)."""

from __future__ import annotations

import pytest
import torch
from mbarrier_model import Barrier

import deepinfer_cuda.kernels.prefill_gluon as g  # (imports without Gluon too: GLUON_IMPORT_ERROR says why, below)
import deepinfer_cuda.kernels.prefill_gluon_persistent as gp
from deepinfer.ops.attention import prefill as ref_prefill
from deepinfer.registry import OPS, check_signature

from triton_mode import GPU, mode

if g.GLUON_IMPORT_ERROR is not None:
    pytest.skip(f"no Gluon for Hopper in this Triton (runs with Triton >= 3.5: CI, the GPU machine): {g.GLUON_IMPORT_ERROR}", allow_module_level=True)


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _call(tokens=256, keys=512, heads=16, d_qk=192, d_v=128, dtype=torch.bfloat16, scale=0.07, window=None, **tensors):
    call = dict(q=_meta(tokens, heads, d_qk, dtype=dtype), k=_meta(keys, heads, d_qk, dtype=dtype), v=_meta(keys, heads, d_v, dtype=dtype),
                softmax_scale=scale, sliding_window=window)
    call.update(tensors)
    return call


def _batch(q_lens, prefixes, heads, d_qk, d_v, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    k_lens = [q + p for q, p in zip(q_lens, prefixes)]
    cu_q = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + k_lens).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), heads, d_qk, generator=gen).bfloat16()
    k = torch.randn(sum(k_lens), heads, d_qk, generator=gen).bfloat16()
    v = torch.randn(sum(k_lens), heads, d_v, generator=gen).bfloat16()
    return tuple(x.to(device) for x in (q, k, v, cu_q, cu_k))


def _check(out, q, k, v, cu_q, cu_k, scale):
    """The conformance tolerance for bf16 (atol * the longest request's keys + rtol * |ref|), and a tighter bound that a
    key masked wrongly in a short request breaks: |err| <= 1e-2 (1 + |ref|), relative norm error <= 5e-3."""
    ref = ref_prefill(q.double(), k.double(), v.double(), cu_q, cu_k, softmax_scale=scale)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape and torch.isfinite(out).all()
    spec = OPS["prefill"]
    tol = spec.tolerance(torch.bfloat16)
    err = (out.double() - ref).abs()
    bound = tol.atol * spec.reduction_length({"cu_seqlens_k": cu_k}) + tol.rtol * ref.abs()
    assert bool((err <= bound).all()), f"conformance: max err {float(err.max()):.3g}, worst err/bound {float((err / bound).max()):.3g}"
    assert bool((err <= 1e-2 * (1 + ref.abs())).all()), f"max err {float(err.max()):.3g}"
    assert float((out.double() - ref).norm() / ref.norm()) <= 5e-3


# (q_lens, prefixes): one token, block edges (63/64/65, 127/128/129), long requests, cached prefixes across tile edges
# (5, 64, 100, 1000), an empty request (no queries, with and without keys)
BATCHES = [
    ([1, 63, 64, 65, 127, 128, 129, 300], [0] * 8),
    ([1, 100, 256, 77, 200], [5, 1000, 128, 3000, 64]),
    ([70, 0, 130, 0, 40], [0, 0, 60, 50, 200]),
]


def test_calls_it_does_not_serve_say_why():
    for kw in (dict(), dict(heads=128), dict(heads=1), dict(d_qk=128), dict(tokens=1, keys=1)):
        assert g.not_served(**_call(**kw)) is None, kw
    assert "bfloat16" in g.not_served(**_call(dtype=torch.float16))
    assert "bfloat16" in g.not_served(**_call(dtype=torch.float32))
    assert "Dqk = 64" in g.not_served(**_call(d_qk=64, d_v=64))
    assert "Dv = 64" in g.not_served(**_call(d_v=64))
    assert "sliding window" in g.not_served(**_call(window=128))
    assert "softmax_scale" in g.not_served(**_call(scale=0.0))
    assert "H = 65536" in g.not_served(**_call(heads=65536, tokens=1, keys=1))
    strided = _meta(512, 16, 256)[:, :, :192]  # heads not packed: no [T, H * D] view
    assert "k is not" in g.not_served(**_call(k=strided))
    assert "v is not" in g.not_served(**_call(v=_meta(512, 16, 2, 128)[:, :, 0]))
    cpu = _call()
    cpu["q"] = torch.zeros(4, 16, 192, dtype=torch.bfloat16)
    assert "not on a GPU" in g.not_served(**cpu)


def test_the_backend_option_chooses_it_on_sm90_and_it_has_the_ops_signature(monkeypatch):
    """auto (the default) and gluon take it on SM90 (deterministic mode keeps the tl kernel's batch-invariant one); tl and
    other GPUs the tl kernel; without Gluon for Hopper auto is the tl kernel and gluon an error saying why."""
    from deepinfer.registry import Registry, RegistryError, ResolveContext
    from deepinfer_cuda.kernels import prefill as tl_prefill

    check_signature(OPS["prefill"], g.prefill, "cuda")

    def chosen(options, cap=(9, 0), deterministic=False):
        monkeypatch.setattr(g, "capability", lambda device: cap)
        registry = Registry()
        registry.register_all("cuda", tl_prefill.REGISTRATIONS + g.REGISTRATIONS)
        ctx = ResolveContext("cuda", dtype=torch.bfloat16, device=torch.device("cuda", 0), options=options, deterministic=deterministic)
        return registry.choose(ctx, "prefill").fn

    gluon = {"prefill_path": "gluon"}
    assert chosen(gluon) is g.prefill
    assert chosen({}) is chosen({"prefill_path": "auto"}) is g.prefill
    assert chosen({"prefill_path": "tl"}) is chosen({}, cap=(10, 0)) is tl_prefill.prefill
    assert chosen(gluon, cap=(10, 0)) is tl_prefill.prefill
    assert chosen(gluon, deterministic=True) is chosen({}, deterministic=True) is tl_prefill.prefill_invariant
    monkeypatch.setattr(g, "GLUON_IMPORT_ERROR", "ImportError: no hopper")
    assert chosen({}) is tl_prefill.prefill
    with pytest.raises(RegistryError, match="prefill_path=gluon, but Triton .* no usable Gluon for Hopper"):
        chosen({"prefill_path": "gluon"})


@pytest.mark.parametrize("q_lens, prefixes", BATCHES)
def test_the_grid_gives_every_query_tile_one_program_covering_its_causal_range(q_lens, prefixes):
    """The kernel's prologue (`program_plan`) over the grid: each request's ceil(q_len / 128) query tiles get one program
    each; a program's key tiles reach its last query's position and no further; its mask-free tiles are visible to its
    first query."""
    k_lens = [q + p for q, p in zip(q_lens, prefixes)]
    cu_q = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    cu_k = [0, *torch.tensor(k_lens).cumsum(0).tolist()]
    slots, heads = g.grid(cu_q[-1], len(q_lens), 16)
    assert heads == 16
    plans = [p for p in (g.program_plan(cu_q, cu_k, pid) for pid in range(slots)) if p is not None]
    assert sorted((p.request, p.m_blk) for p in plans) == [(b, m) for b, n in enumerate(q_lens) for m in range(-(-n // g.BLOCK_M))]
    for p in plans:
        assert (p.q_start, p.q_len, p.k_start, p.k_len) == (cu_q[p.request], q_lens[p.request], cu_k[p.request], k_lens[p.request])
        first_pos = p.k_len - p.q_len + p.m_blk * g.BLOCK_M
        last_pos = p.k_len - p.q_len + min((p.m_blk + 1) * g.BLOCK_M, p.q_len) - 1
        assert (p.num_tiles - 1) * g.BLOCK_N <= last_pos < p.num_tiles * g.BLOCK_N
        assert p.n_full * g.BLOCK_N - 1 <= first_pos < (p.n_full + 1) * g.BLOCK_N - 1
    # the heaviest tile of a request first
    firsts = {}
    for pid in range(slots):
        p = g.program_plan(cu_q, cu_k, pid)
        if p is not None:
            firsts.setdefault(p.request, p.m_blk)
    assert all(m == -(-q_lens[b] // g.BLOCK_M) - 1 for b, m in firsts.items())


def _emulate(q, k, v, cu_q, cu_k, scale, block_n=g.BLOCK_N):
    """The kernel's schedule in torch (float32): per program of the grid, its 128 query rows (rows past the request: the
    next request's, zeros past Tq, as TMA reads them), key tiles of BLOCK_N from the request's key 0 (rows past its keys:
    the next request's, zeros past Tk), the mask only on tiles j >= n_full, the online softmax in base 2 with p rounded to
    bf16 for PV, O / l rounded to bf16; only the request's rows stored."""
    tq, heads, d_qk = q.shape
    pad = torch.zeros(g.BLOCK_M + 2 * block_n, heads, d_qk)
    qp, kp = torch.cat([q.float(), pad]), torch.cat([k.float(), pad])
    vp = torch.cat([v.float(), torch.zeros(2 * block_n, heads, v.shape[2])])
    out = torch.full((tq, heads, v.shape[2]), float("nan"))
    cq, ck = cu_q.tolist(), cu_k.tolist()
    qk_scale = scale * g.LOG2E
    for pid in range(g.grid(tq, len(cq) - 1, heads)[0]):
        p = g.program_plan(cq, ck, pid, block_n)
        if p is None:
            continue
        r0 = p.q_start + p.m_blk * g.BLOCK_M
        pos = p.k_len - p.q_len + p.m_blk * g.BLOCK_M + torch.arange(g.BLOCK_M)
        m = torch.full((heads, g.BLOCK_M), float("-inf"))
        l_sum = torch.zeros(heads, g.BLOCK_M)
        acc = torch.zeros(heads, g.BLOCK_M, v.shape[2])
        for j in range(p.num_tiles):
            c0 = p.k_start + j * block_n
            s = torch.einsum("mhd,nhd->hmn", qp[r0:r0 + g.BLOCK_M], kp[c0:c0 + block_n])
            if j >= p.n_full:
                s = s.masked_fill(~(j * block_n + torch.arange(block_n) <= pos[:, None]), float("-inf"))
            m_new = torch.maximum(m, s.amax(-1) * qk_scale)
            pr = torch.exp2(s * qk_scale - m_new[..., None])
            alpha = torch.exp2(m - m_new)
            l_sum = l_sum * alpha + pr.sum(-1)
            acc = acc * alpha[..., None] + torch.einsum("hmn,nhd->hmd", pr.bfloat16().float(), vp[c0:c0 + block_n])
            m = m_new
        rows = min(g.BLOCK_M, p.q_len - p.m_blk * g.BLOCK_M)
        out[r0:r0 + rows] = (acc / l_sum[..., None]).transpose(0, 1)[:rows]
    return out.bfloat16()


@pytest.mark.parametrize("block_n", [128, 64])
@pytest.mark.parametrize("q_lens, prefixes", BATCHES)
def test_the_schedule_emulated_on_the_cpu_matches_the_reference(q_lens, prefixes, block_n):
    """What the kernel computes, by its own tile arithmetic (`program_plan`, the mask-free tiles, the reads past a request),
    emulated in torch: every row written once, within the GPU test's bounds of the op's reference; at the default key
    tile and at the 64-row one of the tuning `block_n=64`."""
    q, k, v, cu_q, cu_k = _batch(q_lens, prefixes, 2, 192, 128, seed=len(q_lens))
    _check(_emulate(q, k, v, cu_q, cu_k, 192**-0.5, block_n), q, k, v, cu_q, cu_k, 192**-0.5)


def test_the_default_tuning_is_the_gpu_tested_schedule_and_each_tuning_says_what_it_needs():
    t = g.DEFAULT_TUNING
    assert (t.block_n, t.num_stages, t.consumer_regs, t.persistent) == (128, 2, 232, True)
    assert t.shared_bytes(192, 128) == 2 * (128 * 192 + 2 * 128 * 320) + g.BARRIER_BYTES  # 208 KiB and the barriers
    for d_qk in (192, 128):
        assert t.problem(d_qk, 128) is None
        assert g.Tuning(block_n=64, num_stages=4).problem(d_qk, 128) is None
        assert g.Tuning(consumer_regs=240).problem(d_qk, 128) is None
    assert g.Tuning(num_stages=3).problem(128, 128) is None  # 224 KiB
    assert "shared memory" in g.Tuning(num_stages=3).problem(192, 128)
    assert "power of two" in g.Tuning(block_n=112).problem(128, 128)
    assert "consumer_regs" in g.Tuning(consumer_regs=248).problem(128, 128)
    assert "num_stages" in g.Tuning(num_stages=1).problem(128, 128)
    with pytest.raises(ValueError, match="shared memory"):
        g.launch_prefill_gluon(**{k: v for k, v in _call().items() if k != "sliding_window"}, cu_seqlens_q=_meta(3, dtype=torch.int32),
                               cu_seqlens_k=_meta(3, dtype=torch.int32), tuning=g.Tuning(num_stages=3))


def test_the_default_runs_the_persistent_kernel_unless_the_batch_has_more_query_tiles_than_its_order_sorts(monkeypatch):
    from deepinfer_cuda.kernels import prefill_gluon_persistent as pers

    ran = []
    monkeypatch.setattr(pers, "launch", lambda *args: ran.append("persistent"))
    monkeypatch.setattr(g, "_prefill_ws_kernel", type("K", (), {"__getitem__": lambda self, grid: lambda *a, **k: ran.append("a program a tile")})())
    call = {k: v for k, v in _call(tokens=256).items() if k != "sliding_window"}
    cu = {"cu_seqlens_q": _meta(3, dtype=torch.int32), "cu_seqlens_k": _meta(3, dtype=torch.int32)}
    g.launch_prefill_gluon(**call, **cu)
    monkeypatch.setattr(pers, "MAX_SLOTS", pers.num_slots(256, 2) - 1)
    g.launch_prefill_gluon(**call, **cu)
    g.launch_prefill_gluon(**call, **cu, tuning=g.Tuning(persistent=False))
    assert ran == ["persistent", "a program a tile", "a program a tile"]


def test_every_swept_tuning_runs_somewhere_and_the_default_is_swept():
    from deepinfer_cuda.bench import attention_prefill as bench

    labels = [label for label, _ in bench.GLUON_SWEEP]
    assert len(set(labels)) == len(labels) and bench.GLUON_SWEEP[0] == ("default", g.DEFAULT_TUNING)
    for label, tuning in bench.GLUON_SWEEP:
        assert any(tuning.problem(d_qk, 128) is None for d_qk in (192, 128)), label
    assert {bench.SHAPES[i][1:] for i in bench.GLUON_SWEEP_SHAPES} == {
        (4, 4096, 4096, 16, 192, 128), (2, 2048, 2048, 128, 192, 128), (4, 4096, 4096, 16, 128, 128), (2, 2048, 2048, 128, 128, 128)}


@pytest.mark.parametrize("block_n", [128, 64])
@pytest.mark.parametrize("q_lens, prefixes", BATCHES + [([4096] * 4, [0] * 4), ([5, 3000, 700], [9000, 0, 64])])
def test_the_persistent_order_kernel_sorts_the_query_tiles_longest_first(q_lens, prefixes, block_n):
    """`_lpt_order_kernel` (interpreted on the CPU, compiled on a GPU) against `lpt_order`: every query tile once, most
    key tiles first, ties in slot order; count = the query tiles."""
    k_lens = [q + p for q, p in zip(q_lens, prefixes)]
    cu_q = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    cu_k = [0, *torch.tensor(k_lens).cumsum(0).tolist()]
    device = "cuda" if mode() == GPU else "cpu"
    slots = gp.num_slots(cu_q[-1], len(q_lens))
    order = torch.full((slots, 2), -7, dtype=torch.int32, device=device)
    count = torch.full((1,), -7, dtype=torch.int32, device=device)
    import triton

    gp._lpt_order_kernel[(1,)](torch.tensor(cu_q, dtype=torch.int32, device=device), torch.tensor(cu_k, dtype=torch.int32, device=device),
                               order, count, len(q_lens), slots, max(len(q_lens) - 1, 0).bit_length(),
                               BLOCK_M=g.BLOCK_M, BLOCK_N=block_n, SLOTS=triton.next_power_of_2(slots))
    want = gp.lpt_order(cu_q, cu_k, block_n)
    assert len(want) == sum(-(-n // g.BLOCK_M) for n in q_lens) == int(count.item())
    assert [tuple(r) for r in order[:len(want)].tolist()] == want
    assert sorted(want) == sorted((b, m) for b, n in enumerate(q_lens) for m in range(-(-n // g.BLOCK_M)))
    costs = []
    for b, m in want:
        q_len, k_len = q_lens[b], k_lens[b]
        costs.append((k_len - q_len + min((m + 1) * g.BLOCK_M, q_len) - 1 + block_n) // block_n)
    assert costs == sorted(costs, reverse=True)


@pytest.mark.parametrize("heads, sections", [(16, 2), (16, 16), (128, 9), (3, 2), (1, 1), (5, 5)])
def test_the_persistent_items_are_every_query_tile_and_head_once_longest_first_in_each_section(heads, sections):
    """`item_sequence` (the kernel's `_item` arithmetic): every (query tile, head) exactly once, the head sections one
    after the other, within a section the sorted order, each tile over the section's heads."""
    q_lens, prefixes = BATCHES[1]
    k_lens = [q + p for q, p in zip(q_lens, prefixes)]
    cu_q = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    cu_k = [0, *torch.tensor(k_lens).cumsum(0).tolist()]
    order = gp.lpt_order(cu_q, cu_k, 128)
    items = gp.item_sequence(order, heads, sections)
    assert sorted(items) == sorted((b, m, h) for b, m in order for h in range(heads))
    rank = {entry: i for i, entry in enumerate(order)}
    keys = [(h // sections, rank[(b, m)]) for b, m, h in items]
    assert keys == sorted(keys)


def test_section_heads_keep_the_sections_kv_within_the_bytes():
    assert gp.section_heads(16384, 16, 192, 128, 24 << 20) == 2  # 10 MiB a head
    assert gp.section_heads(4096, 128, 192, 128, 24 << 20) == 9
    assert gp.section_heads(4096, 128, 192, 128, 0) == 128
    assert gp.section_heads(1 << 22, 16, 192, 128, 24 << 20) == 1
    assert gp.section_heads(0, 4, 128, 128, 24 << 20) == 4


@pytest.mark.skipif(mode() == GPU, reason="the CPU's fallback (on a GPU the Gluon kernel serves this call)")
def test_a_call_it_does_not_serve_runs_on_the_tl_kernel():
    """Under the interpreter the launch declines (not a GPU) and `prefill` runs prefill.py's tl kernel: its bits."""
    from deepinfer_cuda.kernels import prefill as tl_prefill

    q, k, v, cu_q, cu_k = _batch([5, 70], [3, 0], 2, 192, 128, seed=0)
    assert g.launch_prefill_gluon(q, k, v, cu_q, cu_k, 0.1) is None
    got = g.prefill(q, k, v, cu_q, cu_k, softmax_scale=0.1)
    assert torch.equal(got, tl_prefill.launch_prefill(q, k, v, cu_q, cu_k, 0.1, None))


@pytest.mark.skipif(
    mode() != GPU or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="runs on an SM90 GPU only (TRITON_INTERPRET=0 pytest tests/cuda/test_prefill_gluon.py)",
)
@pytest.mark.parametrize("q_lens, prefixes, heads, d_qk", [
    (*BATCHES[0], 16, 192), (*BATCHES[1], 16, 192), (*BATCHES[2], 16, 192), (*BATCHES[0], 128, 192), ([700, 1500], [0, 2000], 128, 192),
    (*BATCHES[1], 16, 128), ([4096, 4096], [0, 0], 16, 192), ([1024] * 2, [3072] * 2, 16, 192),
])  # fmt: skip
def test_matches_the_reference_on_the_gpu(q_lens, prefixes, heads, d_qk):
    q, k, v, cu_q, cu_k = _batch(q_lens, prefixes, heads, d_qk, 128, seed=heads + d_qk + len(q_lens), device="cuda")
    scale = d_qk**-0.5
    out = g.launch_prefill_gluon(q, k, v, cu_q, cu_k, scale)
    assert out is not None, g.not_served(q, k, v, scale)
    _check(out, q, k, v, cu_q, cu_k, scale)
    # the same inputs twice: the same bits (no race between the warpgroups' turns and the ring)
    assert torch.equal(out, g.launch_prefill_gluon(q, k, v, cu_q, cu_k, scale))


def _swept_tunings():
    from deepinfer_cuda.bench import attention_prefill as bench

    return [pytest.param(t, id=label.replace(" ", "_")) for label, t in bench.GLUON_SWEEP if t != g.DEFAULT_TUNING]


@pytest.mark.skipif(
    mode() != GPU or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="runs on an SM90 GPU only (TRITON_INTERPRET=0 pytest tests/cuda/test_prefill_gluon.py)",
)
@pytest.mark.parametrize("tuning", _swept_tunings())
@pytest.mark.parametrize("q_lens, prefixes, heads, d_qk", [
    (*BATCHES[1], 16, 192), (*BATCHES[2], 16, 128), ([700, 1500], [0, 2000], 128, 192), ([4096, 4096], [0, 0], 16, 128),
])  # fmt: skip
def test_each_tuning_matches_the_reference_on_the_gpu(tuning, q_lens, prefixes, heads, d_qk):
    """Every swept tuning (bench attention_prefill's GLUON_SWEEP; not yet run on a GPU) where it fits the head dims: within
    the reference's bounds, every row written (NaN-filled output), the same bits twice, and where it keeps the default's
    key tile the default's bits (the same tile arithmetic in the same order: only the schedule differs)."""
    if tuning.problem(d_qk, 128) is not None:
        pytest.skip(tuning.problem(d_qk, 128))
    q, k, v, cu_q, cu_k = _batch(q_lens, prefixes, heads, d_qk, 128, seed=heads + d_qk + len(q_lens), device="cuda")
    scale = d_qk**-0.5
    out = torch.full((q.shape[0], heads, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert g.launch_prefill_gluon(q, k, v, cu_q, cu_k, scale, tuning=tuning, out=out) is out
    _check(out, q, k, v, cu_q, cu_k, scale)
    assert torch.equal(out, g.launch_prefill_gluon(q, k, v, cu_q, cu_k, scale, tuning=tuning))
    if tuning.block_n == g.DEFAULT_TUNING.block_n:
        assert torch.equal(out, g.launch_prefill_gluon(q, k, v, cu_q, cu_k, scale))


def test_the_sweep_prints_every_tuning_with_its_difference_and_unwritten_rows(monkeypatch, capsys):
    """bench attention_prefill's `--sweep prefill_gluon` on the CPU, its GPU pieces stood in for (the launch writes the
    reference's output, one tuning leaves rows unwritten, one fails, one does not fit the head dims; timings are fixed):
    one row a tuning and SDPA's, the ratio to SDPA, the % of the matmul rate, the difference from the default's output
    and the rows left NaN."""
    from deepinfer_cuda.bench import attention_prefill as bench
    from deepinfer_cuda.bench import runner

    monkeypatch.setattr(runner, "measure_matmul_tflops", lambda device, timer: 1.0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "cpu")
    monkeypatch.setattr(bench, "SHAPES", [("tiny", 2, 64, 64, 2, 128, 128)])
    skipping, failing = g.Tuning(block_n=64), g.Tuning(consumer_regs=240)

    def launch(q, k, v, cu_q, cu_k, scale, *, tuning=None, out=None):
        if tuning is failing:
            raise RuntimeError("no such kernel")
        want = ref_prefill(q.double(), k.double(), v.double(), cu_q, cu_k, softmax_scale=scale).to(q.dtype)
        out = torch.empty_like(want) if out is None else out
        rows = slice(0, 60) if tuning is skipping else slice(None)
        out[rows] = want[rows]
        return out

    monkeypatch.setattr(g, "launch_prefill_gluon", launch)
    tunings = [("default", g.DEFAULT_TUNING), ("skips rows", skipping), ("fails", failing), ("3 stages", g.Tuning(num_stages=3, block_n=256))]
    timings = iter([2.0, 1.0, 4.0])  # SDPA, default, skips rows (the failing and the unfitting tunings are not timed)
    rows = bench.gluon_sweep(torch.device("cpu"), tunings=tunings, shapes=(0,), timer=lambda fn: (fn(), next(timings))[1])
    printed = capsys.readouterr().out
    assert [r["variant"] for r in rows] == ["torch SDPA (causal, batch form)", "default", "skips rows", "fails", "3 stages"]
    sdpa, default, skips, fails, unfit = rows
    assert sdpa["us"] == 2000.0 and "max |default - SDPA|" in sdpa["note"]
    assert default["us"] == 1000.0 and default["vs_sdpa"] == 2.0 and default["max_diff_default"] == 0.0 and default["nan_rows"] == 0
    assert default["matmul_fraction"] == pytest.approx(bench._flops({"d_qk": 128, "d_v": 128, "heads": 2, "batch": 2, "q_len": 64, "k_len": 64}) / 1e-3 / 1e12)
    assert skips["nan_rows"] == (128 - 60) * 2 and skips["max_diff_default"] != skips["max_diff_default"]  # (token, head) rows left; the diff NaN
    assert skips["vs_sdpa"] == 0.5
    assert fails["us"] is None and "ERROR RuntimeError: no such kernel" in fails["note"]
    assert unfit["us"] is None and "n/a: " in unfit["note"] and "shared memory" in unfit["note"]
    assert "skips rows" in printed and "x SDPA" in printed


def _persistent_program(items, stages, seed):
    """The persistent kernel's three partitions as generators of ("wait", barrier, parity) steps between their reads
    and writes of the shared buffers (Q, the K/V ring, the item ring), with the kernel's phase arithmetic; run in a
    random interleaving until all finish. Returns what each consumer read, in order; raises on a deadlock."""
    import random

    bar = {name: Barrier(c) for name, c in (("q_bar", 1), ("q_empty", 2))}
    for i in range(stages):
        bar[f"k{i}"], bar[f"v{i}"], bar[f"e{i}"] = Barrier(1), Barrier(1), Barrier(2)
    for i in range(2):
        bar[f"turn{i}"], bar[f"ready{i}"], bar[f"free{i}"] = Barrier(1), Barrier(1), Barrier(2)
    mem = {"q": None, "k": [None] * stages, "v": [None] * stages, "items": [None, None]}
    reads = {0: [], 1: []}

    def producer():
        it = 0
        for n, num_tiles in enumerate([*items, None]):  # None: the not-live fields past the last item
            yield "wait", bar[f"free{n % 2}"], ((n // 2) & 1) ^ 1
            mem["items"][n % 2] = (n, num_tiles)
            bar[f"ready{n % 2}"].arrive()
            if num_tiles is None:
                return
            yield "wait", bar["q_empty"], (n & 1) ^ 1
            mem["q"] = n
            bar["q_bar"].arrive()
            for _ in range(num_tiles):
                stage = it % stages
                yield "wait", bar[f"e{stage}"], ((it // stages) & 1) ^ 1
                mem["k"][stage] = it
                bar[f"k{stage}"].arrive()
                mem["v"][stage] = it
                bar[f"v{stage}"].arrive()
                it += 1

    def consumer(w):
        it = turns = done = 0
        while True:
            yield "wait", bar[f"ready{done % 2}"], (done // 2) & 1
            n, num_tiles = mem["items"][done % 2]
            bar[f"free{done % 2}"].arrive()
            if num_tiles is None:
                return
            yield "wait", bar["q_bar"], done & 1
            yield "wait", bar[f"k{it % stages}"], (it // stages) & 1
            yield "wait", bar[f"turn{w}"], (turns & 1) ^ (1 - w)
            reads[w].append(("S", mem["q"], mem["k"][it % stages]))
            bar[f"turn{1 - w}"].arrive()
            for j in range(num_tiles):
                g = it + j
                stage = g % stages
                yield "wait", bar[f"turn{w}"], ((turns + j + 1) & 1) ^ (1 - w)
                if j + 1 < num_tiles:
                    yield "wait", bar[f"k{(g + 1) % stages}"], ((g + 1) // stages) & 1
                    reads[w].append(("S", mem["q"], mem["k"][(g + 1) % stages]))
                yield "wait", bar[f"v{stage}"], (g // stages) & 1
                reads[w].append(("PV", n, mem["v"][stage]))
                bar[f"turn{1 - w}"].arrive()
                bar[f"e{stage}"].arrive()
                if j == max(num_tiles - 2, 0):
                    bar["q_empty"].arrive()
            it += num_tiles
            turns += num_tiles + 1
            done += 1

    rng = random.Random(seed)
    running = {name: (gen, next(gen, None)) for name, gen in (("p", producer()), ("c0", consumer(0)), ("c1", consumer(1)))}
    while running:
        ready = [name for name, (_, step) in running.items() if step is None or step[1].passed(step[2])]
        assert ready, f"deadlock: {[(name, step[2]) for name, (_, step) in running.items()]}"
        name = rng.choice(ready)
        gen, step = running[name]
        nxt = next(gen, "end")
        if nxt == "end":
            del running[name]
        else:
            running[name] = (gen, nxt)
    return reads


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("seed", range(6))
def test_the_persistent_kernels_barrier_protocol_reads_every_tile_once_in_order_without_deadlock(stages, seed):
    """The persistent kernel's waits and arrivals (`_persistent_program`, the kernel's phase arithmetic in Python) in
    random interleavings of its three partitions, over items of 1-5 key tiles: it finishes, and each consumer's QK^T of
    item n reads item n's Q and its key tiles in order, its PV the same tiles (the producer never overwrote a stage or Q
    still to be read)."""
    import random

    items = [random.Random(seed).randint(1, 5) for _ in range(7)]
    reads = _persistent_program(items, stages, seed)
    starts = [sum(items[:n]) for n in range(len(items))]
    want_s = [("S", n, starts[n] + j) for n, tiles in enumerate(items) for j in range(tiles)]
    want_pv = [("PV", n, starts[n] + j) for n, tiles in enumerate(items) for j in range(tiles)]
    for w in (0, 1):
        assert [r for r in reads[w] if r[0] == "S"] == want_s
        assert [r for r in reads[w] if r[0] == "PV"] == want_pv
