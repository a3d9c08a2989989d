"""`deepinfer bench e2e --model-shape v41-flash` on the CPU: its arguments, the cut of the V4.1-Flash shape, its
floors (a hand-computed case), and the whole run on the reference backend at a test-only shrink of the shape
with tiny contexts (its timings are only meaningful on a GPU)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.bench import e2e_v41, v41_flash
from deepinfer.cli.main import build_parser, main

# A shrink of V4.1-Flash for the CPU: its window (128), ratios (2 / 1), hc_mult, formats and roles; small widths.
TINY = dict(vocab_size=512, hidden_size=256, num_attention_heads=4, head_dim=128, qk_rope_head_dim=32, q_lora_rank=128, o_groups=2,
            o_lora_rank=128, index_n_heads=4, index_head_dim=64, index_topk=16, n_routed_experts=16, num_experts_per_tok=4,
            moe_intermediate_size=64, engram_n_heads=2, engram_head_dim=32, engram_compressed_vocab_size=300)  # fmt: skip


def parse(*argv: str):
    return build_parser(["bench", "e2e", *argv]).parse_args(["bench", "e2e", *argv])


def test_arguments_and_their_defaults():
    from deepinfer.cli.bench_e2e_v4 import v4_arguments

    kwargs = v4_arguments(parse("--model-shape", "v41-flash"), "V4.1-Flash")
    assert kwargs == dict(batches=(1, 64, 256), contexts=(4096, 32768), steps=16, layers=None, json_path=None, prefills=((8, 8192), (1, 65536)),
                          prefill_chunk=None)  # fmt: skip


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layers", "41"], "--layers cuts the model: at most 40 (V4.1-Flash), not 41"),
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype is for --model-shape v4-flash"),
        (["--context", "1048570"], "exceeds V4.1-Flash's 1048576 positions"),
        (["--deterministic"], "--deterministic is for --model-shape v2-lite"),
    ],
)
def test_bad_arguments_are_one_line(argv, message, capsys):
    assert main(["bench", "e2e", "--model-shape", "v41-flash", *argv]) != 0
    assert message in capsys.readouterr().err


def test_the_shape_cut_keeps_the_sources_below_the_cut():
    full = v41_flash.flash_config()
    assert v41_flash.layer_kinds(full) == {"swa": 2, "full": 4, "reuse": 30, "reindex": 4}
    assert v41_flash.cache_bytes(full) == {"history_bytes_per_token": 890.0, "fixed_bytes_per_request": 40 * 128 * 528 + 7 * 4096 + 32}
    cut = v41_flash.flash_config(9)
    assert cut.kv_source_layer_ids == (2, 8) and cut.candidate_source_layer_id == -1 and cut.engram_layer_ids == (1,)
    assert v41_flash.flash_config(25).candidate_source_layer_id == 20


def test_the_decode_floor_reads_windows_selected_entries_and_every_index_key():
    config = v41_flash.flash_config(4, TINY)  # swa, swa, full (ratio 2), reuse
    window, entry, key = 128 + 4, 64 + 8, 32 + 2  # fp8 + e8m0 / 32, nvfp4 + e4m3 / 16, mxfp4 + e8m0 / 32 at widths 128 and 64
    p = 99  # 100 tokens: 50 entries visible, 16 selected
    assert v41_flash.cache_read_bytes(config, p) == 4 * 100 * window + 2 * 16 * entry + 50 * key
    parts = v41_flash.floor_parts(config, 2, p, dtype_bytes=4)
    assert parts["cache"] == 2 * v41_flash.cache_read_bytes(config, p) and parts["dense weights"] > 0 and parts["routed experts"] > 0


def test_the_whole_run_on_the_cpu_at_a_shrink_of_the_shape(tmp_path):
    results, prefill, info = e2e_v41.run("reference", batches=(1, 2), contexts=(40,), steps=2, warmup=1, layers=4, copy_gib=0.01,
                                         config_overrides=TINY, dtype=torch.float32, prefills=((1, 48),), prefill_chunk=32, matmul_n=64,
                                         json_path=tmp_path / "v41.json", progress=lambda line: None)  # fmt: skip
    assert [(r.batch, r.context) for r in results] == [(1, 40), (2, 40)] and all(r.step_ms > 0 and r.floor_ms > 0 for r in results)
    assert [(r.batch, r.prompt_len, r.steps) for r in prefill] == [(1, 48, 2)] and prefill[0].floor_s > 0
    assert info["layers"] == 4 and info["cache"]["all_layers"]["history_bytes_per_token"] > info["cache"]["kept_layers"]["history_bytes_per_token"]
    text = e2e_v41.format_results(results, info, prefill)
    assert "B per token of history" in text and "1 x 48" in text
    assert (tmp_path / "v41.json").exists()
