"""DeepSeek-V4-Flash's prefill fp8_block GEMMs: the shapes the sweep times, the tuning entry each plans, and the sweep's
own tables (no GPU: plans on "meta" tensors with the wrappers pointed at sm90, as the compile check does).

`python -m deepinfer_cuda.bench.gemm --sweep fp8_v4_prefill` times these shapes on a GPU; `deepinfer bench compile --arch
sm90 --sweep fp8_v4_prefill` compiles its candidates.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.bench.e2e_v4 import flash_config
from deepinfer.bench.v4_weights import FP8, weight_format
from deepinfer.model.deepseek_v4.config import CSA, HCA, SLIDING
from deepinfer.model.deepseek_v4.model import model_tensor_specs
from deepinfer_cuda.bench import compile_check as cc
from deepinfer_cuda.bench import gemm as bench
from deepinfer_cuda.kernels import gemm as kg

TOKENS = bench.V4_PREFILL_TOKENS
FP8_T = torch.float8_e4m3fn


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _operands(g: bench.V4Gemm):
    """(x, weight, layout) as the model hands them to the op: wo_a's groups over a transposed view of its heads."""
    if g.layout == "masked":
        return _meta(TOKENS, g.groups, g.k).transpose(0, 1), _meta(g.groups, g.n, g.k, dtype=FP8_T), kg._MASKED
    return _meta(TOKENS, g.k), _meta(g.n, g.k, dtype=FP8_T), kg._LINEAR


def _planned(g: bench.V4Gemm, arch: str = "sm90", table=None):
    """(the plan, the gemm tuning entries it read) for `g` on `arch`; table: a tuning lookup in place of the arch's."""
    asked = []
    with cc._as_arch(arch, []):
        lookup = table or kg.config

        def recording(op, variant, device=None):
            asked.append(variant)
            return lookup(op, variant, device)

        kg.config = recording  # (restored by _as_arch on exit)
        x, w, layout = _operands(g)
        return kg.plan_gemm(x, w, "fp8_block", layout), asked


def test_the_shapes_are_every_fp8_weight_of_a_v4_flash_layer():
    """v4_prefill_fp8_gemms lists each fp8 weight of every layer kind once (wq_a and wkv fused, w1 and w3 fused), at its
    [N, K], and the indexer's wq_b only where the layer is CSA."""
    config = flash_config(layers=4)  # sliding, sliding, CSA, HCA
    assert config.layer_types == (SLIDING, SLIDING, CSA, HCA)
    gemms = {g.name: g for g in bench.v4_prefill_fp8_gemms()}
    specs = model_tensor_specs(config)
    for layer, kind in enumerate(config.layer_types):
        fp8 = {name.split(f"layers.{layer}.", 1)[1]: spec.shape for name, spec in specs.items()
               if f"layers.{layer}." in name and weight_format(name, spec) == FP8}
        fused = {
            "wq_a+wkv": ("attn.wq_a.weight", "attn.wkv.weight"), "wq_b": ("attn.wq_b.weight",), "wo_b": ("attn.wo_b.weight",),
            "indexer wq_b": ("attn.indexer.wq_b.weight",), "shared w1|w3": ("ffn.shared_experts.w1.weight", "ffn.shared_experts.w3.weight"),
            "shared w2": ("ffn.shared_experts.w2.weight",),
        }
        covered = {"attn.wo_a.weight"}
        for name, parts in fused.items():
            g = gemms[name]
            runs = g.kinds is None or kind in g.kinds
            assert all(p in fp8 for p in parts) == runs, (layer, name)
            if runs:
                assert (g.n, g.k) == (sum(fp8[p][0] for p in parts), fp8[parts[0]][1]), name
                covered.update(parts)
        wo_a = gemms["wo_a"]
        assert (wo_a.groups * wo_a.n, wo_a.k * wo_a.groups) == (fp8["attn.wo_a.weight"][0], config.num_attention_heads * config.head_dim)
        assert covered == set(fp8), (layer, set(fp8) - covered)


def test_each_shape_plans_the_large_entry_or_its_short_k_entry_on_sm90():
    """K <= 1024 (wq_b, the indexer's wq_b) reads fp8_block_large_short_k, 64 x 128 tiles of 4 warps (the H100 sweep's
    fastest there); the rest fp8_block_large's 128 x 128 of 8. Every plan is one pass of the TMA kernel (no split-K at
    8192 rows)."""
    for g in bench.v4_prefill_fp8_gemms():
        plan, asked = _planned(g)
        short = g.k <= kg.SHORT_K
        assert asked[0] == ("fp8_block_large_short_k" if short else "fp8_block_large"), g.name
        want = (64, 128, 128, 4, 4) if short else (128, 128, 128, 8, 4)
        assert (plan.block_m, plan.block_n, plan.block_k, plan.num_warps, plan.num_stages) == want, g.name
        assert plan.tma and plan.split == 1 and not plan.k_pairs, g.name


def test_a_short_k_entry_decides_k_1024_only_and_its_absence_falls_back():
    wq_b, wo_b = (next(g for g in bench.v4_prefill_fp8_gemms() if g.name == name) for name in ("wq_b", "wo_b"))
    short = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4, "tma": True}

    def table(op, variant, device=None):
        return dict(short) if variant == "fp8_block_large_short_k" else cc.arch_config(op, variant, "sm90")

    plan, _ = _planned(wq_b, table=table)
    assert (plan.block_m, plan.block_n, plan.num_warps, plan.num_stages, plan.tma) == (64, 128, 4, 4, True)
    plan, _ = _planned(wo_b, table=table)
    assert (plan.block_m, plan.num_warps) == (128, 8)
    # sm100 (and the default table) have no short-K entry: its large one serves K 1024
    plan, asked = _planned(wq_b, arch="sm100")
    assert asked[:2] == ["fp8_block_large_short_k", "fp8_block_large"]
    large = cc.arch_config("gemm", "fp8_block_large", "sm100")
    assert (plan.block_m, plan.block_n, plan.num_stages) == (large["BLOCK_M"], large["BLOCK_N"], large["num_stages"])
    # decode rows keep their entries whatever K
    with cc._as_arch("sm90", []):
        assert kg._shape_entry("fp8_block", "fp8_block_small", 1024, None) == cc.arch_config("gemm", "fp8_block_small", "sm90")


def test_the_sweep_times_every_shape_and_compiles_its_candidates():
    cases = bench.sweep_cases("fp8_v4_prefill")
    assert [c.name for c in cases] == [c.name for c in bench.V4_PREFILL_CASES] and len(cases) == len(bench.v4_prefill_fp8_gemms())
    assert not {c.name for c in bench.V4_PREFILL_CASES} & {c.name for c in bench.CASES}  # sweep-only: `bench ops` unchanged
    assert all(c.peer is not None for c in cases)  # the torch fp8 rate reference beside each
    table = cc.arch_config("gemm", "fp8_block_large", "sm90")
    candidates = bench.SWEEP["fp8_v4_prefill"]
    assert 5 <= len(candidates) <= 15
    first = {**table, **bench.sweep_override(*candidates[0])}
    assert first == {"warp_specialize": False, **table}  # the table's own tile leads: its row is the baseline the others compare with
    assert set(bench.sweep_entries("fp8_v4_prefill")) == {"fp8_block_large", "fp8_block_large_short_k"}
    assert bench.sweep_entries("dense_large") == ("dense_large",)
    compile_cases = cc.sweep_cases("fp8_v4_prefill")
    assert len(compile_cases) == len(candidates) * len(cc.V4_PREFILL_COMPILE_SHAPES)
    with pytest.raises(ValueError, match="fp8_v4_prefill"):
        cc.sweep_cases("dense_large")


def test_a_sweep_candidate_reaches_the_launch_of_every_shape():
    """What the compile check captures for a candidate: its tile at every compile shape, through the short-K entry too."""
    cfg, extra = next((c, x) for c, x in bench.SWEEP["fp8_v4_prefill"] if c["BLOCK_M"] == 64 and x.get("kp"))
    for case in (c for c in cc.sweep_cases("fp8_v4_prefill") if "BLOCK_M=64" in c.name and "kp=True" in c.name):
        launches = []
        with cc._as_arch("sm90", launches):
            case.call()
        gemm = [launch for launch in launches if launch.kernel.__name__ == "_gemm_tma_kernel"]
        assert len(gemm) == 1, case.name
        kw = gemm[0].kwargs
        assert (kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"], kw["num_stages"], kw["K_PAIRS"]) == (64, 128, 4, cfg["num_stages"], True), case.name


TINY_V4 = {"hidden_size": 256, "q_lora_rank": 128, "num_attention_heads": 2, "head_dim": 128, "o_groups": 2, "o_lora_rank": 128,
           "index_n_heads": 1, "index_head_dim": 128, "moe_intermediate_size": 128, "n_shared_experts": 1}


def test_the_sweep_loop_runs_each_candidate_and_its_reference_rows(monkeypatch):
    """_sweep_case end to end under the interpreter on the CPU (timing stubbed: one call a row), on V4's layouts at toy
    widths: a linear and wo_a's masked layout over a transposed view. Each candidate's output equals the table tile's
    (fp8 products summed in float32: the tiles change the order of the 128-K groups' sums at most), then the peer's and
    the quantiser's rows; the tuning lookup is restored after."""
    from deepinfer_cuda.bench import common

    monkeypatch.setattr(common, "time_ms", lambda fn, **_: (fn(), 1.0)[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, **_: a.float() @ b.float(), raising=False)  # the peer (no CPU fp8 matmul)
    monkeypatch.setitem(bench.SWEEP, "fp8_v4_prefill", bench.SWEEP["fp8_v4_prefill"][:1] + [(dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2), {})])
    gemms = {g.name: g for g in bench.v4_prefill_fp8_gemms(TINY_V4)}
    table = kg.config
    for name in ("wq_b", "wo_a"):
        case = bench._v4_prefill_case(gemms[name], tokens=48)
        rows = bench._sweep_case("fp8_v4_prefill", case, torch.device("cpu"))
        assert [r["cfg"] for r in rows[2:]] == ["peer torch._scaled_mm per-tensor" if name == "wq_b" else f"peer {case.peer_name}",
                                              "fp8 activation quantiser alone"]
        assert all(r["ms"] == 1.0 for r in rows), rows
        assert all(r["max_diff"] is not None and r["max_diff"] < 1e-2 for r in rows[:2]), rows
        assert kg.config is table
