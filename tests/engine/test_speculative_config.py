"""Hostile `speculative` configurations (LLM(speculative=...), `--speculative`): every field's wrong
types and values are one line naming the field (exit 2 on the command line), never a traceback."""

from __future__ import annotations

import json

import pytest

from deepinfer.cli.main import main
from deepinfer.engine.sampling_params import InvalidRequestError
from deepinfer.engine.speculative.config import SpeculativeConfig


def _confidence(cost_model) -> dict:
    return {"method": "mtp", "policy": "confidence", "cost_model": cost_model}


HOSTILE = [
    (_confidence([1, 2]), "cost_model must be"),
    (_confidence("x"), "cost_model must be"),
    (_confidence(5), "cost_model must be"),
    (_confidence(True), "cost_model must be"),
    (_confidence({"1": "0.1"}), "cost_model entry '1'"),
    (_confidence({"1": True}), "cost_model entry '1'"),
    (_confidence({"1": [0.1]}), "cost_model entry '1'"),
    (_confidence({"1": {}}), "cost_model entry '1'"),
    (_confidence({"1": float("nan")}), "cost_model entry '1'"),
    (_confidence({"1": float("inf")}), "cost_model entry '1'"),
    (_confidence({"1": -0.1}), "cost_model entry '1'"),
    (_confidence({"0": 0.1}), "cost_model entry '0'"),
    (_confidence({"x": 0.1}), "cost_model entry 'x'"),
    (_confidence({"1.5": 0.1}), "cost_model entry '1.5'"),
    (_confidence({"-4": 0.1}), "cost_model entry '-4'"),
    (_confidence({"9" * 40: 0.1}), "cost_model entry '999"),
    (_confidence({}), "needs at least one token count"),
    (_confidence({"draft": 0.1}), "needs at least one token count"),
    (_confidence({"1": 0.1, "draft": float("nan")}), "draft time must be seconds >= 0"),
    (_confidence({"1": 0.1, "draft": float("inf")}), "draft time must be seconds >= 0"),
    (_confidence({"1": 0.1, "draft": -1}), "draft time must be seconds >= 0"),
    (_confidence({"1": 0.1, "draft": "0"}), "draft time must be seconds >= 0"),
    (_confidence({"1": 0.1, "draft": None}), "draft time must be seconds >= 0"),
    ({"method": "mtp", "policy": "fixed", "cost_model": "measure"}, "cost_model is for policies 'confidence' and 'head' only"),
    ({"method": None}, "method must be one of mtp"),
    ({"method": ["mtp"]}, "method must be one of mtp"),
    ({"method": {"a": 1}}, "method must be one of mtp"),
    ({"method": "mtp", "num_drafts": "3"}, "num_drafts must be an integer"),
    ({"method": "mtp", "num_drafts": 3.0}, "num_drafts must be an integer"),
    ({"method": "mtp", "num_drafts": True}, "num_drafts must be an integer"),
    ({"method": "mtp", "num_drafts": None}, "num_drafts must be an integer"),
    ({"method": "mtp", "num_drafts": float("inf")}, "num_drafts must be an integer"),
    ({"method": "mtp", "num_drafts": 10**30}, "num_drafts must be an integer"),
    ({"method": "mtp", "num_drafts": -1}, "num_drafts must be an integer"),
    ({"method": "mtp", "policy": None}, "policy must be one of"),
    ({"method": "mtp", "policy": ["fixed"]}, "policy must be one of"),
    ({"method": "mtp", "x" * 10000: 1}, "unknown key 'xxx"),
    ({"method": "x" * 10000}, "method must be one of mtp"),
]


@pytest.mark.parametrize("value, message", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_fields_are_one_line(value, message):
    with pytest.raises(InvalidRequestError) as info:
        SpeculativeConfig.parse(value)
    text = str(info.value)
    assert message in text and "\n" not in text and len(text) < 300, text


@pytest.mark.parametrize("value, message", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_json_on_the_command_line_exits_2_with_one_line(capsys, value, message):
    """The same values as --speculative JSON (NaN and Infinity as JSON's extension literals)."""
    assert main(["run", "--speculative", json.dumps(value), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"a": ' + "[" * 100000, "nested too deep"),
        ("{" + " " * 100000, "is not valid JSON"),
        ("mtp:3:confidence:" + "x" * 100000, "is not METHOD[:NUM_DRAFTS[:POLICY]]"),
        ("mtp:" + "9" * 100000, "num_drafts '999"),
        ("mtp:3", None),
    ],
)
def test_hostile_text_is_one_line(text, message):
    if message is None:
        assert SpeculativeConfig.parse(text) == SpeculativeConfig("mtp", 3, "fixed")
        return
    with pytest.raises(InvalidRequestError) as info:
        SpeculativeConfig.parse(text)
    assert message in str(info.value) and "\n" not in str(info.value) and len(str(info.value)) < 300, str(info.value)[:300]


def test_keys_of_any_type_from_python_are_named():
    with pytest.raises(InvalidRequestError, match="unknown key 1; the keys are"):
        SpeculativeConfig.parse({"method": "mtp", 1: 2})


def test_good_cost_models_parse():
    config = SpeculativeConfig.parse(_confidence({"1": 0.01, "64": 0.02, "draft": 0.001}))
    assert config.step_costs() == ({1: 0.01, 64: 0.02}, 0.001)
    assert SpeculativeConfig.parse(_confidence({1: 1, 8: 2})).step_costs() == ({1: 1.0, 8: 2.0}, 0.0)
    assert SpeculativeConfig.parse(_confidence("measure")).remeasure
    assert not SpeculativeConfig.parse("mtp:3:confidence").remeasure
