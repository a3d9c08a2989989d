"""The engine thread of `deepinfer serve` without HTTP (deepinfer.serve.engine_loop): the bounded
queue refuses what does not fit, a job past its deadline is aborted with a 408 update and its pages
freed, stop() aborts what is unfinished with a final 503 update and refuses new jobs; and the
command's usage errors are one line with exit code 2 (the serve extra missing, a bad flag, a port
already taken, with --ep N too, and experts that do not divide over the ranks), no rank started."""

from __future__ import annotations

import queue
import socket
import time

import pytest

from deepinfer import SamplingParams
from deepinfer.serve.engine_loop import EngineLoop, Job, QueueFull, ShuttingDown, TooLarge

from waits import HANG_S


@pytest.fixture(scope="module")
def llm(cache):
    from deepinfer import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE", str(cache))
        return LLM(backend="reference", num_kv_blocks=64, max_model_len=256, announce=False)


def job(llm, max_tokens: int, stream=False, deadline=None, n=1):
    updates: queue.Queue = queue.Queue()
    prompts = llm.make_requests(["Hello there"], SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0, n=n))
    return Job(prompts, updates.put, stream, deadline), updates


def final(updates: queue.Queue):
    while True:
        update = updates.get(timeout=HANG_S)
        if update.kind != "tokens":
            return update


def test_the_queue_is_bounded(llm):
    loop = EngineLoop(llm, max_queue=2)
    loop._thread.start = lambda: None  # never started: the inbox only fills
    loop._thread.is_alive = lambda: True
    loop.submit(job(llm, 2)[0])
    loop.submit(job(llm, 2)[0])
    with pytest.raises(QueueFull, match=r"queue is full \(2 sequences wait for the engine, --max-queue 2\)"):
        loop.submit(job(llm, 2)[0])


def test_the_queue_counts_samples(llm):
    """A request of n samples weighs n (one of "n": 1000000 filled the server while counting as
    one); a request bigger than the whole queue could never be taken: TooLarge (a 400), not QueueFull."""
    loop = EngineLoop(llm, max_queue=5)
    loop._thread.start = lambda: None  # never started: the inbox only fills
    loop._thread.is_alive = lambda: True
    loop.submit(job(llm, 2, n=3)[0])
    with pytest.raises(QueueFull, match=r"\(3 sequences wait"):
        loop.submit(job(llm, 2, n=3)[0])
    with pytest.raises(TooLarge, match=r"makes 6 sequences"):
        loop.submit(job(llm, 2, n=6)[0])


def test_deadline_and_stop(llm):
    loop = EngineLoop(llm, max_queue=8)
    loop.start()
    try:
        quick, quick_updates = job(llm, 3)
        loop.submit(quick)
        done = final(quick_updates)
        assert done.kind == "done" and len(done.outputs[0].outputs[0].token_ids) == 3
        late, late_updates = job(llm, 200, stream=True, deadline=time.monotonic())  # due at once: aborted after its first step, at any speed
        loop.submit(late)
        update = final(late_updates)
        assert update.kind == "aborted" and update.status == 408 and "--request-timeout" in update.message
        assert [d.final.finish_reason for d in update.deltas if d.final is not None] == ["abort"]
        long, long_updates = job(llm, 200, stream=True)
        loop.submit(long)
        assert long_updates.get(timeout=HANG_S).kind == "tokens"  # it runs
        loop.stop(0)
        update = final(long_updates)
        assert update.kind == "aborted" and update.status == 503 and "shutting down" in update.message
        with pytest.raises(ShuttingDown):
            loop.submit(job(llm, 2)[0])
        loop.join(HANG_S)
        assert not loop.alive and loop.error is None
        assert not llm.engine.has_unfinished() and llm.engine.block_manager.num_free_blocks == llm.engine.num_kv_blocks
    finally:
        loop.stop(0)
        loop.join(HANG_S)


def test_usage_errors_are_one_line(capsys, monkeypatch, cache):
    import importlib.util

    from deepinfer.cli.main import main

    def one_line(argv, needle):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("deepinfer: error: ") and needle in err, err

    one_line(["serve", "--port", "70000"], "--port must lie in [0, 65535]")
    one_line(["serve", "--max-queue", "0"], "--max-queue must be >= 1")
    one_line(["serve", "--request-timeout", "0"], "--request-timeout must be > 0")
    one_line(["serve", "--max-request-bytes", "0"], "--max-request-bytes must be >= 1")
    # A key no client could send (the server strips the spaces around the key it gets; headers are ASCII) was accepted.
    one_line(["serve", "--api-key", " spaced "], "--api-key holds a space")
    one_line(["serve", "--api-key", "cl\u00e9"], "--api-key holds U+00E9, which is not printable ASCII")
    monkeypatch.setenv("DEEPINFER_CACHE", str(cache))
    # --ep N: checked once by the launcher, before any rank starts.
    one_line(["serve", "--ep", "3", "--backend", "reference"], "16 routed experts + 0 redundant = 16 experts per layer do not divide over --ep 3 ranks")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        one_line(["serve", "--backend", "reference", "--port", str(taken.getsockname()[1])], "cannot listen on 127.0.0.1:")
        one_line(["serve", "--ep", "2", "--backend", "reference", "--port", str(taken.getsockname()[1])], "cannot listen on 127.0.0.1:")
    finally:
        taken.close()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    one_line(["serve"], "deepinfer serve needs uvicorn: pip install 'deepinfer[serve]'")


def test_serve_help_names_no_other_command_in_its_headings(capsys):
    """serve --help's engine heading said "shared by run and run-batch"."""
    from deepinfer.cli.main import main

    with pytest.raises(SystemExit):
        main(["serve", "--help=all"])
    out = capsys.readouterr().out
    headings = [line for line in out.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    summaries = [line.strip() for line in out.splitlines() if line.startswith("  ") and not line.strip().startswith("-")]
    assert "engine:" in headings and "server:" in headings, headings
    assert not any("run-batch" in line or "run and" in line for line in headings + summaries[:40]), headings
