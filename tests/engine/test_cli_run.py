"""`deepinfer run` on the embedded default (reference backend, CPU): built-in prompts, JSONL in and
out, OpenAI batch lines, --resume, and one-line errors that never cost already written results."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from deepinfer import SamplingParams
from deepinfer.cli.main import main
from deepinfer.cli.run import BUILTIN_PROMPTS

from cli_helpers import write_lines
from waits import HANG_S

FAST = ["--backend", "reference", "--no-progress", "--num-kv-blocks", "64"]


pytestmark = pytest.mark.usefixtures("model_cache")  # tests/engine/conftest.py


def read_lines(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def one_line_error(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    # The error is the last line, and one line; only the "dummy weights" notice may come before it.
    assert "Traceback" not in err
    *before, err = err.splitlines()
    assert err.startswith("deepinfer: error: ") and all(line.startswith("deepinfer: model ") for line in before), before
    for needle in needles:
        assert needle in err, err
    return err


def test_no_arguments_runs_the_builtin_prompts(capsys):
    assert main([]) == 0
    out, err = capsys.readouterr()
    for prompt in BUILTIN_PROMPTS:
        assert repr(prompt) in out
    assert out.count("completion:") == len(BUILTIN_PROMPTS)
    assert "dummy weights" in err and "auto-selected reference" in err and "summary:" in err
    assert f"requests          {len(BUILTIN_PROMPTS)}" in err


def test_jsonl_round_trip_with_openai_batch_lines(tmp_path, capsys, api):
    messages = [{"role": "user", "content": "Say hi"}]
    src = write_lines(
        tmp_path / "in.jsonl",
        [
            {"id": "greeting", "prompt": "Hello, my name is"},
            "",  # blank lines are skipped but counted
            {"prompt": "The sky is", "max_tokens": 2},
            {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "x", "messages": messages, "max_tokens": 3}},
            {"custom_id": "req-2", "body": {"prompt": "1 2 3", "max_completion_tokens": 4, "temperature": 0}},
        ],
    )
    out = tmp_path / "out.jsonl"
    assert main(["run", *FAST, "-i", str(src), "-o", str(out), "--temperature", "0", "--max-tokens", "4", "--ignore-eos"]) == 0
    err = capsys.readouterr().err
    assert "requests          4" in err and str(out) in err
    lines = {json.dumps(line.get("id", line.get("custom_id"))): line for line in read_lines(out)}
    assert set(lines) == {'"greeting"', "3", '"req-1"', '"req-2"'}
    assert set(lines['"req-1"']) == {"custom_id", "prompt", "text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens"}
    chat_prompt = api.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    expected = [('"greeting"', "Hello, my name is", 4), ("3", "The sky is", 2), ('"req-1"', chat_prompt, 3), ('"req-2"', "1 2 3", 4)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, _, n in expected]
    wanted = api.generate([prompt for _, prompt, _ in expected], params, use_tqdm=False)
    for (key, prompt, max_tokens), want in zip(expected, wanted):
        line = lines[key]
        assert line["prompt"] == prompt
        assert line["token_ids"] == want.outputs[0].token_ids and line["text"] == want.outputs[0].text
        assert line["finish_reason"] == "length" and line["completion_tokens"] == max_tokens
        assert line["prompt_tokens"] == len(want.prompt_token_ids)


def test_resume_skips_finished_ids_and_repeats_the_uninterrupted_run(tmp_path, capsys):
    src = write_lines(tmp_path / "in.jsonl", [{"id": i, "prompt": f"Story number {i}:"} for i in range(3)])
    full, part = tmp_path / "full.jsonl", tmp_path / "part.jsonl"
    sampling = ["--temperature", "1.0", "--max-tokens", "3", "--seed", "5"]  # sampled: seeds must follow the lines
    assert main(["run", *FAST, *sampling, "-i", str(src), "-o", str(full)]) == 0
    done = full.read_text(encoding="utf-8").splitlines()
    by_id = {json.loads(line)["id"]: line for line in done}
    # An interrupted run: two results written, then a torn line.
    part.write_text(by_id[2] + "\n" + by_id[0] + "\n" + by_id[1][:20], encoding="utf-8")
    assert main(["run", *FAST, *sampling, "-i", str(src), "-o", str(part), "--resume"]) == 0
    err = capsys.readouterr().err
    assert "requests          1 (2 already in" in err and "unfinished last line" in err
    resumed = part.read_text(encoding="utf-8").splitlines()
    assert resumed[:2] == [by_id[2], by_id[0]]
    assert sorted(resumed) == sorted(done)
    # Nothing left: no model is loaded, nothing is written.
    assert main(["run", *FAST, "-i", str(src), "-o", str(part), "--resume"]) == 0
    assert "nothing to do" in capsys.readouterr().err
    assert part.read_text(encoding="utf-8").splitlines() == resumed


def test_an_existing_output_is_never_clobbered(tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": 1, "text": "precious"}\n', encoding="utf-8")
    one_line_error(capsys, ["run", *FAST, "--prompt", "hi", "-o", str(out)], "already exists", "--resume", "--overwrite")
    assert out.read_text(encoding="utf-8") == '{"id": 1, "text": "precious"}\n'
    assert main(["run", *FAST, "--prompt", "hi", "--max-tokens", "2", "-o", str(out), "--overwrite"]) == 0
    assert [line["id"] for line in read_lines(out)] == [1] and read_lines(out)[0]["prompt"] == "hi"


def test_chat_flag_applies_the_template(tmp_path, capsys, api):
    out = tmp_path / "out.jsonl"
    assert main(["run", *FAST, "--chat", "--prompt", "Say hi", "--max-tokens", "2", "-o", str(out)]) == 0
    assert read_lines(out)[0]["prompt"] == api.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi"}])


@pytest.mark.parametrize(
    "lines, needles",
    [
        (['{"prompt": "ok"}', '{"prompt": "broken"'], ["line 2", "not valid JSON"]),
        (['["a list"]'], ["line 1", "JSON object"]),
        (['{"id": "a", "prompt": "x"}', '{"id": "a", "prompt": "y"}'], ["line 2", "duplicate id"]),
        (['{"id": {"a": 1}, "prompt": "x"}'], ["line 1", "id must be a string or an integer"]),
        (['{"body": {"prompt": "x"}}'], ["line 1", "custom_id"]),
    ],
)
def test_bad_input_files(tmp_path, capsys, lines, needles):
    """Lines that leave a request without a usable id break the file: nothing runs (a request's
    own defects fail that line alone: test_cli_run_requests.py)."""
    src = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": 99, "text": "kept"}\n', encoding="utf-8")
    one_line_error(capsys, ["run", *FAST, "-i", str(src), "-o", str(out), "--resume"], *needles)
    assert out.read_text(encoding="utf-8") == '{"id": 99, "text": "kept"}\n'


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["-i", "missing.jsonl"], ["missing.jsonl", "not found"]),
        (["--temperature", "-0.5", "--prompt", "x"], ["temperature"]),
        (["--top-p", "2", "--prompt", "x"], ["top_p"]),
        (["--max-tokens", "0", "--prompt", "x"], ["max_tokens"]),
        (["--max-tokens", "abc", "--prompt", "x"], ["--max-tokens", "abc"]),
        (["--backend", "nope", "--prompt", "x"], ["unknown backend 'nope'"]),
        (["--backend", "cuda", "--prompt", "x"], ["backend 'cuda' is not available"]),
        (["--resume", "--prompt", "x"], ["--resume needs -o"]),
        (["--prompt", "x", "-i", "in.jsonl"], ["either"]),
        (["--top-k", str(2**70), "--prompt", "x"], ["--top-k", "2147483647"]),
        (["--prompt", "ok", "--prompt", "undecodable \udcff bytes"], ["--prompt 2", "not valid UTF-8"]),
        (["--dist-timeout", "-1", "--prompt", "x"], ["--dist-timeout", "(0, "]),
        (["--cpu-threads", "0", "--prompt", "x"], ["--cpu-threads"]),
        (["--max-num-seqs", "0", "--prompt", "x"], ["--max-num-seqs"]),
        (["--model", "no/such/folder", "--prompt", "x"], ["does not exist"]),
        (["--logprobs", "21", "--prompt", "x"], ["--logprobs", "logprobs"]),
        (["--prompt-logprobs", "-1", "--prompt", "x"], ["--prompt-logprobs", "prompt_logprobs"]),
    ],
)
def test_bad_arguments(tmp_path, capsys, argv, needles):
    argv = [a if a not in ("missing.jsonl", "in.jsonl") else str(tmp_path / a) for a in argv]
    if "--backend" not in argv:
        argv = ["--backend", "reference", *argv]
    one_line_error(capsys, ["run", "--no-progress", *argv], *needles)


def _check_logprobs(row: dict, output) -> None:
    """A row's logprobs are the engine's: per position the same token ids in the same order (the
    chosen one, then the top ones by rank), ranks and texts; the values within float32 rounding (the batches differ)."""
    completion = output.outputs[0]
    assert row["token_ids"] == completion.token_ids
    assert row["cumulative_logprob"] == pytest.approx(completion.cumulative_logprob, rel=1e-5)
    for got, want in ((row["logprobs"], completion.logprobs), (row["prompt_logprobs"], output.prompt_logprobs)):
        assert len(got) == len(want)
        for entries, position in zip(got, want):
            if position is None:
                assert entries is None
                continue
            assert [int(token) for token in entries] == list(position)
            assert [(e["rank"], e["decoded_token"]) for e in entries.values()] == [(lp.rank, lp.decoded_token) for lp in position.values()]
            assert [e["logprob"] for e in entries.values()] == pytest.approx([lp.logprob for lp in position.values()], rel=1e-5, abs=1e-6)


def test_rows_carry_the_logprobs_llm_generate_returns(tmp_path, capsys, api):
    """--logprobs / --prompt-logprobs for every request, a line's own fields (either OpenAI spelling)
    for that one; the rows hold what LLM.generate / LLM.chat return for the same request."""
    chat = [{"role": "user", "content": "Say hi"}]
    lines = [
        {"id": "flags", "prompt": "Hello, my name is"},
        {"id": "own", "prompt": "The sky is", "logprobs": 4, "prompt_logprobs": 0},
        {"custom_id": "chat", "url": "/v1/chat/completions", "body": {"messages": chat, "logprobs": True, "top_logprobs": 1}},
        {"id": "null", "prompt_token_ids": [0, 671, 7664, 294], "logprobs": None},  # null: the flag's value
    ]
    src, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    greedy = ["--temperature", "0", "--ignore-eos", "--max-tokens", "3"]
    assert main(["run", *FAST, *greedy, "--logprobs", "2", "--prompt-logprobs", "1", "-i", str(src), "-o", str(out)]) == 0
    rows = read_lines(out)

    def params(logprobs, prompt_logprobs):
        return SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    want = api.generate(["Hello, my name is", "The sky is", {"prompt_token_ids": [0, 671, 7664, 294]}],
                        [params(2, 1), params(4, 0), params(2, 1)], use_tqdm=False)  # fmt: skip
    want.insert(2, api.chat(chat, params(1, 1), use_tqdm=False)[0])
    for row, output in zip(rows, want):
        _check_logprobs(row, output)
    own = rows[1]  # the top 4, and the chosen token first when it is not among them
    assert [len(p) for p in own["logprobs"]] == [4 if p[str(t)]["rank"] <= 4 else 5 for t, p in zip(own["token_ids"], own["logprobs"])]
    assert rows[0]["prompt_logprobs"][0] is None and len(rows[0]["prompt_logprobs"]) == rows[0]["prompt_tokens"]
    # Without them a row has no such keys; --prompt with --logprobs prints rows, not the readable text.
    assert main(["run", *FAST, "--prompt", "hi", "--max-tokens", "1", "-o", str(tmp_path / "plain.jsonl")]) == 0
    assert not {"logprobs", "cumulative_logprob", "prompt_logprobs"} & set(read_lines(tmp_path / "plain.jsonl")[0])
    capsys.readouterr()
    assert main(["run", *FAST, "--prompt", "hi", "--max-tokens", "2", "--logprobs", "0"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [len(position) for position in row["logprobs"]] == [1, 1] and "prompt_logprobs" not in row


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc'"),
        ({"WORLD_SIZE": "abc", "RANK": "0"}, "WORLD_SIZE='abc'"),
        ({"WORLD_SIZE": "2", "RANK": "abc"}, "RANK='abc'"),
        ({"WORLD_SIZE": "2", "RANK": "7"}, "RANK=7 is outside WORLD_SIZE=2"),
    ],
)
def test_a_broken_torchrun_environment_is_one_line(capsys, monkeypatch, env, needle):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    one_line_error(capsys, ["run", *FAST, "--prompt", "x"], needle, "environment variable")


def test_errors_are_one_line_in_a_real_process(tmp_path):
    env = {**os.environ, "DEEPINFER_CACHE": str(tmp_path)}
    bad = write_lines(tmp_path / "in.jsonl", ['{"prompt": "fine"}', "{oops"])
    proc = subprocess.run([sys.executable, "-m", "deepinfer", "run", "-i", str(bad)], capture_output=True, text=True, env=env, timeout=HANG_S)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "line 2" in proc.stderr and "Traceback" not in proc.stderr
