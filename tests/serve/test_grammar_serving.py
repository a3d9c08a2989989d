"""Structured output in `deepinfer serve` (issue 38): a grammar compiling never stops the requests
already streaming (the engine thread goes on stepping while the compile runs elsewhere), and a
hostile grammar (nested past llguidance's reader, deep enough to crash its compiler, matching
nothing, too big) fails its own request with a one-line 400 while the server runs on."""

from __future__ import annotations

import queue
import sys
import threading

import httpx2
import pytest

from deepinfer import SamplingParams
from deepinfer.serve.engine_loop import EngineLoop, Job

from hostile_grammars import CRASHED_BEFORE, CRASHES_THE_CHECK, UNSATISFIABLE, nested_schema
from serve.server_process import ServerProcess


@pytest.fixture(scope="module")
def llm(cache):
    from deepinfer import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE", str(cache))
        return LLM(backend="reference", num_kv_blocks=64, max_model_len=256, announce=False)


def streamed(llm, prompt: str, params: SamplingParams) -> tuple[Job, queue.Queue]:
    updates: queue.Queue = queue.Queue()
    return Job(llm.make_requests([prompt], params), updates.put, stream=True), updates


GUARD_S = 600  # how long an update may take before the engine counts as dead (it never answers then): no timing


def final(updates: queue.Queue):
    while (update := updates.get(timeout=GUARD_S)).kind == "tokens":
        pass
    return update


def test_a_running_stream_keeps_its_steps_while_a_grammar_compiles(llm, monkeypatch):
    """The first structured request stopped a running stream for 3.9 s (15 s under load): here its
    compile is held on purpose, and the stream receives token after token meanwhile; nothing of it
    runs on the engine thread, and no step imports llguidance.torch (3.2 s of torch.compile)."""
    from deepinfer.engine.grammar_sandbox import GrammarSandbox

    entered, release, compiling = threading.Event(), threading.Event(), []

    def held(self, spec, timeout_s, _original=GrammarSandbox.translate):
        compiling.append(threading.current_thread())
        entered.set()
        release.wait()
        return _original(self, spec, timeout_s)

    monkeypatch.setattr(GrammarSandbox, "translate", held)
    monkeypatch.delitem(sys.modules, "llguidance.torch", raising=False)
    loop = EngineLoop(llm, max_queue=8)
    loop.start()
    try:
        free, free_updates = streamed(llm, "Hello there", SamplingParams(max_tokens=80, ignore_eos=True, temperature=0))
        loop.submit(free)
        assert free_updates.get(timeout=GUARD_S).kind == "tokens"
        choice, choice_updates = streamed(llm, "Answer:", SamplingParams(max_tokens=8, structured_outputs={"choice": ["yes", "no"]}))
        loop.submit(choice)
        entered.wait()
        for _ in range(10):  # ten steps of the stream while the compile is held
            assert free_updates.get(timeout=GUARD_S).kind == "tokens"
        assert not release.is_set() and choice_updates.empty() and loop._thread not in compiling
        release.set()
        done = final(choice_updates)
        assert done.kind == "done" and done.outputs[0].outputs[0].text in ("yes", "no")
        done = final(free_updates)
        assert done.kind == "done" and len(done.outputs[0].outputs[0].token_ids) == 80
        assert "llguidance.torch" not in sys.modules
    finally:
        release.set()
        loop.stop(0)
        loop.join(30)
    assert loop.error is None


@pytest.fixture(scope="module")
def server(cache):
    server = ServerProcess("--backend", "reference", "--num-kv-blocks", "64", "--max-model-len", "160", cache=cache)
    yield server
    code, err = server.stop()
    assert code == 0 and "Traceback" not in err, err


def complete(server, **body) -> httpx2.Response:
    return httpx2.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 4, **body}, timeout=GUARD_S)


HOSTILE = [
    pytest.param({"structured_outputs": {"json": nested_schema(400), "disable_additional_properties": True}},
                 "nests objects and arrays more than 100 levels deep", id="nested-400"),
    pytest.param({"structured_outputs": {"grammar": CRASHES_THE_CHECK["lark_20000"]}},
                 "grammar: llguidance's compiler crashed on it (signal SIGSEGV): it is too deeply nested or too big; simplify it", id="lark-20000"),
    pytest.param({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": CRASHES_THE_CHECK["refs_4000"]}}},
                 "json: llguidance's compiler crashed on it (signal SIGSEGV)", id="refs-4000"),
    *(pytest.param({"structured_outputs": fields}, f"{next(iter(fields))} matches nothing: no output satisfies it", id=f"nothing-{next(iter(fields))}")
      for fields in UNSATISFIABLE),
]  # fmt: skip
TOO_BIG = {"structured_outputs": {"choice": [f"option number {i}" for i in range(100_000)]}}


@pytest.mark.parametrize("body, needle", HOSTILE)
def test_a_hostile_grammar_fails_its_request_alone(server, body, needle):
    answer = complete(server, **body)
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == "structured_outputs" and needle in error["message"], error
    assert "\n" not in error["message"] and "backtrace" not in error["message"]
    assert complete(server).status_code == 200 and httpx2.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("body", [
    {"structured_outputs": {"grammar": CRASHED_BEFORE["lark_3000"]}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": CRASHED_BEFORE["refs_1000"]}}},
], ids=["lark-3000", "refs-1000"])  # fmt: skip
def test_what_crashed_the_server_before_runs(server, body):
    """The issue's own inputs (a segmentation fault of the server before) now compile and run."""
    answer = complete(server, **body)
    assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] in ("stop", "length"), answer.text


def test_a_grammar_too_big_is_refused_before_it_compiles(server):
    """A 100,000-string choice list held a compile thread 48 s, then llguidance panicked (its Rust
    backtrace in the 400): refused up front, the limit named. (It is checked with the prompt, against
    the engine, which names structured_outputs as the param.)"""
    answer = complete(server, **TOO_BIG)
    error = answer.json()["error"]
    wanted = "the structured_outputs choice is 2288890 bytes, too big to compile: the limit is 262144 (max_grammar_bytes, --max-grammar-bytes)"
    assert answer.status_code == 400 and error["message"] == wanted and error["param"] == "structured_outputs", error
    assert complete(server).status_code == 200


def test_a_request_the_engine_cannot_add_fails_alone(llm, monkeypatch):
    """Issue 38 (F1): a RecursionError while adding a request (a schema's copy) ended the engine
    thread, and every later request got 503: that request fails (500), the thread serves on."""
    add_request = llm.engine.add_request

    def add_once_broken(ids, params, *args, **kwargs):
        if params.max_tokens == 7:
            raise RecursionError("maximum recursion depth exceeded")
        return add_request(ids, params, *args, **kwargs)

    monkeypatch.setattr(llm.engine, "add_request", add_once_broken)
    loop = EngineLoop(llm, max_queue=8)
    loop.start()
    try:
        broken, broken_updates = streamed(llm, "Hello", SamplingParams(max_tokens=7))
        loop.submit(broken)
        failed = final(broken_updates)
        assert (failed.kind, failed.status) == ("failed", 500)
        assert failed.message == "the engine could not take the request: RecursionError: maximum recursion depth exceeded"
        fine, fine_updates = streamed(llm, "Hello", SamplingParams(max_tokens=3, ignore_eos=True))
        loop.submit(fine)
        assert final(fine_updates).kind == "done" and loop.alive
    finally:
        loop.stop(0)
        loop.join(30)
    assert loop.error is None
