"""The conformance report's JSON is valid JSON (no Infinity) and reads back to the same rows."""

from __future__ import annotations

import json
import math

from deepinfer_conformance.runner import Row, read_json, write_json


def test_infinite_and_missing_scores_are_valid_json_and_read_back(tmp_path):
    rows = [
        Row("a.x.float32", "a", "x", "float32", "cuda", "FAIL", float("inf"), "shape (2,) != (3,)", "reference", float("inf"), False),
        Row("a.y.float32", "a", "y", "float32", "cuda", "pass", 0.25, "max|err| 1e-7", "reference", 0.5, True),
        Row("a.z.float32", "a", "z", "float32", "cuda", "missing", None, "no kernel"),
        Row("a.w.float32", "a", "w", "float32", "cuda", "FAIL", float("nan"), "nan"),
    ]
    path = tmp_path / "report.json"
    write_json(rows, path)
    text = path.read_text()
    assert "Infinity" not in text and "NaN" not in text
    parsed = json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(f"not JSON: {c}")))
    assert parsed[0]["score"] == "inf" and parsed[0]["cross_score"] == "inf" and parsed[2]["score"] is None
    back = read_json(path)
    assert back[:3] == rows[:3]
    assert math.isnan(back[3].score) and back[3].status == "FAIL"
