"""`deepinfer serve` under load on loopback: 64 concurrent streaming clients send 500 seeded greedy
requests against a server whose queue is bounded (--max-queue). Every
request completes or is refused with 429 and its message; none is lost or answered twice; every
completed one streams exactly the text LLM.generate gives. (Greedy tokens could differ only where a
different batch moves a logit across the gap to the runner-up: the `expected` fixture checks that
every gap of these prompts is far wider than float32 batching noise, so the comparison is exact.
Deterministic mode would make it exact by construction, at 10x the step time on the CPU.) A
client that disconnects mid-stream gets its request aborted and its KV pages freed (seen through
/metrics); SIGTERM ends the streams still running with a final event."""

from __future__ import annotations

import asyncio
import json
import time

import httpx2
import pytest

from serve.server_process import ServerProcess
from waits import HANG_S, wait_until

NUM_REQUESTS, CLIENTS, MAX_TOKENS = 500, 64, 4
PROMPTS = [f"Request number {i} says" for i in range(25)]
FLAGS = ["--backend", "reference", "--max-num-seqs", "32", "--max-queue", "48", "--num-kv-blocks", "160",
         "--max-model-len", "128", "--shutdown-timeout", "0"]  # fmt: skip


@pytest.fixture(scope="module")
def server(cache):
    server = ServerProcess(*FLAGS, cache=cache)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def expected(cache):
    """LLM.generate's texts for the prompts, greedy, seed = prompt index."""
    from deepinfer import LLM, SamplingParams

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE", str(cache))
        llm = LLM(backend="reference", num_kv_blocks=160, max_model_len=128, announce=False)
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, seed=i, logprobs=2) for i in range(len(PROMPTS))]
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    for output in outputs:
        for position in output.logprobs:
            first, second = sorted((lp.logprob for lp in position.values() if lp.rank in (1, 2)), reverse=True)
            assert first - second > 1e-3, "a greedy choice too close to call: pick other prompts"
    return [o.text for o in outputs]


async def events(response):
    """The JSON events of a server-sent event stream, until [DONE] (which must come)."""
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            return
        yield json.loads(data)
    raise AssertionError("the stream ended without [DONE]")


async def one_request(client, url: str, i: int) -> dict:
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS, "temperature": 0, "seed": i % len(PROMPTS), "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"i": i, "status": response.status_code, "error": json.loads(await response.aread())["error"]}
        ids, text, reasons = set(), "", []
        async for event in events(response):
            assert "error" not in event, event
            ids.add(event["id"])
            for choice in event["choices"]:
                text += choice["text"]
                if choice["finish_reason"] is not None:
                    reasons.append(choice["finish_reason"])
        return {"i": i, "status": 200, "ids": ids, "text": text, "reasons": reasons}


async def load(url: str) -> list[dict]:
    todo = iter(range(NUM_REQUESTS))
    results = []
    limits = httpx2.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx2.AsyncClient(timeout=HANG_S, limits=limits) as client:

        async def worker():
            for i in todo:
                results.append(await one_request(client, url, i))
                if results[-1]["status"] == 429:
                    await asyncio.sleep(0.2)  # backs off, as a client told 429 should

        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(CLIENTS))), HANG_S)
    return results


def test_500_streaming_requests_from_64_clients(server, expected):
    start = time.monotonic()
    results = asyncio.run(load(server.url))
    wall = time.monotonic() - start
    assert sorted(r["i"] for r in results) == list(range(NUM_REQUESTS))  # none lost, none twice
    done = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] != 200]
    assert all(r["status"] == 429 and "queue is full" in r["error"]["message"] and r["error"]["code"] == 429 for r in refused), refused[:3]
    assert len(done) >= NUM_REQUESTS // 2, f"{len(refused)} of {NUM_REQUESTS} refused"
    ids = [next(iter(r["ids"])) for r in done]
    assert all(len(r["ids"]) == 1 for r in done) and len(set(ids)) == len(done)  # one answer per request
    for r in done:
        assert r["reasons"] == ["length"], r
        assert r["text"] == expected[r["i"] % len(PROMPTS)], r
    metrics = server.metrics()
    assert metrics['deepinfer_requests_total{endpoint="/v1/completions",status="200"}'] == len(done)
    assert metrics.get('deepinfer_requests_total{endpoint="/v1/completions",status="429"}', 0) == len(refused)
    assert metrics["deepinfer_num_requests_running"] == 0 and metrics["deepinfer_kv_cache_usage_ratio"] == 0
    print(f"{len(done)} done, {len(refused)} refused (429) in {wall:.1f} s")


def read_events(server, body: dict, count: int):
    """Open a stream, read `count` events, return (the open response, its line iterator, the events)."""
    client = httpx2.Client(timeout=HANG_S)
    response = client.send(client.build_request("POST", f"{server.url}/v1/completions", json={**body, "stream": True}), stream=True)
    assert response.status_code == 200
    lines = response.iter_lines()
    got = []
    for line in lines:
        if line.startswith("data: "):
            got.append(line.removeprefix("data: "))
            if len(got) == count:
                break
    return client, response, lines, got


def wait_for(server, condition, what: str) -> dict:
    """The server's metrics once `condition` holds for them (polled: an event, not a time)."""
    metrics = {}

    def holds() -> bool:
        metrics.clear()
        metrics.update(server.metrics())
        return condition(metrics)

    wait_until(holds, what, server.proc)
    return metrics


def test_a_client_that_disconnects_frees_its_kv_blocks(server):
    aborted = 'deepinfer_requests_aborted_total{reason="disconnect"}'
    before = server.metrics().get(aborted, 0)
    client, response, _, got = read_events(server, {"prompt": "Tell a long story", "max_tokens": 110, "ignore_eos": True}, 2)
    assert len(got) == 2
    held = server.metrics()
    assert held["deepinfer_kv_cache_usage_ratio"] > 0 and held["deepinfer_num_requests_running"] == 1
    response.close()
    client.close()
    metrics = wait_for(server, lambda m: m.get(aborted, 0) == before + 1 and m["deepinfer_kv_cache_usage_ratio"] == 0, "the abort counted, the pages freed")
    assert metrics.get(aborted, 0) == before + 1, metrics
    assert metrics["deepinfer_kv_cache_usage_ratio"] == 0 and metrics["deepinfer_num_requests_running"] == 0


def test_sigterm_ends_running_streams_with_a_final_event(server):
    client, response, lines, got = read_events(server, {"prompt": "Another long story", "max_tokens": 110, "ignore_eos": True}, 1)
    code, err = server.stop()
    rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    client.close()
    assert rest[-1] == "[DONE]", rest
    error = json.loads(rest[-2])["error"]
    assert error["code"] == 503 and "shutting down" in error["message"]
    assert json.loads(rest[-3])["choices"][0]["finish_reason"] == "abort"
    assert code == 0, err
    with pytest.raises(httpx2.ConnectError):
        httpx2.get(f"{server.url}/health", timeout=5)
