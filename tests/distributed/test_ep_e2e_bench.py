"""`deepinfer bench e2e-ep` on the CPU: a tiny DeepSeek-V3-shaped random model (config overrides),
two ranks over gloo on the reference backend, with and without EPLB redundant experts on a skewed
routing load; the JSON rows are checked, never the speed (timings mean something only on a GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from deepinfer.bench import e2e_ep
from deepinfer.model.weights import LINEAR, TensorSpec

from waits import HANG_S

TINY = dict(
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16,
    n_group=4, topk_group=2, num_experts_per_tok=4, vocab_size=512, max_position_embeddings=256, rope_scaling=None,
)  # fmt: skip


def overrides() -> list[str]:
    return [word for key, value in TINY.items() for word in ("--override", f"{key}={json.dumps(value)}")]


def test_two_ranks_with_and_without_redundant_experts(tmp_path):
    out = tmp_path / "ep2.json"
    command = [
        sys.executable, "-m", "deepinfer", "bench", "e2e-ep", "--ep", "2", "--backend", "reference", "--dtype", "float32",
        *overrides(), "--layers", "3", "--batch", "2", "--batch", "4", "--prompt-len", "8", "--new-tokens", "6",
        "--num-redundant-experts", "0", "--num-redundant-experts", "2", "--skew", "1", "--skew-experts", "2", "--json", str(out),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert e2e_ep.HEADER in proc.stdout
    saved = json.loads(out.read_text())
    machine = saved["machine"]
    assert machine["ep"] == 2 and machine["backend"] == "reference" and machine["layers"] == 3 and machine["dense_layers"] == 1
    rows = saved["results"]
    variants = [(r["num_redundant_experts"], r["placement"], r["batch_per_rank"]) for r in rows]
    assert variants == [(0, "default", 2), (0, "default", 4), (2, "eplb", 2), (2, "eplb", 4)]
    for r in rows:
        assert r["ep"] == 2 and r["total_batch"] == 2 * r["batch_per_rank"] and r["cuda_graphs"] is False and r["ep_path"] == "gloo"
        assert r["step_ms"] > 0 and len(r["step_ms_per_rank"]) == 2 and r["step_ms"] == max(r["step_ms_per_rank"])
        assert r["tok_s"] == pytest.approx(r["total_batch"] / (r["step_ms"] / 1e3))
        assert r["tok_s_per_rank"] == pytest.approx(r["tok_s"] / 2)
        assert r["expert_max_mean"] > 1.5  # the skew made a few experts hot
        assert r["rank_max_mean"] >= 1.0
    default, eplb = rows[0], rows[2]
    assert default["eplb_rank_max_mean_before"] is None
    # EPLB placed 18 physical experts from the warm-up's load: the ranks carry (nearly) equal rows.
    assert eplb["eplb_rank_max_mean_after"] < eplb["eplb_rank_max_mean_before"]
    assert eplb["rank_max_mean"] < default["rank_max_mean"]


def test_one_process_rows_and_deterministic_weights():
    rows = e2e_ep.run(
        "reference", batches=(2,), prompt_len=8, new_tokens=4, layers=2, redundant=(0,), skew=1.0, skew_experts=2.0, dtype=torch.float32, config_overrides=TINY
    )
    assert [(r.ep, r.placement, r.batch_per_rank, r.rank_max_mean) for r in rows] == [(1, "default", 2, 1.0)] and rows[0].ep_path == "-"
    assert "decode tok/s" in e2e_ep.format_results(rows)

    specs = {f"model.layers.1.mlp.experts.3.{p}.weight": TensorSpec((8, 4), LINEAR) for p in ("gate_proj", "up_proj", "down_proj")}
    a = e2e_ep.RandomWeights(specs, torch.device("cpu"), torch.bfloat16)
    b = e2e_ep.RandomWeights(specs, torch.device("cpu"), torch.bfloat16)
    taken = a.linear("model.layers.1.mlp.experts.3.up_proj").weight
    assert taken.dtype == torch.bfloat16 and torch.equal(taken, b("model.layers.1.mlp.", 3)[1].weight)  # EPLB's re-read: same values
    assert len(a.remaining()) == 2 and b.remaining() == sorted(specs)


def test_skew_bias_and_expert_memory():
    bias = e2e_ep.skew_bias(256, layer=3, skew=0.5, skew_experts=16)
    assert bias.max() == pytest.approx(0.5) and (bias > 0.5 / 2.718).sum() == 16
    assert torch.equal(bias, e2e_ep.skew_bias(256, layer=3, skew=0.5, skew_experts=16))
    assert not torch.equal(bias, e2e_ep.skew_bias(256, layer=4, skew=0.5, skew_experts=16))  # each layer its own hot experts
    assert not e2e_ep.skew_bias(256, layer=3, skew=0.0, skew_experts=16).any()
    cfg = e2e_ep.model_config(layers=4, dense_layers=1)
    assert cfg["n_routed_experts"] == 256 and cfg["hidden_size"] == 7168 and cfg["first_k_dense_replace"] == 1
    # 256 experts x 3 x 7168 x 2048 x 2 B = 22.5 GB per MoE layer on one GPU; half on each of two.
    assert e2e_ep.expert_memory_gib(cfg, ep=1) * 2**30 / 3 == pytest.approx(22.55e9, rel=1e-3)
    assert e2e_ep.expert_memory_gib(cfg, ep=2, num_redundant_experts=32) == pytest.approx(e2e_ep.expert_memory_gib(cfg, ep=1) * 144 / 256)


def test_cli_passes_every_option_to_the_ranks():
    from deepinfer.cli import bench_e2e_ep
    from deepinfer.cli.main import build_parser

    parser = build_parser()
    argv = ["bench", "e2e-ep", "--ep", "2", "--batch", "3", "--batch", "5", "--num-redundant-experts", "0", "--num-redundant-experts", "32",
            "--skew", "0.7", "--enforce-eager", "--override", "hidden_size=64"]
    args = parser.parse_args(argv)
    again = parser.parse_args(["bench", "e2e-ep", *bench_e2e_ep.command_line(args)])
    assert vars(again) == vars(args)
    assert bench_e2e_ep.parse_overrides(["a=1", "b=null", "c=text"]) == {"a": 1, "b": None, "c": "text"}


def test_four_ranks_with_redundant_experts(tmp_path):
    """Issue 7's scaling runs need 4 and 8 GPUs; the same command runs 4 ranks here (gloo), experts
    (16 + 4 redundant) sharded 5 per rank."""
    out = tmp_path / "ep4.json"
    command = [
        sys.executable, "-m", "deepinfer", "bench", "e2e-ep", "--ep", "4", "--backend", "reference", "--dtype", "float32",
        *overrides(), "--layers", "2", "--batch", "2", "--prompt-len", "8", "--new-tokens", "4",
        "--num-redundant-experts", "4", "--skew", "1", "--skew-experts", "2", "--json", str(out),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["results"]
    assert row["ep"] == 4 and row["num_redundant_experts"] == 4 and row["placement"] == "eplb"
    assert row["total_batch"] == 8 and len(row["step_ms_per_rank"]) == 4 and row["ep_path"] == "gloo"
    assert row["eplb_rank_max_mean_after"] <= row["eplb_rank_max_mean_before"]
