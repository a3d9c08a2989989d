"""The SM90 Gluon mxfp4 kernel's host side on a CPU: which calls it serves, its tiles and stages, its TMA
descriptors, and its registration under backend option mxfp4_path=gluon. Its compilation for sm90 is
tests/cuda/test_compile_check.py's; its numbers are `deepinfer conformance --backend cuda --backend-option
mxfp4_path=gluon` on an H100/H200 (not run here: no GPU)."""

from __future__ import annotations

import pytest
import torch

import deepinfer_cuda.kernels.gemm_mxfp4_gluon as gg  # (imports without Gluon too: GLUON_IMPORT_ERROR says why, below)
from deepinfer.ops import quant
from deepinfer.registry import Registry, ResolveContext
from deepinfer_cuda.bench.compile_check import arch_config
from deepinfer_cuda.options import MXFP4_PATH

if gg.GLUON_IMPORT_ERROR is not None:
    pytest.skip(f"no Gluon for Hopper in this Triton (runs with Triton >= 3.5: CI, the GPU machine): {gg.GLUON_IMPORT_ERROR}", allow_module_level=True)

SM90 = lambda variant: arch_config("gemm", variant, "sm90")  # noqa: E731


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_decode_and_prefill_tiles_at_v4_flash_expert_shapes():
    u8 = torch.uint8
    # decode, masked: 16 rows per expert -> the small entry, a 16-row tile (wgmma N = 16), one program per (row tile, N block, expert)
    # one consumer warpgroup, a register cap for two CTAs per SM, the shared-memory budget halved: K steps of 256, 3 stages of
    # 24 KiB + 16 KiB of scales
    p = gg.plan_gluon(_meta(8, 16, 4096), _meta(8, 4096, 2048, dtype=u8), gg._MASKED, SM90)
    assert (p.block_m, p.block_n, p.block_k, p.num_warps, p.maxnreg, p.num_stages) == (16, 128, 256, 4, 128, 3)
    assert p.grid == (1, 32, 8)
    # decode, contiguous: B64 x top-6 over 256 experts (2 rows per expert in the bucket): 8-row tiles (min_block_m) with
    # their own K step of 128, row tiles + one partial per expert, 8 stages of 10 KiB
    p = gg.plan_gluon(_meta(384, 4096), _meta(256, 4096, 2048, dtype=u8), gg._CONTIGUOUS, SM90)
    assert p.block_m == 8 and p.block_k == 128 and p.num_m_tiles == 384 // 8 + 256 and p.grid == (304 * 32,) and p.num_stages == 8
    # B256 (8 rows per expert in the bucket): 16-row tiles, so that an expert's rows stay in one tile
    p = gg.plan_gluon(_meta(1536, 4096), _meta(256, 4096, 2048, dtype=u8), gg._CONTIGUOUS, SM90)
    assert p.block_m == 16 and p.block_k == 256 and p.num_stages == 3
    # prefill, contiguous: T8192 x top-6 through w2 (K 2048) -> the large entry, 128 tokens x 256 weight rows
    p = gg.plan_gluon(_meta(49152, 2048), _meta(256, 4096, 1024, dtype=u8), gg._CONTIGUOUS, SM90)
    assert (p.block_m, p.block_n, p.num_stages, p.num_warps, p.maxnreg) == (128, 256, 3, 8, None) and p.num_m_tiles == 49152 // 128 + 256


def test_stages_shrink_to_fit_shared_memory():
    assert gg._fit_stages(128, 128, 128, 4096, 4) == 4  # 16 KiB of scales + 4 x 40 KiB
    assert gg._fit_stages(128, 128, 128, 32768, 4) == 2  # 128 KiB of scales
    per_stage, strip = 128 * 128 * 2 + 128 * 64, 128 * 8192 // 32
    stages = gg._fit_stages(128, 128, 128, 8192, 6)
    assert strip + stages * per_stage <= gg.SHARED_MEMORY_BUDGET < strip + (stages + 1) * per_stage
    assert gg._fit_stages(16, 128, 128, 4096, 8, ctas_per_sm=2) == 7  # two CTAs per SM share it: 16 KiB + 7 x 12 KiB


def test_calls_it_does_not_serve_say_why():
    w, s = torch.zeros(2, 64, 256, dtype=torch.uint8), torch.zeros(2, 64, 16, dtype=torch.uint8)
    x = torch.zeros(5, 512, dtype=torch.bfloat16)
    assert gg.not_served(x, w, s, gg._CONTIGUOUS) is None
    assert "bfloat16" in gg.not_served(x.half(), w, s, gg._CONTIGUOUS)
    assert "multiple of 512" in gg.not_served(x[:, :256], w[..., :128], s[..., :8], gg._CONTIGUOUS)
    assert "contiguous" in gg.not_served(torch.zeros(512, 5, dtype=torch.bfloat16).T, w, s, gg._CONTIGUOUS)


def test_descriptors_view_the_operands_as_2d_tiles():
    e, n, k, rows = 3, 256, 1024, 40
    x = torch.zeros(rows, k, dtype=torch.bfloat16)
    w, s = torch.zeros(e, n, k // 2, dtype=torch.uint8), torch.zeros(e, n, k // 32, dtype=torch.uint8)
    plan = gg.plan_gluon(x, w, gg._CONTIGUOUS, SM90)
    xd, wd, sd = gg.descriptors(plan, x, w, s)
    assert (xd.shape, xd.block_shape) == ([rows, k], [plan.block_m, 64])
    assert (wd.shape, wd.block_shape) == ([e * n, k // 2], [plan.block_n, 32])
    assert (sd.shape, sd.strides, sd.block_shape) == ([e * n, k // 128], [k // 128, 1], [plan.block_n, 4])  # int32 words of 4 scales
    assert sd.base.dtype == torch.int32 and sd.layout.element_bitwidth == 32
    assert xd.layout.swizzle_byte_width == 128 and sd.layout.swizzle_byte_width == 0


def _chosen(monkeypatch, path, sm90, fmt="mxfp4", dtype=torch.bfloat16):
    import deepinfer_cuda.kernels.gemm as kg

    monkeypatch.setattr(gg, "is_sm90", lambda device: sm90)
    registry = Registry()
    registry.register_all("cuda", kg.REGISTRATIONS + gg.REGISTRATIONS)
    ctx = ResolveContext("cuda", dtype=dtype, options={"mxfp4_path": path})
    return registry.choose(ctx, "grouped_gemm", fmt).fn, registry.choose(ctx, "linear", fmt).fn


def test_option_gluon_picks_it_only_on_sm90_for_mxfp4(monkeypatch):
    import deepinfer_cuda.kernels.gemm as kg

    assert "gluon" in MXFP4_PATH.choices and MXFP4_PATH.default == "auto"
    assert _chosen(monkeypatch, "gluon", True) == (gg.grouped_gemm, gg.linear)
    # auto on SM90: the prefill-sized calls on it (measured faster there), the rest on the tl kernel
    assert _chosen(monkeypatch, "auto", True) == (gg._prefill_grouped_gemm, gg._prefill_linear)
    assert _chosen(monkeypatch, "auto", False) == (kg.grouped_gemm, kg.linear)
    assert _chosen(monkeypatch, "register", True) != (gg._prefill_grouped_gemm, gg._prefill_linear)
    assert _chosen(monkeypatch, "gluon", False) == (kg.grouped_gemm, kg.linear)  # not SM90: as auto
    assert _chosen(monkeypatch, "gluon", True, fmt="mxfp8")[0] is kg.grouped_gemm
    assert _chosen(monkeypatch, "gluon", True, dtype=torch.float16)[0] is kg.grouped_gemm


def test_auto_takes_it_for_prefill_sized_calls_only():
    """More than 64 rows per expert (gemm.py's prefill tiles) is prefill-sized: where it measured 1.4-1.5x the tl kernel;
    decode sizes stay on the tl kernel (0.7-0.8x there)."""
    u8 = torch.uint8
    w = _meta(256, 4096, 2048, dtype=u8)
    assert not gg.prefill_sized(_meta(6 * 256, 4096), w, gg._CONTIGUOUS)  # decode batch 256 x top-6 over 256 experts
    assert gg.prefill_sized(_meta(6 * 8192, 4096), w, gg._CONTIGUOUS)  # an 8192-token chunk
    assert not gg.prefill_sized(_meta(8, 16, 4096), _meta(8, 4096, 2048, dtype=u8), gg._MASKED)
    assert gg.prefill_sized(_meta(1024, 4096), _meta(4096, 2048, dtype=u8), gg._LINEAR)


def test_auto_takes_it_for_decode_only_where_the_decode_entry_says(monkeypatch):
    """The decode entry's "auto" flag (on since it measured 1.05-1.20x the tl kernel on an H100) routes mxfp4_path=auto's
    decode-sized calls to this kernel; off an SM90 device never."""
    assert SM90("mxfp4_gluon_small")["auto"] is True
    monkeypatch.setattr(gg, "is_sm90", lambda device: True)
    monkeypatch.setattr(gg, "config", lambda op, variant, device: SM90(variant))  # the SM90 table, on this CPU
    assert gg.decode_on_gluon(torch.device("cpu"))
    monkeypatch.setattr(gg, "config", lambda op, variant, device: {**SM90(variant), "auto": False})
    assert not gg.decode_on_gluon(torch.device("cpu"))
    monkeypatch.setattr(gg, "is_sm90", lambda device: False)
    assert not gg.decode_on_gluon(torch.device("cpu"))


def test_a_decode_sized_call_under_auto_runs_the_tl_register_path():
    import deepinfer_cuda.kernels.gemm as kg

    gen = torch.Generator().manual_seed(1)
    w, s = quant.quantize_weight_mxfp4(torch.randn(2, 64, 512, generator=gen))
    x = torch.randn(2, 8, 512, generator=gen).bfloat16()  # K 512: the Gluon kernel would serve it, but 8 rows per expert
    mm = torch.tensor([8, 3], dtype=torch.int32)
    got = gg._prefill_grouped_gemm(x, w, masked_m=mm, weight_scale=s, fmt="mxfp4")
    want = kg.launch_gemm(x, w, s, "mxfp4", kg._MASKED, masked_m=mm, mx_path="register")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1, :3], want[1, :3])


def test_calls_it_does_not_serve_run_the_tl_register_path():
    """K 256 (not a multiple of 512): the wrapper hands the call to the tl kernel, interpreted here."""
    import deepinfer_cuda.kernels.gemm as kg

    gen = torch.Generator().manual_seed(0)
    w, s = quant.quantize_weight_mxfp4(torch.randn(2, 64, 256, generator=gen))
    x = torch.randn(2, 8, 256, generator=gen).bfloat16()
    mm = torch.tensor([8, 3], dtype=torch.int32)
    got = gg.grouped_gemm(x, w, masked_m=mm, weight_scale=s, fmt="mxfp4")
    want = kg.launch_gemm(x, w, s, "mxfp4", kg._MASKED, masked_m=mm, mx_path="register")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1, :3], want[1, :3])


def test_a_linear_out_dtype_other_than_x_runs_the_tl_register_path():
    """A served shape (K 512, bf16 x) asking for float32 out: the tl kernel's register path, interpreted here."""
    import deepinfer_cuda.kernels.gemm as kg

    gen = torch.Generator().manual_seed(2)
    w, s = quant.quantize_weight_mxfp4(torch.randn(64, 512, generator=gen))
    x = torch.randn(3, 512, generator=gen).bfloat16()
    assert gg.not_served(x, w, s, gg._LINEAR) is None
    got = gg.linear(x, w, weight_scale=s, fmt="mxfp4", out_dtype=torch.float32)
    want = kg.launch_gemm(x, w, s, "mxfp4", kg._LINEAR, mx_path="register", out_dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, want)


# ---------------------------------------------------------------------------------------------
# Tail tiles (the prefill entry's "tail_tiles" flag): the host's plans, and a mirror of the kernel's program -> tile map
# (the kernel itself is compiled by the compile check's "tail tiles" cases and timed by the prefill entry's sweep on a GPU)


def _tail_tiles_on(variant):
    """The SM90 table with the prefill entry's tail_tiles flag on."""
    return {**SM90(variant), **({"tail_tiles": True} if variant == "mxfp4_gluon_large" else {})}


def test_tail_tiles_are_on_in_the_table_and_off_is_one_launch_as_before():
    u8 = torch.uint8
    assert SM90("mxfp4_gluon_large")["tail_tiles"] is True

    def tails_off(variant):
        return {**SM90(variant), "tail_tiles": False}

    x, w = _meta(49152, 4096), _meta(256, 4096, 2048, dtype=u8)
    assert gg.plan_launches(x, w, gg._CONTIGUOUS, tails_off) == (gg.plan_gluon(x, w, gg._CONTIGUOUS, tails_off),)
    assert gg.plan_gluon(x, w, gg._CONTIGUOUS, tails_off).tiles == gg._ALL_TILES


def test_tail_tiles_plan_a_body_and_a_tail_launch_at_v4_flash_prefill():
    """8192 tokens x top-6 over 256 experts (w13, K 4096): 128-row body tiles and 64-row tail tiles, the same 256 weight
    rows and 8 warps a tile, 3 stages each (shared memory allows them); grids bounded from 49152 rows and 256 experts."""
    u8 = torch.uint8
    body, tail = gg.plan_launches(_meta(49152, 4096), _meta(256, 4096, 2048, dtype=u8), gg._CONTIGUOUS, _tail_tiles_on)
    assert (body.tiles, body.block_m, body.full_m, body.tail_m, body.block_n, body.num_warps, body.num_stages) == (gg._BODY_TILES, 128, 128, 64, 256, 8, 3)
    assert (tail.tiles, tail.block_m, tail.full_m, tail.tail_m, tail.block_n, tail.num_warps, tail.num_stages) == (gg._TAIL_TILES, 64, 128, 64, 256, 8, 3)
    assert body.num_m_tiles == (49152 + 256 * 63) // 128 == 510 and tail.num_m_tiles == 256
    assert body.grid == (510 * 16,) and tail.grid == (256 * 16,)
    # masked and linear calls, and decode-sized contiguous ones (the decode entry's flag is not on), keep one launch
    assert len(gg.plan_launches(_meta(8, 256, 4096), _meta(8, 4096, 2048, dtype=u8), gg._MASKED, _tail_tiles_on)) == 1
    assert len(gg.plan_launches(_meta(4096, 4096), _meta(4096, 2048, dtype=u8), gg._LINEAR, _tail_tiles_on)) == 1
    assert len(gg.plan_launches(_meta(1536, 4096), _meta(256, 4096, 2048, dtype=u8), gg._CONTIGUOUS, _tail_tiles_on)) == 1


def _expert_row_tiles(plan, offsets: torch.Tensor):
    """A mirror of `_expert_row_tiles`: each expert's row tiles that plan's TILES picks, its first tile's first row, its row bound."""
    lo, hi = offsets[:-1].long(), offsets[1:].long()
    rows = hi - lo
    if plan.tiles == gg._ALL_TILES:
        return (rows + plan.block_m - 1) // plan.block_m, lo, hi
    if plan.tiles == gg._BODY_TILES:
        return rows // plan.full_m + (rows % plan.full_m > plan.tail_m).long(), lo, hi
    remainder = rows % plan.full_m
    return ((remainder > 0) & (remainder <= plan.tail_m)).long(), hi - remainder, hi


def _tile_map(plan, offsets: torch.Tensor, tile: torch.Tensor, num_m_tiles: int):
    """A mirror of `grouped_tile` (contiguous layout) for tile indices `tile` of a launch of num_m_tiles row tiles:
    (expert, row_start, row_end, pid_n) per tile, expert E with row_end 0 past every expert's tiles; and the experts'
    tiles in all."""
    tiles, first, hi = _expert_row_tiles(plan, offsets)
    ends = tiles.cumsum(0)
    per_group = plan.group_m * plan.num_n
    first_m = tile // per_group * plan.group_m
    group_m = torch.clamp(num_m_tiles - first_m, max=plan.group_m)
    t = first_m + (tile % per_group) % group_m
    pid_n = (tile % per_group) // group_m
    e = (ends[None, :] <= t[:, None]).sum(1)
    pad = lambda v: torch.cat([v, v.new_zeros(1)])  # noqa: E731  (expert E: no rows)
    row_start = pad(first)[e] + (t - pad(ends - tiles)[e]) * plan.block_m
    return e, row_start, pad(hi)[e], pid_n, int(ends[-1])


def _program_tiles(plan, offsets: torch.Tensor):
    """The one-program-a-tile kernel: `_tile_map` over every program of plan's grid."""
    return _tile_map(plan, offsets, torch.arange(plan.num_m_tiles * plan.num_n), plan.num_m_tiles)


def _persistent_walk(plan, offsets: torch.Tensor):
    """A mirror of the persistent kernel's walk: the exact row tiles m (`_expert_row_tiles`' sum, on the device), and
    each program p of plan's grid taking tiles p, p + programs, ... below m * num_n, mapped by `grouped_tile` over m
    row tiles: (program, tile) pairs in walk order."""
    programs = plan.grid[0]
    total = int(_expert_row_tiles(plan, offsets)[0].sum()) * plan.num_n
    return [(p, tile) for p in range(programs) for tile in range(p, total, programs)]


def _persistent_tiles(plan, offsets: torch.Tensor):
    """`_program_tiles` for the persistent kernel: the tiles its programs walk (`_persistent_walk`), mapped."""
    assert plan.persistent
    m_tiles = int(_expert_row_tiles(plan, offsets)[0].sum())
    walked = torch.tensor([tile for _, tile in _persistent_walk(plan, offsets)], dtype=torch.long)
    assert sorted(walked.tolist()) == list(range(m_tiles * plan.num_n)), "a tile walked twice or not at all"
    assert m_tiles <= plan.num_m_tiles, "more row tiles than the plan's bound"
    return _tile_map(plan, offsets, walked, max(m_tiles, 1))


def _coverage(plans, offsets: torch.Tensor) -> torch.Tensor:
    """How many times the plans' programs compute each (N block, row): the store's masks, rows < row_end, applied."""
    num_n, total = plans[0].num_n, int(offsets[-1])
    cover = torch.zeros(num_n, total + 1, dtype=torch.long)
    for plan in plans:
        e, start, end, pid_n, tiles = (_persistent_tiles if plan.persistent else _program_tiles)(plan, offsets)
        assert tiles <= plan.num_m_tiles, "an expert's tiles past the grid"
        work = start < end
        assert bool((e[work] < plan.experts).all())
        stop = torch.minimum(start + plan.block_m, end)
        cover.index_put_((pid_n[work], start[work]), torch.ones(int(work.sum()), dtype=torch.long), accumulate=True)
        cover.index_put_((pid_n[work], stop[work]), -torch.ones(int(work.sum()), dtype=torch.long), accumulate=True)
    return cover.cumsum(1)[:, :total]


def _offsets(counts) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)


def test_the_tile_mirror_matches_todays_single_launch():
    """The mirror's all-tiles mode (today's launch, its grid plan_gluon's) computes every row once: a check of the mirror."""
    u8 = torch.uint8
    plan = gg.plan_gluon(_meta(49152, 4096), _meta(256, 4096, 2048, dtype=u8), gg._CONTIGUOUS, SM90)
    counts = torch.bincount(torch.rand(8192, 256, generator=torch.Generator().manual_seed(3)).topk(6, dim=1).indices.flatten(), minlength=256)
    assert bool((_coverage([plan], _offsets(counts.tolist())) == 1).all())


def _v4_split_counts():
    """Splits of 49152 rows over 256 experts: V4-Flash's routing (each token's top 6 of 256 random scores), the even
    split (192 each: every remainder 64, all tails), and the extremes of each launch's bound."""
    gen = torch.Generator().manual_seed(0)
    routed = [torch.bincount(torch.rand(8192, 256, generator=gen).topk(6, dim=1).indices.flatten(), minlength=256).tolist() for _ in range(3)]
    rest = lambda counts: counts + [49152 - sum(counts)]  # noqa: E731  (the last expert takes the rows left)
    return routed + [
        [192] * 256,
        rest([193] * 254) + [0],  # body tiles: a full and a padded one an expert
        rest([65] * 255),  # one padded body tile an expert: the body's bound
        rest([64] * 255),  # tail tiles only, but for one expert
        rest([1] * 255),
        rest([0] * 255),  # every row on one expert
        [49152] + [0] * 255,
        rest([3 * 128 + 1, 0] * 127) + [0],  # three full tiles and a tail, every other expert empty
    ]


def test_tail_tiles_compute_every_row_once_at_v4_flash_prefill():
    """Body and tail launches (their grids plan_launches', the kernel's map mirrored) over several splits of 8192 x top-6
    rows: every row and N block computed exactly once, every expert's tiles within the grids."""
    u8 = torch.uint8
    plans = gg.plan_launches(_meta(49152, 4096), _meta(256, 4096, 2048, dtype=u8), gg._CONTIGUOUS, _tail_tiles_on)
    assert len(plans) == 2
    for counts in _v4_split_counts():
        assert sum(counts) == 49152 and len(counts) == 256 and min(counts) >= 0
        assert bool((_coverage(plans, _offsets(counts)) == 1).all()), counts[:8]


def _small_contiguous_plan(experts: int, rows: int, full_m: int, **extra) -> "gg.GluonPlan":
    """A contiguous launch of `rows` rows over `experts` experts in full_m-row tiles and 3 N blocks of 1 (the small-split
    tests' toy shape)."""
    from deepinfer.triton_common import cdiv

    fields = dict(layout=gg._CONTIGUOUS, experts=experts, n=3, k=512, max_m=0, rows_total=rows, block_m=full_m, block_n=1, block_k=128,
                  group_m=2, num_warps=4, num_stages=2, producer_regs=40, maxnreg=None, num_m_tiles=cdiv(rows, full_m) + experts, num_n=3)
    return gg.GluonPlan(**{**fields, **extra})


def test_tail_tile_grid_bounds_hold_for_every_split_of_the_rows():
    """Every split of up to 14 rows over up to 4 experts (body tiles of 4 rows, tail tiles of 2): each launch's tiles fit
    its bound; together they compute every row once. And the V4-Flash prefill bounds against their worst splits."""
    from itertools import combinations_with_replacement


    full_m, tail_m = 4, 2
    for experts in range(1, 5):
        for rows in range(1, 15):
            plan = _small_contiguous_plan(experts, rows, full_m)
            plans = gg.tail_tile_plans(plan, {"num_stages": 2})
            assert [p.num_m_tiles for p in plans] == [n for n in (gg.body_tile_bound(rows, experts, full_m, tail_m), gg.tail_tile_bound(rows, experts)) if n]
            for cuts in combinations_with_replacement(range(rows + 1), experts - 1):  # every split: sorted cut points
                offsets = torch.tensor([0, *cuts, rows], dtype=torch.int32)
                assert bool((_coverage(plans, offsets) == 1).all()), (experts, cuts, rows)  # (and each launch's tiles within its grid)
    # V4-Flash prefill: the body's bound is met by 255 experts of 65 rows and the rest on one, the tail's by any split that
    # leaves every expert a remainder of 1 to 64 rows
    assert gg.body_tile_bound(49152, 256, 128, 64) == 255 + (49152 - 65 * 255 + 63) // 128
    assert gg.tail_tile_bound(49152, 256) == 256


def test_the_wrapper_launches_the_body_then_the_tail_into_one_output(monkeypatch):
    """grouped_gemm with tail tiles on: two launches of the kernel (captured, as the compile check does), TILES 1 then 2,
    on plan_launches' grids, writing the same output."""
    from deepinfer_cuda.bench import compile_check as cc

    u8 = torch.uint8
    launches = []
    with cc._as_arch("sm90", launches):
        monkeypatch.setattr(gg, "config", lambda op, variant, device=None: _tail_tiles_on(variant))
        gg.grouped_gemm(
            _meta(49152, 4096),
            _meta(256, 4096, 2048, dtype=u8),
            expert_offsets=_meta(257, dtype=torch.int32),
            weight_scale=_meta(256, 4096, 128, dtype=u8),
            fmt="mxfp4",
        )
    assert [(launch.kwargs["TILES"], launch.kwargs["BLOCK_M"], launch.kwargs["FULL_M"], launch.kwargs["TAIL_M"]) for launch in launches] == [
        (gg._BODY_TILES, 128, 128, 64),
        (gg._TAIL_TILES, 64, 128, 64),
    ]
    assert [launch.args[9] for launch in launches] == [510, 256]  # num_m_tiles
    assert launches[0].args[3] is launches[1].args[3]  # out


def test_the_prefill_sweep_times_tail_tiles_on_an_even_and_a_routed_split():
    """`python -m deepinfer_cuda.bench.gemm --sweep mxfp4_gluon_large` (on a GPU) times the table's tile with tail tiles
    beside the others, on 192 rows an expert and on a router's split of 8192 x top-6 rows (each fragment names one case)."""
    from deepinfer_cuda.bench import gemm as bench

    large = SM90("mxfp4_gluon_large")
    tile = {key: large[key] for key in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")}
    assert ({**tile, "tail_tiles": True}, {}) in bench.SWEEP["mxfp4_gluon_large"]
    fragments = bench.SWEEP_CASES["mxfp4_gluon_large"]
    assert len(fragments) == 2 and all(sum(fragment in case.name for case in bench.CASES) == 1 for fragment in fragments)
    offsets = bench._routed_offsets(256, 8192, 6, torch.device("cpu"))
    counts = offsets[1:] - offsets[:-1]
    assert offsets.dtype == torch.int32 and int(offsets[0]) == 0 and int(offsets[-1]) == 49152 and bool((counts >= 0).all())
    assert 150 < int(counts.min()) < 192 < int(counts.max()) < 240  # about 192 +- 14 an expert, not all equal
    assert torch.equal(offsets, bench._routed_offsets(256, 8192, 6, torch.device("cpu")))  # a fixed seed


# ---------------------------------------------------------------------------------------------
# The persistent form (the prefill entry's "persistent" flag, off: measured no faster on an H100): the host's plans, and a mirror
# of its walk (each program tiles pid, pid + programs, ... over the exact row tiles). The kernel itself is compiled by the
# compile check's "persistent" cases; its output is compared with the table's by the prefill entry's sweep on a GPU.

H100_SMS = 132


def _persistent_on(variant, tail_tiles=True):
    """The SM90 table with the prefill entry's persistent flag on (and tail tiles as given)."""
    return {**SM90(variant), **({"persistent": True, "tail_tiles": tail_tiles} if variant == "mxfp4_gluon_large" else {})}


def test_persistent_is_off_in_the_table():
    large = SM90("mxfp4_gluon_large")
    assert large["persistent"] is False
    u8 = torch.uint8
    for p in gg.plan_launches(_meta(49152, 4096), _meta(256, 4096, 2048, dtype=u8), gg._CONTIGUOUS, SM90, sms=H100_SMS):
        assert not p.persistent and p.max_programs == 0 and p.grid == (p.num_m_tiles * p.num_n,)


def test_persistent_plans_one_program_per_sm_at_v4_flash_prefill():
    """w13 and w2 at 8192 tokens x top-6: the body and tail launches each at most one program per SM (their tile bounds
    are far above 132), the entry's 3 stages (two 8 KiB scale boxes in place of the 32 / 16 KiB strip: 4 would fit),
    the producer warp at the entry's persistent_producer_regs; masked and linear calls persistent too."""
    u8 = torch.uint8
    for k in (4096, 2048):
        body, tail = gg.plan_launches(_meta(49152, k), _meta(256, 4096, k // 2, dtype=u8), gg._CONTIGUOUS, _persistent_on, sms=H100_SMS)
        assert body.persistent and tail.persistent
        assert (body.tiles, body.block_m, tail.tiles, tail.block_m) == (gg._BODY_TILES, 128, gg._TAIL_TILES, 64)
        assert body.grid == tail.grid == (H100_SMS,) and body.tiles_bound == 510 * 16 and tail.tiles_bound == 256 * 16
        assert body.num_stages == tail.num_stages == 3 and body.producer_regs == tail.producer_regs == 64
    assert gg._fit_stages(128, 256, 128, 4096, 4, persistent=True) == 4  # 2 x 8 KiB + 4 x 48 KiB
    assert gg._fit_stages(128, 256, 128, 4096, 4) == 3  # the strip: 32 KiB + 3 x 48 KiB
    assert gg._fit_stages(128, 256, 128, 65536, 3, persistent=True) == 3  # the scale slots do not grow with K
    masked = gg.plan_gluon(_meta(8, 1024, 4096), _meta(8, 4096, 2048, dtype=u8), gg._MASKED, _persistent_on, sms=H100_SMS)
    assert masked.persistent and masked.tiles_bound == 8 * 16 * 8 and masked.grid == (H100_SMS,)
    small = gg.plan_gluon(_meta(2, 128, 4096), _meta(2, 4096, 2048, dtype=u8), gg._MASKED, _persistent_on, sms=H100_SMS)
    assert small.grid == (small.tiles_bound,) == (2 * 16,)  # fewer tiles than SMs: a program a tile
    linear = gg.plan_gluon(_meta(4096, 4096), _meta(4096, 2048, dtype=u8), gg._LINEAR, _persistent_on, sms=H100_SMS)
    assert linear.persistent and linear.grid == (H100_SMS,)
    # decode-sized calls take the decode entry (no persistent flag): one program a tile
    assert not gg.plan_gluon(_meta(1536, 4096), _meta(256, 4096, 2048, dtype=u8), gg._CONTIGUOUS, _persistent_on, sms=H100_SMS).persistent


@pytest.mark.parametrize("tail_tiles", [True, False])
def test_persistent_walk_computes_every_row_once_at_v4_flash_prefill(tail_tiles):
    """The persistent launches (132 programs, their walk mirrored) over V4-Flash's splits of 8192 x top-6 rows, with and
    without tail tiles: every tile index walked once, every row and N block computed once, the same tiles as the
    one-program-a-tile launches compute."""
    u8 = torch.uint8
    cfg = lambda variant: _persistent_on(variant, tail_tiles)  # noqa: E731
    plans = gg.plan_launches(_meta(49152, 4096), _meta(256, 4096, 2048, dtype=u8), gg._CONTIGUOUS, cfg, sms=H100_SMS)
    assert len(plans) == (2 if tail_tiles else 1) and all(p.persistent and p.grid == (H100_SMS,) for p in plans)
    for counts in _v4_split_counts():
        offsets = _offsets(counts)
        assert bool((_coverage(plans, offsets) == 1).all()), counts[:8]
        for plan in plans:  # the same (expert, row_start, N block) tiles as today's launch's tiles with work
            e, start, end, pid_n, _ = _program_tiles(plan, offsets)
            pe, pstart, pend, ppid_n, _ = _persistent_tiles(plan, offsets)
            today = {(int(a), int(b), int(c)) for a, b, c, w in zip(e, start, pid_n, start < end) if w}
            walked = {(int(a), int(b), int(c)) for a, b, c in zip(pe, pstart, ppid_n)}
            assert bool((pstart < pend).all()) and walked == today and len(walked) == len(pe)


def test_persistent_walk_balances_the_programs():
    """Round-robin: at 192 rows an expert the body's 4096 tiles (256 experts x 16 N blocks) give each of 132 programs 31
    or 32 tiles; a program's consecutive tiles are GROUP_M row tiles' worth apart in the grouped order."""
    u8 = torch.uint8
    body, tail = gg.plan_launches(_meta(49152, 4096), _meta(256, 4096, 2048, dtype=u8), gg._CONTIGUOUS, _persistent_on, sms=H100_SMS)
    offsets = _offsets([192] * 256)
    for plan in (body, tail):
        per_program = torch.bincount(torch.tensor([p for p, _ in _persistent_walk(plan, offsets)]), minlength=H100_SMS)
        assert int(per_program.sum()) == 4096 and set(per_program.tolist()) == {31, 32}


def test_persistent_walk_computes_every_row_once_for_every_small_split():
    """Every split of up to 14 rows over up to 4 experts (body tiles of 4 rows, tail tiles of 2; and without tail tiles),
    on 1, 2, 3 and 5 programs: every row computed once."""
    from itertools import combinations_with_replacement


    full_m = 4  # (tail tiles of 2)
    for experts in range(1, 5):
        for rows in range(1, 15):
            for programs in (1, 2, 3, 5):
                plan = _small_contiguous_plan(experts, rows, full_m, producer_regs=64, max_programs=programs)
                for plans in ((plan,), gg.tail_tile_plans(plan, {"num_stages": 2})):
                    assert all(p.persistent and p.grid[0] <= programs for p in plans)
                    for cuts in combinations_with_replacement(range(rows + 1), experts - 1):
                        offsets = torch.tensor([0, *cuts, rows], dtype=torch.int32)
                        assert bool((_coverage(plans, offsets) == 1).all()), (experts, cuts, rows, programs)


def test_persistent_masked_walk_is_the_grids_program_order():
    """Masked: tile -> (row tile, N block, expert) with row tiles fastest, then N blocks (`_tile_of`), the order of the
    one-program-a-tile grid's program ids; every (row tile, N block, expert) walked once."""
    num_m_tiles, num_n, experts, programs = 3, 4, 5, 7
    walked = []
    for p in range(programs):
        for tile in range(p, num_m_tiles * num_n * experts, programs):
            pid_m, rest = tile % num_m_tiles, tile // num_m_tiles
            walked.append((pid_m, rest % num_n, rest // num_n))
    assert sorted(walked) == sorted((m, n, e) for m in range(num_m_tiles) for n in range(num_n) for e in range(experts))


def test_the_wrapper_launches_the_persistent_kernel_on_one_program_per_sm(monkeypatch):
    """grouped_gemm with the flag on: the persistent kernel, body then tail, 132 programs each (the compile check's
    sm90 SM count), its SCALE_SLOTS and producer registers; off: the one-program-a-tile kernel."""
    from deepinfer_cuda.bench import compile_check as cc

    u8 = torch.uint8
    for on in (True, False):
        launches = []
        with cc._as_arch("sm90", launches):
            monkeypatch.setattr(gg, "config", lambda op, variant, device=None, on=on: _persistent_on(variant) if on else SM90(variant))
            gg.grouped_gemm(
                _meta(49152, 4096),
                _meta(256, 4096, 2048, dtype=u8),
                expert_offsets=_meta(257, dtype=torch.int32),
                weight_scale=_meta(256, 4096, 128, dtype=u8),
                fmt="mxfp4",
            )
        kernel = gg._mxfp4_gemm_persistent_kernel if on else gg._mxfp4_gemm_ws_kernel
        assert [launch.kernel for launch in launches] == [kernel, kernel]
        assert [launch.kwargs["TILES"] for launch in launches] == [gg._BODY_TILES, gg._TAIL_TILES]
        if on:
            assert all(launch.kwargs["SCALE_SLOTS"] == gg.SCALE_SLOTS and launch.kwargs["PRODUCER_REGS"] == 64 for launch in launches)


def test_the_prefill_sweep_compares_the_persistent_form_with_the_table():
    """The prefill entry's sweep (on a GPU) times the table's tile persistent, with tail tiles, and prints its largest
    difference from the table's output (equal: the same K steps in the same order)."""
    from deepinfer_cuda.bench import gemm as bench

    large = SM90("mxfp4_gluon_large")
    tile = {key: large[key] for key in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")}
    assert ({**tile, "tail_tiles": True, "persistent": True}, {}) in bench.SWEEP["mxfp4_gluon_large"]
