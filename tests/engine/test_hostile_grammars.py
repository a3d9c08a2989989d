"""Issue 38 (F1, F2, T2, U3): hostile structured outputs in `deepinfer run`, in a real process (a
grammar that crashed llguidance took the whole process down: exit 139, no row). Each fails its own
line with a one-line error row, or runs; the other lines run, and every line has its row."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from hostile_grammars import CRASHED_BEFORE, CRASHES_THE_CHECK, UNSATISFIABLE, nested_schema


def test_hostile_grammars_fail_their_line_alone(tmp_path, cache):
    deep = {"json": nested_schema(400), "disable_additional_properties": True}
    lines = [
        ({"id": "deep", "structured_outputs": deep}, "invalid_request_error", "the line nests objects and arrays more than 100 levels deep"),
        ({"id": "lark_3000", "structured_outputs": {"grammar": CRASHED_BEFORE["lark_3000"]}}, None, "x"),
        ({"id": "refs_1000", "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": CRASHED_BEFORE["refs_1000"]}}}, None, ""),
        ({"id": "lark_20000", "structured_outputs": {"grammar": CRASHES_THE_CHECK["lark_20000"]}}, "generation_error",
         "grammar: llguidance's compiler crashed on it (signal SIGSEGV): it is too deeply nested or too big; simplify it"),
        ({"id": "refs_4000", "structured_outputs": {"json": CRASHES_THE_CHECK["refs_4000"]}}, "generation_error",
         "json: llguidance's compiler crashed on it (signal SIGSEGV)"),
        ({"id": "nothing", "structured_outputs": UNSATISFIABLE[0]}, "generation_error", "regex matches nothing: no output satisfies it"),
        ({"id": "too_big", "structured_outputs": {"choice": [f"option {i}" for i in range(30_000)]}}, "invalid_request_error",
         "too big to compile: the limit is 262144 (max_grammar_bytes, --max-grammar-bytes)"),
        ({"id": "fine", "structured_outputs": {"choice": ["yes", "no"]}}, None, ""),
    ]  # fmt: skip
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({**line, "prompt": "x", "max_tokens": 4}) + "\n" for line, _, _ in lines), encoding="utf-8")
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "DEEPINFER_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "deepinfer", "run", "--backend", "reference", "--no-progress", "--num-kv-blocks", "64", "-i", str(source), "-o", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert proc.returncode == 1 and "requests          8; 5 failed" in proc.stderr, (proc.returncode, proc.stderr[-2000:])
    rows = [json.loads(row) for row in out.read_text(encoding="utf-8").splitlines()]
    assert [row["id"] for row in rows] == [line["id"] for line, _, _ in lines]
    for number, ((_, kind, needle), row) in enumerate(zip(lines, rows), start=1):
        if kind is None:
            assert "error" not in row and row["text"].startswith(needle), row
        else:
            message = row["error"]["message"]
            assert row["error"]["type"] == kind and message.startswith(f"{source} line {number}: ") and needle in message and "\n" not in message, row
    assert rows[-1]["text"] in ("yes", "no") and rows[1]["finish_reason"] == "stop"


def test_the_structured_flags_are_checked_in_a_child_and_bounded(tmp_path, capsys, cache, monkeypatch):
    """`run --grammar FILE` with a grammar that crashes llguidance (checked in the CLI's own process
    before: a segmentation fault) and a flag over --max-grammar-bytes are one line, exit 2, before
    the model loads; the limit reaches the engine."""
    from deepinfer.cli.main import main

    monkeypatch.setenv("DEEPINFER_CACHE", str(cache))
    fast = ["run", "--backend", "reference", "--no-progress", "--num-kv-blocks", "64", "--prompt", "x", "--max-tokens", "3"]
    grammar = tmp_path / "chain.lark"
    grammar.write_text(CRASHES_THE_CHECK["lark_20000"], encoding="utf-8")
    refused = [
        (["--grammar", str(grammar)], "--grammar: grammar: llguidance's compiler crashed on it (signal SIGSEGV)"),
        (["--max-grammar-bytes", "10", "--regex", "[0-9]{2000}"], "--regex: the regex is 11 bytes, over --max-grammar-bytes 10"),
        (["--max-grammar-bytes", "0"], "--max-grammar-bytes must be >= 1, got 0"),
    ]
    for argv, needle in refused:
        assert main([*fast, *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("deepinfer: error: ") and needle in err, err
    lines = tmp_path / "in.jsonl"
    lines.write_text(json.dumps({"id": "long", "prompt": "x", "structured_outputs": {"regex": "b" * 101}}) + "\n", encoding="utf-8")
    assert main([*fast[:-4], "--max-grammar-bytes", "100", "-i", str(lines)]) == 1
    row = json.loads(capsys.readouterr().out)
    assert row["error"]["message"].endswith("the structured_outputs regex is 101 bytes, too big to compile: the limit is 100 (max_grammar_bytes, "
                                            "--max-grammar-bytes)")  # fmt: skip
