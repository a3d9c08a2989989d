"""The end-to-end benchmark's plumbing on the CPU: same weights in transformers and deepinfer, same
greedy tokens, and a floor computed from the config. (Its timings are only meaningful on a GPU.)"""

import itertools
import json

import pytest
import torch

from deepinfer.bench import e2e

from tiny_shapes import TINY_V2


def test_tiny_run_produces_results_and_json(tmp_path, monkeypatch):
    # A clock that only moves forward, one millisecond per timed call: each later (longer) generation
    # takes longer, so the plumbing is checked without timing the machine (a busy CPU would void it).
    clock = itertools.count(1)
    monkeypatch.setattr(e2e, "_timed", lambda fn, device: (fn(), next(clock) * 1e-3)[1])
    out = tmp_path / "e2e.json"
    results = e2e.run("reference", batches=(1, 3), prompt_len=8, new_tokens=2, layers=2, json_path=out, config_overrides=TINY_V2, copy_gib=0.01)
    assert [r.batch for r in results] == [1, 3]
    for r in results:
        assert r.deepinfer_step_ms > 0 and r.hf_step_ms > 0 and r.floor_ms > 0
        assert r.deepinfer_tok_s == r.batch / (r.deepinfer_step_ms / 1e3)
    saved = json.loads(out.read_text())
    assert saved["machine"]["layers"] == 2 and len(saved["results"]) == 2
    assert saved["machine"]["backend"] == "reference" and saved["machine"]["gpu"] == "cpu"
    assert "floor ms" in e2e.format_results(results)


def test_deepinfer_runs_the_transformers_weights_token_for_token():
    from transformers import AutoConfig, AutoModelForCausalLM

    from deepinfer.engine.llm import LLM
    from deepinfer.engine.llm_engine import EngineConfig, LLMEngine
    from deepinfer.engine.sampling_params import SamplingParams
    from deepinfer.model.config import ModelConfig
    from deepinfer.model.deepseek import DeepseekForCausalLM
    from deepinfer.model.loader import LoadedModel
    from deepinfer.model.weights import WeightStore
    from deepinfer.runtime import open_runtime

    cfg = dict(e2e.V2_LITE, **TINY_V2, num_hidden_layers=2)
    torch.manual_seed(0)
    hf_config = AutoConfig.for_model("deepseek_v2", **cfg)
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    rt = open_runtime("reference", dtype=torch.float32)
    config = ModelConfig.from_dict({**hf_config.to_dict(), **cfg, "model_type": "deepseek_v2"}, source="tiny")
    model = DeepseekForCausalLM(config, rt.ops, rt.device, torch.float32)
    model.load_weights(WeightStore(e2e.hf_to_deepinfer_tensors(hf.state_dict(), cfg)))
    llm = LLM.from_engine(LLMEngine(LoadedModel(model, config, None, "tiny"), rt, torch.float32, EngineConfig(num_kv_blocks=64)))
    ids = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(3))
    outputs = llm.generate([{"prompt_token_ids": p.tolist()} for p in ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    ours = [o.outputs[0].token_ids for o in outputs]
    with torch.inference_mode():
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False)[:, 7:].tolist()
    assert ours == theirs


def test_floor_counts_touched_experts():
    one = e2e.decode_floor_bytes(e2e.V2_LITE, batch=1, context=0)
    many = e2e.decode_floor_bytes(e2e.V2_LITE, batch=64, context=0)
    expert = 3 * 2048 * 1408 * 2
    # batch 1 touches 6 routed experts per MoE layer; batch 64 nearly all 64.
    assert 26 * 50 * expert < many - one < 26 * 58 * expert
    assert 15e9 < e2e.decode_floor_bytes(e2e.V2_LITE, batch=64, context=0) < 33e9


def test_memory_needed_counts_the_v2_lite_weights_once():
    parts = e2e.memory_needed(e2e.V2_LITE, max_batch=64, prompt_len=128, new_tokens=64, with_hf=True, copy_gib=2.0)
    assert 15.5e9 * 2 < parts["weights"] < 16e9 * 2  # DeepSeek-V2-Lite: 15.7B parameters in bf16
    assert 14e9 * 2 < parts["stacked experts"] < parts["weights"]  # deepinfer's copy of the 64 x 26 routed experts
    assert parts["KV cache"] <= e2e.ENGINE_KV_CACHE_GIB * e2e.GiB and parts["bandwidth test"] == 4 * e2e.GiB
    assert "HF KV cache" not in e2e.memory_needed(e2e.V2_LITE, 64, 128, 64, with_hf=False, copy_gib=2.0)


def test_cli_refuses_a_run_that_does_not_fit_in_one_line(monkeypatch, capsys):
    from deepinfer.cli.main import main

    monkeypatch.setattr(e2e, "free_memory", lambda device, memory_info: 3 * e2e.GiB)
    assert main(["bench", "e2e", "--backend", "reference", "--layers", "2", "--no-hf"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "bench e2e needs at least 7.6 GiB on cpu (weights 2.0, stacked experts 1.0, KV cache 0.6, bandwidth test 4.0) and 3.0 GiB is free" in err
    assert "--layers" in err


def test_cli_asks_the_chosen_backend_whether_it_can_run():
    from cli_helpers import run_main

    result = run_main("bench", "e2e", "--backend", "cuda")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "backend 'cuda' is not available" in lines[0]
    result = run_main("bench", "e2e", "--layers", "28")
    assert result.returncode == 2 and "--layers cuts the model: at most 27, not 28" in result.stderr


# -- --profile ------------------------------------------------------------------------------------


def test_profile_lists_the_decode_steps_time_by_name(tmp_path, monkeypatch):
    """The reference backend names no device profiler activity: the rows are the host's ops, each its
    self time per decode step (generation of 1 + N tokens minus 1 token, over N)."""
    clock = itertools.count(1)
    monkeypatch.setattr(e2e, "_timed", lambda fn, device: (fn(), next(clock) * 1e-3)[1])
    out = tmp_path / "e2e.json"
    results = e2e.run("reference", batches=(2,), prompt_len=8, new_tokens=2, layers=2, with_hf=False, json_path=out, config_overrides=TINY_V2,
                      copy_gib=0.01, profile_rows=5)  # fmt: skip
    profile = results[0].profile
    assert profile["device_kernels"] is False and profile["total_ms_per_step"] > 0
    rows = list(profile["us_per_step"].values())
    assert 0 < len(rows) <= 5 and rows == sorted(rows, reverse=True) and all(us > 0 for us in rows)
    assert any(name.startswith("aten::") for name in profile["us_per_step"])
    assert json.loads(out.read_text())["results"][0]["profile"] == profile
    text = e2e.format_results(results)
    assert "### batch 2:" in text and "host ops (self time" in text and "device idle" not in text


def test_profile_keeps_the_device_events_when_the_backend_names_an_activity():
    """A backend's profiler activity makes the rows its device's kernels, never the host ops that launched them."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from deepinfer.bench import step_profile

    class Recorded:
        def key_averages(self):
            return [SimpleNamespace(key="aten::mm", device_type=DeviceType.CPU, self_cpu_time_total=40.0, self_device_time_total=0.0),
                    SimpleNamespace(key="gemm_kernel", device_type=DeviceType.CUDA, self_cpu_time_total=0.0, self_device_time_total=30.0),
                    SimpleNamespace(key="norm_kernel", device_type=DeviceType.CUDA, self_cpu_time_total=0.0, self_device_time_total=10.0)]  # fmt: skip

    assert step_profile.self_times(Recorded(), device=True) == {"gemm_kernel": 30.0, "norm_kernel": 10.0}
    assert step_profile.self_times(Recorded(), device=False) == {"aten::mm": 40.0}
    profile = step_profile._profile(step_profile.Counter({"gemm_kernel": 30.0, "norm_kernel": 10.0, "gone": -1.0}), "CUDA").to_json(1)
    assert profile == {"device_kernels": True, "total_ms_per_step": 0.04, "us_per_step": {"gemm_kernel": 30.0}}
    assert "device idle at least 60.0% of the step" in step_profile.format_profile("batch 1", profile, step_ms=0.1)
    # kernels that overlap (PDL) sum to more than the step: no idle bound is claimed
    overlapped = step_profile.format_profile("batch 1", profile, step_ms=0.03)
    assert "kernels overlap" in overlapped and "idle at least" not in overlapped


def test_the_profiler_activity_is_the_backends():
    from torch.profiler import ProfilerActivity

    from deepinfer.bench.step_profile import activities
    from deepinfer.plugins import load_plugins

    assert activities(None) == [ProfilerActivity.CPU]
    cuda = load_plugins().backends["cuda"]
    assert activities(cuda.profiler_activity) == [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with pytest.raises(ValueError, match="not a torch.profiler.ProfilerActivity"):
        activities("Warp")


# -- --deterministic-cost -------------------------------------------------------------------------


def test_deterministic_cost_alternates_both_modes_over_the_same_weights(tmp_path, monkeypatch):
    from deepinfer.bench import deterministic_cost

    built, order = [], []
    real_llm = e2e.bench_llm

    def recording_llm(loaded, runtime, max_batch, prompt_len, deterministic=False, overlap=None):
        model = loaded.model
        built.append((deterministic, runtime.ops.ctx.deterministic, {"embed": model.embed_tokens.clone(), "head": model.lm_head.clone()}))
        llm = real_llm(loaded, runtime, max_batch, prompt_len, deterministic, overlap)
        llm.mode = deterministic
        return llm

    clock = itertools.count(1)

    def timed(fn, device):  # each later generation takes longer: every step time is positive
        fn()
        return next(clock) * 1e-3

    real_greedy = e2e.greedy
    monkeypatch.setattr(e2e, "bench_llm", recording_llm)
    monkeypatch.setattr(e2e, "_timed", timed)
    monkeypatch.setattr(e2e, "greedy", lambda llm, prompts, n: (order.append(llm.mode), real_greedy(llm, prompts, n))[1])
    out = tmp_path / "cost.json"
    results = deterministic_cost.run("reference", batches=(1, 2), prompt_len=8, new_tokens=2, layers=2, repeat=3, json_path=out,
                                     config_overrides=TINY_V2)  # fmt: skip
    assert [(b[0], b[1]) for b in built] == [(False, False), (True, True)]
    assert all(torch.equal(built[0][2][k], built[1][2][k]) for k in built[0][2]), "both modes run the same weights"
    timed_order = order[4:16]  # batch 1: 2 warm-up generations per mode, then 3 rounds of (1, 1 + N) per mode, taking turns
    assert timed_order == [False, False, True, True] * 3
    for r in results:
        assert len(r.default_runs) == len(r.deterministic_runs) == 3
        assert r.default_ms == sorted(r.default_runs)[1] and r.cost == pytest.approx(r.deterministic_ms / r.default_ms - 1)
    saved = json.loads(out.read_text())
    assert saved["kind"] == "deterministic_cost" and saved["machine"]["repeat"] == 3 and [r["batch"] for r in saved["results"]] == [1, 2]
    assert "cost" in deterministic_cost.format_results(results)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--deterministic-cost", "--deterministic"], "--deterministic-cost runs both modes itself: leave out --deterministic"),
        (["--deterministic-cost", "--model-shape", "v4-flash"], "--deterministic-cost is for --model-shape v2-lite"),
        (["--deterministic-cost", "--profile"], "--deterministic-cost and --profile are separate runs"),
        (["--repeat", "3"], "--repeat counts the rounds of --deterministic-cost"),
        (["--deterministic-cost", "--repeat", "0"], "--repeat must be at least 1, not 0"),
        (["--profile", "--profile-rows", "0"], "--profile-rows must be at least 1, not 0"),
    ],
)
def test_profile_and_cost_flags_that_mean_nothing_are_one_line(argv, message, capsys):
    from deepinfer.cli.main import main

    assert main(["bench", "e2e", "--backend", "reference", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err
