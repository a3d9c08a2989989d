"""`deepinfer bench structured` on the reference backend and the embedded tiny model (cheap settings):
the JSON holds a mask-fill time per batch size asked and the throughput runs of every round per
constrained share, every request of which ran to its length, with each overhead's spread over the
rounds (printed next to it); the workload's defaults are the backend's (its bench_scale, not its
device); the plot is written; bad flags are one line."""

from __future__ import annotations

import json

import pytest

from deepinfer.bench import structured
from deepinfer.bench.structured import Throughput
from deepinfer.cli import bench_structured
from deepinfer.cli.main import main

pytestmark = pytest.mark.usefixtures("model_cache")  # tests/engine/conftest.py


def test_bench_writes_its_json_and_plot(tmp_path, capsys):
    out = tmp_path / "structured.json"
    argv = ["bench", "structured", "--backend", "reference", "--batch", "4", "--input-len", "6", "--output-len", "6", "--repeats", "2",
            "--mask-batches", "1,3", "--mask-steps", "3", "--json", str(out), "--plot", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "mask fill per step" in printed and "out tok/s" in printed and "2 rounds (median, min..max over the rounds)" in printed
    data = json.loads(out.read_text())
    assert data["kind"] == "structured" and data["machine"]["backend"] == "reference" and data["machine"]["model"] == "tiny-v3"
    assert data["workload"] == {"batch": 4, "input_len": 6, "output_len": 6, "mask_batches": "1,3", "mask_steps": 3, "repeats": 2}
    masks = data["mask_fill"]
    assert [m["batch"] for m in masks] == [1, 3] and all(0 < m["ms_min"] <= m["ms_per_step"] <= m["ms_max"] for m in masks)
    runs = data["throughput"]
    assert [(r["constrained"], r["batch"]) for r in runs] == [(0, 4), (2, 4), (4, 4)]
    for r in runs:
        assert r["output_tokens"] == 4 * 6 and len(r["runs_wall_s"]) == len(r["runs_tokens_per_s"]) == 2
        assert r["runs_tokens_per_s"] == pytest.approx([r["output_tokens"] / w for w in r["runs_wall_s"]])
        assert r["output_tokens_per_s"] == pytest.approx(sum(r["runs_tokens_per_s"]) / 2)  # the median of two
    assert set(data["overhead"]) == set(data["overhead_spread"]) == {"50%", "100%"}
    for share, spread in data["overhead_spread"].items():
        assert len(spread["runs"]) == 2 and spread["min"] <= spread["median"] == data["overhead"][share] <= spread["max"]
        assert f"{spread['median']:9.1%}  {spread['min']:+.1%}..{spread['max']:+.1%}" in printed  # the spread next to the overhead
    assert (tmp_path / "structured.png").stat().st_size > 0


def test_the_schema_never_ends_before_the_output_length():
    """The throughput runs compare equal lengths: a document of the schema has at least output_len / 4
    items, and no item is shorter than 4 tokens (DeepSeek's tokenizer: 9 for the shortest)."""
    from deepinfer import LLM

    assert structured.schema(structured.min_items(64))["minItems"] == 16 and structured.min_items(65) == 17
    tokenizer = LLM(model="tiny-v3", backend="reference", announce=False).engine.tokenizer
    assert len(tokenizer.encode('{"id":0,"tag":"beta"}', add_bos=False)) >= 4
    json.loads(structured.DOCUMENT)  # the mask-fill matchers walk a valid document


@pytest.mark.parametrize(
    "flags, needle",
    [(["--mask-batches", "1,x"], "--mask-batches must be integers"), (["--batch", "0"], "--batch must be at least 1"),
     (["--layers", "2"], "--layers cuts a --model-shape model"), (["--model", "tiny-v3", "--model-shape", "v2-lite"], "not both"),
     (["--repeats", "0"], "--repeats must be at least 1")],
)  # fmt: skip
def test_bad_flags_are_one_line(capsys, flags, needle):
    assert main(["bench", "structured", "--backend", "reference", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err, err


def test_the_overhead_is_paired_by_round_and_printed_with_its_spread():
    """Round r's constrained run against round r's free run; the median, min and max of those."""
    free = Throughput(0.0, 0, 4, 8, 32, 1.0, 32.0, [1.0, 2.0, 1.0], [32.0, 16.0, 32.0])
    half = Throughput(0.5, 2, 4, 8, 32, 1.0, 32.0, [1.0, 2.0, 1.6], [32.0, 16.0, 20.0])  # 0%, 0% and 37.5% slower than its round's free run
    spread = structured.overhead_spread([free, half])
    assert spread == {"50%": {"min": 0.0, "median": 0.0, "max": pytest.approx(0.375), "runs": [0.0, 0.0, pytest.approx(0.375)]}}
    assert structured.overhead([free, half]) == {"50%": 0.0}
    table = structured.format_results([], [free, half])
    assert "     2 ( 50%)       32.0     16.0..32.0          0.0%  +0.0%..+37.5%" in table


@pytest.mark.parametrize("backend, scale", [("reference", "host"), ("fake", "device")])
def test_the_workload_defaults_are_the_backends(tmp_path, monkeypatch, capsys, backend, scale):
    """The defaults follow the backend's bench_scale: the fake backend runs on the CPU too, yet declares
    an accelerator's scale (the default), so it gets the accelerator's batch."""
    import deepinfer.plugins as plugins_mod
    from deepinfer.backends import reference
    from deepinfer.plugins import Plugins

    from fake_backend import FakeBackend

    plugins = Plugins(load_entry_points=False, extra_plugins=(FakeBackend(), reference))
    monkeypatch.setattr(plugins_mod, "load_plugins", lambda: plugins)
    out = tmp_path / "structured.json"
    assert main(["bench", "structured", "--backend", backend, "--no-throughput", "--mask-batches", "2", "--mask-steps", "2", "--json", str(out)]) == 0
    assert f"deepinfer: workload ({scale} defaults, flags given override them): batch {bench_structured.DEFAULTS[scale]['batch']}," in capsys.readouterr().err
    workload = json.loads(out.read_text())["workload"]
    assert workload == {**bench_structured.DEFAULTS[scale], "mask_batches": "2", "mask_steps": 2}
    assert bench_structured.DEFAULTS["host"]["batch"] < bench_structured.DEFAULTS["device"]["batch"]
