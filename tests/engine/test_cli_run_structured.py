"""`deepinfer run` with a structured-output flag (--json-schema FILE, --regex, --choice, --grammar
FILE) on the embedded default: the flag constrains every request without a structured field of
its own; a bad flag stops the run before it starts, in one line (exit 2)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from deepinfer.cli.main import main

from cli_helpers import write_lines

FAST = ["--backend", "reference", "--no-progress", "--num-kv-blocks", "64"]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"], "additionalProperties": False}

pytestmark = pytest.mark.usefixtures("model_cache")  # tests/engine/conftest.py


def read_rows(path):
    return {row["id"]: row for row in map(json.loads, path.read_text(encoding="utf-8").splitlines())}


def test_json_schema_flag_and_lines_with_their_own(tmp_path, capsys):
    """The flag's schema for the lines without a field; a line's structured_outputs or response_format wins."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA), encoding="utf-8")
    src = write_lines(tmp_path / "in.jsonl", [
        {"id": "flag", "prompt": "a"},
        {"id": "flag2", "prompt": "b", "temperature": 0},
        {"id": "own", "prompt": "c", "structured_outputs": {"regex": "[0-9]{3}"}},
        {"id": "free", "prompt": "d", "response_format": {"type": "text"}, "max_tokens": 5, "ignore_eos": True},
    ])  # fmt: skip
    out = tmp_path / "out.jsonl"
    argv = ["run", *FAST, "-i", str(src), "-o", str(out), "--max-tokens", "40", "--json-schema", str(schema), "--disable-any-whitespace"]
    assert main(argv) == 0, capsys.readouterr().err
    rows = read_rows(out)
    for key in ("flag", "flag2"):
        assert rows[key]["finish_reason"] == "stop", rows[key]
        jsonschema.validate(json.loads(rows[key]["text"]), SCHEMA)
    assert rows["own"]["finish_reason"] == "stop" and re.fullmatch("[0-9]{3}", rows["own"]["text"])
    assert rows["free"]["finish_reason"] == "length" and rows["free"]["completion_tokens"] == 5
    assert not re.fullmatch(r'\{"n":[0-9]\}', rows["free"]["text"])  # it ran free: random text


def test_choice_regex_and_grammar_flags(tmp_path, capsys):
    assert main(["run", *FAST, "--prompt", "x", "--prompt", "y", "--choice", "yes", "--choice", "no thanks"]) == 0
    out = capsys.readouterr().out
    completions = re.findall(r"completion: '(.*)' \((\w+)\)", out)
    assert len(completions) == 2 and all(text in ("yes", "no thanks") and reason == "stop" for text, reason in completions), out
    date = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    rows = tmp_path / "regex.jsonl"
    assert main(["run", *FAST, "--prompt", "x", "--regex", date, "--max-tokens", "30", "-o", str(rows)]) == 0
    row = read_rows(rows)[1]
    assert row["finish_reason"] == "stop" and re.fullmatch(date, row["text"]), row
    grammar = tmp_path / "sum.lark"
    grammar.write_text('start: NUMBER ("+" NUMBER)~1..3\nNUMBER: /[1-9]/\n', encoding="utf-8")
    rows = tmp_path / "grammar.jsonl"
    assert main(["run", *FAST, "--prompt", "x", "--grammar", str(grammar), "--max-tokens", "30", "-o", str(rows)]) == 0
    row = read_rows(rows)[1]
    assert row["finish_reason"] == "stop" and re.fullmatch(r"[1-9](\+[1-9]){1,3}", row["text"]), row
    assert eval(row["text"]) == sum(map(int, row["text"].split("+")))


@pytest.mark.parametrize(
    "flags, needles",
    [
        (["--json-schema", "{missing}"], ["--json-schema", "does not exist"]),
        (["--json-schema", "{folder}"], ["--json-schema", "is a folder"]),
        (["--json-schema", "{not_json}"], ["--json-schema", "is not valid JSON"]),
        (["--json-schema", "{array}"], ["--json-schema", "must be a JSON schema"]),
        (["--json-schema", "{bad_type}"], ["--json-schema", "json does not compile"]),
        (["--grammar", "{missing}"], ["--grammar", "does not exist"]),
        (["--grammar", "{bad_grammar}"], ["--grammar", "grammar does not compile"]),
        (["--regex", "[a-"], ["--regex", "regex does not compile", "unclosed character class"]),
        (["--choice", ""], ["--choice", "choice must be"]),
        (["--regex", "a", "--choice", "b"], ["not allowed with argument"]),
        (["--regex", "a", "--disable-any-whitespace"], ["--disable-any-whitespace applies to --json-schema only"]),
    ],
    ids=["missing", "folder", "not-json", "array", "bad-type", "grammar-missing", "bad-grammar", "bad-regex", "empty-choice", "two", "whitespace"],
)
def test_bad_flags_are_one_line_exit_2(tmp_path, capsys, flags, needles):
    files = {"missing": tmp_path / "nope.json", "folder": tmp_path, "not_json": tmp_path / "bad.json", "array": tmp_path / "array.json",
             "bad_type": tmp_path / "type.json", "bad_grammar": tmp_path / "bad.lark"}  # fmt: skip
    files["not_json"].write_text("{not json", encoding="utf-8")
    files["array"].write_text("[1, 2]", encoding="utf-8")
    files["bad_type"].write_text('{"type": "frobnicate"}', encoding="utf-8")
    files["bad_grammar"].write_text("start: (", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    argv = ["run", *FAST, "--prompt", "x", "-o", str(out), *(f.format(**files) for f in flags)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("deepinfer: error: "), err
    assert all(needle in err for needle in needles), err
    assert not out.exists()  # nothing ran
