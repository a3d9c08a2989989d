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
                          enforce_eager=False, prefills=((8, 8192), (1, 65536)), prefill_chunk=None)  # fmt: skip
    given = v4_arguments(parse("--model-shape", "v4-flash", "--batch", "8", "--context", "1000", "--context", "70000", "--new-tokens", "4",
                               "--layers", "3", "--kv-cache-dtype", "auto", "--prefill", "2x100", "--prefill", "1X5000", "--prefill-chunk", "512"))  # fmt: skip
    assert given == dict(batches=(8,), contexts=(1000, 70000), steps=4, layers=3, kv_cache_dtype="auto", json_path=None, profile_rows=0,
                         enforce_eager=False, prefills=((2, 100), (1, 5000)), prefill_chunk=512)  # fmt: skip
    assert v4_arguments(parse("--model-shape", "v4-flash", "--no-prefill"))["prefills"] == ()
    only_prefill = v4_arguments(parse("--model-shape", "v4-flash", "--no-decode", "--prefill", "1x64"))
    assert only_prefill["batches"] == () and only_prefill["contexts"] == () and only_prefill["prefills"] == ((1, 64),)
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
        (["--prefill", "1x64"], "--prefill is for --model-shape v4-flash"),
        (["--no-prefill"], "--no-prefill is for --model-shape v4-flash"),
        (["--no-decode"], "--no-decode is for --model-shape v4-flash"),
        (["--prefill-chunk", "64"], "--prefill-chunk is for --model-shape v4-flash"),
        (["--model-shape", "v4-flash", "--prefill", "8"], "--prefill takes PROMPTSxTOKENS, prompts of tokens each (e.g. 8x8192), not '8'"),
        (["--model-shape", "v4-flash", "--prefill", "8x"], "--prefill takes PROMPTSxTOKENS"),
        (["--model-shape", "v4-flash", "--prefill", "0x64"], "--prefill 0x64: prompts and tokens must both be at least 1"),
        (["--model-shape", "v4-flash", "--prefill", "1x1048576"], "1048576 tokens and the one sampled exceed V4-Flash's 1048576 positions"),
        (["--model-shape", "v4-flash", "--prefill-chunk", "0"], "--prefill-chunk must be at least 1, not 0"),
        (["--model-shape", "v4-flash", "--no-prefill", "--prefill", "1x64"], "--no-prefill skips the prefill rows: leave out --prefill"),
        (["--model-shape", "v4-flash", "--no-prefill", "--prefill-chunk", "64"], "--no-prefill skips the prefill rows: leave out --prefill-chunk"),
        (["--model-shape", "v4-flash", "--no-decode", "--batch", "4"], "--no-decode skips the decode rows: leave out --batch"),
        (["--model-shape", "v4-flash", "--no-decode", "--enforce-eager"], "--no-decode skips the decode rows: leave out --enforce-eager"),
        (["--model-shape", "v4-flash", "--no-decode", "--no-prefill"], "--no-decode and --no-prefill leave nothing to run"),
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
    parts = e2e_v4.memory_parts(flash, [e2e_v4.EnginePlan(num_blocks=1, max_seqs=1)], block_size=64, kv_dtype=torch.float8_e4m3fn, dtype=torch.bfloat16,
                                copy_gib=2.0)  # fmt: skip
    # 256 experts x 3 x 2048 x 4096 in mxfp4 (0.5 + 1/32 bytes each) per layer: 3.43 GB; 43 layers plus the rest: ~156 GB.
    assert 150e9 < parts["weights"] < 160e9 and parts["expert stacking"] == 2 * 256 * 3 * 2048 * 4096 * (0.5 + 1 / 32)
    assert parts["bandwidth test"] == 4 * GiB
    assert "prefill activations" not in parts and "matmul test" not in parts  # a decode-only run holds neither


def test_the_plan_holds_the_larger_engine_and_its_prefill_activations():
    """The decode rows' engine and the prefill rows' run one after the other: the plan holds the larger one,
    with its prefill step's activations (a hand count at V4-Flash widths, 8192 tokens, a 65536-token prompt)."""
    from deepinfer.model.deepseek_v4 import caches

    flash = e2e_v4.flash_config()
    # Per token, bf16: streams 3*4*4096*2 = 98304; attention: q and output 4*64*512*2 = 262144, compressors' float32 projections
    # 4*4*(512+128)*4 = 40960, the indexer's queries 3*64*128*2 = 49152 and scores over 65536/4 entries 2*16384*4 = 131072, the
    # window's and HCA's row ids (128 + 512)*4 = 2560: 485888; MoE (6*(2*4096 + 3*2048) + 4096 + 3*2048)*2 = 192512. Times 1.5.
    per_token = 98304 + max(262144 + 40960 + 49152 + 131072 + 2560, 192512)
    assert e2e_v4.prefill_activation_bytes(flash, 8192, 65536) == 8192 * per_token * 1.5 == 7178551296
    decode, prefill = e2e_v4.EnginePlan(num_blocks=3000, max_seqs=256), e2e_v4.EnginePlan(num_blocks=1100, max_seqs=8, prefill_tokens=8192, longest=65536)
    kv = torch.float8_e4m3fn
    block, slot = caches.block_bytes(flash, 64, kv), caches.slot_bytes(flash)
    both = e2e_v4.memory_parts(flash, [decode, prefill], block_size=64, kv_dtype=kv, dtype=torch.bfloat16, copy_gib=2.0, matmul_n=8192)
    assert both["KV cache"] == 1100 * block + 8 * slot and both["prefill activations"] == 7178551296  # the prefill engine holds more
    assert both["matmul test"] == 10 * 8192**2
    big_decode = e2e_v4.EnginePlan(num_blocks=40000, max_seqs=256)
    held = e2e_v4.memory_parts(flash, [big_decode, prefill], block_size=64, kv_dtype=kv, dtype=torch.bfloat16)
    assert held["KV cache"] == 40000 * block + 256 * slot and "prefill activations" not in held


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


def test_the_tiny_run_on_the_reference_backend(tmp_path, monkeypatch):
    import weakref

    from deepinfer.engine.llm_engine import LLMEngine

    engines, alive_before = [], []
    real_init = LLMEngine.__init__

    def init(self, *args, **kwargs):  # the decode rows' engine is gone (its caches freed) before the prefill rows' is built
        alive_before.append([ref() is not None for ref in engines])
        engines.append(weakref.ref(self))
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "__init__", init)
    out = tmp_path / "v4.json"
    results, prefill, info = e2e_v4.run("reference", batches=(1, 3), contexts=(300,), steps=2, warmup=1, kv_cache_dtype="fp8", json_path=out,
                                        config_overrides={**TINY, "num_hidden_layers": 4}, copy_gib=0.01, progress=lambda line: None, profile_rows=3,
                                        prefills=((1, 20),), prefill_chunk=16, matmul_n=32)  # fmt: skip
    # after the decode rows, on an engine of its own: 20 tokens in steps of at most 16
    assert [(r.batch, r.prompt_len, r.steps) for r in prefill] == [(1, 20, 2)] and info["prefill_chunk_tokens"] == 16
    assert alive_before == [[], [False]]
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
    assert saved["machine"]["kv_cache_dtype"] == "fp8" and len(saved["results"]) == 2 and len(saved["prefill"]) == 1
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
    small = dict(config_overrides={**TINY, "num_hidden_layers": 2}, copy_gib=0.01, matmul_n=32, progress=lambda line: None)
    for dtype in ("fp8", "auto"):
        with pytest.raises(Stop):  # the decode rows' engine first
            e2e_v4.run("reference", batches=(1,), contexts=(300,), kv_cache_dtype=dtype, prefills=((1, 40),), **small)
    assert [kw["kv_cache_dtype"] for kw in seen] == ["fp8", "auto"] and not seen[0]["enable_prefix_caching"]
    assert seen[0]["max_model_len"] == e2e_v4.model_len((300,), 16)  # the decode rows' own, whatever the prefill rows need
    seen.clear()
    with pytest.raises(Stop):  # only prefill rows: their engine
        e2e_v4.run("reference", batches=(), contexts=(), kv_cache_dtype="fp8", prefills=((3, 40), (1, 100)), prefill_chunk=64, **small)
    (prefill,) = seen
    assert prefill["kv_cache_dtype"] == "fp8" and not prefill["enable_prefix_caching"] and prefill["enforce_eager"]
    assert prefill["max_num_batched_tokens"] == 64 and prefill["max_num_seqs"] == 3 and prefill["max_model_len"] == 101


def test_cli_refuses_a_run_that_does_not_fit_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(e2e_v4, "free_memory", lambda device, memory_info: 3 * GiB)
    assert main(["bench", "e2e", "--model-shape", "v4-flash", "--backend", "reference"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "bench e2e --model-shape v4-flash needs at least" in err and "3.0 GiB is free for even one layer" in err, err


def test_the_prefill_rows_prefill_every_prompt_in_chunks_and_report(tmp_path, monkeypatch):
    """Each row runs untimed once, then PREFILL_PASSES timed (patched to 2 here), through the engine's own prefill steps:
    every prompt token computed from position 0, no step over the chunk; the figures come from the FLOP count, the
    rates measured in the run and the median of the timed passes."""
    from deepinfer.bench.v4_prefill_floor import RATE_OF_PART, floor_seconds, prefill_flops
    from deepinfer.engine.model_runner import ModelRunner

    steps = []
    real_run = ModelRunner.run
    monkeypatch.setattr(ModelRunner, "run", lambda self, batch, *a, **kw: steps.append((batch.is_prefill, batch.num_tokens)) or real_run(self, batch, *a, **kw))
    monkeypatch.setattr(e2e_v4, "PREFILL_PASSES", 2)
    out = tmp_path / "prefill.json"
    results, prefill, info = e2e_v4.run("reference", batches=(), contexts=(), prefills=((2, 24), (1, 150)), prefill_chunk=64, json_path=out,
                                        config_overrides={**TINY, "num_hidden_layers": 4}, dtype=torch.float32, matmul_n=32,
                                        progress=lambda line: None)  # fmt: skip
    assert results == [] and "copy_bandwidth_tb_s" not in info  # no decode rows
    # 2 x 24 = 48 tokens fit one step; 150 take 64 + 64 + 22; each row three times
    assert steps == [(True, 48)] * 3 + [(True, 64), (True, 64), (True, 22)] * 3
    assert [(r.batch, r.prompt_len, r.chunk_tokens, r.steps) for r in prefill] == [(2, 24, 64, 1), (1, 150, 64, 3)]
    rates = info["matmul_tflops"]
    assert rates["bf16"] > 0 and rates["fp8"] is None and "the fp8 parts of the prefill floor are divided by the bf16 rate" in info["fp8_rate_missing"]
    config = e2e_v4.flash_config(4, TINY)
    for r in prefill:
        assert r.flops == prefill_flops(config, r.batch, r.prompt_len) and r.rates == RATE_OF_PART
        assert r.floor_flops == sum(r.flops.values())
        assert r.floor_s == pytest.approx(floor_seconds(r.flops, {"bf16": rates["bf16"] * 1e12, "fp8": rates["bf16"] * 1e12}))
        assert r.tok_s == r.batch * r.prompt_len / r.seconds and r.of_floor == r.floor_s / r.seconds
        assert len(r.pass_seconds) == 2 and r.seconds == pytest.approx(sum(r.pass_seconds) / 2)  # the median of two
    saved = json.loads(out.read_text())
    assert saved["results"] == [] and [(row["batch"], row["prompt_len"], row["chunk_tokens"]) for row in saved["prefill"]] == [(2, 24, 64), (1, 150, 64)]
    assert saved["machine"]["prefill_chunk_tokens"] == 64 and saved["machine"]["matmul_how"].endswith("n = 32")
    table = e2e_v4.format_results(results, info, prefill)
    assert "prefill: matmul bf16" in table and "1 x 150" in table and "batch  context" not in table


def test_profile_adds_one_profiled_pass_of_each_prefill_row(monkeypatch):
    """--profile on the prefill rows: each row once more under the profiler (after its timed passes), its ops by
    time in the row's result and in the table (the reference backend names no device activity: host ops)."""
    from deepinfer.engine.model_runner import ModelRunner

    steps = []
    real_run = ModelRunner.run
    monkeypatch.setattr(ModelRunner, "run", lambda self, batch, *a, **kw: steps.append(batch.num_tokens) or real_run(self, batch, *a, **kw))
    results, prefill, info = e2e_v4.run("reference", batches=(), contexts=(), prefills=((2, 24),), prefill_chunk=64, profile_rows=5,
                                        config_overrides={**TINY, "num_hidden_layers": 2}, dtype=torch.float32, matmul_n=32,
                                        progress=lambda line: None)  # fmt: skip
    assert steps == [48] * (2 + e2e_v4.PREFILL_PASSES)  # untimed, the timed passes, profiled
    profile = prefill[0].profile
    assert profile["device_kernels"] is False and 0 < len(profile["us_per_step"]) <= 5 and profile["total_ms_per_step"] > 0
    table = e2e_v4.format_results(results, info, prefill)
    assert f"### prefill 2 x 24: {prefill[0].seconds * 1e3:.3f} ms per prefill pass; host ops" in table


def test_matmul_rates_measure_an_fp8_product_off_the_host(monkeypatch):
    """On a device (here the CPU posing as one), the fp8 rate is torch._scaled_mm's; on the host it is not measured."""
    from deepinfer.bench import device_api, e2e

    on_cpu = e2e.matmul_rates(torch.device("cpu"), 16)
    assert on_cpu.n == 16 and on_cpu.bf16 > 0 and on_cpu.fp8 is None and "the host has no fp8 product" in on_cpu.fp8_missing
    assert on_cpu.for_floor() == {"bf16": on_cpu.bf16, "fp8": on_cpu.bf16}
    monkeypatch.setattr(device_api, "on_host", lambda device: False)
    monkeypatch.setattr(e2e, "synchronize", lambda device: None)
    posed = e2e.matmul_rates(torch.device("cpu"), 16)
    assert posed.fp8 > 0 and posed.fp8_missing is None and posed.for_floor() == {"bf16": posed.bf16, "fp8": posed.fp8}
    assert e2e.matmul_side(torch.device("cpu")) == e2e.DEVICE_MATMUL_N  # (on_host is patched: a device's side)


def test_cli_prefill_rows_alone_print_their_table(monkeypatch, tmp_path, capsys):
    """`--no-decode --prefill 1x24 --prefill-chunk 16` at a test-only shrink of V4-Flash: one row, two steps, its table."""
    monkeypatch.setattr(e2e_v4, "V4_FLASH", {**e2e_v4.V4_FLASH, **TINY, "num_hidden_layers": 4})
    out = tmp_path / "v4.json"
    argv = ["bench", "e2e", "--model-shape", "v4-flash", "--backend", "reference", "--no-decode", "--prefill", "1x24", "--prefill-chunk", "16",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "4 of 4 layers (2 sliding, 1 CSA, 1 HCA)" in table and "prefill: matmul bf16" in table and "1 x 24" in table
    (row,) = json.loads(out.read_text())["prefill"]
    assert row["steps"] == 2 and row["chunk_tokens"] == 16 and row["floor_s"] > 0


def test_a_failing_prefill_row_keeps_the_decode_rows_in_the_json(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory in a prefill row")

    monkeypatch.setattr(e2e_v4, "_prefill_rows", broken)
    out = tmp_path / "v4.json"
    with pytest.raises(RuntimeError, match="out of memory in a prefill row"):
        e2e_v4.run("reference", batches=(1,), contexts=(40,), steps=1, warmup=0, prefills=((1, 16),), json_path=out, dtype=torch.float32,
                   config_overrides={**TINY, "num_hidden_layers": 2}, copy_gib=0.01, matmul_n=16, progress=lambda line: None)  # fmt: skip
    saved = json.loads(out.read_text())
    assert [(row["batch"], row["context"]) for row in saved["results"]] == [(1, 40)] and saved["prefill"] == []
