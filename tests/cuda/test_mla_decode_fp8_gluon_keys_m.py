"""The SM90 Gluon mla_decode over an FP8 cache with the keys as the wgmma's M (mla_decode_fp8_gluon_keys_m.py, behind
the tuning switch mla_decode/gluon_fp8 "keys_as_m"). On a CPU: which calls the switch sends to it, its column order,
and a torch emulation of its schedule's arithmetic (tiles alternating between two online softmaxes over s^T = k . q^T,
the raw bf16 values and row scales, a partial tile's zeroed rows, the merge, the split partials) against the op. On an
SM90 GPU (TRITON_INTERPRET=0 pytest tests/cuda/test_mla_decode_fp8_gluon_keys_m.py): its output against the tl
kernel's. Its compilation for sm90 is tests/cuda/test_compile_check.py's."""

from __future__ import annotations

import math

import pytest
import torch

import deepinfer_cuda.kernels.mla_decode_fp8_gluon as fp8_gluon
import deepinfer_cuda.kernels.mla_decode_fp8_gluon_keys_m as km
from deepinfer.ops import attention, kv_cache_format

from triton_mode import GPU, mode

if fp8_gluon.GLUON_IMPORT_ERROR is not None:
    pytest.skip(f"no Gluon for Hopper in this Triton (runs with Triton >= 3.5: CI, the GPU machine): {fp8_gluon.GLUON_IMPORT_ERROR}", allow_module_level=True)

LOG2E = 1.4426950408889634


def test_the_column_order_is_the_documented_permutation_of_each_chunk():
    x = torch.arange(2 * 576).reshape(2, 576)
    y = km.mma_k_order(x)
    for col in range(64):
        i, h, c, j = col // 16, (col // 8) % 2, (col // 2) % 4, col % 2
        assert torch.equal(y[:, 64 * 3 + col], x[:, 64 * 3 + 16 * c + 4 * i + 2 * h + j]), col
    assert torch.equal(y.sort(dim=1).values, x)  # a permutation within each row
    q, k = torch.randn(16, 576, dtype=torch.float64), torch.randn(64, 576, dtype=torch.float64)
    torch.testing.assert_close(km.mma_k_order(k) @ km.mma_k_order(q).T, k @ q.T)


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


@pytest.mark.parametrize("switch", [False, True])
def test_the_switch_sends_calls_of_at_most_16_rows_here(monkeypatch, switch):
    monkeypatch.setattr(fp8_gluon, "config", lambda op, variant, device=None: {"keys_as_m": switch})
    here, there = [], []
    monkeypatch.setattr(km, "launch", lambda *a: here.append(a[0].shape) or "keys_as_m")
    monkeypatch.setattr(fp8_gluon.parts, "launch", lambda kernel, cache, strides, q_nope, *a, **kw: there.append(q_nope.shape) or "split_keys")
    cache = _meta(8, 64, 592, dtype=torch.float8_e4m3fn)
    for s, h in ((1, 16), (2, 8), (4, 4), (1, 32), (1, 128)):
        out = fp8_gluon.launch_mla_decode_fp8_gluon(
            _meta(2, s, h, 512), _meta(2, s, h, 64), cache, _meta(2, 4, dtype=torch.int32), _meta(2, dtype=torch.int32), 0.1
        )
        assert out == ("keys_as_m" if switch and s * h <= 16 else "split_keys"), (s, h)
    assert len(here) == (3 if switch else 0) and len(there) == (2 if switch else 5)
    assert "S*H = 32" in km.not_served(_meta(2, 2, 16, 512), cache)


def test_the_descriptors_are_built_once_for_the_cache_an_engine_passes_every_step():
    cache = _meta(8, 64, 592, dtype=torch.float8_e4m3fn)
    first = km._descriptors(cache)
    assert km._descriptors(cache) is first and [d.block_shape for d in first] == [[64, 128], [64, 16], [64, 4]]
    other = _meta(16, 64, 592, dtype=torch.float8_e4m3fn)
    assert km._descriptors(other) is not first and km._descriptors(other)[0].shape == [16 * 64, 148]
    assert km._descriptors(cache) is not first and km._descriptors(cache)[0].shape == [8 * 64, 148]  # (rebuilt: one kept)


def test_the_sweep_times_the_switch_on_the_16_head_fp8_rows():
    """`python -m deepinfer_cuda.bench.gemm --sweep mla_gluon_fp8`: the table's entry, then keys_as_m, on
    bench/attention_decode.py's 16-head FP8-cache rows (those take the FP8 Gluon kernel); `deepinfer bench compile --sweep
    mla_gluon_fp8` builds both at one split and at split partials (TMA and asynchronous wgmmas asked of the keys-as-M
    kernel; the table kernel's wgmmas are serialised by Triton 3.9's ptxas, not by 3.6's)."""
    from deepinfer_cuda.bench import compile_check as cc
    from deepinfer_cuda.bench import gemm as bench
    from deepinfer_cuda.tuning import config

    candidates = bench.SWEEP["mla_gluon_fp8"]
    assert candidates == [({}, {}), ({"keys_as_m": True}, {})] and config("mla_decode", "gluon_fp8", None) == {"keys_as_m": True}
    assert bench.sweep_entries("mla_gluon_fp8") == ("gluon_fp8",) and bench.SWEEP_OPS["mla_gluon_fp8"] == "mla_decode"
    assert [c.name for c in bench.sweep_cases("mla_gluon_fp8")] == [f"B{b}_ctx4096_H16_S1_fp8cache_page64" for b in (64, 128, 256)]
    compile_cases = cc.sweep_cases("mla_gluon_fp8")
    assert [(c.tma, c.wgmma_async) for c in compile_cases] == [(False, False)] * 2 + [(True, True)] * 2


def _emulate(q_nope, q_rope, cache, block_table, seq_lens, softmax_scale, tokens_per_split):
    """The kernel's arithmetic in torch (float32 for its float32 steps, bf16 where it rounds): per (request, split),
    tiles j of 64 rows into warpgroup j % 2's online softmax, then the merge; with several splits, the partials and lse
    merged as mla_decode.py's combine does."""
    batch, num_q, heads, latent = q_nope.shape
    n, qk_scale, raw_unit = km.MAX_ROWS, softmax_scale * LOG2E, 2.0**112
    out = torch.zeros(batch, num_q, heads, latent)
    cols = torch.arange(n)
    for b in range(batch):
        seq_len = int(seq_lens[b])
        q = torch.zeros(n, 576)
        q[: num_q * heads] = torch.cat((q_nope[b], q_rope[b]), dim=-1).float().reshape(num_q * heads, 576)
        q = km.mma_k_order(q.to(torch.bfloat16)).float()
        parts_o, parts_lse = [], []
        for lo in range(0, max(seq_len, 1), tokens_per_split):
            split_end = min(lo + tokens_per_split, seq_len)
            num_tiles = max(split_end - lo + 63, 0) // 64
            m = [torch.full((n,), -math.inf) for _ in range(2)]
            l_part = [torch.zeros(64, n) for _ in range(2)]
            o = [torch.zeros(latent, n) for _ in range(2)]
            for j in range(num_tiles):
                w, start = j % 2, lo + 64 * j
                rows = cache[int(block_table[b, start // 64])].clone()
                rows[split_end - start :] = 0  # the loader zeroes a partial tile's rows past the end
                raw = (rows[:, :576].float() / raw_unit).to(torch.bfloat16)
                sc = kv_cache_format.row_scales(rows)[:, 0].float() * raw_unit
                s_t = km.mma_k_order(raw).float() @ q.T  # [64 keys, n]
                keys = torch.arange(64)[:, None] + start
                visible = (keys < split_end) & (keys < seq_len - num_q + cols[None, :] // heads + 1)
                scores = torch.where(visible, s_t * (sc * qk_scale)[:, None], -math.inf)
                m_new = torch.maximum(m[w], scores.max(dim=0).values)
                m_safe = torch.where(m_new == -math.inf, 0.0, m_new)
                alpha = torch.exp2(m[w] - m_safe)
                p = torch.exp2(scores - m_safe)
                l_part[w] = l_part[w] * alpha + p
                m[w] = m_new
                o[w] = o[w] * alpha + raw[:, :latent].float().T @ (p * sc[:, None]).to(torch.bfloat16).float()
            mm = torch.maximum(m[0], m[1])
            m_safe = torch.where(mm == -math.inf, 0.0, mm)
            a0, a1 = torch.exp2(m[0] - m_safe), torch.exp2(m[1] - m_safe)
            l_sum = l_part[0].sum(0) * a0 + l_part[1].sum(0) * a1
            has = l_sum > 0
            l_safe = torch.where(has, l_sum, 1.0)
            parts_o.append((o[0] * a0 / l_safe + o[1] * a1 / l_safe).T)  # [n, latent]
            parts_lse.append(torch.where(has, mm + torch.log2(l_safe), -math.inf))
        lse = torch.stack(parts_lse)  # [splits, n]
        top = lse.max(dim=0).values
        weight = torch.where(lse == -math.inf, 0.0, torch.exp2(lse - torch.where(top == -math.inf, 0.0, top)))
        merged = (weight[:, :, None] * torch.stack(parts_o)).sum(0) / weight.sum(0).clamp(min=1e-30)[:, None]
        out[b] = merged[: num_q * heads].reshape(num_q, heads, latent)
    return out


@pytest.mark.parametrize("heads, num_q, lengths, tokens_per_split", [
    (16, 1, (300, 64, 5), 4096),  # one split: a partial tile, a whole one, a request that leaves warpgroup 1 nothing
    (16, 1, (300, 190), 128),  # splits of two tiles, the last split partial
    (8, 2, (200, 77), 4096),  # S = 2 (MTP): the causal mask per column
    (4, 4, (130,), 64),  # S = 4, one tile a split
])  # fmt: skip
def test_the_schedule_emulated_in_torch_matches_the_op(heads, num_q, lengths, tokens_per_split):
    gen = torch.Generator().manual_seed(0)
    batch, pages_each = len(lengths), 5
    cache = kv_cache_format.quantize_rows(torch.randn(batch * pages_each, 64, 576, generator=gen))
    stale = torch.randint(0, 256, (batch * pages_each, 64, 592), generator=gen, dtype=torch.uint8)  # past each length: any bytes, NaN codes too
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    block_table = torch.randperm(batch * pages_each, generator=gen).to(torch.int32).view(batch, pages_each)
    for b, n in enumerate(lengths):
        for t in range(n, pages_each * 64):
            cache[block_table[b, t // 64], t % 64] = stale[block_table[b, t // 64], t % 64].view(torch.float8_e4m3fn)
    q_nope = torch.randn(batch, num_q, heads, 512, generator=gen).to(torch.bfloat16)
    q_rope = torch.randn(batch, num_q, heads, 64, generator=gen).to(torch.bfloat16)
    want = attention.mla_decode(q_nope, q_rope, cache, block_table, seq_lens, softmax_scale=192**-0.5).float()
    got = _emulate(q_nope, q_rope, cache, block_table, seq_lens, 192**-0.5, tokens_per_split)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.skipif(
    mode() != GPU or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="runs on an SM90 GPU only (TRITON_INTERPRET=0 pytest tests/cuda/test_mla_decode_fp8_gluon_keys_m.py)",
)
@pytest.mark.parametrize("batch, heads, ctx, queries, splits, short", [
    (4, 16, 4096, 1, None, False), (4, 16, 4096, 1, 1, False), (4, 16, 4096, 1, 8, False), (4, 8, 4096, 2, 3, False),
    (3, 4, 4096, 4, None, False), (2, 16, 960, 1, None, False), (5, 16, 256, 1, 1, True),
])  # fmt: skip
def test_matches_the_tl_kernel_on_the_gpu(batch, heads, ctx, queries, splits, short):
    from deepinfer_cuda.kernels import mla_decode as tl_mla

    gen = torch.Generator(device="cuda").manual_seed(0)
    pages = batch * (ctx // 64)
    cache = kv_cache_format.quantize_rows(torch.randn(pages, 64, 576, device="cuda", generator=gen))
    block_table = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32).view(batch, ctx // 64)
    low = queries if short else ctx // 2  # short: lengths from S (one partial tile, warpgroup 1 idle) up
    seq_lens = torch.randint(low, ctx + 1, (batch,), device="cuda", generator=gen, dtype=torch.int32)
    q_nope = torch.randn(batch, queries, heads, 512, device="cuda", generator=gen).to(torch.bfloat16)
    q_rope = torch.randn(batch, queries, heads, 64, device="cuda", generator=gen).to(torch.bfloat16)
    want = tl_mla.launch_mla_decode(q_nope, q_rope, cache, block_table, seq_lens, 192**-0.5, num_splits=splits)
    got = km.launch(q_nope, q_rope, cache, block_table, seq_lens, 192**-0.5, splits, None)
    assert not got.isnan().any()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 1.6e-2 * max(1.0, want.float().abs().max().item()), err
