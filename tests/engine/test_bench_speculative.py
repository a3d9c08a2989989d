"""`deepinfer bench speculative` measures the verification policy at its defaults: every engine in
deterministic mode, so outputs keep to their recorded continuations and the controlled drafts keep
agreeing (a tiny V2-shaped model on the reference backend here; its timings mean nothing on a CPU).
Rows whose outputs left their continuations are flagged; a backend without batch-invariant kernels
is one line naming --no-deterministic."""

from __future__ import annotations

import json

import pytest

from deepinfer.bench import speculative
from deepinfer.bench.speculative import SpecResult
from deepinfer.cli.main import main

from tiny_shapes import TINY_V2


def test_the_default_keeps_outputs_on_their_continuations(tmp_path, monkeypatch):
    from deepinfer.engine.speculative import cost_cache
    from deepinfer.engine.speculative.cost_model import HingeFit

    # an accelerator's step costs (flat up to 16 tokens), not this machine's: a busy CPU's measured slope
    # makes the confidence policy verify fewer drafts, and the acceptance below would depend on the load
    monkeypatch.setattr(cost_cache, "step_cost_model", lambda *args, **kwargs: HingeFit(0.01, 16, 0.001, 0.0).model())
    out = tmp_path / "spec.json"
    seen = []
    results = speculative.run("reference", (4,), layers=2, prompt_len=8, new_tokens=12, num_drafts=3, first=0.9, decay=0.8, spread=0.3,
                              json_path=out, on_result=seen.append, config_overrides=TINY_V2)  # fmt: skip
    assert [r.mode for r in results] == ["no speculation", "fixed-3", "confidence-3"] and seen == results
    for r in results[1:]:
        assert r.outputs_equal == 4 and r.left_continuations == 0
        assert r.acceptance_length > 1.5  # drafts agree at 0.9, 0.72, 0.58 (times a request's factor in [0.7, 1])
    data = json.loads(out.read_text())
    assert data["machine"]["deterministic"] is True and all(row["left_continuations"] == 0 for row in data["results"])
    assert speculative.notes(results, deterministic=True) == []
    assert "left their continuations" not in speculative.format_results(results)


def test_the_command_line_default_is_deterministic():
    from deepinfer.cli.main import build_parser, parse

    argv = ["bench", "speculative"]
    assert parse(build_parser(argv), argv).deterministic is True
    argv = ["bench", "speculative", "--no-deterministic"]
    assert parse(build_parser(argv), argv).deterministic is False


def _row(mode: str, equal: int) -> SpecResult:
    return SpecResult(16, mode, 1.0, 100.0, 1.05, 2.0, 0.02, equal)


def test_rows_that_left_their_continuations_are_flagged():
    results = [SpecResult(16, "no speculation", 1.0, 100.0, None, None, None, 16), _row("fixed-5", 0), _row("confidence-5", 16)]
    table = speculative.format_results(results)
    assert table.count("(left their continuations)") == 1 and "0/16  (left their continuations)" in table
    (warning,) = speculative.notes(results, deterministic=False)
    assert warning.startswith("warning: outputs left their recorded continuations: fixed-5 at 16 (16 of 16).")
    assert "under-count" in warning and "deterministic mode" in warning
    (error,) = speculative.notes(results, deterministic=True)
    assert error.startswith("error: outputs left their recorded continuations in deterministic mode: fixed-5 at 16") and "bug" in error


def test_a_backend_without_batch_invariant_kernels_is_one_line(monkeypatch, capsys):
    import deepinfer.plugins as plugins_mod
    import deepinfer.runtime as runtime_mod
    from deepinfer.backends import reference
    from deepinfer.plugins import Plugins

    from fake_backend import FakeBackend

    plugins = Plugins(load_entry_points=False, extra_plugins=(FakeBackend(), reference))
    monkeypatch.setattr(plugins_mod, "load_plugins", lambda: plugins)
    monkeypatch.setattr(runtime_mod, "load_plugins", lambda: plugins)
    assert main(["bench", "speculative", "--backend", "fake", "--layers", "1", "--concurrency", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "has no batch-invariant kernel for op" in err and "--no-deterministic measures with the backend's own kernels" in err


@pytest.mark.parametrize("flags, needle", [(["--num-drafts", "0"], "--num-drafts must lie in"), (["--spread", "1"], "--spread must lie in")])
def test_bad_flags_are_one_line(capsys, flags, needle):
    assert main(["bench", "speculative", "--backend", "reference", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_the_head_policy_row_on_controlled_drafts(tmp_path, monkeypatch):
    """DSpark's confidence-head policy on the controlled-acceptance setup: its row keeps the outputs and, reading
    the drafts' (calibrated) confidences, verifies fewer drafts than fixed-k for about the same acceptance."""
    from deepinfer.engine.speculative import cost_cache
    from deepinfer.engine.speculative.cost_model import HingeFit

    # an accelerator's step costs (flat up to 16 tokens), not this machine's: on a busy CPU the measured slope made the
    # head policy verify no drafts at all (acceptance 1.0), so the assertions below would depend on the load
    monkeypatch.setattr(cost_cache, "step_cost_model", lambda *args, **kwargs: HingeFit(0.01, 16, 0.001, 0.0).model())
    results = speculative.run("reference", (4,), layers=2, prompt_len=8, new_tokens=12, num_drafts=5, first=0.9, decay=0.6, spread=0.3,
                              config_overrides=TINY_V2, policies=("fixed", "head"))  # fmt: skip
    assert [r.mode for r in results] == ["no speculation", "fixed-5", "head-5"]
    fixed, head = results[1:]
    assert fixed.outputs_equal == head.outputs_equal == 4
    assert head.acceptance_length > 1.5 and head.drafts_verified_per_step < fixed.drafts_verified_per_step


def test_bad_policies_are_one_line(capsys):
    assert main(["bench", "speculative", "--backend", "reference", "--policies", "fixed,sometimes"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--policies lists distinct policies of fixed, confidence, head" in err, err
