"""`deepinfer run -i`: a request's own defect (an unknown or unimplemented field, a bad value, text
that is not valid Unicode, a prompt the model cannot take) fails that line alone with an error row
naming the problem; the other lines run, rows come in input order, the exit code is 1, and
--resume counts the error rows as done (the same bad line never stops a run again)."""

from __future__ import annotations

import json

import pytest

from deepinfer import SamplingParams
from deepinfer.cli.main import main

from cli_helpers import write_lines

FAST = ["--backend", "reference", "--no-progress", "--num-kv-blocks", "64"]
GREEDY = ["--temperature", "0", "--ignore-eos"]


@pytest.fixture(autouse=True)
def model_cache(cache, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE", str(cache))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)


CHAT = [{"role": "user", "content": "Say hi"}]
# (line, the id its row carries, words its error message holds; None: the line runs)
LINES = [
    ({"id": "long-first", "prompt": "Once upon a time", "max_tokens": 6}, "long-first", None),
    ({"id": "no-prompt", "text": "x"}, "no-prompt", ['no "prompt"']),
    ({"custom_id": "body-text", "body": "x"}, "body-text", ["body"]),
    ({"id": "temperature", "prompt": "x", "temperature": -1}, "temperature", ["temperature"]),
    ({"id": "many", "prompt": "x", "max_tokens": "many"}, "many", ["max_tokens"]),
    ({"id": "empty-chat", "messages": []}, "empty-chat", ["messages"]),
    ({"id": "both", "prompt": "x", "messages": CHAT}, "both", ["one of"]),
    ({"id": "presence", "prompt": "x", "presence_penalty": 2.5}, "presence", ["presence_penalty must be in [-2, 2]"]),
    ({"custom_id": "frequency", "body": {"prompt": "x", "frequency_penalty": "1"}}, "frequency", ["frequency_penalty"]),
    ({"custom_id": "logprobs", "body": {"messages": CHAT, "logprobs": True, "top_logprobs": 21}}, "logprobs", ["logprobs must be"]),
    ({"id": "logprobs-spelling", "prompt": "x", "logprobs": 2, "top_logprobs": 2}, "logprobs-spelling", ['"logprobs" must be true or false']),
    ({"id": "min-tokens", "prompt": "x", "min_tokens": -3}, "min-tokens", ["min_tokens"]),
    ({"id": "best-of", "prompt": "x", "best_of": 2}, "best-of", ["best_of"]),
    ({"id": "n", "prompt": "x", "n": 2}, "n", ['"n": 2 is not supported by deepinfer run', "run-batch"]),
    ({"id": "logit-bias", "prompt": "x", "logit_bias": {"one": 5}}, "logit-bias", ["logit_bias must be a dict of token ids"]),
    ({"id": "logit-bias-vocabulary", "prompt": "x", "logit_bias": {"1000000": 5}}, "logit-bias-vocabulary", ["logit_bias has token id 1000000"]),
    ({"id": "format", "prompt": "x", "response_format": {"type": "xml"}}, "format", ["response_format must be"]),
    ({"id": "json-object", "prompt": "x", "max_tokens": 4, "response_format": {"type": "json_object"}}, "json-object", None),
    ({"id": "choice", "prompt": "x", "max_tokens": 4, "structured_outputs": {"choice": ["yes", "no"]}}, "choice", None),
    ({"id": "tools", "prompt": "x", "tools": []}, "tools", ['"tools"']),
    ({"id": "typo", "prompt": "x", "temprature": 0}, "typo", ['unknown field "temprature"']),
    ({"custom_id": "url", "url": "/v1/embeddings", "body": {"prompt": "x"}}, "url", ["/v1/embeddings"]),
    ({"id": "stop-int", "prompt": "x", "stop": 5}, "stop-int", ["stop must be"]),
    ({"id": "stop-ids-int", "prompt": "x", "stop_token_ids": 5}, "stop-ids-int", ["stop_token_ids"]),
    ({"id": "stop-dict", "prompt": "x", "stop": {"x": 1}}, "stop-dict", ["stop must be"]),
    ({"id": "top-k", "prompt": "x", "top_k": 2**70}, "top-k", ["top_k", "2147483647"]),
    ({"id": "seed", "prompt": "x", "seed": 2**64}, "seed", ["seed"]),
    ({"id": "surrogate-prompt", "prompt": "a\udc00b"}, "surrogate-prompt", ["prompt holds a lone surrogate"]),
    ({"id": "\udc00", "prompt": "x"}, "\udc00", ["id holds a lone surrogate"]),
    ({"custom_id": "surrogate-chat", "body": {"messages": [{"role": "user", "content": "\ud800"}]}}, "surrogate-chat", ["body.messages[0].content"]),
    ({"id": "vocabulary", "prompt_token_ids": [0, 10**12]}, "vocabulary", ["outside the vocabulary"]),
    ({"id": "chat-option-on-prompt", "prompt": "x", "add_generation_prompt": False}, "chat-option-on-prompt",
     ['"add_generation_prompt" applies to "messages" only']),
    ({"id": "chat-option-type", "messages": CHAT, "continue_final_message": "yes"}, "chat-option-type", ['"continue_final_message" must be true or false']),
    ({"id": "null-sampling", "prompt": "x", "temperature": None, "top_p": None, "seed": None, "max_tokens": 2}, "null-sampling", None),  # null: the default
    # Known keys at their neutral value, and ignored keys: the line runs.
    (
        {"custom_id": "neutral", "method": "POST", "url": "/v1/completions",
         "body": {"model": "gpt-4o", "user": "u1", "prompt": "Hi", "stream": False, "n": 1, "presence_penalty": 0, "logprobs": None, "max_tokens": 3}},
        "neutral", None,
    ),  # fmt: skip
    # The sampling options vLLM adds run with their values: penalties, a bias (OpenAI's string ids), bans, min_tokens.
    (
        {"id": "options", "prompt": "Hi", "max_tokens": 4, "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2,
         "logit_bias": {"7": 100}, "min_tokens": 2, "bad_words": ["zz"], "allowed_token_ids": [7, 8, 9], "include_stop_str_in_output": True},
        "options", None,
    ),  # fmt: skip
    ({"id": "short-last", "prompt": "The sky is", "max_tokens": 1}, "short-last", None),
]


def test_each_bad_request_fails_alone_and_resume_counts_it_done(tmp_path, capsys, api):
    src = write_lines(tmp_path / "in.jsonl", [line for line, _, _ in LINES])
    out = tmp_path / "out.jsonl"
    assert main(["run", *FAST, *GREEDY, "-i", str(src), "-o", str(out)]) == 1, "a failed request makes the exit code 1"
    err = capsys.readouterr().err
    bad = sum(needles is not None for _, _, needles in LINES)
    assert f"requests          {len(LINES)}; {bad} failed (error rows in {out})" in err, err
    text = out.read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines()]
    # One row per line, in input order (the first request finishes last), ids as the input had them.
    assert [json.dumps(row.get("id", row.get("custom_id"))) for row in rows] == [json.dumps(want) for _, want, _ in LINES]
    for number, ((_, _, needles), row) in enumerate(zip(LINES, rows), start=1):
        if needles is None:
            assert "text" in row and "error" not in row, row
            continue
        assert set(row) in ({"id", "error"}, {"custom_id", "error"}) and row["error"]["type"] == "invalid_request_error", row
        message = row["error"]["message"]
        assert f"in.jsonl line {number}" in message and all(n in message for n in needles), (number, message)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 3, 1)]
    want = api.generate(["Once upon a time", "Hi", "The sky is"], params, use_tqdm=False)
    got = {row.get("id", row.get("custom_id")): row for row in rows if "text" in row}
    assert [got[k]["token_ids"] for k in ("long-first", "neutral", "short-last")] == [w.outputs[0].token_ids for w in want]
    assert got["options"]["token_ids"] == [7, 7, 7, 7], "the bias of 100 on token 7 picks it every time"
    # The error rows are finished requests: --resume has nothing left, and never fails on them.
    assert main(["run", *FAST, *GREEDY, "-i", str(src), "-o", str(out), "--resume"]) == 0
    assert "nothing to do" in capsys.readouterr().err
    assert out.read_text(encoding="utf-8") == text


def test_every_line_refused_loads_no_model_and_prints_error_rows(tmp_path, capsys):
    src = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x", "presence_penalty": 3}, {"id": "b", "prompt": "y", "best_of": 3}])
    assert main(["run", *FAST, "-i", str(src)]) == 1
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [row["id"] for row in rows] == ["a", "b"] and all("error" in row for row in rows)
    assert "dummy weights" not in err and "2 failed (error rows above)" in err


def test_a_command_line_prompt_the_cache_cannot_hold_fails_alone(capsys):
    run = ["run", "--backend", "reference", "--no-progress", "--num-kv-blocks", "2", "--max-tokens", "20"]
    assert main([*run, "--prompt", "hi", "--prompt", "a b c d e f g h i j k l m n o p"]) == 1
    out = capsys.readouterr().out
    assert "[1] prompt: 'hi'" in out
    assert "[2] error: --prompt 2 needs 3 KV blocks" in out


def test_a_result_that_cannot_be_written_becomes_an_error_row(tmp_path, capsys, monkeypatch):
    """A request that fails at write time (here: a result holding text that is not valid Unicode)
    gets an error row, and the run goes on."""
    from deepinfer.cli import run as run_module

    real = run_module.result_row

    def poisoned(request, prompt, output):
        row = real(request, prompt, output)
        if request.id == "poisoned":
            row["text"] += "\udc00"
        return row

    monkeypatch.setattr(run_module, "result_row", poisoned)
    src = write_lines(tmp_path / "in.jsonl", [{"id": "poisoned", "prompt": "x"}, {"id": "fine", "prompt": "y"}])
    out = tmp_path / "out.jsonl"
    assert main(["run", *FAST, "--max-tokens", "2", "-i", str(src), "-o", str(out)]) == 1
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert rows[0]["id"] == "poisoned" and rows[0]["error"]["type"] == "generation_error" and "UTF-8" in rows[0]["error"]["message"]
    assert rows[1]["id"] == "fine" and "text" in rows[1]


def test_a_lone_surrogate_through_the_python_api_is_one_line(api):
    from deepinfer.engine.sampling_params import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="lone surrogate"):
        api.generate(["fine", "bad \udc00"], SamplingParams(max_tokens=1), use_tqdm=False)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"stop": 5}, "stop must be"),
        ({"stop": {"x": 1}}, "stop must be"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"top_k": 2**31}, "top_k"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ],
)
def test_sampling_params_refuse_wrong_types_and_ranges(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_top_k_at_its_bound_runs_and_keeps_every_token(api):
    """top_k = 2**31 - 1 (above the vocabulary) samples as top_k off does."""
    params = [SamplingParams(temperature=1.0, top_k=k, seed=3, max_tokens=4) for k in (0, 2**31 - 1)]
    off, bound = api.generate(["Hello", "Hello"], params, use_tqdm=False)
    assert off.outputs[0].token_ids == bound.outputs[0].token_ids


def test_the_chat_template_options_of_a_messages_line(tmp_path, capsys, api):
    """add_generation_prompt / continue_final_message / chat_template_kwargs (the table's chat
    options) render the line's messages as LLM.chat renders them."""
    messages = [*CHAT, {"role": "assistant", "content": "Hi"}]
    src = write_lines(tmp_path / "in.jsonl", [
        {"id": "continue", "messages": messages, "add_generation_prompt": False, "continue_final_message": True},
        {"id": "kwargs", "messages": CHAT, "chat_template_kwargs": {"unused": 1}},
    ])  # fmt: skip
    out = tmp_path / "out.jsonl"
    assert main(["run", *FAST, "--max-tokens", "1", "-i", str(src), "-o", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert rows[0]["prompt"] == api.tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert rows[1]["prompt"] == api.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    assert rows[0]["prompt"] != api.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
