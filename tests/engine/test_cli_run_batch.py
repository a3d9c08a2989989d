"""`deepinfer run-batch` on the embedded default (reference backend, CPU): a vLLM-shaped OpenAI batch
file in, OpenAI batch output rows out whose bodies the real `openai` types accept, in input order; a
line deepinfer cannot honour gets an error row naming the field while the rest runs; --resume after
an interrupted run completes it without duplicates; a second run on the same output is refused."""

from __future__ import annotations

import fcntl
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from deepinfer import SamplingParams
from deepinfer.cli.main import main
from deepinfer.cli.request_fields import FIELDS, Chat, Sampling

from cli_helpers import write_lines
from waits import finish, holds_flock, stopped_once

MAX_MODEL_LEN = 48  # chat lines without max_tokens run to the model's length: keep it short on the CPU
FAST = ["--backend", "reference", "--no-progress", "--num-kv-blocks", "64", "--max-model-len", str(MAX_MODEL_LEN)]
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    from deepinfer.model.embedded import ensure_embedded

    root = tmp_path_factory.mktemp("deepinfer_cache")
    ensure_embedded(root)
    return root


@pytest.fixture(autouse=True)
def model_cache(cache, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE", str(cache))
    monkeypatch.delenv("RANK", raising=False)


def line(custom_id: str, url: str, body, method: str = "POST", **more) -> dict:
    return {"custom_id": custom_id, "method": method, "url": url, "body": body, **more}


def read_rows(path) -> list[dict]:
    return [json.loads(text) for text in path.read_text(encoding="utf-8").splitlines()]


def validate(row: dict):
    """The row's body through the openai package's own type for its endpoint."""
    body = row["response"]["body"]
    kind = Completion if body["object"] == "text_completion" else ChatCompletion
    return kind.model_validate(body)


def one_line_error(capsys, argv, *needles) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    *before, last = err.splitlines()
    assert last.startswith("deepinfer: error: ") and all(b.startswith("deepinfer: model ") for b in before), err
    for needle in needles:
        assert needle in last, last
    return last


# ---- a vLLM-shaped file: 100 mixed lines ---------------------------------------------------------

# Lines that run: (kind, body maker). A body maker takes the line's number and returns (url, body).
RUNS = {
    "completion": lambda i: (COMPLETIONS, {"model": "tiny-v3", "prompt": f"Story {i}:", "max_tokens": 2 + i % 3, "temperature": 0}),
    "completion-stop-seed": lambda i: (COMPLETIONS, {"prompt": f"Line {i}\n", "max_tokens": 4, "stop": ["\n", "."], "seed": i}),
    "completion-token-ids": lambda i: (COMPLETIONS, {"prompt": [0, 5 + i % 50, 7], "max_tokens": 2, "n": 1, "logprobs": None, "user": "u1",
                                                     "stream": False, "presence_penalty": 0, "echo": False}),
    "completion-two-prompts": lambda i: (COMPLETIONS, {"prompt": [f"A{i}", f"B {i} b"], "max_tokens": 2}),
    "completion-default-max-tokens": lambda i: (COMPLETIONS, {"prompt": f"Count {i}", "temperature": 0.8, "top_p": 0.9}),
    "completion-null-temperature": lambda i: (COMPLETIONS, {"prompt": f"N {i}", "temperature": None, "max_tokens": 2, "ignore_eos": True}),
    "chat": lambda i: (CHAT, {"model": "tiny-v3", "messages": [{"role": "user", "content": f"Hi {i}"}], "max_completion_tokens": 3, "seed": i}),
    "chat-sampled": lambda i: (CHAT, {"messages": HI, "max_tokens": 2, "temperature": 0.7, "top_k": 20, "min_p": 0.05, "logprobs": False}),
    "chat-text-parts": lambda i: (CHAT, {"messages": [{"role": "system", "content": "Be brief."},
                                                      {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": str(i)}]}],
                                         "max_tokens": 2, "request_id": f"r{i}"}),
    "chat-default-max-tokens": lambda i: (CHAT, {"messages": [{"role": "user", "content": f"Talk {i}"}], "top_logprobs": 0}),
    "completion-penalties": lambda i: (COMPLETIONS, {"prompt": "x", "max_tokens": 3, "presence_penalty": 0.5, "repetition_penalty": 1.2,
                                                     "logit_bias": {"5": 2.0}}),
    "chat-logprobs": lambda i: (CHAT, {"messages": HI, "max_tokens": 2, "logprobs": True, "top_logprobs": 2}),
    "completion-logprobs": lambda i: (COMPLETIONS, {"prompt": f"x {i}", "max_tokens": 3, "logprobs": 1}),
    "chat-frequency-penalty": lambda i: (CHAT, {"messages": HI, "max_tokens": 3, "frequency_penalty": 1.0, "min_tokens": 1}),
}  # fmt: skip
# Lines that fail alone: (kind, body maker, the error's param, its status, words its message holds).
FAILS = {
    "n-zero": (lambda i: (COMPLETIONS, {"prompt": "x", "n": 0}), "n", 400, ['n must be an integer in [1, 16384], got 0']),
    "chat-logprobs-not-bool": (lambda i: (CHAT, {"messages": HI, "logprobs": 2}), "logprobs", 400, ['"logprobs" must be true or false']),
    "top-logprobs-alone": (lambda i: (CHAT, {"messages": HI, "top_logprobs": 2}), "top_logprobs", 400, ['"top_logprobs" needs "logprobs": true']),
    "completion-logprobs-not-int": (lambda i: (COMPLETIONS, {"prompt": "x", "logprobs": "3"}), "logprobs", 400, ['"logprobs" must be an integer']),
    "too-many-logprobs": (lambda i: (COMPLETIONS, {"prompt": "x", "logprobs": 50}), "logprobs", 400, ["logprobs"]),
    "stream": (lambda i: (CHAT, {"messages": HI, "stream": True}), "stream", 400, ['"stream"']),
    "echo": (lambda i: (COMPLETIONS, {"prompt": "x", "echo": True}), "echo", 400, ['"echo"']),
    "unknown": (lambda i: (COMPLETIONS, {"prompt": "x", "temprature": 0}), "temprature", 400, ['unknown field "temprature"']),
    "openai-only-field": (lambda i: (CHAT, {"messages": HI, "metadata": {"a": "b"}}), "metadata", 400, ['unknown field "metadata"']),
    "other-endpoint-field": (lambda i: (COMPLETIONS, {"prompt": "x", "top_logprobs": 0}), "top_logprobs", 400, ["/v1/chat/completions"]),
    "messages-at-completions": (lambda i: (COMPLETIONS, {"messages": HI}), "messages", 400, ['"messages" is a field of /v1/chat/completions']),
    "model": (lambda i: (CHAT, {"model": "gpt-4o", "messages": HI}), "model", 404, ["The model `gpt-4o` does not exist"]),
    "url": (lambda i: ("/v1/embeddings", {"input": "x"}), "url", 400, ["/v1/embeddings"]),
    "messages-not-a-list": (lambda i: (CHAT, {"messages": "hi"}), "messages", 400, ['"messages" must be a non-empty list']),
    "image-part": (lambda i: (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
                   "messages", 400, ['"image_url" part']),
    "prompt-object": (lambda i: (COMPLETIONS, {"prompt": {"text": "x"}}), "prompt", 400, ['"prompt" must be']),
    "no-prompt": (lambda i: (COMPLETIONS, {"max_tokens": 2}), "prompt", 400, ['needs "prompt"']),
    "bad-temperature": (lambda i: (COMPLETIONS, {"prompt": "x", "temperature": "hot"}), "temperature", 400, ["temperature must be"]),
    "zero-max-tokens": (lambda i: (CHAT, {"messages": HI, "max_completion_tokens": 0}), "max_completion_tokens", 400, ["max_tokens must be"]),
    "too-long": (lambda i: (COMPLETIONS, {"prompt": [0] + [17] * 60, "max_tokens": 1}), None, 400, ["61 tokens", "maximum length is 48"]),
}  # fmt: skip
BROKEN_LINES = {  # lines whose method or body cannot be read: (the line without its custom_id, param, words)
    "no-body": ({"method": "POST", "url": CHAT}, "body", ['needs a "body"']),
    "get": ({"method": "GET", "url": CHAT, "body": {"messages": HI}}, "method", ['method "GET"']),
    "extra-key": ({"method": "POST", "url": CHAT, "body": {"messages": HI}, "priority": 1}, "priority", ['unknown field "priority" in an OpenAI batch line']),
}  # fmt: skip


def mixed_file(path, count: int = 100) -> tuple:
    """`count` lines of every kind above, shuffled; and per line the expectation: None (it runs,
    with the kind's name) or (param, status, needles)."""
    kinds = [*RUNS] * 3 + [*FAILS] + [*BROKEN_LINES]
    order = [kinds[i % len(kinds)] for i in range(count)]
    random.Random(0).shuffle(order)
    items, expected = [], []
    for i, kind in enumerate(order, start=1):
        custom_id = f"req-{i}-{kind}"
        if kind in RUNS:
            url, body = RUNS[kind](i)
            items.append(line(custom_id, url, body))
            expected.append((kind, None))
        elif kind in FAILS:
            make, param, status, needles = FAILS[kind]
            url, body = make(i)
            items.append(line(custom_id, url, body))
            expected.append((kind, (param, status, needles)))
        else:
            rest, param, needles = BROKEN_LINES[kind]
            items.append({"custom_id": custom_id, **rest})
            expected.append((kind, (param, 400, needles)))
    write_lines(path, items)
    return items, expected


def cli(*args, cache, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "DEEPINFER_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    return subprocess.Popen([sys.executable, "-m", "deepinfer", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, cache):
    """The 100-line file run as a user runs it (its own process), and what two more runs on the
    same output said while it held the output's lock: (items, expected, output path, exit code,
    stderr, second runs). The first run is stopped (SIGSTOP) once it holds the lock and goes on
    only after both others have exited, so they meet the lock on a machine of any speed."""
    tmp = tmp_path_factory.mktemp("batch")
    src, out = tmp / "requests.jsonl", tmp / "results.jsonl"
    items, expected = mixed_file(src)
    if not Path("/proc/locks").exists():
        pytest.skip("seeing the output's lock held needs Linux's /proc/locks")
    proc = cli("run-batch", *FAST, "-i", str(src), "-o", str(out), cache=cache)
    with stopped_once(proc, lambda: holds_flock(proc.pid, out), "the first run holding the output's lock"):
        flags = ("--resume", "--overwrite")
        seconds = [cli("run-batch", *FAST, "-i", str(src), "-o", str(out), flag, cache=cache) for flag in flags]
        second_results = []
        for second, flag in zip(seconds, flags):
            second_code, _, second_err = finish(second, f"a second run on the locked output ({flag})")
            second_results.append((second_code, second_err))
    code, _, err = finish(proc, "the first run")
    return items, expected, out, code, err, second_results


def test_a_vllm_shaped_file_runs_with_rows_in_input_order(full_run):
    items, expected, out, code, err, _ = full_run
    assert code == 1, f"some lines failed: exit code 1\n{err}"
    failed = sum(want is not None for _, want in expected)
    assert f"requests          100; {failed} failed (error rows in {out})" in err, err
    assert "Traceback" not in err
    rows = read_rows(out)
    assert [row["custom_id"] for row in rows] == [item["custom_id"] for item in items], "one row per line, in input order"
    assert len({row["id"] for row in rows}) == 100 and len({row["response"]["request_id"] for row in rows}) == 100, "unique ids"
    for number, (row, item, (kind, want)) in enumerate(zip(rows, items, expected), start=1):
        assert list(row) == ["id", "custom_id", "response", "error"], row
        if want is None:
            assert row["error"] is None and row["response"]["status_code"] == 200, (kind, row)
            check_result(kind, item, validate(row))
            continue
        param, status, needles = want
        error = row["error"]
        assert row["response"] == {"status_code": status, "request_id": row["response"]["request_id"], "body": None}, (kind, row)
        assert error["param"] == param and error["code"] == status and error["object"] == "error", (kind, error)
        assert error["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
        assert re.search(rf"requests\.jsonl line {number}\b", error["message"]), error["message"]
        assert all(n in error["message"] for n in needles), (kind, error["message"])
        if param is not None:
            assert json.dumps(param) in error["message"] or param in error["message"], (kind, error["message"])


def check_logprobs(request: dict, choice, tokens: int) -> None:
    """A choice's logprobs: none unless asked; else one entry per generated token, its top k by
    logprob, each logprob <= 0 and the chosen token's at most the best one's."""
    k = request.get("top_logprobs", 0) if request.get("logprobs") is True else request.get("logprobs")
    if k is None or k is False:
        assert choice.logprobs is None
        return
    if hasattr(choice.logprobs, "content"):  # chat
        content = choice.logprobs.content
        assert len(content) == tokens  # (each token decoded alone: their texts need not add up to the message)
        for entry in content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == k and bytes(entry.bytes) == entry.token.encode()
            tops = [t.logprob for t in entry.top_logprobs]
            assert tops == sorted(tops, reverse=True) and (not tops or entry.logprob <= tops[0] + 1e-6)
    else:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == tokens
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(tokens)]
        for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
            assert chosen <= 0 and len(top) <= k and all(v <= 0 for v in top.values())
            assert chosen <= max(top.values()) + 1e-6


def check_result(kind: str, item: dict, body) -> None:
    """What a result body of each kind must hold, beyond its type."""
    request = item["body"]
    assert body.model == "tiny-v3" and body.usage.total_tokens == body.usage.prompt_tokens + body.usage.completion_tokens
    if item["url"] == COMPLETIONS:
        assert isinstance(body, Completion) and body.object == "text_completion" and body.id.startswith("cmpl-")
        texts = [choice.text for choice in body.choices]
    else:
        assert isinstance(body, ChatCompletion) and body.object == "chat.completion" and body.id.startswith("chatcmpl-")
        assert all(choice.message.role == "assistant" for choice in body.choices)
        texts = [choice.message.content for choice in body.choices]
    prompts = 2 if kind == "completion-two-prompts" else 1
    assert [choice.index for choice in body.choices] == list(range(prompts)) and all(isinstance(t, str) for t in texts)
    limit = request.get("max_completion_tokens", request.get("max_tokens"))
    if limit is None:  # the endpoint's default: 16 for completions, the model's length for chat
        limit = 16 if item["url"] == COMPLETIONS else MAX_MODEL_LEN - body.usage.prompt_tokens
    for choice in body.choices:
        assert choice.finish_reason in ("stop", "length")
        check_logprobs(request, choice, body.usage.completion_tokens // prompts)
    if all(choice.finish_reason == "length" for choice in body.choices):
        assert body.usage.completion_tokens == limit * prompts, (kind, body.usage)
    else:
        assert body.usage.completion_tokens < limit * prompts
    if kind == "completion-stop-seed":
        for choice in body.choices:
            assert "\n" not in choice.text and "." not in choice.text
            assert (choice.finish_reason == "stop") == (choice.stop_reason is not None)


def test_a_second_run_on_the_same_output_is_refused_at_once(full_run):
    *_, second_results = full_run
    for code, err in second_results:
        assert code == 2, err
        lines = [text for text in err.strip().splitlines() if text]
        assert len(lines) == 1 and lines[0].startswith("deepinfer: error: output ") and "in use by another deepinfer run" in lines[0], err


def test_resume_after_an_interrupted_run_completes_it_without_duplicates(full_run, tmp_path, capsys):
    items, expected, full, _, _, _ = full_run
    src = full.parent / "requests.jsonl"
    text = full.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    out = tmp_path / "results.jsonl"
    out.write_text("".join(lines[:75]) + lines[75][:40], encoding="utf-8")  # a run killed while writing row 76
    failing_left = any(want is not None for _, want in expected[75:])
    assert main(["run-batch", *FAST, "-i", str(src), "-o", str(out), "--resume"]) == int(failing_left)
    err = capsys.readouterr().err
    assert "requests          25 (75 already in" in err and "unfinished last line" in err, err
    rows, want = read_rows(out), read_rows(full)
    assert [row["custom_id"] for row in rows] == [item["custom_id"] for item in items], "every line once, in input order"
    assert out.read_text(encoding="utf-8").startswith("".join(lines[:75])), "the rows before are kept as they were"
    for row, wanted in zip(rows[75:], want[75:]):
        assert row["id"] != wanted["id"], "a resumed row is a new response"
        assert same_content(row) == same_content(wanted), row["custom_id"]  # seeds follow the lines: the same tokens
    # Nothing left: no model loaded, nothing written.
    assert main(["run-batch", *FAST, "-i", str(src), "-o", str(out), "--resume"]) == 0
    assert "nothing to do" in capsys.readouterr().err
    assert read_rows(out) == rows


def same_content(row: dict) -> dict:
    """A row without what differs between two runs: its ids and creation time, and its logprobs'
    values (a recomputed line runs in another batch, which may move their last bits; the tokens
    and their texts stay, and the values are checked against the engine elsewhere)."""
    body = row["response"]["body"]
    if body is None:
        return {"error": row["error"], "status": row["response"]["status_code"]}
    choices = json.loads(json.dumps(body["choices"]), parse_float=lambda text: 0.0)  # the choices' only floats are logprobs
    return {"choices": choices, "usage": body["usage"], "model": body["model"], "object": body["object"]}


# ---- bodies, usage and the served model ---------------------------------------------------------


def test_bodies_validate_and_usage_counts_the_tokens(tmp_path, capsys, api):
    """Greedy lines against LLM.generate / LLM.chat: the same text, and usage counts their tokens."""
    items = [
        line("text", COMPLETIONS, {"prompt": "Hello, my name is", "max_tokens": 4, "temperature": 0, "ignore_eos": True}),
        line("ids", COMPLETIONS, {"prompt": [0, 2182, 11, 1100], "max_tokens": 3, "temperature": 0, "ignore_eos": True}),
        line("three", COMPLETIONS, {"prompt": ["a", "b c", "d e f"], "max_tokens": 2, "temperature": 0, "ignore_eos": True}),
        line("chat", CHAT, {"messages": HI, "max_completion_tokens": 3, "temperature": 0, "ignore_eos": True}),
        line("continue", CHAT, {"messages": [*HI, {"role": "assistant", "content": "Hi"}], "add_generation_prompt": False,
                                "continue_final_message": True, "max_tokens": 2, "temperature": 0, "ignore_eos": True}),
    ]  # fmt: skip
    src, out = write_lines(tmp_path / "in.jsonl", items), tmp_path / "out.jsonl"
    assert main(["run-batch", *FAST, "-i", str(src), "-o", str(out)]) == 0
    rows = read_rows(out)
    bodies = [validate(row) for row in rows]
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    want = {
        "text": api.generate(["Hello, my name is"], greedy(4), use_tqdm=False),
        "ids": api.generate([{"prompt_token_ids": [0, 2182, 11, 1100]}], greedy(3), use_tqdm=False),
        "three": api.generate(["a", "b c", "d e f"], greedy(2), use_tqdm=False),
        "chat": api.chat(HI, greedy(3), use_tqdm=False),
        "continue": api.chat([*HI, {"role": "assistant", "content": "Hi"}], greedy(2), use_tqdm=False,
                             add_generation_prompt=False, continue_final_message=True),
    }  # fmt: skip
    for row, body in zip(rows, bodies):
        outputs = want[row["custom_id"]]
        texts = [c.text if isinstance(body, Completion) else c.message.content for c in body.choices]
        assert texts == [o.outputs[0].text for o in outputs], row["custom_id"]
        assert body.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in outputs)
        assert body.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in outputs)
        assert body.usage.total_tokens == body.usage.prompt_tokens + body.usage.completion_tokens
    assert bodies[1].usage.prompt_tokens == 4 and bodies[2].usage.completion_tokens == 3 * 2
    err = capsys.readouterr().err
    assert f"prompt tokens     {sum(b.usage.prompt_tokens for b in bodies)}" in err
    assert f"generated tokens  {sum(b.usage.completion_tokens for b in bodies)}" in err


def test_n_gives_n_choices_per_prompt(tmp_path, capsys, api):
    """"n": a choice per sample, a prompt's samples in a row (choice i*n + j), usage counting each
    prompt once and every choice's tokens; greedy samples are the n=1 output, sampled ones differ."""
    items = [
        line("greedy", COMPLETIONS, {"prompt": ["a", "b c"], "n": 2, "max_tokens": 3, "temperature": 0, "ignore_eos": True}),
        line("sampled", COMPLETIONS, {"prompt": ["a", "b c"], "n": 3, "max_tokens": 4, "temperature": 1, "seed": 5, "ignore_eos": True}),
        line("chat", CHAT, {"messages": HI, "n": 3, "max_completion_tokens": 4, "seed": 2, "ignore_eos": True}),
    ]  # fmt: skip
    src, out = write_lines(tmp_path / "in.jsonl", items), tmp_path / "out.jsonl"
    assert main(["run-batch", *FAST, "-i", str(src), "-o", str(out)]) == 0
    rows = read_rows(out)
    greedy, sampled, chat = [validate(row) for row in rows]
    assert isinstance(chat, ChatCompletion) and isinstance(sampled, Completion)
    assert [c.index for c in greedy.choices] == [0, 1, 2, 3] and [c.index for c in sampled.choices] == [*range(6)]
    assert [c.index for c in chat.choices] == [0, 1, 2]
    one = api.generate(["a", "b c"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [c.text for c in greedy.choices] == [o.outputs[0].text for o in one for _ in range(2)]
    tokenizer = api.get_tokenizer()
    prompt_tokens = len(tokenizer.encode("a")) + len(tokenizer.encode("b c"))
    assert (greedy.usage.prompt_tokens, greedy.usage.completion_tokens) == (prompt_tokens, 4 * 3)
    assert (sampled.usage.prompt_tokens, sampled.usage.completion_tokens) == (prompt_tokens, 6 * 4)
    assert chat.usage.completion_tokens == 3 * 4 and all(c.finish_reason == "length" for c in chat.choices)
    assert len({c.text for c in sampled.choices[:3]}) == 3 and len({c.message.content for c in chat.choices}) == 3


def test_logprobs_are_the_engines(tmp_path, capsys, api):
    """Completions "logprobs": k and chat "logprobs": true with "top_logprobs": k carry the values
    LLM.generate / LLM.chat give with SamplingParams(logprobs=k), in OpenAI's two shapes."""
    items = [
        line("text", COMPLETIONS, {"prompt": "Hello, my name is", "max_tokens": 3, "temperature": 0, "ignore_eos": True, "logprobs": 2}),
        line("chat", CHAT, {"messages": HI, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 3}),
        line("chat-chosen-only", CHAT, {"messages": HI, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "logprobs": True}),
    ]  # fmt: skip
    src, out = write_lines(tmp_path / "in.jsonl", items), tmp_path / "out.jsonl"
    assert main(["run-batch", *FAST, "-i", str(src), "-o", str(out)]) == 0
    text, chat, chosen_only = [validate(row) for row in read_rows(out)]
    want = api.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2), use_tqdm=False)[0].outputs[0]
    lp = text.choices[0].logprobs
    # run-batch steps its three lines in one batch, generate this one alone: float32 logits move by a
    # few 1e-6 with the batch where the host's BLAS rounds a row by its position (AMD EPYC, OpenBLAS)
    close = dict(abs=1e-5)
    assert lp.token_logprobs == pytest.approx([pos[t].logprob for t, pos in zip(want.token_ids, want.logprobs)], **close)
    ranked = [sorted((v for v in pos.values() if v.rank <= 2), key=lambda v: v.rank) for pos in want.logprobs]
    assert [list(top.values()) for top in lp.top_logprobs] == [pytest.approx([v.logprob for v in r], **close) for r in ranked]
    assert lp.tokens == [pos[t].decoded_token for t, pos in zip(want.token_ids, want.logprobs)]
    want = api.chat(HI, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=3), use_tqdm=False)[0].outputs[0]
    content = chat.choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx([pos[t].logprob for t, pos in zip(want.token_ids, want.logprobs)], abs=1e-5)
    assert all(len(e.top_logprobs) == 3 for e in content) and all(e.top_logprobs == [] for e in chosen_only.choices[0].logprobs.content)
    assert text.choices[0].logprobs is not None and chat.choices[0].logprobs.refusal is None


def test_the_served_model_names(tmp_path, capsys):
    """vLLM's rule: "model" is absent, null or a served name (--served-model-name, else --model);
    the bodies carry the first served name."""
    items = [line(name or "none", COMPLETIONS, {"model": name, "prompt": "x", "max_tokens": 1}) for name in ("deepseek-v3", "alias", None, "tiny-v3")]
    src, out = write_lines(tmp_path / "in.jsonl", items), tmp_path / "out.jsonl"
    assert main(["run-batch", *FAST, "-i", str(src), "-o", str(out), "--served-model-name", "deepseek-v3", "alias"]) == 1
    rows = read_rows(out)
    assert [validate(row).model for row in rows[:3]] == ["deepseek-v3"] * 3
    assert rows[3]["error"]["code"] == 404 and "tiny-v3" in rows[3]["error"]["message"] and "deepseek-v3, alias" in rows[3]["error"]["message"]
    # Without --served-model-name: --model as given.
    assert main(["run-batch", *FAST, "--model", "tiny-v3", "-i", str(src), "-o", str(out), "--overwrite"]) == 1
    rows = read_rows(out)
    assert [row["error"]["code"] if row["error"] else validate(row).model for row in rows] == [404, 404, "tiny-v3", "tiny-v3"]
    capsys.readouterr()


# ---- the file's defects, the flags -----------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, needles",
    [
        ("not json", ["line 2", "not valid JSON"]),
        ('["a list"]', ["line 2", "expected a JSON object"]),
        ({"method": "POST", "url": CHAT, "body": {"messages": HI}}, ["line 2", 'needs a "custom_id"']),
        ({"custom_id": 7, "method": "POST", "url": CHAT, "body": {"messages": HI}}, ["line 2", "custom_id must be a string"]),
        (line("a", CHAT, {"messages": HI}), ["line 2", 'duplicate custom_id "a" (first at', "line 1"]),
    ],
)
def test_a_line_that_breaks_the_file_stops_the_run_before_it_starts(tmp_path, capsys, bad, needles):
    src = write_lines(tmp_path / "in.jsonl", [line("a", CHAT, {"messages": HI}), bad])
    out = tmp_path / "out.jsonl"
    one_line_error(capsys, ["run-batch", *FAST, "-i", str(src), "-o", str(out)], *needles)
    assert not out.exists(), "nothing written, no empty file left behind"


@pytest.mark.parametrize(
    "argv, needles",
    [
        ([], ["-i/--input"]),
        (["-i", "missing.jsonl"], ["missing.jsonl not found"]),
        (["-i", "{src}", "-o", "{src}"], ["is the input file"]),
        (["-i", "{src}", "--resume"], ["--resume needs -o/--output"]),
        (["-i", "{src}", "--max-num-seqs", "0"], ["--max-num-seqs must be >= 1"]),
        (["-i", "{src}", "-tp", "2"], ["--tensor-parallel-size 2", "--ep 2"]),
        (["-i", "{src}", "--served-model-name", " "], ["--served-model-name"]),
        (["-i", "{src}", "--max-tokens", "3"], ["unrecognized arguments: --max-tokens", "deepinfer run-batch --help"]),
    ],
)
def test_bad_flags_are_one_line(tmp_path, capsys, argv, needles):
    src = write_lines(tmp_path / "in.jsonl", [line("a", CHAT, {"messages": HI})])
    one_line_error(capsys, ["run-batch", *FAST, *[a.replace("{src}", str(src)) for a in argv]], *needles)


def test_resume_refuses_an_output_of_deepinfer_run(tmp_path, capsys):
    src = write_lines(tmp_path / "in.jsonl", [line("a", CHAT, {"messages": HI})])
    out = tmp_path / "out.jsonl"
    content = '{"custom_id": "a", "prompt": "x", "text": "y", "token_ids": [], "finish_reason": "length", "prompt_tokens": 1, "completion_tokens": 0}\n'
    out.write_text(content, encoding="utf-8")
    one_line_error(capsys, ["run-batch", *FAST, "-i", str(src), "-o", str(out), "--resume"], "line 1", "not an OpenAI batch output row")
    assert out.read_text(encoding="utf-8") == content


def test_a_locked_output_is_refused_and_kept(tmp_path, capsys):
    src = write_lines(tmp_path / "in.jsonl", [line("a", CHAT, {"messages": HI})])
    out = tmp_path / "out.jsonl"
    out.write_text("kept\n", encoding="utf-8")
    with open(out, "rb") as other:  # what a running deepinfer holds
        fcntl.flock(other.fileno(), fcntl.LOCK_EX)
        for flag in ("--resume", "--overwrite"):
            one_line_error(capsys, ["run-batch", *FAST, "-i", str(src), "-o", str(out), flag], "in use by another deepinfer run")
    assert out.read_text(encoding="utf-8") == "kept\n"


def test_the_field_table_names_real_parameters():
    """Enabling a field is one line of the table: every sampling rule names a SamplingParams field
    and every chat rule a render_chat argument, so the line that maps them stays right."""
    import dataclasses
    import inspect

    from deepinfer.engine.chat import render_chat

    params = {f.name for f in dataclasses.fields(SamplingParams)}
    chat = set(inspect.signature(render_chat).parameters)
    for key, rule in FIELDS.items():
        if isinstance(rule, Sampling):
            assert rule.param in params, key
        if isinstance(rule, Chat):
            assert rule.option in chat, key


def test_prompt_logprobs_are_read_by_run_only():
    """`run` rows hold prompt logprobs; an OpenAI batch body has no place for them, so run-batch
    takes only null, naming the field (the line's error "param")."""
    from deepinfer.cli.request_fields import BadField, read_fields

    body = {"prompt": "x", "prompt_logprobs": 1}
    assert read_fields(body, skip=("prompt",)).sampling == {"prompt_logprobs": 1}
    with pytest.raises(BadField, match=r'^"prompt_logprobs": 1 is not supported by deepinfer run-batch .*deepinfer run writes them') as info:
        read_fields(body, skip=("prompt",), endpoint=COMPLETIONS)
    assert info.value.param == "prompt_logprobs"
    assert read_fields({**body, "prompt_logprobs": None}, skip=("prompt",), endpoint=COMPLETIONS).sampling == {}
