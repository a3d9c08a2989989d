"""The SM90 Gluon fp8_block kernel's host side on a CPU: which calls it serves, its tiles, stages, K splits and persistent
grid, its schedule options (the overlapped K loop, the 256-wide tiles, the TMA store epilogue), its TMA descriptors,
and its registration under backend option fp8_path=gluon. Its compilation for sm90 is tests/cuda/test_compile_check.py's;
its numbers are a GPU's (`deepinfer conformance --backend cuda --backend-option fp8_path=gluon --op linear --op
grouped_gemm` on an H100/H200, and on an SM90 GPU `TRITON_INTERPRET=0 pytest tests/cuda/test_gemm_fp8_gluon.py`: each
schedule option's output against the table's, bit for bit; not run here)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import deepinfer_cuda.kernels.gemm_fp8_gluon as gg  # (imports without Gluon too: GLUON_IMPORT_ERROR says why, below)
from deepinfer.ops import quant
from deepinfer.registry import Registry, ResolveContext
from deepinfer_cuda.bench.compile_check import arch_config
from deepinfer_cuda.options import FP8_PATH

from triton_mode import GPU, mode

if gg.GLUON_IMPORT_ERROR is not None:
    pytest.skip(f"no Gluon for Hopper in this Triton (runs with Triton >= 3.5: CI, the GPU machine): {gg.GLUON_IMPORT_ERROR}", allow_module_level=True)

SM90 = lambda variant: arch_config("gemm", variant, "sm90")  # noqa: E731
F8 = quant.FP8_DTYPE


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _plan(x, w, layout):
    return gg.plan_gluon(x, w, layout, SM90, sms=132)


def test_prefill_tiles_fill_every_sm_with_persistent_programs():
    # V4-Flash's wq_a + wkv at 8192 tokens: the 128 x 256 tile (two column halves), two consumer warpgroups, the TMA store's
    # 64 KiB of output buffers beside 3 stages of 48 KiB, no K split
    p = _plan(_meta(8192, 4096), _meta(1536, 4096, dtype=F8), gg._LINEAR)
    assert (p.block_m, p.block_n, p.sub_n, p.consumers, p.num_stages, p.split, p.tma_store) == (128, 256, 2, 2, 3, 1, True)
    assert (p.num_m_tiles, p.num_n, p.total_kb, p.units, p.grid) == (64, 6, 32, 384, (132,))
    # the grouped prefill, 8 experts x 4096 tokens: row tiles + one partial per expert (gemm.plan_gemm's bound)
    p = _plan(_meta(8 * 4096, 7168), _meta(8, 4096, 7168, dtype=F8), gg._CONTIGUOUS)
    assert (p.block_m, p.split, p.num_m_tiles, p.num_n, p.total_kb, p.grid) == (128, 1, 256 + 8, 16, 56, (132,))


def test_decode_batches_split_k_where_the_tiles_leave_sms_idle():
    # 256 rows x 4096 columns: 2 x 32 tiles of 128 x 128 and two K splits, 128 units on 132 SMs
    p = _plan(_meta(256, 4096), _meta(4096, 4096, dtype=F8), gg._LINEAR)
    assert (p.block_m, p.block_n, p.consumers, p.tiles, p.split, p.kb_per_split, p.grid) == (128, 128, 2, 64, 2, 16, (128,))
    # 128 rows x 1536 columns: 12 tiles, so more K splits (float32 partials), one unit per program
    p = _plan(_meta(128, 4096), _meta(1536, 4096, dtype=F8), gg._LINEAR)
    assert p.tiles == 12 and p.split > 4 and p.units <= 132 and p.grid == (p.units,)
    assert p.split * p.kb_per_split >= p.total_kb > (p.split - 1) * p.kb_per_split  # no empty split
    # the masked decode layout (32 rows per expert): 64 x 128, one consumer warpgroup; 8 x 32 tiles need no split
    p = _plan(_meta(8, 32, 7168), _meta(8, 4096, 7168, dtype=F8), gg._MASKED)
    assert (p.block_m, p.block_n, p.consumers, p.split, p.tiles, p.grid) == (64, 128, 1, 1, 256, (132,))
    # batch 1: 32 tiles, K 7168 in splits of at least 2 groups
    p = _plan(_meta(1, 7168), _meta(4096, 7168, dtype=F8), gg._LINEAR)
    assert p.block_m == 64 and p.tiles == 32 and 1 < p.split <= 56 // 2 and p.units <= 132


def test_the_split_is_chosen_for_the_row_bucket():
    """As gemm.plan_gemm: every row count of a power-of-two bucket compiles the same kernel (PARTIAL is a constexpr)."""
    w = _meta(1536, 4096, dtype=F8)
    splits = {_plan(_meta(rows, 4096), w, gg._LINEAR).split for rows in (65, 100, 128)}
    assert len(splits) == 1 and splits.pop() > 1


def test_choose_split():
    cfg = SM90("fp8_gluon_medium")
    assert gg.choose_split(132, 32, 132, cfg) == 1  # the tiles fill the SMs
    assert gg.choose_split(8, 32, 132, SM90("fp8_gluon_large")) == 1  # the prefill entry never splits
    for tiles in (1, 8, 24, 48, 100):
        for total_kb in (1, 3, 8, 32, 56):
            split = gg.choose_split(tiles, total_kb, 132, cfg)
            kps = -(-total_kb // split)
            assert 1 <= split <= gg.MAX_SPLIT and -(-total_kb // kps) == split  # every split has groups
            assert split == 1 or split <= total_kb // cfg["min_kb_per_split"]
    assert gg.choose_split(24, 32, 132, cfg) >= 4  # 24 tiles: most SMs stream the weight
    assert gg.choose_split(24, 2, 132, cfg) == 1  # too few groups to split


def test_stages_shrink_to_fit_shared_memory():
    assert gg.fit_stages(128, 128, 6) == 6  # 6 x 32 KiB
    assert gg.fit_stages(128, 128, 8) == 6
    assert gg.fit_stages(64, 64, 8, ctas_per_sm=2) == 6  # two programs per SM share it
    assert gg.fit_stages(256, 256, 4) == 3 and gg.fit_stages(512, 512, 4) == 2  # at least 2


def test_tuning_entries_are_what_the_kernel_takes():
    for name in ("fp8_gluon_small", "fp8_gluon_medium", "fp8_gluon_large"):
        cfg = SM90(name)
        assert cfg["BLOCK_M"] == 64 * cfg["consumers"] and (128 % cfg["BLOCK_N"] == 0 or cfg["BLOCK_N"] == 256), name
        # the decode entries keep the register stores and one product set; the prefill entry (timed on an H100) takes the
        # 128 x 256 tile with the TMA store
        assert not cfg.get("overlap", False) and cfg.get("waves", 1) == 1, name
        assert cfg.get("tma_store", False) == (name == "fp8_gluon_large"), name
    x, w = _meta(8192, 4096), _meta(1536, 4096, dtype=F8)
    with pytest.raises(ValueError, match="64 rows per wave"):
        gg.plan_gluon(x, w, gg._LINEAR, _large(BLOCK_M=256), sms=132)
    with pytest.raises(ValueError, match="divide 128"):
        gg.plan_gluon(x, w, gg._LINEAR, _large(BLOCK_N=192), sms=132)
    with pytest.raises(ValueError, match="four sub-tiles"):
        gg.plan_gluon(x, w, gg._LINEAR, _large(BLOCK_M=256, waves=2, BLOCK_N=256), sms=132)
    with pytest.raises(ValueError, match="one sub-tile"):
        gg.plan_gluon(x, w, gg._LINEAR, lambda v: {**SM90(v), "BLOCK_N": 256, "overlap": True}, sms=132)


# the prefill entry before the H100 sweep (128 x 128, 6 stages, register stores): the base the schedule options are planned on
FORMER_LARGE = {"BLOCK_N": 128, "num_stages": 6, "consumer_regs": 232, "tma_store": False}


def _large(**over):
    return lambda v: {**SM90(v), **FORMER_LARGE, **over}


def test_schedule_options_plan_their_tiles_and_stages():
    x, w = _meta(8 * 4096, 7168), _meta(8, 4096, 7168, dtype=F8)
    # the overlapped K loop: the table's tile and ring, two product register sets in the consumers' 240 registers
    p = gg.plan_gluon(x, w, gg._CONTIGUOUS, _large(overlap=True, consumer_regs=240), sms=132)
    assert (p.block_m, p.block_n, p.waves, p.sub_n, p.overlap, p.tma_store, p.num_stages, p.consumer_regs) == (128, 128, 1, 1, True, False, 6, 240)
    # 128 x 256: two column halves (one weight-scale block each); 4 stages of 48 KiB
    p = gg.plan_gluon(x, w, gg._CONTIGUOUS, _large(BLOCK_N=256, num_stages=6), sms=132)
    assert (p.block_n, p.sub_n, p.num_n, p.num_stages) == (256, 2, 16, 4)
    # 256 x 128: two 64-row waves per consumer warpgroup; row tiles of 256 (+ one partial per expert)
    p = gg.plan_gluon(x, w, gg._CONTIGUOUS, _large(BLOCK_M=256, waves=2, num_stages=4), sms=132)
    assert (p.block_m, p.waves, p.consumers, p.num_m_tiles, p.num_stages) == (256, 2, 2, 128 + 8, 4)


def test_tma_store_takes_its_buffers_from_the_ring_and_only_unsplit_16_bit_rows():
    x, w = _meta(8192, 1024), _meta(32768, 1024, dtype=F8)
    p = gg.plan_gluon(x, w, gg._LINEAR, _large(overlap=True, tma_store=True, consumer_regs=240), sms=132)
    assert p.tma_store and p.num_stages == 5  # 5 x 32 KiB + two 16 KiB output buffers
    p = gg.plan_gluon(x, w, gg._LINEAR, _large(BLOCK_N=256, num_stages=4, tma_store=True), sms=132)
    assert p.tma_store and p.num_stages == 3  # 3 x 48 KiB + four 16 KiB buffers (two sub-tiles per consumer)
    # N not a multiple of 8 (rows of 16 bytes), or K splits (float32 partials): the register stores
    assert not gg.plan_gluon(_meta(8192, 1024), _meta(1540, 1024, dtype=F8), gg._LINEAR, _large(tma_store=True), sms=132).tma_store
    small = gg.plan_gluon(_meta(128, 4096), _meta(1536, 4096, dtype=F8), gg._LINEAR, lambda v: {**SM90(v), "tma_store": True}, sms=132)
    assert small.split > 1 and not small.tma_store


def test_the_output_descriptor_views_rows_by_sub_tile():
    e, n, k, max_m = 3, 384, 256, 40
    w = torch.zeros(e, n, k, dtype=F8)
    masked = torch.zeros(e, max_m, k, dtype=torch.bfloat16)
    p = gg.plan_gluon(masked, w, gg._MASKED, _large(BLOCK_N=256, num_stages=4, tma_store=True), sms=132)
    assert p.tma_store  # (the small entry, with the options set over it)
    out = torch.zeros(e, max_m, n, dtype=torch.bfloat16)
    d = gg.output_descriptor(p, out)
    assert (d.shape, d.strides, d.block_shape) == ([e * max_m, n], [n, 1], [64, 128])  # the experts' rows stacked: a box is one sub-tile
    assert gg.output_descriptor(dataclasses.replace(p, tma_store=False), out) is None


def test_calls_it_does_not_serve_say_why():
    w = torch.zeros(2, 64, 256, dtype=F8)
    x = torch.zeros(5, 256, dtype=torch.bfloat16)
    assert gg.not_served(x, w, gg._CONTIGUOUS) is None
    assert gg.not_served(x.half(), w, gg._CONTIGUOUS) is None
    assert "float32" in gg.not_served(x.float(), w, gg._CONTIGUOUS)
    assert "multiple of 16" in gg.not_served(x[:, :200], w[..., :200], gg._CONTIGUOUS)
    assert "contiguous" in gg.not_served(x, w.transpose(1, 2).contiguous().transpose(1, 2), gg._CONTIGUOUS)
    xt = torch.zeros(5, 2, 256, dtype=torch.bfloat16).transpose(0, 1)  # [E, max_m, K] laid out expert-minor
    assert "expert-minor" in gg.not_served(xt, w, gg._MASKED)


def test_descriptors_view_the_operands_as_2d_tiles():
    e, n, k, rows = 3, 192, 320, 40
    xq = torch.zeros(rows, k, dtype=F8)
    w = torch.zeros(e, n, k, dtype=F8)
    plan = gg.plan_gluon(torch.zeros(rows, k, dtype=torch.bfloat16), w, gg._CONTIGUOUS, SM90, sms=132)
    xd, wd = gg.descriptors(plan, xq, w)
    assert (xd.shape, xd.strides, xd.block_shape) == ([rows, k], [k, 1], [plan.block_m, 128])
    assert (wd.shape, wd.strides, wd.block_shape) == ([e * n, k], [k, 1], [plan.block_n, 128])
    assert xd.layout.swizzle_byte_width == 128 and wd.layout.swizzle_byte_width == 128  # K-major e4m3 rows of 128 bytes


def _chosen(monkeypatch, path, sm90, fmt="fp8_block", dtype=torch.bfloat16):
    import deepinfer_cuda.kernels.gemm as kg

    monkeypatch.setattr(gg, "is_sm90", lambda device: sm90)
    registry = Registry()
    registry.register_all("cuda", kg.REGISTRATIONS + gg.REGISTRATIONS)
    ctx = ResolveContext("cuda", dtype=dtype, options={} if path is None else {"fp8_path": path})
    return registry.choose(ctx, "grouped_gemm", fmt).fn, registry.choose(ctx, "linear", fmt).fn


def test_option_gluon_picks_it_only_on_sm90_for_fp8_block(monkeypatch):
    import deepinfer_cuda.kernels.gemm as kg

    assert FP8_PATH.choices == ("auto", "tl", "gluon", "cublas") and FP8_PATH.default == "auto"
    assert _chosen(monkeypatch, "gluon", True) == (gg.grouped_gemm, gg.linear)
    assert _chosen(monkeypatch, "gluon", True, dtype=torch.float16) == (gg.grouped_gemm, gg.linear)
    # auto is the tl kernel until the Gluon kernel has passed conformance on a GPU; tl is the tl kernel
    for path in (None, "auto", "tl"):
        assert _chosen(monkeypatch, path, True) == (kg.grouped_gemm, kg.linear), path
    assert _chosen(monkeypatch, "gluon", False) == (kg.grouped_gemm, kg.linear)  # not SM90
    assert _chosen(monkeypatch, "gluon", True, dtype=torch.float32) == (kg.grouped_gemm, kg.linear)
    assert _chosen(monkeypatch, "gluon", True, fmt="mxfp4")[0] is not gg.grouped_gemm


@pytest.mark.skipif(mode() == GPU, reason="runs in CI under the interpreter (CPU tensors, interpreted kernels); on a GPU the comparisons below cover it")
def test_calls_it_does_not_serve_run_the_tl_kernel():
    """float32 x and K 200 (not a multiple of 16): the wrapper hands the calls to gemm.py's kernel, interpreted here."""
    import deepinfer_cuda.kernels.gemm as kg

    gen = torch.Generator().manual_seed(0)
    w, s = quant.quantize_weight_fp8_block(torch.randn(2, 96, 256, generator=gen) * 0.05)
    x = torch.randn(2, 8, 256, generator=gen)
    mm = torch.tensor([8, 3], dtype=torch.int32)
    got = gg.grouped_gemm(x, w, masked_m=mm, weight_scale=s, fmt="fp8_block")
    want = kg.launch_gemm(x, w, s, "fp8_block", kg._MASKED, masked_m=mm)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1, :3], want[1, :3])
    w, s = quant.quantize_weight_fp8_block(torch.randn(64, 200, generator=gen) * 0.05)
    x = torch.randn(3, 200, generator=gen).bfloat16()
    assert "multiple of 16" in gg.not_served(x, w, gg._LINEAR)
    got = gg.linear(x, w, weight_scale=s, fmt="fp8_block", out_dtype=torch.float32)
    want = kg.launch_gemm(x, w, s, "fp8_block", kg._LINEAR, out_dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.skipif(mode() == GPU, reason="runs in CI under the interpreter (the Gluon launch stubbed); on a GPU the sweep itself runs")
def test_the_gluon_sweep_times_each_candidate_against_the_table_and_the_tl_kernel(monkeypatch):
    """bench/gemm.py's `--sweep fp8_gluon_large` loop on the CPU at toy sizes: the Gluon GEMM (no interpreter for Gluon)
    stubbed by the tl kernel, interpreted, after planning with the candidate's entry; each candidate's row compares its
    output with the table's and the tl kernel's, the tl kernel's GEMM alone is the reference row, and the tuning lookup
    is restored after."""
    import deepinfer_cuda.kernels.gemm as kg
    import deepinfer_cuda.tuning as tuning
    from deepinfer_cuda.bench import common
    from deepinfer_cuda.bench import gemm as bench

    plans = []
    cpu_table = tuning.config  # (the CPU's table has no Gluon entries: the sm90 ones stand in)
    monkeypatch.setattr(tuning, "config", lambda op, v, device=None: SM90(v) if v.startswith("fp8_gluon") else cpu_table(op, v, device))
    monkeypatch.setattr(gg, "config", tuning.config)

    def run(x, weight, weight_scale, layout, *, offsets=None, masked_m=None, out_dtype=None, prequantised=None):
        assert prequantised is not None and prequantised[1].stride(0) == 1  # the scales of a group: its rows contiguous (the Gluon layout)
        plans.append(gg.plan_gluon(x, weight, layout, sms=132))
        return kg.launch_gemm(x, weight, weight_scale, "fp8_block", layout, offsets=offsets, masked_m=masked_m, out_dtype=out_dtype)

    monkeypatch.setattr(gg, "_run", run)
    monkeypatch.setattr(common, "time_ms", lambda fn, **_: (fn(), 1.0)[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    table = gg.config
    candidates = bench.SWEEP["fp8_gluon_large"]
    assert candidates[0][0] == {k: SM90("fp8_gluon_large")[k] for k in candidates[0][0]}  # the table's schedule leads: the baseline row
    # rows past 256 an expert: the prefill entry, fp8_gluon_large
    for case in (bench._grouped_case("toy grouped, GEMM only, gluon", "fp8_block", 2, 264, 384, 256, prequantise=True, peer=False, path="gluon"),
                 bench._linear_case("toy linear, GEMM only, gluon", "fp8_block", 300, 256, 384, bound="compute", path="gluon", prequantise=True,
                                    peer=False)):
        plans.clear()
        rows = bench._sweep_case("fp8_gluon_large", case, torch.device("cpu"))
        assert [r["cfg"] for r in rows[len(candidates):]] == ["tl kernel (fp8_path=tl), GEMM alone"]
        assert all(r["ms"] == 1.0 for r in rows), rows
        assert all(r["max_diff"] == 0 and r["max_diff_tl"] == 0 for r in rows[: len(candidates)]), rows
        # plans[0]: the table's reference run; then each candidate's checked run and its timed run
        assert len(plans) == 1 + 2 * len(candidates)
        options = [(p.block_m, p.block_n, p.overlap, p.tma_store, p.waves, p.sub_n) for p in plans[1::2]]
        assert options == [(c["BLOCK_M"], c["BLOCK_N"], c.get("overlap", False), c.get("tma_store", False), c.get("waves", 1), c["BLOCK_N"] // 128 or 1)
                           for c, _ in candidates], options
        assert gg.config is table


def _gpu_operands(e, rows, n, k, layout, gen):
    w, ws = quant.quantize_weight_fp8_block(torch.randn(e, n, k, device="cuda", generator=gen) * 0.05)
    if layout == gg._MASKED:
        x = torch.randn(e, rows, k, device="cuda", generator=gen).bfloat16()
        return x, w, ws, {"masked_m": torch.tensor([rows, rows // 3, 0][:e], dtype=torch.int32, device="cuda")}
    if layout == gg._LINEAR:
        return torch.randn(rows, k, device="cuda", generator=gen).bfloat16(), w[0], ws[0], {}
    counts = torch.tensor([rows // 2, 1, 0, rows - rows // 2 - 1][:e])  # uneven experts: partial tiles, one row, none
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(device="cuda", dtype=torch.int32)
    return torch.randn(rows, k, device="cuda", generator=gen).bfloat16(), w, ws, {"expert_offsets": offsets}


@pytest.mark.skipif(mode() != GPU or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="runs on an SM90 GPU only (TRITON_INTERPRET=0 pytest tests/cuda/test_gemm_fp8_gluon.py)")
@pytest.mark.parametrize("layout, e, rows, n, k", [
    (gg._CONTIGUOUS, 4, 1100, 4096, 7168),  # 56 groups: the overlapped loop's pairs end even (one group left after them)
    (gg._CONTIGUOUS, 4, 700, 448, 640),  # 5 groups (odd), N past the last 256-wide tile's first half
    (gg._LINEAR, 1, 333, 520, 1040),  # a K tail (9 groups, the last partial); TMA stores clipped at N
    (gg._LINEAR, 1, 300, 516, 256),  # N not a multiple of 8: register stores
    (gg._LINEAR, 1, 4096, 1536, 128),  # one group
    (gg._LINEAR, 1, 256, 4096, 4096),  # decode rows: K splits (float32 partials)
    (gg._MASKED, 3, 300, 1024, 2048),
])  # fmt: skip
def test_schedule_options_give_the_tables_output_bit_for_bit_on_the_gpu(monkeypatch, layout, e, rows, n, k):
    """Every candidate of the sweep fp8_gluon_large (bench/gemm.py), set over the two-consumer entries (_medium: K splits
    into float32 partials; _large), against the table's schedule: with the same K split the same products, scales and
    promotion order, so the same bits (a wider tile can change the split: then within the tolerance); and near the tl
    kernel's output. On an H200 (2026-12-07) the first form of this test failed at 256 x 4096 -> 4096 (the 128 x 256
    tile changes the split there) and on the masked case (NaN rows past masked_m in its own tolerance check)."""
    from deepinfer_cuda.bench import gemm as bench
    from deepinfer_cuda.kernels import gemm as kg
    from deepinfer_cuda.tuning import config as table_config

    gen = torch.Generator(device="cuda").manual_seed(0)
    x, w, ws, index = _gpu_operands(e, rows, n, k, layout, gen)
    run = (lambda: gg.linear(x, w, weight_scale=ws, fmt="fp8_block")) if layout == gg._LINEAR else (
        lambda: gg.grouped_gemm(x, w, weight_scale=ws, fmt="fp8_block", **index))
    want = run()
    tl = kg.launch_gemm(x, w, ws, "fp8_block", layout, offsets=index.get("expert_offsets"), masked_m=index.get("masked_m"))
    valid = torch.ones_like(want, dtype=torch.bool)
    if layout == gg._MASKED:
        valid = torch.arange(rows, device="cuda")[None, :, None] < index["masked_m"][:, None, None]
    bound = 2e-2 * max(1.0, tl.float().abs().max().item())
    assert torch.where(valid, want.float() - tl.float(), 0).abs().max().item() <= bound  # (rows past masked_m may hold NaN)
    splits = gg.plan_gluon(x, w, layout).split
    for cfg, _ in bench.SWEEP["fp8_gluon_large"]:
        over = lambda op, v, device=None, _cfg=cfg: {**table_config(op, v, device), **(_cfg if v in ("fp8_gluon_medium", "fp8_gluon_large") else {})}  # noqa: E731
        monkeypatch.setattr(gg, "config", over)
        got = run()
        if gg.plan_gluon(x, w, layout).split == splits:
            assert torch.equal(torch.where(valid, got, 0), torch.where(valid, want, 0)), cfg
        else:  # another tile count gives another K split: the partials are summed in another grouping, not the same bits
            assert torch.where(valid, got.float() - want.float(), 0).abs().max().item() <= bound, cfg
