"""Backend discovery through entry points, broken plugins, availability and the auto choice."""

import json
import subprocess
import sys
from importlib.metadata import EntryPoint

import pytest

import deepinfer.plugins as plugins_mod
from deepinfer.plugins import BackendError, Plugins
from deepinfer.registry import all_ops
from deepinfer.runtime import open_runtime

from cli_helpers import run_cli
from waits import HANG_S


def test_builtin_backends_are_discovered_through_the_entry_point_group():
    plugins = Plugins()
    assert {"reference", "cuda", "ascend"} <= set(plugins.backends)
    assert plugins.backends["reference"].plugin == "reference"
    assert plugins.backends["cuda"].plugin == "cuda"
    assert plugins.backends["ascend"].kv_block_size == 128
    assert plugins.failures == []


DECLARE_ONLY = """
import json, sys
from deepinfer.plugins import load_plugins
plugins = load_plugins()
declared = {"backends": sorted(plugins.backends), "failures": [f.error for f in plugins.failures], "torch": "torch" in sys.modules}
plugins.probe("reference")
declared["torch_after_a_probe"] = "torch" in sys.modules
print(json.dumps(declared))
"""


def test_loading_the_plugins_and_declaring_backends_imports_no_torch():
    """Plugin modules and probe modules import torch only inside the functions that need it."""
    proc = subprocess.run([sys.executable, "-c", DECLARE_ONLY], capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr
    declared = json.loads(proc.stdout)
    assert {"reference", "cuda", "ascend"} <= set(declared["backends"]) and declared["failures"] == []
    assert declared["torch"] is False and declared["torch_after_a_probe"] is True


def test_a_broken_plugin_is_reported_and_the_others_still_load(monkeypatch):
    real = plugins_mod.entry_points

    def with_broken(group):
        eps = list(real(group=group))
        return eps + [EntryPoint(name="zz_broken", value="deepinfer_no_such_module.plugin", group=group)]

    monkeypatch.setattr(plugins_mod, "entry_points", with_broken)
    plugins = Plugins()
    assert "reference" in plugins.backends
    assert len(plugins.failures) == 1
    failure = plugins.failures[0]
    assert failure.entry_point.startswith("zz_broken")
    assert "ModuleNotFoundError" in failure.error and "deepinfer_no_such_module" in failure.error


def test_unavailable_backend_error_is_one_line_with_reason_and_hint():
    plugins = Plugins()
    with pytest.raises(BackendError) as err:
        plugins.require("ascend")
    message = str(err.value)
    assert "ascend" in message and "torch_npu is not installed" in message and "deepinfer[ascend]" in message
    assert "\n" not in message
    with pytest.raises(BackendError, match="unknown backend 'tpu'.*reference"):
        plugins.require("tpu")


def test_auto_picks_the_available_backend_and_says_why():
    rt = open_runtime("auto")
    assert rt.backend.name == "reference"
    assert "auto-selected reference" in rt.chosen_by
    assert "cuda unavailable" in rt.chosen_by and "ascend unavailable" in rt.chosen_by


def test_out_of_tree_plugin_is_installed_and_seen(oot_env):
    result = run_cli("backends", env=oot_env)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    lines = {line.split()[0]: line for line in out.splitlines() if line and not line.startswith(" ")}
    assert lines["reference"].split()[1] == "available"
    assert lines["oot"].split()[1] == "available"
    assert "oot_offline" in lines and "unavailable" in lines["oot_offline"] and "switched off" in lines["oot_offline"]
    assert "unavailable" in lines["cuda"] and "built without CUDA" in lines["cuda"]
    assert "unavailable" in lines["ascend"] and "torch_npu is not installed" in lines["ascend"]
    assert "plugin oot_broken = deepinfer_oot_backend.broken failed to load: ImportError" in out
    total = len(all_ops())  # the oot fixture, like the reference, serves every declared op
    assert f"reference: {total}/{total} ops covered" in out and f"oot: {total}/{total} ops covered" in out


def test_unavailable_out_of_tree_backend_exits_2_without_traceback(oot_env):
    result = run_cli("conformance", "--backend", "oot_offline", env=oot_env)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "switched off" in lines[0] and "switch it on" in lines[0]


# ---------------------------------------------------------------------- a plugin that calls sys.exit


@pytest.fixture(scope="module")
def exit_plugin_env(tmp_path_factory) -> dict[str, str]:
    """tests/fixtures/oot_exit_plugin pip-installed into a folder, and an environment that sees it."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    target = tmp_path_factory.mktemp("exit_site")
    src = tmp_path_factory.mktemp("exit_build") / "oot_exit_plugin"
    shutil.copytree(Path(__file__).parents[1] / "fixtures" / "oot_exit_plugin", src)
    pip_install = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run([*pip_install, "--target", str(target), str(src)], check=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(target), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def test_a_plugin_calling_sys_exit_at_import_is_reported_and_backends_still_lists_the_others(exit_plugin_env):
    result = run_cli("backends", env=exit_plugin_env)
    assert result.returncode == 0, result.stderr
    assert "plugin oot_exits = deepinfer_oot_exit.plugin failed to load: SystemExit: 3" in result.stdout
    total = len(all_ops())
    assert "reference  available" in result.stdout and f"reference: {total}/{total} ops covered" in result.stdout
    assert result.stderr.count("oot_exits") == 1  # logged once


def test_a_plugin_calling_sys_exit_at_import_leaves_every_other_command_working(exit_plugin_env):
    result = run_cli("bench", "ops", "--backend", "reference", "--op", "rms_norm", "--repeat", "1", env=exit_plugin_env)
    assert result.returncode == 0, result.stderr
    assert "rms_norm" in result.stdout
    assert result.stderr.count("backend plugin oot_exits = deepinfer_oot_exit.plugin failed: SystemExit: 3") == 1


def test_keyboard_interrupt_in_a_plugin_is_not_swallowed(monkeypatch, tmp_path):
    """Ctrl-C while a plugin imports stops the command (main prints "interrupted", exit 130)."""
    (tmp_path / "deepinfer_ctrl_c_plugin.py").write_text("raise KeyboardInterrupt\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    real = plugins_mod.entry_points

    def entry_points(group):
        return [*real(group=group), EntryPoint(name="zz_ctrl_c", value="deepinfer_ctrl_c_plugin", group=group)]

    monkeypatch.setattr(plugins_mod, "entry_points", entry_points)
    with pytest.raises(KeyboardInterrupt):
        Plugins()


def test_sys_exit_in_a_hook_or_a_probe_is_a_failure_too():
    from types import SimpleNamespace

    from deepinfer.plugins import BackendSpec, hookimpl

    def exiting_probe(interpret=False):
        raise SystemExit(4)

    ok = SimpleNamespace(deepinfer_add_backends=hookimpl(lambda register: register(BackendSpec(name="exits_in_probe", device_type="cpu", probe=exiting_probe))))
    bad = SimpleNamespace(deepinfer_add_backends=hookimpl(lambda register: (_ for _ in ()).throw(SystemExit(5))))
    plugins = Plugins(load_entry_points=False, extra_plugins=(ok, bad))
    assert any("deepinfer_add_backends raised SystemExit: 5" in f.error for f in plugins.failures)
    found = plugins.probe("exits_in_probe")
    assert not found.available and "SystemExit: 4" in found.reason


def test_a_bench_scale_that_is_not_one_is_a_plugin_failure():
    """BackendSpec.bench_scale sizes the benchmarks' default workloads: "device" or "host" (the reference's)."""
    from types import SimpleNamespace

    from deepinfer.plugins import BackendSpec, hookimpl

    def declare(register):
        register(BackendSpec(name="tiny_scale", device_type="cpu", probe=lambda interpret=False: None, bench_scale="tiny"))

    plugins = Plugins(load_entry_points=False, extra_plugins=(SimpleNamespace(deepinfer_add_backends=hookimpl(declare)),))
    assert "tiny_scale" not in plugins.backends
    assert [f.error for f in plugins.failures] == ["backend 'tiny_scale' declares bench_scale 'tiny', not one of device, host"]
    assert Plugins().backends["reference"].bench_scale == "host" and Plugins().backends["cuda"].bench_scale == "device"
