"""`deepinfer serve` through the real openai client: one server (a subprocess on a loopback port,
the embedded tiny model on the reference backend, an API key) for the module. Completions and chat,
whole and streamed (the streamed text is the whole answer's), n > 1, logprobs in each endpoint's
shape, stop strings, seeds, structured output by response_format, and OpenAI's errors: 400 with the
field to blame, 404 for an unknown model, 401 without the key."""

from __future__ import annotations

import json

import httpx2
import jsonschema
import openai
import pytest

from serve.server_process import ServerProcess
from waits import HANG_S

KEY = "sk-test"
HI = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def server(cache):
    server = ServerProcess("--backend", "reference", "--num-kv-blocks", "64", "--max-model-len", "160", "--served-model-name", "tiny", "alias",
                           cache=cache, api_key=KEY)  # fmt: skip
    yield server
    code, err = server.stop()
    assert code == 0, err


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=HANG_S)


def streamed_texts(stream) -> tuple[dict[int, str], dict[int, str], list]:
    """(text per choice index, finish_reason per choice index, the chunks)."""
    texts, reasons, chunks = {}, {}, []
    for chunk in stream:
        chunks.append(chunk)
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, chunks


def test_models(client):
    assert [m.id for m in client.models.list()] == ["tiny", "alias"]


def test_completions_n_logprobs_and_the_same_text_streamed(client):
    whole = client.completions.create(model="tiny", prompt=["Hello, my name is", "The sky"], max_tokens=5, n=2, seed=3, logprobs=2)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert whole.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in whole.choices) == 20
    for choice in whole.choices:
        assert choice.finish_reason == "length" and len(choice.logprobs.token_logprobs) == 5
        assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
        assert "".join(choice.logprobs.tokens) == choice.text
    stream = client.completions.create(model="tiny", prompt=["Hello, my name is", "The sky"], max_tokens=5, n=2, seed=3, logprobs=2, stream=True,
                                       stream_options={"include_usage": True})  # fmt: skip
    texts, reasons, chunks = streamed_texts(stream)
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {i: "length" for i in range(4)}
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    tokens = [t for chunk in chunks for c in chunk.choices if c.index == 0 and c.logprobs for t in c.logprobs.tokens]
    assert tokens == whole.choices[0].logprobs.tokens


def test_usage_counts_the_cached_prompt_tokens(client):
    prompt = list(range(1, 41))  # token ids: two full 16-token blocks, then the rest
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens == 40
    assert again.usage.prompt_tokens_details.cached_tokens == 32  # the full blocks came from the prefix cache
    assert again.choices[0].text == first.choices[0].text
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32


def test_chat_whole_and_streamed(client):
    whole = client.chat.completions.create(model="alias", messages=HI, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and choice.message.role == "assistant" and choice.finish_reason == "length"
    assert len(choice.logprobs.content) == 4 and all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    stream = client.chat.completions.create(model="alias", messages=HI, max_tokens=4, temperature=0, n=2, stream=True)
    texts, reasons, chunks = streamed_texts(stream)
    assert texts == {0: choice.message.content, 1: choice.message.content}  # greedy: both samples alike
    assert reasons == {0: "length", 1: "length"}
    first = [next(c for chunk in chunks for c in chunk.choices if c.index == i) for i in (0, 1)]
    assert all(c.delta.role == "assistant" for c in first)


def test_stop_string_whole_and_streamed(client):
    free = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0)
    text = free.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    cut = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].model_extra["stop_reason"] == stop
    texts, reasons, _ = streamed_texts(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0,
                                                                 stop=[stop], stream=True))  # fmt: skip
    assert texts == {0: cut.choices[0].text} and reasons == {0: "stop"}


def test_seeds(client):
    def text(seed):
        return client.chat.completions.create(model="tiny", messages=HI, max_tokens=6, temperature=1.0, seed=seed).choices[0].message.content

    assert text(11) == text(11)
    assert len({text(11), text(12), text(13)}) > 1


def test_structured_output_by_response_format(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    answer = client.chat.completions.create(messages=HI, max_tokens=60, seed=0, model="tiny",
                                            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.parametrize("extra, param, needle", [
    ({"temperature": -1}, "temperature", "temperature"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate", 'unknown field "frobnicate"'),
    ({"extra_body": {"echo": True}}, "echo", "echo"),
    ({"extra_body": {"stream_options": {"include_usage": True}}}, "stream_options", '"stream": true'),
    ({"extra_body": {"messages": HI}}, "messages", "/v1/chat/completions"),
])  # fmt: skip
def test_bad_fields_are_400_with_the_field(client, extra, param, needle):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, **extra)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param and needle in error["message"], error
    assert error["type"] == "BadRequestError" and error["code"] == 400


def test_prompt_too_long_is_400(client):
    with pytest.raises(openai.BadRequestError, match="maximum length is 160"):
        client.completions.create(model="tiny", prompt=list(range(5, 200)), max_tokens=2)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError, match="The model `gpt-4` does not exist"):
        client.chat.completions.create(model="gpt-4", messages=HI, max_tokens=2)


def test_missing_or_wrong_key_is_401_but_health_is_open(server):
    for key in (None, "sk-wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics")):
            reply = httpx2.request(method, f"{server.url}{path}", headers=headers, json={"prompt": "x"}, timeout=HANG_S)
            assert reply.status_code == 401 and reply.json()["error"]["type"] == "AuthenticationError", (path, reply.text)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()
    assert httpx2.get(f"{server.url}/health", timeout=HANG_S).status_code == 200


def test_body_that_is_not_json_and_unknown_route(server):
    reply = httpx2.post(f"{server.url}/v1/completions", headers=server.headers(), content=b"{not json", timeout=HANG_S)
    assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]["message"]
    reply = httpx2.post(f"{server.url}/v1/embeddings", headers=server.headers(), json={}, timeout=HANG_S)
    assert reply.status_code == 404 and reply.json()["error"]["code"] == 404


def test_metrics_count_requests_and_tokens(server, client):
    before = server.metrics()
    client.completions.create(model="tiny", prompt="Count me", max_tokens=3, temperature=0)
    after = server.metrics()
    done = 'deepinfer_requests_total{endpoint="/v1/completions",status="200"}'
    assert after[done] == before.get(done, 0) + 1
    assert after["deepinfer_generation_tokens_total"] >= before["deepinfer_generation_tokens_total"] + 3
    assert after["deepinfer_kv_cache_usage_ratio"] == 0 and after["deepinfer_num_requests_running"] == 0
    assert after["deepinfer_step_seconds_count"] > before["deepinfer_step_seconds_count"]
