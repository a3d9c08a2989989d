"""`deepinfer serve --ep 2` on gloo (two CPU ranks of the embedded tiny model, one HTTP front end on
rank 0): completions and chat, whole and streamed, n > 1, give the tokens one process's
LLM.generate gives (the requests are dealt to both ranks); structured output is a 400; a client
that disconnects frees the KV pages on the rank that ran its request, the other rank's request
running on (the per-rank gauges of /metrics); SIGTERM to the launcher drains through rank 0 (a
running stream ends with its final event) and stops every rank, exit code 0; a rank that dies ends
the server: its clients get a 500, the launcher prints one line naming the rank."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx2
import openai
import pytest

from serve.server_process import ServerProcess
from waits import HANG_S, wait_until

FLAGS = ["--ep", "2", "--backend", "reference", "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "160", "--shutdown-timeout", "1"]
PROMPTS = ["Hello, my name is", "The sky", "One two three", "Request number 7 says"]
HI = [{"role": "user", "content": "Say hi"}]


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.fixture(scope="module")
def server(cache):
    server = ServerProcess(*FLAGS, cache=cache)
    ranks = children(server.proc.pid)
    yield server
    if server.proc.poll() is None:
        server.stop()
    assert len(ranks) == 2


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=HANG_S)


@pytest.fixture(scope="module")
def llm(cache):
    from deepinfer import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE", str(cache))
        return LLM(backend="reference", dtype="float32", num_kv_blocks=64, max_model_len=160, announce=False)


def test_completions_and_chat_equal_one_process(server, client, llm):
    from deepinfer import SamplingParams

    # Greedy and seeded sampling, n = 2, several prompts in one request and requests in flight
    # together: both ranks run some.
    whole = client.completions.create(model="tiny-v3", prompt=PROMPTS, max_tokens=6, n=2, seed=5, temperature=0.8)
    expected = llm.generate(PROMPTS, SamplingParams(max_tokens=6, n=2, seed=5, temperature=0.8), use_tqdm=False)
    assert [c.text for c in whole.choices] == [s.text for o in expected for s in o.outputs]
    streams = [client.completions.create(model="tiny-v3", prompt=p, max_tokens=8, temperature=0, seed=i, stream=True) for i, p in enumerate(PROMPTS)]
    texts = ["".join(c.choices[0].text for c in stream if c.choices) for stream in streams]
    greedy = llm.generate(PROMPTS, [SamplingParams(max_tokens=8, temperature=0, seed=i) for i in range(len(PROMPTS))], use_tqdm=False)
    assert texts == [o.outputs[0].text for o in greedy]
    chat = client.chat.completions.create(model="tiny-v3", messages=HI, max_tokens=4, temperature=0, n=2, stream=True)
    pieces = {}
    for chunk in chat:
        for choice in chunk.choices:
            pieces[choice.index] = pieces.get(choice.index, "") + (choice.delta.content or "")
    one = llm.chat(HI, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0].outputs[0].text
    assert pieces == {0: one, 1: one}
    with pytest.raises(openai.BadRequestError, match="structured_outputs does not combine with expert parallelism"):
        client.chat.completions.create(model="tiny-v3", messages=HI, max_tokens=4, response_format={"type": "json_object"})
    metrics = server.metrics()
    assert metrics['deepinfer_requests_total{endpoint="/v1/completions",status="200"}'] == 1 + len(PROMPTS)
    assert metrics["deepinfer_generation_tokens_total"] == 4 * 2 * 6 + 8 * len(PROMPTS) + 2 * 4


def test_a_disconnect_frees_the_pages_on_its_rank(server):
    body = {"prompt": "Hello there", "max_tokens": 150, "ignore_eos": True, "temperature": 0, "stream": True}

    def rank_gauges(name: str, metrics=None) -> list[float]:
        metrics = metrics or server.metrics()
        return [metrics[f'deepinfer_rank_{name}{{rank="{r}"}}'] for r in (0, 1)]

    snapshots = []

    def one_freed() -> bool:  # the gauges below are read from the snapshot that showed it (the other request runs on)
        snapshots.append(server.metrics())
        return sorted(rank_gauges("num_requests_running", snapshots[-1])) == [0, 1]

    with httpx2.Client(timeout=HANG_S) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as first, http.stream("POST", f"{server.url}/v1/completions", json=body) as second:
            lines = [first.iter_lines(), second.iter_lines()]  # kept: an iterator dropped closes its connection
            for stream in lines:
                assert json.loads(next(line for line in stream if line.startswith("data: ")).removeprefix("data: "))["choices"]
            wait_until(lambda: rank_gauges("num_requests_running") == [1, 1], "one request on each rank", server.proc)
            assert all(ratio > 0 for ratio in rank_gauges("kv_cache_usage_ratio"))
            first.close()  # its client goes away: the request on one rank is aborted
            wait_until(one_freed, "the closed stream's rank freed", server.proc)
            running, usage = rank_gauges("num_requests_running", snapshots[-1]), rank_gauges("kv_cache_usage_ratio", snapshots[-1])
            freed = running.index(0)
            assert usage[freed] == 0 and usage[1 - freed] > 0, snapshots[-1]
            assert snapshots[-1]['deepinfer_requests_aborted_total{reason="disconnect"}'] == 1
            rest = [json.loads(line.removeprefix("data: ")) for line in lines[1] if line.startswith("data: {")]
        assert rest[-1]["choices"][0]["finish_reason"] == "length"
    wait_until(lambda: rank_gauges("kv_cache_usage_ratio") == [0, 0], "every page free", server.proc)


def test_sigterm_to_the_launcher_stops_every_rank(server):
    """A stream still running gets --shutdown-timeout (1 s), then its final error event."""
    ranks = children(server.proc.pid)
    assert len(ranks) == 2
    body = {"prompt": "Hello there", "max_tokens": 150, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx2.Client(timeout=HANG_S) as http, http.stream("POST", f"{server.url}/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        server.proc.send_signal(signal.SIGTERM)
        rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]" and "shutting down" in json.loads(rest[-2])["error"]["message"], rest[-3:]
    server.proc.wait(timeout=HANG_S)  # (a second signal would kill the ranks)
    code, err = server.stop()
    assert code == 0, err
    assert "starting 2 ranks" in err and "2 expert-parallel ranks" in err and "error" not in err, err
    assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists()], "a rank outlived the launcher"


def test_a_rank_that_dies_ends_the_server_with_one_line(cache, tmp_path):
    """Rank 1 dies (exit 7, no message) in its third step."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    from deepinfer.engine.llm_engine import LLMEngine\n"
        "    before_step = LLMEngine.before_step  # once per forward step on every rank\n"
        "    LLMEngine.before_step = lambda self: os._exit(7) if self.num_steps >= 2 else before_step(self)\n"
    )
    path = os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    server = ServerProcess(*FLAGS, cache=cache, env={"PYTHONPATH": path})
    try:
        reply = httpx2.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 20, "ignore_eos": True}, timeout=HANG_S)
        assert reply.status_code == 500 and "PeerFailure" in reply.json()["error"]["message"], reply.text
        code, err = server.proc.wait(timeout=HANG_S), server.proc.stderr.read()
    finally:
        server.stop()
    errors = [line for line in err.splitlines() if line.startswith("deepinfer: error: ")]
    assert code == 1 and len(errors) == 1 and "rank 1 exited with code 7" in errors[0] and "(logs: " in errors[0], err
    assert "Traceback" not in err, err
