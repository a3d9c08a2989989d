"""Backend discovery through entry points, broken plugins, availability and the auto choice."""

from importlib.metadata import EntryPoint

import pytest

import deepinfer.plugins as plugins_mod
from deepinfer.plugins import BackendError, Plugins
from deepinfer.runtime import open_runtime

from cli_helpers import run_cli


def test_builtin_backends_are_discovered_through_the_entry_point_group():
    plugins = Plugins()
    assert {"reference", "cuda", "ascend"} <= set(plugins.backends)
    assert plugins.backends["reference"].plugin == "reference"
    assert plugins.backends["cuda"].plugin == "cuda"
    assert plugins.backends["ascend"].kv_block_size == 128
    assert plugins.failures == []


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
    assert "reference: 13/13 ops covered" in out and "oot: 13/13 ops covered" in out


def test_unavailable_out_of_tree_backend_exits_2_without_traceback(oot_env):
    result = run_cli("conformance", "--backend", "oot_offline", env=oot_env)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "switched off" in lines[0] and "switch it on" in lines[0]
