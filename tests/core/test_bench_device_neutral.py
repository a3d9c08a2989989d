"""The benchmarks ask the backend, never a device type: device graphs come from the backend's
GraphCapture (a backend without one leaves the in-graph rows out, with a note), the p2p copy and
`--ep N`'s device check count the backend's devices (BackendSpec.local_devices), and no benchmark
names a device module (events, streams and synchronisation go through torch's generic API)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

import deepinfer.plugins as plugins_mod
from deepinfer.bench import device_api
from deepinfer.bench import ep as bench
from deepinfer.cli.main import main
from deepinfer.plugins import Availability, BackendSpec, Plugins, hookimpl

from fake_backend import RecordingGraphs


@pytest.mark.parametrize("forbidden", ['device.type == "cuda"', "torch.cuda", "getattr(torch, device.type"])
def test_the_benchmarks_name_no_device_api(forbidden):
    from deepinfer import bench as package

    for path in Path(package.__file__).parent.glob("*.py"):
        assert forbidden not in path.read_text(), f"{path.name} has {forbidden}"


def _accelerator(count, graphs=None) -> BackendSpec:
    return BackendSpec(name="accel", device_type="fakeaccel", probe=lambda interpret=False: Availability(True, "ok"), device_count=count, graph_capture=graphs)


def _only(monkeypatch, *specs: BackendSpec) -> None:
    plugin = types.SimpleNamespace(deepinfer_add_backends=hookimpl(lambda register: [register(s) for s in specs]))
    monkeypatch.setattr(plugins_mod, "load_plugins", lambda: Plugins(load_entry_points=False, extra_plugins=(plugin,)))


def _no_ranks(monkeypatch):
    from deepinfer.cli import launch

    def torchrun(*args, **kwargs):
        raise AssertionError("ranks started")

    monkeypatch.setattr(launch, "torchrun", torchrun)


# -- device graphs ---------------------------------------------------------------------------


class _ExpertParallel:
    def _take(self, record) -> None:
        pass


class _RunAgain:
    """A GraphCapture for the CPU: a 'graph' replays by running the captured function again."""

    def __init__(self):
        self.pools = self.captures = self.warmups = self.replays = 0

    def new_pool(self, device):
        self.pools += 1
        return self.pools

    def capture(self, fn, *, device, pool, warmups):
        for _ in range(warmups):
            fn()
        self.warmups += warmups
        self.captures += 1
        out = fn()

        def replay():
            self.replays += 1
            fn()

        return types.SimpleNamespace(replay=replay), out


def _impl(calls: list[str]) -> bench.Impl:
    def dispatch(x, ids, *, num_experts, ep_group):
        calls.append("dispatch")
        return x * 2, torch.zeros(1, dtype=torch.int32), torch.arange(x.shape[0])

    def combine(expert_out, weights, row_of_slot, *, ep_group):
        calls.append("combine")
        return expert_out[row_of_slot]

    return bench.Impl(bench.SYMM, types.SimpleNamespace(fn=dispatch), types.SimpleNamespace(fn=combine))


def test_in_graph_rows_are_captured_by_the_backend(monkeypatch):
    """The graph rows record and replay through the backend's GraphCapture (here one that runs on
    the CPU): two graphs (dispatches; dispatch + combine pairs), captured after the eager warm-up,
    each replayed once untimed and `repeat` times timed."""
    monkeypatch.setattr(bench, "start_together", lambda device, group: None)
    graphs, calls = _RunAgain(), []
    x, ids, weights = torch.ones(4, 8, dtype=torch.bfloat16), torch.zeros(4, 2, dtype=torch.int32), torch.ones(4, 2)
    error, dispatch, combine, mean, phases = bench._graph_times(_impl(calls), x, ids, weights, _ExpertParallel(), torch.device("cpu"), None, 1, 3, graphs)
    assert error is None, error
    assert graphs.captures == 2 and graphs.warmups == 0 and graphs.pools == 2 and graphs.replays == 2 * (1 + 3)
    assert dispatch > 0 and combine >= 0 and mean > 0 and phases is None
    assert calls.count("dispatch") == 1 + 2 * (1 + 4) + 2 * (1 + 4)  # the eager warm-up, then each graph's capture and 4 replays


def test_without_graph_capture_the_in_graph_rows_are_left_out():
    symm = bench.Impl(bench.SYMM, None, None)
    graph_row = f"{bench.SYMM} (CUDA graph)"
    measured, left_out = bench._variants(symm, bench.TARGET_LATENCY_TOKENS, can_capture=False)
    assert graph_row not in [label for label, _, _ in measured] and left_out == [graph_row]
    assert bench._variants(symm, bench.TARGET_LATENCY_TOKENS, can_capture=True)[1] == []
    result = {"backend": "x", "ep": 2, "device": "d", "process_group": "g", "p2p": None, "rows": [], "notes": [f"{graph_row}: not measured"]}
    assert f"note: {graph_row}: not measured" in bench.format_table(result)


def test_the_e2e_ep_graphs_note_asks_the_backend(monkeypatch):
    from deepinfer.cli.bench_e2e_ep import captures_graphs

    plain = BackendSpec(name="plain", device_type="fakeaccel", probe=lambda interpret=False: Availability(True, "ok"))
    _only(monkeypatch, _accelerator(lambda: 2, RecordingGraphs()), plain)
    assert captures_graphs(types.SimpleNamespace(backend="accel", interpret=False))
    assert not captures_graphs(types.SimpleNamespace(backend="accel", interpret=True))  # the interpreter runs on the CPU
    assert not captures_graphs(types.SimpleNamespace(backend="plain", interpret=False))


def test_the_e2e_ep_json_notes_graphs_only_where_the_runtime_captures():
    from deepinfer.bench import e2e_ep

    cfg = e2e_ep.model_config(2, 1)

    def info(graphs):
        backend = types.SimpleNamespace(name="fake")
        runtime = types.SimpleNamespace(device=torch.device("cpu"), backend=backend, options={}, graph_capture=graphs)
        return e2e_ep.machine_info(runtime, 2, cfg, torch.bfloat16, 0.5, 16.0, False)

    assert info(RecordingGraphs())["note"] == e2e_ep.GRAPHS_NOTE and "note" not in info(None)
    assert info(None)["device"] == "cpu"


# -- devices counted by the backend ----------------------------------------------------------


def test_the_p2p_copy_is_measured_where_the_backend_has_two_devices():
    assert bench.measures_p2p(_accelerator(lambda: 2), interpret=False)
    assert not bench.measures_p2p(_accelerator(lambda: 1), interpret=False)
    assert not bench.measures_p2p(_accelerator(lambda: 8), interpret=True)  # the interpreter: the CPU, no p2p
    assert not bench.measures_p2p(BackendSpec(name="cpu", device_type="cpu", probe=None), interpret=False)


def test_bench_e2e_ep_asks_the_backend_how_many_devices_it_has(monkeypatch, capsys):
    _no_ranks(monkeypatch)
    _only(monkeypatch, _accelerator(lambda: 1))
    assert main(["bench", "e2e-ep", "--backend", "accel", "--ep", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ep 2 needs one fakeaccel device per rank, and this host has 1 (backend accel)" in err[0], err


def test_run_ep_asks_the_backend_how_many_devices_it_has(monkeypatch, capsys):
    _no_ranks(monkeypatch)
    _only(monkeypatch, _accelerator(lambda: 1))
    assert main(["run", "--no-progress", "--backend", "accel", "--ep", "2", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ep 2 needs one fakeaccel device per rank, and this host has 1 (backend accel)" in err[0], err


# -- the generic device calls on the CPU -----------------------------------------------------


def test_the_device_calls_on_the_cpu_do_nothing_and_say_so():
    cpu = torch.device("cpu")
    device_api.synchronize(cpu)
    device_api.empty_cache(cpu)  # torch.accelerator.empty_cache() raises where there is no accelerator
    assert device_api.device_name(cpu) == "cpu" and device_api.on_host(cpu)
    assert device_api.peer_access("cpu", 0, 1) is None  # the device module cannot tell: not guessed
    marks = bench.Marks(cpu)
    marks("a")
    marks("b")
    (_, t0), (_, t1) = marks.times_us()
    assert t0 == 0.0 and t1 >= 0.0
