"""The cuda bench runner's logic on the CPU: fake cases, a fake timer, fixed ceilings.

What runs on the GPU (the timings themselves) cannot be checked here; what can: the arithmetic of
rates and fractions, the table, the JSON, --op filtering, and that a module that fails to import or
a case that fails becomes a row instead of a crash. Plus the CLI's discovery of the runner.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from deepinfer.errors import UserError
from deepinfer_cuda.bench import runner
from deepinfer_cuda.bench.common import BenchCase

COPY_TBS, MATMUL_TFLOPS = 4.0, 800.0
CALLS: list[float] = []  # the fake "duration" of the last kernel/peer call, in ms


def fake_timer(fn):
    fn()
    return CALLS[-1]


CAPTURING: list[bool] = []


def fake_graph_timer(fn):
    """A graph replay removes launch overhead: here, half the stream time. Refuses a call that syncs."""
    CAPTURING.append(True)
    try:
        fn()
    finally:
        CAPTURING.clear()
    if CALLS[-1] < 0:
        raise RuntimeError("operation not permitted when stream is capturing")
    return CALLS[-1] / 2


def _work(ms: float):
    def call(state):
        CALLS.append(ms)
        return torch.zeros(1)

    return call


def _boom(state):
    raise RuntimeError("kernel exploded\nsecond line")


def make_cases():
    from deepinfer_cuda.bench.misc import GraphCase

    setup = lambda device: {"x": torch.ones(4, device=device)}  # noqa: E731

    def syncing(state):  # an op with a host sync: graph capture fails, the runner times it on the stream
        CALLS.append(-1.0 if CAPTURING else 3.0)
        return torch.zeros(1)

    return [
        # 4e9 bytes in 1.25 ms = 3.2 TB/s = 80% of 4.0; the peer takes 2.5 ms: 2.00x
        BenchCase("rms_norm", "mem", setup, _work(1.25), _work(2.5), "torch peer", lambda s: 1e9, lambda s: 4e9),
        # 8e11 flops in 2 ms = 400 TFLOP/s = 50% of 800
        BenchCase("grouped_gemm", "compute", setup, _work(2.0), None, "", lambda s: 8e11, lambda s: 1e9, bound="compute"),
        BenchCase("rope", "setup_fails", lambda device: (_ for _ in ()).throw(MemoryError("no room")), _work(1.0), None, "", lambda s: 0, lambda s: 0),
        BenchCase("rope", "kernel_fails", setup, _boom, None, "", lambda s: 0, lambda s: 0),
        BenchCase("silu_and_mul", "peer_fails", setup, _work(1.0), _boom, "F.silu", lambda s: 0, lambda s: 1e9),
        # Graph-timed: 0.1 ms on the stream, 0.05 ms from the graph; the peer is graph-timed too.
        GraphCase("rms_norm", "decode", setup, _work(0.1), _work(0.4), "torch peer", lambda s: 0, lambda s: 1e8),
        GraphCase("rope", "graph_refused", setup, syncing, None, "", lambda s: 0, lambda s: 3e9),
    ]


@pytest.fixture
def fake_bench(tmp_path, monkeypatch):
    """A package `fakebench` with a good module, a module that fails to import and one without CASES."""
    pkg = tmp_path / "fakebench"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "broken.py").write_text('OPS = ("gate",)\nimport deepinfer_no_such_module\n')
    (pkg / "empty.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(runner, "measure_copy_tbs", lambda device, timer: COPY_TBS)
    monkeypatch.setattr(runner, "measure_matmul_tflops", lambda device, timer: MATMUL_TFLOPS)
    for name in [m for m in sys.modules if m.startswith("fakebench")]:
        monkeypatch.delitem(sys.modules, name)
    good = types.ModuleType("fakebench.good")
    good.CASES = make_cases()
    monkeypatch.setitem(sys.modules, "fakebench.good", good)
    CALLS.clear()

    def run(**kwargs):
        lines: list[str] = []
        result = runner.run(device="cpu", modules=("good", "broken", "empty"), package="fakebench", timer=fake_timer,
                            graph_timer=fake_graph_timer, out=lines.append, progress=lambda line: None, **kwargs)
        return result, "\n".join(lines)

    return run


def _by_case(result):
    return {r["case"]: r for r in result["results"]}


BENCH_MODULES = [  # in TABLE_ORDER
    "attention_decode", "attention_prefill", "gemm", "quant_act", "moe", "sampling", "misc", "v4_attention", "v4_misc", "v4_decode_plan", "v41_ops",
]  # fmt: skip


def test_the_runner_finds_the_bench_modules_by_iterating_its_package():
    """No hand-kept list: every module of deepinfer_cuda.bench that declares OPS is benched, in
    TABLE_ORDER; the others are helpers and say so (issue 14, item 8)."""
    import importlib

    from deepinfer.discovery import submodules

    modules = [importlib.import_module(f"deepinfer_cuda.bench.{name}") for name in BENCH_MODULES]
    cases, failures = runner.load_cases()
    assert failures == [] and cases == [case for module in modules for case in module.CASES]
    assert [m.TABLE_ORDER for m in modules] == sorted(m.TABLE_ORDER for m in modules)
    for module in submodules("deepinfer_cuda.bench"):
        if hasattr(module, "OPS"):
            assert module.__name__.rsplit(".", 1)[1] in BENCH_MODULES
            assert set(module.OPS) == {case.op for case in module.CASES}, module.__name__
        else:
            assert "Not a bench module" in " ".join((module.__doc__ or "").split()), module.__name__


def test_discovered_modules_in_table_order_helpers_left_out_failures_kept(tmp_path, monkeypatch):
    pkg = tmp_path / "discoveredbench"
    pkg.mkdir()
    files = {
        "__init__.py": "",
        "zeta.py": 'OPS = ("rms_norm",)\nTABLE_ORDER = 1\nCASES = ["z"]\n',
        "alpha.py": 'OPS: tuple = ("rope",)\nTABLE_ORDER = 2\nCASES = ["a"]\n',
        "unordered.py": 'OPS = ("silu_and_mul",)\nCASES = ["u"]\n',  # no TABLE_ORDER: after the others
        "helper.py": 'CASES = ["not a bench case"]\n',  # no OPS: a helper, like compile_check
        "broken_helper.py": "import deepinfer_no_such_module\n",  # a helper that fails: not the runner's business
        "broken_bench.py": 'OPS = ("gate",)\nimport deepinfer_no_such_module\n',
        "syntax.py": "OPS = (\n",  # cannot be read: it might be a bench module
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("discoveredbench")]:
        monkeypatch.delitem(sys.modules, name)
    cases, failures = runner.load_cases(package="discoveredbench")
    assert cases == ["z", "a", "u"]
    by_module = {f.row.op: f for f in failures}
    assert set(by_module) == {"(broken_bench)", "(syntax)"}
    assert "deepinfer_no_such_module" in by_module["(broken_bench)"].row.error and "SyntaxError" in by_module["(syntax)"].row.error
    assert by_module["(broken_bench)"].covers == ("gate",) and by_module["(syntax)"].covers is None
    assert not by_module["(broken_bench)"].concerns({"rms_norm"}) and by_module["(broken_bench)"].concerns({"gate", "rope"})
    assert by_module["(syntax)"].concerns({"rms_norm"}) and by_module["(broken_bench)"].concerns(None)


def test_rates_fractions_and_speedups(fake_bench):
    result, text = fake_bench()
    rows = _by_case(result)
    mem = rows["mem"]
    assert mem["status"] == "ok" and mem["kernel_ms"] == 1.25 and mem["peer_ms"] == 2.5
    assert mem["tbs"] == pytest.approx(3.2) and mem["tflops"] == pytest.approx(0.8)
    assert mem["ceiling"] == "copy" and mem["fraction"] == pytest.approx(0.8) and mem["speedup"] == pytest.approx(2.0)
    comp = rows["compute"]
    assert comp["ceiling"] == "matmul" and comp["tflops"] == pytest.approx(400) and comp["fraction"] == pytest.approx(0.5)
    assert comp["peer_ms"] is None and comp["speedup"] is None and comp["peer_name"] is None


def test_graph_timed_cases(fake_bench):
    result, text = fake_bench()
    rows = _by_case(result)
    dec = rows["decode"]
    assert dec["timing"] == "graph" and dec["kernel_ms"] == pytest.approx(0.05) and dec["peer_ms"] == pytest.approx(0.2)
    assert dec["tbs"] == pytest.approx(2.0) and dec["fraction"] == pytest.approx(0.5) and dec["speedup"] == pytest.approx(4.0)
    assert rows["mem"]["timing"] == "stream"
    refused = rows["graph_refused"]
    assert refused["status"] == "ok" and refused["kernel_ms"] == 3.0 and refused["tbs"] == pytest.approx(1.0)
    assert any("kernel: CUDA graph timing failed (RuntimeError: operation not permitted" in n and "timed on the stream" in n for n in refused["notes"])
    assert "decode (graph)" in text and "graph_refused (graph)" not in text and refused["timing"] == "stream"


def test_failures_become_rows_not_crashes(fake_bench):
    result, text = fake_bench()
    rows = _by_case(result)
    assert rows["setup_fails"]["status"] == "error" and rows["setup_fails"]["error"].startswith("setup: MemoryError: no room")
    assert rows["kernel_fails"]["status"] == "error" and rows["kernel_fails"]["error"] == "first run: RuntimeError: kernel exploded"
    peer = rows["peer_fails"]
    assert peer["status"] == "ok" and peer["peer_ms"] is None and any("peer failed: RuntimeError" in n for n in peer["notes"])
    imports = {r["op"]: r for r in result["results"] if r["case"] == "import"}
    assert set(imports) == {"(broken)", "(empty)"}
    assert "ModuleNotFoundError" in imports["(broken)"]["error"] and "deepinfer_no_such_module" in imports["(broken)"]["error"]
    assert "AttributeError" in imports["(empty)"]["error"] and "CASES" in imports["(empty)"]["error"]
    assert "note: silu_and_mul/peer_fails: peer failed: RuntimeError: kernel exploded" in text


def test_table(fake_bench):
    _, text = fake_bench()
    lines = text.splitlines()
    how = runner.Ceilings(0, 0)
    assert lines[1] == f"ceilings: copy {COPY_TBS:.3f} TB/s ({how.copy_how}); matmul {MATMUL_TFLOPS:.1f} TFLOP/s ({how.matmul_how})"
    header = next(i for i, line in enumerate(lines) if line.startswith("op "))
    assert lines[header].split() == ["op", "case", "kernel", "ms", "TB/s", "TFLOP/s", "%", "ceiling", "peer", "peer", "ms", "speedup"]
    assert set(lines[header + 1]) <= {"-", " "}
    mem = next(line for line in lines if " mem " in line)
    assert mem.split()[:6] == ["rms_norm", "mem", "1.2500", "3.200", "0.8", "80.0%"] and "copy" in mem
    assert "torch peer" in mem and mem.rstrip().endswith("2.00x")
    comp = next(line for line in lines if " compute " in line)
    assert "50.0% matmul" in comp and "400.0" in comp
    err = next(line for line in lines if "kernel_fails" in line)
    assert "ERROR" in err and "first run: RuntimeError: kernel exploded" in err
    # Columns line up: every data row starts its kernel-ms column where the header does.
    col = lines[header].index("kernel ms")
    ok_rows = [line for line in lines[header + 2:] if "ERROR" not in line and line.strip() and not line.startswith("note")]
    assert ok_rows and all(line[col - 2:col] == "  " for line in ok_rows)


def test_op_filter_and_import_failures_that_concern_it(fake_bench):
    result, text = fake_bench(ops=["rms_norm"])
    # (broken) declares it benches gate only: hidden; (empty) declares no OPS, so nobody knows what it covers: shown.
    assert [(r["op"], r["case"]) for r in result["results"]] == [("(empty)", "import"), ("rms_norm", "mem"), ("rms_norm", "decode")]
    result, _ = fake_bench(ops=["rms_norm", "gate"])
    cases = [(r["op"], r["case"]) for r in result["results"]]
    assert ("(broken)", "import") in cases and ("rms_norm", "mem") in cases
    assert {op for op, case in cases if case != "import"} == {"rms_norm"}
    assert result["uncovered_ops"] == ["gate"]


def test_op_filter_keeps_only_that_op(fake_bench):
    result, text = fake_bench(ops=["rope"])
    assert {r["case"] for r in result["results"] if r["case"] != "import"} == {"setup_fails", "kernel_fails", "graph_refused"}
    assert "mem" not in text.split()


def test_unknown_op_is_a_one_line_user_error(fake_bench):
    with pytest.raises(UserError) as err:
        fake_bench(ops=["rms_norm", "nope"])
    assert "unknown op(s) nope" in str(err.value) and "\n" not in str(err.value)


def test_json_has_machine_ceilings_and_rows(fake_bench, tmp_path):
    path = tmp_path / "bench.json"
    fake_bench(json_path=path)
    data = json.loads(path.read_text())
    machine = data["machine"]
    assert {"date", "torch", "triton", "gpu", "device", "cuda"} <= set(machine)
    assert machine["torch"] == torch.__version__ and machine["device"] == "cpu"
    assert data["ceilings"]["copy_tbs"] == COPY_TBS and data["ceilings"]["matmul_tflops"] == MATMUL_TFLOPS
    mem = next(r for r in data["results"] if r["case"] == "mem")
    assert mem["fraction"] == pytest.approx(0.8) and mem["bytes"] == 4e9 and mem["flops"] == 1e9


def test_missing_folder_and_missing_matplotlib_fail_before_benchmarking(fake_bench, tmp_path, monkeypatch):
    with pytest.raises(UserError, match="does not exist"):
        fake_bench(json_path=tmp_path / "no" / "x.json")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(UserError, match="--plot needs matplotlib"):
        fake_bench(plot_path=tmp_path / "x.png")
    assert CALLS == []  # nothing was timed


def test_plot_draws_one_bar_per_measured_case(fake_bench, tmp_path, monkeypatch):
    drawn = {}

    class Axes:
        def bar(self, xs, values, color, **kwargs):
            if len(values):
                drawn["values"], drawn["colors"] = list(values), list(color)

        def __getattr__(self, name):
            return lambda *a, **k: None

    class Figure:
        def tight_layout(self):
            pass

        def savefig(self, path, dpi):
            Path(path).write_bytes(b"png")

    class Plt:
        def subplots(self, figsize):
            return Figure(), Axes()

        def close(self, fig):
            pass

    monkeypatch.setattr(runner, "_plot_module", lambda: Plt())
    fake_bench(plot_path=tmp_path / "x.png")
    assert (tmp_path / "x.png").read_bytes() == b"png"
    # mem, compute, peer_fails (1e9 B in 1 ms), decode, graph_refused; errors have no bar
    assert drawn["values"] == pytest.approx([80.0, 50.0, 25.0, 50.0, 25.0])
    assert drawn["colors"][:2] == ["tab:blue", "tab:orange"]


def test_no_gpu_is_a_user_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="need an NVIDIA GPU"):
        runner.run(ops=["rms_norm"], out=lambda line: None)


def test_the_misc_cases_are_well_formed():
    from deepinfer.registry import all_ops
    from deepinfer_cuda.bench import misc

    names = [(c.op, c.name) for c in misc.CASES]
    assert len(set(names)) == len(names)
    assert {c.op for c in misc.CASES} == {"rms_norm", "silu_and_mul", "rope"} <= set(all_ops())
    assert all(c.peer is not None and c.bound == "memory" for c in misc.CASES)
    assert {c.name for c in misc.CASES if getattr(c, "graph", False)} >= {"T64_D7168_bf16_residual", "T64_I2048_bf16"}


def test_the_quantiser_cases_are_well_formed_and_counted_by_hand():
    from deepinfer.ops import quant
    from deepinfer_cuda.bench import quant_act

    assert {(c.op, c.name.split()[3]) for c in quant_act.CASES} == {("linear", "M1"), ("linear", "M64")}
    assert all(c.graph and c.bound == "memory" for c in quant_act.CASES)
    s = quant_act._setup(3, 300)(torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(quant_act._peer(s), quant.quantize_act_fp8(s["x"])))
    assert quant_act._bytes(s) == 3 * 300 * 2 + 3 * 300 + 3 * 3 * 4  # bf16 read, e4m3 written, 3 groups of scales a row


# ---------------------------------------------------------------------------------------------- CLI


def test_the_cuda_backend_declares_its_runner_as_a_capability():
    """`BackendSpec.bench_runner`, not a module attribute read with getattr (issue 14, item 2)."""
    import deepinfer_cuda.plugin as cuda_plugin
    from deepinfer.cli.bench_ops import bench_runner
    from deepinfer.plugins import Plugins

    plugins = Plugins()
    assert plugins.backend("cuda").bench_runner == "deepinfer_cuda.bench.runner:run"
    assert bench_runner(plugins.backend("cuda")) is runner.run
    assert bench_runner(plugins.backend("reference")) is None
    assert not hasattr(cuda_plugin, "BENCH_RUNNER")


def _fake_gpu_plugins(monkeypatch, bench_runner: str):
    import deepinfer.plugins as plugins_mod
    from deepinfer.plugins import Availability, BackendSpec, Plugins, hookimpl

    spec = BackendSpec(name="fakegpu", device_type="cpu", probe=lambda interpret=False: Availability(True, "ok"), bench_runner=bench_runner)
    plugin = types.SimpleNamespace(deepinfer_add_backends=hookimpl(lambda register: register(spec)))
    monkeypatch.setattr(plugins_mod, "load_plugins", lambda: Plugins(load_entry_points=False, extra_plugins=(plugin,)))


def test_cli_hands_the_arguments_to_the_backend_runner(monkeypatch, tmp_path):
    from deepinfer.cli.main import main

    seen = {}
    fake_runner = types.ModuleType("fake_bench_runner_mod")
    fake_runner.go = lambda **kwargs: seen.update(kwargs)
    monkeypatch.setitem(sys.modules, "fake_bench_runner_mod", fake_runner)
    _fake_gpu_plugins(monkeypatch, "fake_bench_runner_mod:go")
    path = tmp_path / "r.json"
    assert main(["bench", "ops", "--backend", "fakegpu", "--op", "rms_norm", "--op", "rope", "--json", str(path), "--plot", str(tmp_path / "p.png")]) == 0
    assert seen == {"ops": ["rms_norm", "rope"], "json_path": path, "plot_path": tmp_path / "p.png"}
    assert main(["bench", "ops", "--backend", "fakegpu", "--op", "nope"]) == 2


def test_a_runner_that_fails_to_load_is_one_line(monkeypatch, capsys):
    from deepinfer.cli.main import main

    _fake_gpu_plugins(monkeypatch, "deepinfer_no_such_bench_module:run")
    assert main(["bench", "ops", "--backend", "fakegpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "its bench runner 'deepinfer_no_such_bench_module:run' failed to load: ModuleNotFoundError" in err


def test_a_failed_ceiling_leaves_rates_without_fractions(fake_bench, monkeypatch):
    def oom(device, timer):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(runner, "measure_copy_tbs", oom)
    result, text = fake_bench(ops=["rms_norm", "grouped_gemm"])
    rows = _by_case(result)
    assert rows["mem"]["tbs"] == pytest.approx(3.2) and rows["mem"]["fraction"] is None
    assert rows["compute"]["fraction"] == pytest.approx(0.5)
    assert "note: measuring the copy_tbs ceiling failed: RuntimeError: CUDA out of memory" in text
