"""`deepinfer run` takes vLLM's engine flags with vLLM's meaning: each accepted value reaches the
engine the run builds (--dtype's aliases through one table, --max-model-len, --gpu-memory-utilization
into the KV budget, -tp 1), and a bad value is one line with exit 2, before anything runs."""

from __future__ import annotations

import math

import pytest
import torch

import deepinfer.engine.llm as llm_module
import deepinfer.plugins as plugins_mod
from deepinfer.backends import reference
from deepinfer.cli import run as run_cli
from deepinfer.cli.main import build_parser, main, parse
from deepinfer.cli.run import command_line
from deepinfer.engine.dtype_names import DTYPE_NAMES
from deepinfer.engine.llm import LLM, resolve_dtype
from deepinfer.engine.llm_engine import EngineConfig, derive_seed
from deepinfer.engine.model_runner import kv_block_bytes
from deepinfer.engine.sampling_params import InvalidRequestError, SamplingParams
from deepinfer.plugins import Plugins

from fake_backend import FakeBackend

FAST = ["--backend", "reference", "--no-progress", "--num-kv-blocks", "64"]
MiB = 1 << 20

# vLLM's --dtype names and the torch dtype each means (vllm/config: "half" is float16, "float" is float32).
VLLM_DTYPES = {"half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16, "float": torch.float32, "float32": torch.float32}


pytestmark = pytest.mark.usefixtures("model_cache")  # tests/engine/conftest.py


@pytest.fixture
def built(monkeypatch) -> list[LLM]:
    """The LLMs `deepinfer run` builds in this test (it imports LLM from deepinfer.engine.llm when it runs)."""
    llms: list[LLM] = []

    class RecordingLLM(LLM):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            llms.append(self)

    monkeypatch.setattr(llm_module, "LLM", RecordingLLM)
    return llms


def one_line_error(capsys, argv, *needles) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    *before, err = err.splitlines()
    assert err.startswith("deepinfer: error: ") and all(line.startswith("deepinfer: model ") for line in before), before
    for needle in needles:
        assert needle in err, err
    return err


def test_vllm_flags_reach_the_engine(capsys, built):
    argv = [
        "run", *FAST, "--prompt", "hi", "--max-tokens", "2", "--temperature", "0",
        "--dtype", "half", "--max-model-len", "256", "--gpu-memory-utilization", "0.5", "-tp", "1", "--kv-cache-dtype", "fp8",
        "--seed", "7", "--enforce-eager", "--max-num-seqs", "3", "--max-num-batched-tokens", "100",
    ]  # fmt: skip
    assert main(argv) == 0
    assert "completion:" in capsys.readouterr().out
    (llm,) = built
    engine, config = llm.engine, llm.engine.config
    assert engine.dtype == torch.float16 and engine.cache_dtype == torch.float8_e4m3fn
    assert engine.max_model_len == 256 and config.max_model_len == 256
    assert config.gpu_memory_utilization == 0.5
    assert (config.seed, config.enforce_eager, config.max_num_seqs, config.max_num_batched_tokens) == (7, True, 3, 100)
    assert llm.world_size == 1  # -tp 1: one process, nothing sharded


def test_defaults_are_vllms(built):
    assert main(["run", *FAST, "--prompt", "hi", "--max-tokens", "1"]) == 0
    config = built[0].engine.config
    assert config.gpu_memory_utilization == 0.9 and config.max_model_len is None and config.kv_cache_dtype == "auto"
    assert built[0].engine.max_model_len == 4096  # the model's max_position_embeddings
    assert built[0].engine.dtype == torch.float32  # auto on the CPU
    assert config.max_num_batched_tokens == 8192  # the host: vLLM's budget below 70 GiB (engine/step_budget.py)


def test_the_step_budget_follows_the_device_as_vllms_does(monkeypatch):
    """No max_num_batched_tokens: 16384 tokens a step on an accelerator with at least 70 GiB (vLLM's LLM class), 8192 on a
    smaller one and on the host; `deepinfer serve` defaults to 8192 (vLLM's server), run and run-batch to the engine's."""
    from deepinfer.engine import step_budget
    from deepinfer.model import memory

    gib = 1 << 30
    for total, want in ((80 * gib, 16384), (70 * gib, 16384), (64 * gib, 8192), (None, 8192)):
        monkeypatch.setattr(memory, "device_total", lambda device, total=total: total)
        assert step_budget.default_max_num_batched_tokens(torch.device("cpu")) == want
    assert memory.device_total.__name__ == "<lambda>"  # (patched where step_budget reads it)
    monkeypatch.undo()
    assert memory.device_total(torch.device("cpu")) is None  # host memory has no accelerator total
    parser = build_parser()
    assert parse(parser, ["serve"]).max_num_batched_tokens == 8192
    assert parse(parser, ["run", "--prompt", "x"]).max_num_batched_tokens is None
    assert parse(parser, ["run-batch", "-i", "a.jsonl", "-o", "b.jsonl"]).max_num_batched_tokens is None


def test_the_seed_flag_seeds_each_request():
    """--seed N: each request samples with a seed derived from N and its line (vLLM: a run repeats for one seed)."""
    args = parse(build_parser(), ["run", "--seed", "7", "--prompt", "a", "--prompt", "b"])
    from deepinfer.cli.run_requests import collect_requests, make_params

    requests, _ = collect_requests(args)
    assert [make_params(args, r).seed for r in requests] == [derive_seed(7, 1), derive_seed(7, 2)]
    assert derive_seed(7, 1) != derive_seed(8, 1)


def test_dtype_names_are_one_table_for_the_cli_and_the_api():
    parser = build_parser()
    dtype_flag = next(a for a in run_cli._PARSER._actions if "--dtype" in a.option_strings)
    assert tuple(dtype_flag.choices) == DTYPE_NAMES
    for name, want in VLLM_DTYPES.items():
        assert parse(parser, ["run", "--dtype", name]).dtype == name
        assert resolve_dtype(name, "cuda") == want and resolve_dtype(name, "cpu") == want
    assert resolve_dtype("auto", "cpu") == torch.float32 and resolve_dtype("auto", "cuda") == torch.bfloat16
    with pytest.raises(InvalidRequestError, match="unknown dtype 'int8'; use auto, half"):
        resolve_dtype("int8", "cpu")


def test_the_new_flags_travel_to_the_ranks():
    """`--ep N` restarts the command in N ranks from command_line(args): the new flags must survive it."""
    parser = build_parser()
    argv = ["run", "--dtype", "half", "--max-model-len", "256", "--gpu-memory-utilization", "0.5", "-tp", "1",
            "--tokenizer", "tok", "--chat-template", "{{ x }}"]  # fmt: skip
    args = parse(parser, argv)
    again = parse(parser, ["run", *command_line(args)])
    for name in ("dtype", "max_model_len", "gpu_memory_utilization", "tensor_parallel_size", "tokenizer", "chat_template"):
        assert getattr(again, name) == getattr(args, name), name


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["-tp", "2"], ["--tensor-parallel-size 2", "no tensor parallelism", "expert parallelism", "--ep 2"]),
        (["--tensor-parallel-size", "8", "--ep", "2"], ["--tensor-parallel-size 8", "--ep 8"]),
        (["--tensor-parallel-size", "0"], ["--tensor-parallel-size must be 1, got 0"]),
        (["-tp", "two"], ["-tp", "invalid int value"]),
        (["--gpu-memory-utilization", "0"], ["--gpu-memory-utilization must be a fraction in (0, 1], got 0.0"]),
        (["--gpu-memory-utilization", "1.01"], ["--gpu-memory-utilization", "got 1.01"]),
        (["--gpu-memory-utilization", "-0.5"], ["--gpu-memory-utilization", "got -0.5"]),
        (["--gpu-memory-utilization", "nan"], ["--gpu-memory-utilization", "got nan"]),
        (["--gpu-memory-utilization", "90%"], ["--gpu-memory-utilization", "invalid float value"]),
        (["--dtype", "int8"], ["--dtype", "invalid choice", "int8", "half", "float32"]),
        (["--max-model-len", "0"], ["--max-model-len must be >= 1, got 0"]),
        (["--max-model-len", "4k"], ["--max-model-len", "invalid int value"]),
        (["--max-model-len", "100000"], ["max_model_len 100000 is longer than the model's max_position_embeddings 4096", "leave it out"]),
        (["--kv-cache-dtype", "fp8_e5m2"], ["--kv-cache-dtype", "invalid choice"]),
        (["--max-num-batched-tokens", "0"], ["--max-num-batched-tokens must be >= 1"]),
        (["--seed", "x"], ["--seed", "invalid int value"]),
        (["--tokenizer", "no/such/folder"], ["tokenizer path no/such/folder does not exist"]),
        (["--chat-template", "no/such/file.jinja"], ["--chat-template no/such/file.jinja: no such file"]),
        # issue 38 (F9): sizes no memory holds, refused before the engine allocates them (they used to end in a MemoryError)
        (["--num-kv-blocks", "1000000000000"], ["num_kv_blocks=1000000000000 does not fit", "KV blocks of", "available RAM", "--num-kv-blocks"]),
        (["--max-num-seqs", "1000000000000"], ["max_num_seqs=1000000000000 does not fit", "sequence slots of", "--max-num-seqs"]),
    ],
)
def test_bad_engine_flags_are_one_line(capsys, built, argv, needles):
    one_line_error(capsys, ["run", *FAST, "--prompt", "x", *argv], *needles)
    assert not built  # refused before an engine was built


def test_api_validates_gpu_memory_utilization():
    for good in (1, 1.0, 0.01):
        EngineConfig(gpu_memory_utilization=good).validate()
    for bad in (0, 0.0, -0.1, 1.5, math.nan, math.inf, True, "0.5", None):
        with pytest.raises(InvalidRequestError, match=r"gpu_memory_utilization must be a fraction in \(0, 1\]") as info:
            EngineConfig(gpu_memory_utilization=bad).validate()
        assert "\n" not in str(info.value)
    with pytest.raises(InvalidRequestError, match="gpu_memory_utilization"):
        LLM(backend="reference", announce=False, gpu_memory_utilization=2)  # before anything loads


def llm_with_device_memory(monkeypatch, free: int, total: int, **kwargs) -> LLM:
    """An LLM on a backend that reports (free, total) bytes of device memory (the KV budget's input)."""
    backend = FakeBackend(memory_info=lambda device: (free, total))
    monkeypatch.setattr(plugins_mod, "load_plugins", lambda: Plugins(load_entry_points=False, extra_plugins=(backend, reference)))
    return LLM(backend="fake", announce=False, max_num_seqs=2, **kwargs)


def test_gpu_memory_utilization_sizes_the_kv_cache(monkeypatch):
    """The KV cache gets free - (1 - utilization) * total bytes: 10 MiB of device memory, 6 free."""
    free, total = 6 * MiB, 10 * MiB
    sizes = {}
    for utilization in (0.9, 0.5):
        llm = llm_with_device_memory(monkeypatch, free, total, gpu_memory_utilization=utilization)
        engine = llm.engine
        per_block = kv_block_bytes(engine.loaded.model, engine.block_size, engine.cache_dtype)
        sizes[utilization] = engine.num_kv_blocks
        assert engine.num_kv_blocks == int(free - (1 - utilization) * total) // per_block
        assert engine.num_kv_blocks < engine.config.max_num_seqs * -(-engine.max_model_len // engine.block_size)  # the budget decided, not the cap
    assert sizes[0.5] < sizes[0.9]
    with pytest.raises(InvalidRequestError, match=r"no memory for the KV cache.*raise gpu_memory_utilization \(0.4\)"):
        llm_with_device_memory(monkeypatch, free, total, gpu_memory_utilization=0.4)  # 6 MiB free < the 6 MiB the engine must leave


def test_the_cli_flag_sizes_the_kv_cache(monkeypatch, capsys, built):
    free, total = 6 * MiB, 10 * MiB
    backend = FakeBackend(memory_info=lambda device: (free, total))
    monkeypatch.setattr(plugins_mod, "load_plugins", lambda: Plugins(load_entry_points=False, extra_plugins=(backend, reference)))
    argv = ["run", "--backend", "fake", "--no-progress", "--prompt", "hi", "--max-tokens", "1", "--max-num-seqs", "2"]
    assert main([*argv, "--gpu-memory-utilization", "0.7"]) == 0
    capsys.readouterr()
    engine = built[0].engine
    per_block = kv_block_bytes(engine.loaded.model, engine.block_size, engine.cache_dtype)
    assert engine.config.gpu_memory_utilization == 0.7
    assert engine.num_kv_blocks == int(free - 0.3 * total) // per_block
    one_line_error(capsys, [*argv, "--gpu-memory-utilization", "0.3"], "no memory for the KV cache", "raise gpu_memory_utilization (0.3)")


def test_a_kv_cache_or_sequence_slots_beyond_the_free_device_memory_are_refused_before_allocating(monkeypatch):
    """num_kv_blocks / max_num_seqs are checked against the backend's free memory (6 MiB here), not only the host's."""
    with pytest.raises(InvalidRequestError, match=r"num_kv_blocks=100000 does not fit: .* need .* on cpu, but 6.0 MiB is free on cpu") as info:
        llm_with_device_memory(monkeypatch, 6 * MiB, 10 * MiB, num_kv_blocks=100_000)
    assert "\n" not in str(info.value)
    backend = FakeBackend(memory_info=lambda device: (6 * MiB, 10 * MiB))
    monkeypatch.setattr(plugins_mod, "load_plugins", lambda: Plugins(load_entry_points=False, extra_plugins=(backend, reference)))
    with pytest.raises(InvalidRequestError, match=r"max_num_seqs=1000 does not fit: 1000 sequence slots of \d+ bytes"):
        LLM(backend="fake", announce=False, max_num_seqs=1000, num_kv_blocks=8)  # the penalty tables alone: 1000 x 129280 x 4 bytes
    assert LLM(backend="fake", announce=False, max_num_seqs=2, num_kv_blocks=8).engine.num_kv_blocks == 8


def test_state_slots_that_leave_no_kv_budget_name_max_num_seqs(capsys, built):
    """DeepSeek-V4 keeps a state slot per sequence: 3000 of tiny-v4's (90 KB each) outgrow the CPU's
    256 MiB default budget, and the error says so instead of only "set num_kv_blocks"."""
    argv = ["run", "--backend", "reference", "--no-progress", "--model", "tiny-v4", "--prompt", "x", "--max-num-seqs", "3000"]
    one_line_error(capsys, argv, "no memory for the KV cache", "lower max_num_seqs (3000 state slots take")


def test_max_model_len_bounds_the_requests(api_short):
    """--max-model-len / max_model_len: a prompt that leaves no room under it fails alone, as in vLLM."""
    ids = list(range(100, 164))  # 64 tokens
    with pytest.raises(InvalidRequestError, match="maximum length is 64"):
        api_short.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), use_tqdm=False)
    out = api_short.generate({"prompt_token_ids": ids[:60]}, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4 and out[0].outputs[0].finish_reason == "length"  # stopped at 64 tokens


@pytest.fixture(scope="module")
def api_short(cache):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE", str(cache))
        return LLM(backend="reference", announce=False, num_kv_blocks=64, max_model_len=64)
