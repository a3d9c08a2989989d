"""`deepinfer run` and `run-batch` against hostile input (issue 38): JSON Python cannot read, lines
nested too deeply, a text too long for the model, n in the hundreds of millions, chat templates that
fail at render time, token options that leave nothing to sample. Each fails its own line with an
error row, or, where nothing can name the line, stops the run with one line (exit 2); never a
traceback, never a lost run, and every row is strict JSON (no NaN, no infinities)."""

from __future__ import annotations

import json

import pytest

from cli_helpers import run_main, write_lines

FAST = ["--backend", "reference", "--no-progress", "--num-kv-blocks", "64"]
CHAT = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(autouse=True)
def model_cache(cache, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE", str(cache))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)


def strict_rows(path) -> list[dict]:
    """The output's rows, read as strict JSON (NaN and infinities refused); lines end at "\\n" only."""

    def refuse(constant):
        raise AssertionError(f"the output holds {constant}, which is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text(encoding="utf-8").split("\n") if line]


def nested(depth: int):
    value = "x"
    for _ in range(depth):
        value = [value]
    return value


def batch_line(custom_id: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


@pytest.mark.parametrize("command", ["run", "run-batch"])
@pytest.mark.parametrize("bad, needle", [("[" * 100_000, "nested too deeply"), ('{"custom_id": "big", "id": ' + "9" * 5000 + "}", "4300 digits")],
                         ids=["100000-brackets", "5000-digit-integer"])  # fmt: skip
def test_json_python_cannot_read_is_not_valid_json(tmp_path, command, bad, needle):
    """A RecursionError / ValueError traceback before: now the file's one-line error (nothing can name the line)."""
    good = batch_line("ok", {"prompt": "Hello", "max_tokens": 2}) if command == "run-batch" else {"id": "ok", "prompt": "Hello", "max_tokens": 2}
    src = write_lines(tmp_path / "in.jsonl", [good, bad])
    result = run_main(command, *FAST, "-i", str(src), "-o", str(tmp_path / "out.jsonl"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "line 2: not valid JSON" in last and needle in last, last


def test_run_lines_nested_too_deeply_fail_alone_and_line_separators_stay_in_their_strings(tmp_path):
    """A line nested past the limit gets an error row (it parses: its id is known); U+2028 and
    U+0085 inside a JSON string are text, not line ends (the whole file was refused before)."""
    separated = "a\u2028b\u0085c"
    lines = [
        {"id": "deep", "prompt": "x", "stop": nested(150)},
        json.dumps({"id": "separators", "prompt": separated, "max_tokens": 2}, ensure_ascii=False),
        {"id": "after", "prompt": "Hello", "max_tokens": 2},
    ]
    src = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    result = run_main("run", *FAST, "-i", str(src), "-o", str(out))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    deep, separators, after = strict_rows(out)
    assert deep["id"] == "deep" and "more than 100 levels deep" in deep["error"]["message"], deep
    assert separators["id"] == "separators" and separators["prompt"] == separated and separators["completion_tokens"] == 2
    assert after["id"] == "after" and after["completion_tokens"] == 2


def test_run_batch_line_with_a_huge_n_or_deep_nesting_fails_alone(tmp_path):
    """"n": 100000000 raised MemoryError and lost the whole run: now an error row naming n (vLLM's bound, 16384)."""
    lines = [
        batch_line("huge-n", {"prompt": "Hello", "max_tokens": 2, "n": 100_000_000}),
        batch_line("deep", {"prompt": "Hello", "max_tokens": 2, "stop": nested(150)}),
        batch_line("ok", {"prompt": "Hello", "max_tokens": 2, "n": 2}),
    ]
    src = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    result = run_main("run-batch", *FAST, "-i", str(src), "-o", str(out))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    huge, deep, ok = strict_rows(out)
    assert huge["error"]["param"] == "n" and "n must be an integer in [1, 16384]" in huge["error"]["message"], huge
    assert "more than 100 levels deep" in deep["error"]["message"], deep
    assert ok["error"] is None and len(ok["response"]["body"]["choices"]) == 2


def test_a_text_too_long_for_the_model_is_refused_before_it_is_tokenized(tmp_path, monkeypatch):
    """A 100 MB line took the process down in the tokenizer: a text longer than max_model_len times
    the tokenizer's longest token can only be too long, and is refused without tokenizing it."""
    from deepinfer.model.tokenizer import Tokenizer

    longest = [0]
    encode = Tokenizer.encode

    def recording(self, text, add_bos=None):
        longest[0] = max(longest[0], len(text))
        return encode(self, text, add_bos)

    monkeypatch.setattr(Tokenizer, "encode", recording)
    limit = 64 * 128  # --max-model-len 64 times the tiny tokenizer's longest token (128 characters)
    lines = [
        {"id": "huge", "prompt": "word " * (limit // 5 + 1)},
        {"id": "huge-bad-word", "prompt": "Hello", "bad_words": ["word " * (limit // 5 + 1)]},
        {"id": "ok", "prompt": "Hello", "max_tokens": 2},
    ]
    src = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    result = run_main("run", *FAST, "--max-model-len", "64", "-i", str(src), "-o", str(out))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    huge, word, ok = strict_rows(out)
    assert "characters long, so at least" in huge["error"]["message"] and "maximum length is 64" in huge["error"]["message"], huge
    assert "a bad word of 8195 characters is longer than any text" in word["error"]["message"], word
    assert ok["completion_tokens"] == 2
    assert 0 < longest[0] < limit  # the long text never reached the tokenizer


@pytest.mark.parametrize("template, needle", [
    ("{{ range(10**9)|list }}", "OverflowError"),
    ("{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    ("{{ 1/0 }}", "ZeroDivisionError"),
], ids=["huge-range", "recursive-macro", "division-by-zero"])  # fmt: skip
def test_a_chat_template_that_fails_at_render_time_fails_each_chat_line_alone(tmp_path, template, needle):
    """The sandbox held, but its errors aborted the whole run with a traceback: now an error row per chat line."""
    src = write_lines(tmp_path / "in.jsonl", [{"id": "chat", "messages": CHAT}, {"id": "plain", "prompt": "Hello", "max_tokens": 2}])
    out = tmp_path / "out.jsonl"
    result = run_main("run", *FAST, "--chat-template", template, "-i", str(src), "-o", str(out))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    chat, plain = strict_rows(out)
    assert "the chat template failed on this conversation" in chat["error"]["message"] and needle in chat["error"]["message"], chat
    assert plain["completion_tokens"] == 2


def test_token_options_that_ban_every_token_fail_their_request_and_rows_stay_json(tmp_path, cache):
    """With --logprobs-mode processed_logprobs: a request whose options ban every token wrote
    "logprob": NaN and a token outside allowed_token_ids; a logit_bias of -1e308 did the same. Now
    the first fails alone, the bias is refused (OpenAI's range), and a banned token's -inf
    log-probability among the top ones is written as -9999.0 (vLLM's)."""
    from deepinfer.model.embedded import ensure_embedded
    from deepinfer.model.tokenizer import Tokenizer

    eos = Tokenizer.from_folder(ensure_embedded(cache)).eos_token_id
    lines = [
        {"id": "nothing-left", "prompt": "Hello", "allowed_token_ids": [eos], "min_tokens": 3, "max_tokens": 4, "logprobs": 2},
        {"id": "huge-bias", "prompt": "Hello", "allowed_token_ids": [5], "logit_bias": {"5": -1e308}, "logprobs": 2},
        {"id": "two-allowed", "prompt": "Hello", "allowed_token_ids": [5, 6], "max_tokens": 3, "logprobs": 3},
    ]
    src = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    result = run_main("run", *FAST, "--logprobs-mode", "processed_logprobs", "-i", str(src), "-o", str(out))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    nothing, bias, two = strict_rows(out)
    assert nothing["error"]["type"] == "generation_error", nothing
    assert "after 0 tokens no token is left to sample: allowed_token_ids and min_tokens ban every token" in nothing["error"]["message"]
    assert "logit_bias values must lie in [-100, 100]" in bias["error"]["message"], bias
    assert set(two["token_ids"]) <= {5, 6} and len(two["token_ids"]) == 3, two
    for position in two["logprobs"]:
        values = sorted((entry["logprob"] for entry in position.values()), reverse=True)
        assert values[-1] == -9999.0 and all(v > -9999.0 for v in values[:2]), position  # the third most likely token was banned
