"""`deepinfer bench ops` (with and without --ep) and `bench e2e` take `--backend-option KEY=VALUE` as
`run` does and hand the options to the kernel choice; a bench runner that takes none says so; `--ep N`
counts devices by asking the backend and refuses a bad --dist-timeout before any rank starts.
Checked with the fake backend (tests/fake_backend.py) and the cuda backend under the interpreter."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import types

import pytest
import torch

import deepinfer.plugins as plugins_mod
from deepinfer.cli import bench_ops_ep
from deepinfer.cli.main import build_parser, main
from deepinfer.plugins import Availability, BackendSpec, Plugins, hookimpl

from fake_backend import UNUSABLE
from waits import HANG_S


def _only(monkeypatch, *specs: BackendSpec) -> None:
    plugin = types.SimpleNamespace(deepinfer_add_backends=hookimpl(lambda register: [register(s) for s in specs]))
    monkeypatch.setattr(plugins_mod, "load_plugins", lambda: Plugins(load_entry_points=False, extra_plugins=(plugin,)))


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_bench_ops_options_reach_the_kernel_choice(fake, tmp_path):
    out = tmp_path / "ops.json"
    argv = ["bench", "ops", "--backend", "fake", "--op", "rms_norm", "--repeat", "1", "--json", str(out)]
    assert main([*argv, "--backend-option", "norm_flavour=fancy"]) == 0
    assert fake.calls and set(fake.calls) == {"fancy"}
    assert json.loads(out.read_text())["backend_options"] == {"norm_flavour": "fancy", "exotic": "off"}


@pytest.mark.parametrize(
    "flag, message",
    [
        ("norm_flavour", "--backend-option 'norm_flavour': expected KEY=VALUE"),
        ("norm_flavour=spicy", "option norm_flavour='spicy' is not allowed; use one of: plain, fancy"),
        ("colour=red", "backend 'fake' has no option 'colour'"),
        ("exotic=on", f"backend 'fake' cannot serve op 'rms_norm': {UNUSABLE}"),
    ],
)
def test_a_bad_bench_ops_option_is_one_line(fake, capsys, flag, message):
    assert main(["bench", "ops", "--backend", "fake", "--op", "rms_norm", "--repeat", "1", "--backend-option", flag]) == 2
    assert message in _one_line(capsys)
    assert "exotic" not in fake.calls


def test_a_bench_runner_takes_no_options_and_says_so(monkeypatch, capsys):
    from deepinfer.options import BackendOption

    called = []
    module = types.ModuleType("fake_runner_for_options")
    module.run = lambda **kwargs: called.append(kwargs)
    monkeypatch.setitem(sys.modules, "fake_runner_for_options", module)
    option = BackendOption("path", ("a", "b"), "a", "which path")
    _only(monkeypatch, BackendSpec(name="gpu", device_type="cpu", probe=lambda interpret=False: Availability(True, "ok"),
                                   bench_runner="fake_runner_for_options:run", options=(option,)))
    assert main(["bench", "ops", "--backend", "gpu", "--backend-option", "path=b"]) == 2
    line = _one_line(capsys)
    assert "backend 'gpu': its bench runner (fake_runner_for_options:run) takes no backend options" in line and "path=b" in line
    assert main(["bench", "ops", "--backend", "gpu"]) == 0 and len(called) == 1


def test_bench_e2e_hands_the_options_to_the_runtime(fake, monkeypatch, capsys):
    from deepinfer.bench import e2e

    seen = {}
    monkeypatch.setattr(e2e, "run", lambda *args, **kwargs: seen.update(kwargs) or [])
    assert main(["bench", "e2e", "--backend", "fake", "--no-hf", "--backend-option", "norm_flavour=fancy"]) == 0
    assert seen["backend_options"] == {"norm_flavour": "fancy"}
    seen.clear()
    assert main(["bench", "e2e", "--backend", "fake", "--backend-option", "norm_flavour=spicy"]) == 2
    assert "norm_flavour='spicy' is not allowed" in _one_line(capsys) and not seen


def test_the_e2e_benchmark_opens_its_runtime_with_the_options(fake, monkeypatch, tmp_path):
    from deepinfer.bench import e2e

    tiny = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256, bos_token_id=510, eos_token_id=511)
    clock = itertools.count(1)
    monkeypatch.setattr(e2e, "_timed", lambda fn, device: (fn(), next(clock) * 1e-3)[1])
    out = tmp_path / "e2e.json"
    e2e.run("fake", batches=(1,), prompt_len=4, new_tokens=2, layers=1, with_hf=False, json_path=out, config_overrides=tiny,
            copy_gib=0.01, backend_options={"norm_flavour": "fancy"})
    assert fake.calls and set(fake.calls) == {"fancy"}
    assert json.loads(out.read_text())["machine"]["backend_options"] == {"norm_flavour": "fancy", "exotic": "off"}


# ------------------------------------------------------------------------------------------ --ep N


def _ep_args(*argv: str):
    return build_parser().parse_args(["bench", "ops", *argv])


def test_the_ranks_get_the_options(monkeypatch):
    args = _ep_args("--backend", "cuda", "--ep", "2", "--backend-option", "ep_path=nccl", "--backend-option", "mxfp4_path=upcast")
    words = bench_ops_ep.command_line(args)
    assert words[words.index("--backend-option"):] == ["--backend-option", "ep_path=nccl", "--backend-option", "mxfp4_path=upcast"]
    assert _ep_args(*words[2:]).backend_option == args.backend_option  # a rank parses the same options back

    from deepinfer.bench import ep
    from deepinfer.cli import launch

    seen = {}
    monkeypatch.setattr(launch, "launched_by_torchrun", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(ep, "run_rank", lambda **kwargs: seen.update(kwargs))
    assert bench_ops_ep.run(args) == 0
    assert seen["backend_options"] == {"ep_path": "nccl", "mxfp4_path": "upcast"}


def test_the_check_chooses_the_ep_paths_with_the_options():
    """ep_path=symm where symmetric memory cannot run (the interpreter) fails the check, before any rank."""
    argv = ["bench", "ops", "--backend", "cuda", "--ep", "2", "--backend-option", "ep_path=symm"]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "deepinfer", *argv], capture_output=True, text=True, timeout=HANG_S, env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "backend 'cuda' cannot serve op 'dispatch': backend option ep_path=symm" in lines[0] and "starting" not in proc.stderr


def _no_ranks(monkeypatch):
    from deepinfer.cli import launch

    def torchrun(*args, **kwargs):
        raise AssertionError("ranks started")

    monkeypatch.setattr(launch, "torchrun", torchrun)


@pytest.mark.parametrize("timeout", ["-1", "0", "nan"])
def test_a_bad_dist_timeout_is_refused_before_any_rank(monkeypatch, capsys, timeout):
    _no_ranks(monkeypatch)
    assert main(["bench", "ops", "--backend", "reference", "--ep", "2", "--dist-timeout", timeout]) == 2
    assert "--dist-timeout must be a number of seconds" in _one_line(capsys)


def _accelerator(count=None) -> BackendSpec:
    return BackendSpec(name="accel", device_type="fakeaccel", probe=lambda interpret=False: Availability(True, "ok"), device_count=count)


def test_the_backend_counts_its_devices(monkeypatch):
    assert _accelerator(lambda: 3).local_devices() == 3
    assert _accelerator(lambda: 3).local_devices(interpret=True) is None  # the interpreter runs on the CPU: ranks share it
    assert BackendSpec(name="cpu", device_type="cpu", probe=None).local_devices() is None
    assert _accelerator().local_devices() == 0  # torch has no such device module
    monkeypatch.setattr(torch, "fakeaccel", types.SimpleNamespace(device_count=lambda: 5), raising=False)
    assert _accelerator().local_devices() == 5  # no declared count: torch.<device_type>.device_count()


def test_ep_asks_the_backend_how_many_devices_it_has(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # tests/conftest.py sets 1: the interpreter would run the ranks on the CPU
    _no_ranks(monkeypatch)
    _only(monkeypatch, _accelerator(lambda: 1))
    assert main(["bench", "ops", "--backend", "accel", "--ep", "2"]) == 2
    assert "--ep 2 with backend 'accel' needs 2 fakeaccel devices (one rank each); this host has 1" in _one_line(capsys)
