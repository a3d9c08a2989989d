"""`deepinfer bench e2e --model-shape v4-flash` on the CPU: its arguments, its floor (a hand-computed
case), its memory plan, the random release-format weights, starting a request at a cache length,
and the whole run on the reference backend at a test-only shrink of the V4-Flash shape (its timings
are only meaningful on a GPU)."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.bench import e2e_v4
from deepinfer.bench.e2e import GiB
from deepinfer.cli.main import build_parser, main
from deepinfer.errors import UserError

# A shrink of V4-Flash for the CPU: V4's window (128), ratios (4 / 128), hc_mult and formats; small widths.
TINY = dict(vocab_size=512, hidden_size=256, num_attention_heads=4, head_dim=128, qk_rope_head_dim=32, q_lora_rank=128, o_groups=2,
            o_lora_rank=128, index_n_heads=4, index_head_dim=64, index_topk=16, n_routed_experts=16, num_experts_per_tok=4,
            moe_intermediate_size=64)  # fmt: skip


def parse(*argv: str):
    return build_parser(["bench", "e2e", *argv]).parse_args(["bench", "e2e", *argv])


# -- arguments -------------------------------------------------------------------------------


def test_v4_arguments_and_their_defaults():
    from deepinfer.cli.bench_e2e_v4 import v4_arguments

    kwargs = v4_arguments(parse("--model-shape", "v4-flash"))
    assert kwargs == dict(batches=(1, 64, 256), contexts=(4096, 32768), steps=16, layers=None, kv_cache_dtype="fp8", json_path=None, profile_rows=0,
                          enforce_eager=False)
    given = v4_arguments(parse("--model-shape", "v4-flash", "--batch", "8", "--context", "1000", "--context", "70000", "--new-tokens", "4",
                               "--layers", "3", "--kv-cache-dtype", "auto"))  # fmt: skip
    assert given == dict(batches=(8,), contexts=(1000, 70000), steps=4, layers=3, kv_cache_dtype="auto", json_path=None, profile_rows=0,
                         enforce_eager=False)
    profiled = v4_arguments(parse("--model-shape", "v4-flash", "--profile", "--profile-rows", "7"))
    assert profiled["profile_rows"] == 7
    assert v4_arguments(parse("--model-shape", "v4-flash", "--enforce-eager"))["enforce_eager"] is True
    assert parse().model_shape == "v2-lite"  # the default shape is unchanged


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model-shape", "v4-flash", "--layers", "44"], "--layers cuts the model: at most 43 (V4-Flash), not 44"),
        (["--model-shape", "v4-flash", "--context", "0"], "--context must be at least 1, not 0"),
        (["--model-shape", "v4-flash", "--layers", "0"], "--layers must be at least 1, not 0"),
        (["--model-shape", "v4-flash", "--batch", "0"], "--batch must be at least 1, not 0"),
        (["--model-shape", "v4-flash", "--context", "1048570"], "exceeds V4-Flash's 1048576 positions"),
        (["--model-shape", "v4-flash", "--prompt-len", "64"], "--prompt-len is for the v2-lite shape"),
        (["--context", "4096"], "--context is for --model-shape v4-flash"),
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype is for --model-shape v4-flash"),
        (["--enforce-eager"], "--enforce-eager is for --model-shape v4-flash"),
    ],
)
def test_bad_arguments_are_one_line(argv, message, capsys):
    assert main(["bench", "e2e", "--backend", "reference", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err


def test_an_unknown_kv_cache_dtype_is_a_usage_error(capsys):
    assert main(["bench", "e2e", "--model-shape", "v4-flash", "--kv-cache-dtype", "int8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--kv-cache-dtype: invalid choice: 'int8' (choose from 'auto', 'fp8')" in err, err


# -- the floor and the memory plan -----------------------------------------------------------


def test_floor_of_a_hand_counted_model():
    """Two layers (CSA with hash routing, HCA with scored routing), batch 2, decoding position 299, fp8 cache."""
    config = e2e_v4.flash_config(2, {**TINY, "compress_ratios": [4, 128], "num_hash_layers": 1})
    parts = e2e_v4.floor_parts(config, batch=2, position=299, kv_dtype=torch.float8_e4m3fn, dtype_bytes=2)
    # Outside the layers: head 512*256*2 = 262144, final norm 256*4, hc_head fn 4*1024*4 + base 16 + scale 4; embedding rows 2*256*2.
    outside = 262144 + 1024 + 16384 + 16 + 4 + 2 * 512
    # Every layer: attn/ffn norms 2*1024, hc fn 2*24*1024*4, base 2*96, scale 2*12; attention in fp8 (weight bytes + 4 per
    # 128x128 block): wq_a 32768+8, wq_b 65536+16, wkv 32768+8, wo_a 65536+16, wo_b 65536+16, q_norm and kv norm 2*512,
    # sinks 16; router 16*256*4; shared expert fp8 3*(16384+8).
    common = 2 * 1024 + 2 * 98304 + 2 * 96 + 2 * 12 + (32776 + 65552 + 32776 + 65552 + 65552 + 2 * 512 + 16) + 16384 + 3 * 16392
    # CSA: compressor bf16 wkv/wgate 2*256*256*2, ape 4*256*4, norm 128*4; indexer compressor 2*128*256*2, ape 4*128*4, norm 64*4;
    # indexer wq_b fp8 256*128+8, weights_proj bf16 4*256*2; hash table rows 2 tokens * 4 experts * 8.
    csa = 2 * 131072 + 4096 + 512 + 2 * 65536 + 2048 + 256 + 32776 + 2048 + 2 * 4 * 8
    # HCA: compressor bf16 wkv/wgate 2*128*256*2, ape 128*128*4, norm 128*4; correction bias 16*4.
    hca = 2 * 65536 + 65536 + 512 + 64
    assert parts["dense weights"] == outside + 2 * common + csa + hca == 1968156
    # Routed: 16 * (1 - (3/4)^2) = 7 distinct experts per layer, each 3 mxfp4 matrices of 64x256: 3 * (8192 + 512).
    assert e2e_v4.distinct_experts(16, 4, 2) == 7.0
    assert parts["routed experts"] == 2 * 7 * 3 * (8192 + 512) == 365568
    # Per sequence: the window's 128 rows of 128 in both layers; CSA: 75 index keys of 64 and 16 selected entries of 128;
    # HCA: 2 complete entries of 128; FP8 rows of one byte per value and a 16-byte tail (scale + padding).
    assert parts["KV"] == 2 * (2 * 128 * 144 + 75 * 80 + 16 * 144 + 2 * 144) == 90912
    bf16 = e2e_v4.floor_parts(config, batch=2, position=299, kv_dtype=torch.bfloat16, dtype_bytes=2)
    assert bf16["KV"] == 2 * (2 * 128 * 128 + 75 * 64 + 16 * 128 + 2 * 128) * 2


def test_layers_are_the_most_that_fit_and_a_misfit_is_one_line():
    def plan(n):
        return {"weights": n * 10 * GiB, "KV cache": 5 * GiB}

    assert e2e_v4.choose_layers(plan, 57 * GiB, None, "cpu", most=43) == 5
    assert e2e_v4.choose_layers(plan, 10**6 * GiB, None, "cpu", most=43) == 43
    assert e2e_v4.choose_layers(plan, None, None, "cpu", most=7) == 7
    assert e2e_v4.choose_layers(plan, 57 * GiB, 4, "cpu") == 4
    with pytest.raises(UserError, match=r"needs at least 15.0 GiB on cpu \(weights 10.0, KV cache 5.0\) and 14.0 GiB is free for even one layer") as error:
        e2e_v4.choose_layers(plan, 14 * GiB, None, "cpu")
    assert "\n" not in str(error.value)
    with pytest.raises(UserError, match="for the 6-layer model; cut it further with --layers"):
        e2e_v4.choose_layers(plan, 57 * GiB, 6, "cpu")


def test_the_v4_flash_plan_counts_its_weights_and_caches():
    flash = e2e_v4.flash_config()
    kinds = [flash.layer_types.count(kind) for kind in ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")]
    assert flash.num_hidden_layers == 43 and kinds == [2, 21, 20] and flash.mlp_layer_types.count("hash_moe") == 3
    parts = e2e_v4.memory_parts(flash, num_blocks=1, block_size=64, max_batch=1, kv_dtype=torch.float8_e4m3fn, dtype=torch.bfloat16, copy_gib=2.0)
    # 256 experts x 3 x 2048 x 4096 in mxfp4 (0.5 + 1/32 bytes each) per layer: 3.43 GB; 43 layers plus the rest: ~156 GB.
    assert 150e9 < parts["weights"] < 160e9 and parts["expert stacking"] == 2 * 256 * 3 * 2048 * 4096 * (0.5 + 1 / 32)
    assert parts["bandwidth test"] == 4 * GiB


# -- weights, cache length, the run ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_engine():
    from deepinfer.bench.v4_weights import RandomV4Weights
    from deepinfer.engine.llm_engine import EngineConfig, LLMEngine
    from deepinfer.model.deepseek_v4.model import DeepseekV4ForCausalLM
    from deepinfer.model.loader import LoadedModel
    from deepinfer.runtime import open_runtime

    config = e2e_v4.flash_config(4, TINY)
    runtime = open_runtime("reference", dtype=torch.float32)
    model = DeepseekV4ForCausalLM(config, runtime.ops, runtime.device, torch.float32, max_positions=1024)
    weights = RandomV4Weights(config, runtime.device, torch.float32)
    model.load_weights(weights)
    assert weights.remaining() == []
    engine_config = EngineConfig(max_num_seqs=4, num_kv_blocks=128, enable_prefix_caching=False, max_model_len=1024, kv_cache_dtype="fp8")
    return LLMEngine(LoadedModel(model, config, None, "tiny"), runtime, torch.float32, engine_config)


def test_weights_are_drawn_in_the_release_formats(tiny_engine):
    model = tiny_engine.loaded.model
    csa = model.layers[2]
    assert csa.attn.kind == "compressed_sparse_attention"
    for projection in (csa.attn.wq_a, csa.attn.wq_b, csa.attn.wkv, csa.attn.wo_b, csa.attn.index_wq_b):
        assert projection.fmt == "fp8_block" and projection.weight.dtype == torch.float8_e4m3fn
    assert csa.attn.wo_a.fmt == "fp8_block"  # the grouped output projection, one FP8 "expert" per group
    assert csa.attn.compressor.wkv.fmt == "dense" and csa.attn.index_weights.fmt == "dense"  # bf16 in the release
    assert csa.ffn.down.fmt == "mxfp4" and csa.ffn.down.weight.dtype == torch.uint8
    assert all(part.fmt == "mxfp4" for part in csa.ffn.gate_up.parts)
    assert all(p.fmt == "fp8_block" for p in csa.ffn.shared[0].parts) and csa.ffn.shared[1].fmt == "fp8_block"
    assert model.layers[3].ffn.bias is not None and not model.layers[3].ffn.bias.any()  # zero correction bias: near-uniform routing


def test_a_request_admitted_at_its_cache_length_computes_only_its_last_token(tiny_engine):
    from deepinfer.engine.sampling_params import SamplingParams
    from deepinfer.ops import kv_cache_format

    csa = tiny_engine.runner.kv_caches[2]
    e2e_v4.fill_random(tiny_engine.runner.kv_caches, torch.Generator().manual_seed(0))
    for cache in (csa.swa, csa.compressor.pool, csa.indexer.pool):  # FP8 rows: N(0, 1) values with their scales
        values = kv_cache_format.dequantize_rows(cache)
        assert cache.dtype == torch.float8_e4m3fn and torch.isfinite(values).all() and 0.5 < values.std() < 2
    assert csa.compressor.ring_kv.std() > 0.5  # the float32 rings too
    before = tiny_engine.num_prompt_tokens_computed
    seqs = [e2e_v4.admit_at_cache_length(tiny_engine, list(range(300 + i)), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)) for i in range(2)]
    assert [s.num_computed_tokens for s in seqs] == [299, 300] and not tiny_engine.scheduler.waiting
    tiny_engine.step()
    assert tiny_engine.num_prompt_tokens_computed - before == 2  # one token each, not 599
    assert [s.num_computed_tokens for s in seqs] == [300, 301] and all(s.num_output_tokens == 1 for s in seqs)
    tiny_engine.step()  # a decode step
    assert all(s.num_output_tokens == 2 for s in seqs)
    tiny_engine.abort_all()
    assert tiny_engine.block_manager.num_free_blocks == tiny_engine.num_kv_blocks


def test_the_tiny_run_on_the_reference_backend(tmp_path):
    out = tmp_path / "v4.json"
    results, info = e2e_v4.run("reference", batches=(1, 3), contexts=(300,), steps=2, warmup=1, kv_cache_dtype="fp8", json_path=out,
                               config_overrides={**TINY, "num_hidden_layers": 4}, copy_gib=0.01, progress=lambda line: None, profile_rows=3)  # fmt: skip
    assert [(r.batch, r.context) for r in results] == [(1, 300), (3, 300)]
    for r in results:  # --profile: two more decode steps per pair under the profiler (the host's ops: the reference names no device activity)
        assert r.profile["device_kernels"] is False and r.profile["total_ms_per_step"] > 0 and 0 < len(r.profile["us_per_step"]) <= 3
    assert info["layers"] == 4 and info["layer_types"] == {"sliding": 2, "CSA": 1, "HCA": 1} and info["backend"] == "reference"
    assert info["device_graphs"] is False  # the reference backend has none
    for r in results:
        assert r.step_ms > 0 and r.plan_ms > 0 and r.floor_ms > 0 and r.tok_s == r.batch / (r.step_ms / 1e3)
        assert r.floor_bytes == sum(r.floor_parts.values())
        assert r.floor_parts == e2e_v4.floor_parts(e2e_v4.flash_config(4, TINY), r.batch, 300 + 1 + 1, kv_dtype=torch.float8_e4m3fn, dtype_bytes=2)
    saved = json.loads(out.read_text())
    assert saved["machine"]["kv_cache_dtype"] == "fp8" and len(saved["results"]) == 2
    assert "4 of 4 layers (2 sliding, 1 CSA, 1 HCA)" in e2e_v4.format_results(results, info)
    assert "### batch 3 context 300:" in e2e_v4.format_results(results, info)
    assert saved["results"][1]["profile"] == results[1].profile


def test_the_kv_cache_dtype_reaches_the_engine_config(monkeypatch):
    from deepinfer.engine import llm_engine

    seen = []

    class Stop(Exception):
        pass

    def recording(**kwargs):
        seen.append(kwargs)
        raise Stop

    monkeypatch.setattr(llm_engine, "EngineConfig", recording)
    for dtype in ("fp8", "auto"):
        with pytest.raises(Stop):
            e2e_v4.run("reference", batches=(1,), contexts=(300,), kv_cache_dtype=dtype, config_overrides=TINY, progress=lambda line: None)
    assert [kw["kv_cache_dtype"] for kw in seen] == ["fp8", "auto"] and not seen[0]["enable_prefix_caching"]


def test_cli_refuses_a_run_that_does_not_fit_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(e2e_v4, "free_memory", lambda device, memory_info: 3 * GiB)
    assert main(["bench", "e2e", "--model-shape", "v4-flash", "--backend", "reference"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "bench e2e --model-shape v4-flash needs at least" in err and "3.0 GiB is free for even one layer" in err, err
