"""`deepinfer serve`'s routes against hostile requests (issue 38), in this process (the FastAPI app
through starlette's test client, the engine thread running the embedded tiny model): each one is a
4xx answer in OpenAI's shape naming the field to blame, never a 500 with a server traceback, and
the server keeps answering. A lone surrogate, a body nested too deeply or too large, a text too
long for the model (refused before it is tokenized), a request that could never fit the queue,
token ids outside the vocabulary, token options that ban every token; every answer is strict JSON."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from deepinfer.serve.app import ServeConfig, build_app
from deepinfer.serve.server import make_frontend

MAX_QUEUE = 8
MAX_MODEL_LEN = 256
LIMIT = 1 << 20  # --max-request-bytes of this server


@pytest.fixture(scope="module")
def front(cache):
    from deepinfer import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE", str(cache))
        llm = LLM(backend="reference", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN, logprobs_mode="processed_logprobs", announce=False)
    front = make_frontend(llm, ServeConfig(["tiny"], max_request_bytes=LIMIT), MAX_QUEUE)
    front.loop.start()
    yield front
    front.loop.stop(0)
    front.loop.join(30)


@pytest.fixture(scope="module")
def client(front):
    return TestClient(build_app(front), raise_server_exceptions=False)


def strict(text: str):
    def refuse(constant):
        raise AssertionError(f"the answer holds {constant}, which is not JSON")

    return json.loads(text, parse_constant=refuse)


def post(client, body, url="/v1/completions", **kwargs):
    """POST `body` (a dict, or raw JSON text); the status and the strictly parsed answer."""
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    reply = client.post(url, content=content, headers={"content-type": "application/json"}, **kwargs)
    return reply.status_code, strict(reply.text)


def refused(client, body, status: int, param, *needles, url="/v1/completions") -> dict:
    code, answer = post(client, body, url)
    error = answer.get("error")
    assert code == status and error is not None and error["code"] == status and error["param"] == param, (code, answer)
    for needle in needles:
        assert needle in error["message"], error["message"]
    return error


def nested(depth: int):
    value = "x"
    for _ in range(depth):
        value = [value]
    return value


def test_lone_surrogates_are_400_naming_the_field(client):
    """A lone surrogate in "model", in "bad_words" or as a field name answered a plain-text 500."""
    refused(client, '{"model": "\\udc00", "prompt": "x"}', 400, "model", "lone surrogate")
    refused(client, '{"prompt": "x", "bad_words": ["\\udc00"]}', 400, "bad_words", "bad_words[0] holds a lone surrogate")
    refused(client, '{"prompt": "x", "\\udc00": 1}', 400, None, "a field name holds a lone surrogate")
    refused(client, '{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages", "messages[0].content", url="/v1/chat/completions")


def test_bodies_nested_too_deeply_are_400(client):
    refused(client, "[" * 100_000, 400, None, "not valid JSON", "nested too deeply")
    refused(client, {"prompt": "x", "stop": nested(150)}, 400, "stop", "more than 100 levels deep")
    refused(client, '{"prompt": "x", "seed": ' + "9" * 5000 + "}", 400, None, "not valid JSON", "4300 digits")


def test_a_body_over_the_limit_is_413_before_it_is_read_whole(client):
    """A 200 MB body was read and parsed; now --max-request-bytes bounds it, by its Content-Length
    or, without one, as it arrives."""
    big = json.dumps({"prompt": "x" * LIMIT})
    refused(client, big, 413, None, f"this server reads at most {LIMIT} bytes", "--max-request-bytes")

    def chunks():  # no Content-Length: the body arrives in pieces
        for start in range(0, len(big), 1 << 16):
            yield big[start : start + (1 << 16)].encode()

    reply = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert reply.status_code == 413 and f"more than {LIMIT} bytes" in reply.json()["error"]["message"], reply.text
    assert post(client, {"prompt": "Hello", "max_tokens": 2})[0] == 200  # still serving


def test_a_prompt_too_long_for_the_model_is_400_before_it_is_tokenized(client, monkeypatch):
    """A 40 MB prompt took gigabytes in the tokenizer and stalled /health: a text longer than the
    model's length times the tokenizer's longest token is refused without tokenizing it."""
    from deepinfer.model.tokenizer import Tokenizer

    seen = []
    encode = Tokenizer.encode
    monkeypatch.setattr(Tokenizer, "encode", lambda self, text, add_bos=None: seen.append(len(text)) or encode(self, text, add_bos))
    text = "word " * (MAX_MODEL_LEN * 128 // 5 + 1)  # the tiny tokenizer's longest token spells 128 characters
    refused(client, {"prompt": text, "max_tokens": 2}, 400, "prompt", "characters long, so at least", f"maximum length is {MAX_MODEL_LEN}")
    assert seen == []


def test_a_request_that_could_never_fit_the_queue_is_400(client):
    """2000 prompts got 429 "queue full (0 requests wait)" forever, and "n": 2**63 took the server
    down: the queue counts sequences (prompts times n) and a request that alone exceeds it is a
    client error; n is bounded by vLLM's 16384."""
    refused(client, {"prompt": ["Hi"] * (MAX_QUEUE + 1), "max_tokens": 2}, 400, "prompt", f"makes {MAX_QUEUE + 1} sequences", "--max-queue")
    refused(client, {"prompt": "Hi", "n": MAX_QUEUE + 1, "max_tokens": 2}, 400, "n", "times n = 9")
    refused(client, {"prompt": "Hi", "n": 2**63, "max_tokens": 2}, 400, "n", "n must be an integer in [1, 16384]")
    refused(client, {"messages": [{"role": "user", "content": "Hi"}], "n": 1_000_000}, 400, "n", url="/v1/chat/completions")


def test_token_ids_outside_the_vocabulary_blame_their_field(client):
    """The 400 named "prompt" for an id out of the vocabulary in logit_bias or allowed_token_ids."""
    refused(client, {"prompt": "Hi", "logit_bias": {"1000000": 1}}, 400, "logit_bias", "logit_bias has token id 1000000")
    refused(client, {"prompt": "Hi", "allowed_token_ids": [1000000]}, 400, "allowed_token_ids", "outside the vocabulary")


def test_options_that_ban_every_token_fail_alone_and_no_answer_holds_nan(client, front):
    """--logprobs-mode processed_logprobs: a request whose options ban every token answered 500
    ("Out of range float values are not JSON compliant") and streamed NaN. Now it fails with a
    400 (an error event when streamed), and a banned token among the top ones reads -9999.0."""
    eos = front.llm.tokenizer.eos_token_id
    dead = {"prompt": "Hello", "allowed_token_ids": [eos], "min_tokens": 3, "max_tokens": 4, "logprobs": 2}
    refused(client, dead, 400, None, "no token is left to sample", "allowed_token_ids and min_tokens ban every token")
    with client.stream("POST", "/v1/completions", json={**dead, "stream": True}) as reply:
        events = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "no token is left to sample" in strict(events[-2])["error"]["message"], events
    for event in events[:-1]:
        strict(event)
    refused(client, {"prompt": "Hello", "logit_bias": {"5": -1e308}}, 400, "logit_bias", "[-100, 100]")
    code, answer = post(client, {"prompt": "Hello", "allowed_token_ids": [5, 6], "max_tokens": 3, "logprobs": 3})
    assert code == 200, answer
    logprobs = answer["choices"][0]["logprobs"]
    assert all(sorted(top.values())[0] == -9999.0 for top in logprobs["top_logprobs"]), logprobs
    code, answer = post(client, {"messages": [{"role": "user", "content": "Hi"}], "allowed_token_ids": [5, 6], "max_tokens": 2, "logprobs": True,
                                 "top_logprobs": 3}, url="/v1/chat/completions")  # fmt: skip
    assert code == 200 and all(t["top_logprobs"][-1]["logprob"] == -9999.0 for t in answer["choices"][0]["logprobs"]["content"]), answer


def test_an_unknown_field_answers_without_pointing_at_the_command_line(client):
    """An HTTP client was told to read `--help`."""
    error = refused(client, {"prompt": "x", "frobnicate": 1}, 400, "frobnicate", 'unknown field "frobnicate"')
    assert "--help" not in error["message"]
    refused(client, {"prompt": "x", "max_token": 2}, 400, "max_token", 'did you mean "max_tokens"?')
