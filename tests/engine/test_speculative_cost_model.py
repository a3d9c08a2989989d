"""The confidence policy's step-cost model: fitted from timed runs as a pure function (so noisy and
outlying runs can be injected and the policy's decisions shown not to follow them), measured with
more runs where steps are short (a fake clock, no wall-clock timing), kept per machine and model
shape in the cache folder, and announced while it is measured."""

from __future__ import annotations

import json
import random

import pytest

from deepinfer.engine.speculative.cost_measure import MAX_REPEATS, MIN_REPEATS, CostSamples, measure, token_points
from deepinfer.engine.speculative.cost_model import HingeFit, StepCostModel, fit
from deepinfer.engine.speculative.policy import ConfidencePolicy

MOST = 1024
CPU_LIKE = HingeFit(flat=0.009, knee=4, per_token=0.00066, draft=0.0005)  # measured shape of the tiny model on one core
GPU_LIKE = HingeFit(flat=0.005, knee=128, per_token=0.00002, draft=0.0002)  # flat while the weights' reads dominate


def _true_step(curve: HingeFit, tokens: int) -> float:
    return curve.flat + curve.per_token * max(0, tokens - curve.knee)


def _samples(curve: HingeFit, seed: int, outliers: bool) -> dict[int, list[float]]:
    """Five runs a point with +-5% jitter; with outliers: two runs of one point three times as long,
    every run of a short point (4 tokens: the size of the run that verified 2.40 drafts) 35% longer,
    and every run of a long point (256 tokens) 2.5 times as long (another process's burst)."""
    rng = random.Random(seed)
    steps = {}
    for t in token_points(MOST):
        runs = [_true_step(curve, t) * rng.uniform(0.95, 1.05) for _ in range(5)]
        if outliers:
            if t == 16:
                runs[1] *= 3
                runs[3] *= 3
            if t == 4:
                runs = [r * 1.35 for r in runs]
            if t == 256:
                runs = [r * 2.5 for r in runs]
        steps[t] = runs
    return steps


# (batch of requests, each one's draft confidences): few unlikely drafts at low load (verify none on the CPU-like
# curve), likely drafts at low load (verify), a big batch of middling drafts (some), one sure request
SCENARIOS = [
    [[0.05, 0.04, 0.03]] * 4,
    [[0.95, 0.9, 0.85]] * 4,
    [[0.6, 0.45, 0.3]] * 48,
    [[0.99, 0.97, 0.95, 0.9, 0.85]],
]


def _decisions(model: StepCostModel, padded: bool) -> list[list[int]]:
    out = []
    for confidences in SCENARIOS:
        policy = ConfidencePolicy(model, padded=padded)
        out.append(policy.choose(list(range(len(confidences))), confidences))
    return out


@pytest.mark.parametrize("curve", [CPU_LIKE, GPU_LIKE], ids=["cpu-like", "gpu-like"])
@pytest.mark.parametrize("padded", [False, True])
def test_decisions_do_not_follow_noise_or_outliers(curve, padded):
    truth = _decisions(curve.model(), padded)
    assert any(sum(d) > 0 for d in truth) and (curve is GPU_LIKE or any(sum(d) == 0 for d in truth))  # on the CPU-like curve: some verify nothing
    interpolated_flips = 0
    for seed in range(40):
        for outliers in (False, True):
            steps = _samples(curve, seed, outliers)
            assert _decisions(fit(steps, MOST, [curve.draft * MOST]).model(), padded) == truth, (seed, outliers)
            medians = {t: sorted(runs)[len(runs) // 2] for t, runs in steps.items()}
            interpolated_flips += _decisions(StepCostModel.from_table(medians, curve.draft), padded) != truth
    assert interpolated_flips > 0  # the samples are hostile enough: interpolating their medians (the old model) flips decisions


def test_an_exact_hinge_is_recovered_and_the_fit_is_a_pure_function():
    steps = {t: [_true_step(CPU_LIKE, t)] * 3 for t in token_points(MOST)}
    fitted = fit(steps, MOST, [CPU_LIKE.draft * MOST] * 3)
    assert fitted.knee == CPU_LIKE.knee
    assert fitted.flat == pytest.approx(CPU_LIKE.flat) and fitted.per_token == pytest.approx(CPU_LIKE.per_token)
    assert fitted.draft == pytest.approx(CPU_LIKE.draft)
    shuffled = {t: list(reversed(runs)) for t, runs in reversed(list(_samples(CPU_LIKE, 3, True).items()))}
    assert fit(shuffled) == fit(_samples(CPU_LIKE, 3, True))  # the order of runs and points does not matter
    model = fitted.model()
    for t in (1, 3, 4, 5, 100, 1024, 5000):  # the table is the hinge, extrapolated past the measured points
        assert model.step(t) == pytest.approx(_true_step(CPU_LIKE, t))
    assert "9 ms a step of up to 4 tokens, 0.66 ms each token more" in fitted.describe()


def test_few_points_fit():
    assert fit({1: [0.01]}).model().step(1) == pytest.approx(0.01)
    two = fit({1: [0.01], 2: [0.012]})
    assert (two.knee, two.model().step(4)) == (1, pytest.approx(0.016))
    with pytest.raises(ValueError):
        fit({1: []})
    with pytest.raises(ValueError):
        fit({})


class FakeDevice:
    """Forwards that advance a fake clock by a hinge's step time (twice that on a shape's first run)."""

    def __init__(self, curve: HingeFit):
        self.curve, self.now, self.calls, self.seen = curve, 0.0, [], set()

    def _run(self, what, tokens, seconds):
        self.calls.append((what, tokens))
        self.now += seconds * (2 if (what, tokens) not in self.seen else 1)
        self.seen.add((what, tokens))

    def target(self, tokens):
        self._run("target", tokens, _true_step(self.curve, tokens))

    def draft(self, tokens):
        self._run("draft", tokens, self.curve.draft * tokens)


@pytest.mark.parametrize("warm_each_shape", [True, False])
def test_short_steps_get_more_runs(warm_each_shape):
    device = FakeDevice(CPU_LIKE)
    points = []
    samples = measure(device.target, device.draft, 1000, lambda: None, warm_each_shape, on_point=lambda: points.append(1), clock=lambda: device.now)
    assert list(samples.steps) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000] and len(points) == 12  # progress after every point and the draft
    assert len(samples.steps[1]) == MAX_REPEATS and len(samples.steps[1000]) == MIN_REPEATS
    assert all(MIN_REPEATS <= len(runs) <= MAX_REPEATS for runs in samples.steps.values())
    assert samples.draft_tokens == 1000 and len(samples.draft) == MIN_REPEATS
    untimed = sum(len(runs) for runs in samples.steps.values()) + len(samples.draft)
    assert len(device.calls) - untimed == (12 if warm_each_shape else 2)  # untimed runs: before each shape, or before the first of each forward
    # the first run of a shape (twice as slow here) is never one of the timed ones when each shape is warmed
    if warm_each_shape:
        assert samples.steps[4] == [pytest.approx(_true_step(CPU_LIKE, 4))] * len(samples.steps[4])


def test_no_draft_model_costs_nothing():
    device = FakeDevice(CPU_LIKE)
    samples = measure(device.target, None, 8, lambda: None, clock=lambda: device.now)
    assert samples.draft == [] and fit(samples.steps, samples.draft_tokens, samples.draft).draft == 0.0


# -- the cache ------------------------------------------------------------------------------------


def test_the_cache_round_trips_and_refuses_what_is_not_its_key(tmp_path, caplog):
    from deepinfer.engine.speculative import cost_cache

    key = {"format": cost_cache.FORMAT, "device": "cpu: test", "max_tokens": MOST, "draft_model": True}
    path = cost_cache.cache_path(key, tmp_path)
    assert cost_cache.load(path, key) is None  # nothing kept yet
    samples = CostSamples(_samples(CPU_LIKE, 1, True), MOST, [CPU_LIKE.draft * MOST] * 3)
    fitted = fit(samples.steps, samples.draft_tokens, samples.draft)
    assert cost_cache.store(path, key, samples, fitted, 1.5)
    loaded = cost_cache.load(path, key)
    assert loaded == samples and fit(loaded.steps, loaded.draft_tokens, loaded.draft) == fitted
    assert json.loads(path.read_text())["fit"]["knee_tokens"] == fitted.knee
    other = {**key, "device": "cpu: another"}
    assert cost_cache.cache_path(other, tmp_path) != path
    assert cost_cache.load(path, other) is None and "another machine's" in caplog.text
    for broken in ("{not json", json.dumps({"key": key, "samples": {"steps": {"1": []}, "draft_tokens": 1, "draft": []}}), "[" * 100000, "[]"):
        path.write_text(broken)
        caplog.clear()
        assert cost_cache.load(path, key) is None and "unusable" in caplog.text, broken[:40]


def test_an_unwritable_cache_is_a_warning(tmp_path, caplog):
    from deepinfer.engine.speculative import cost_cache

    blocker = tmp_path / "file"
    blocker.write_text("")
    samples = CostSamples({1: [0.01]}, 1, [])
    assert not cost_cache.store(blocker / "speculative-costs" / "x.json", {}, samples, fit(samples.steps), 0.1)
    assert "set DEEPINFER_CACHE to a writable folder" in caplog.text


def test_the_engine_announces_measures_keeps_and_reuses_its_step_costs(tmp_path, monkeypatch, capsys):
    """A first engine measures (and says so before it starts, then what it found), a second one of the
    same shape reads the kept file and measures nothing, cost_model "measure" measures again; an engine
    built without announce prints nothing."""
    from deepinfer import LLM

    from engine.determinism import write_small_checkpoint

    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path / "cache"))
    checkpoint = write_small_checkpoint(tmp_path / "tiny", num_hidden_layers=1)

    def llm(cost_model=None, announce=True):
        spec = {"method": "mtp", "num_drafts": 2, "policy": "confidence", **({"cost_model": cost_model} if cost_model else {})}
        return LLM(model=str(checkpoint), backend="reference", dtype="float32", num_kv_blocks=32, max_num_seqs=4, speculative=spec, announce=announce)

    first = llm()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "speculative step costs" in line]
    assert len(lines) == 2 and lines[0].startswith("deepinfer: measuring the speculative step costs on cpu")
    assert ": target forwards of 1 to 12 tokens, and the draft layer's, once per machine and model shape ..." in lines[0]
    assert lines[1].startswith("deepinfer: speculative step costs measured in ") and "kept in" in lines[1]
    files = list((tmp_path / "cache" / "speculative-costs").glob("*.json"))
    assert len(files) == 1 and str(files[0]) in lines[1]
    stored = json.loads(files[0].read_text())
    assert stored["key"]["max_tokens"] == 12 and stored["key"]["draft_model"] and list(stored["samples"]["steps"]) == ["1", "2", "4", "8", "12"]

    second = llm()
    err = capsys.readouterr().err
    assert "measuring" not in err and f"speculative step costs from {files[0]}" in err and 'cost_model "measure" measures them again' in err
    assert second.engine.speculative.policy.cost == first.engine.speculative.policy.cost

    llm("measure")
    assert "deepinfer: measuring the speculative step costs" in capsys.readouterr().err
    assert json.loads(files[0].read_text())["samples"] != stored["samples"]  # replaced by the new runs

    llm(announce=False)
    assert "speculative" not in capsys.readouterr().err
