"""A load from a KV tier holds back only the request that waits for it: the running batch keeps stepping while a
slow store answers (driven by events, not by time); an aborted load gives its blocks back; the CLI flags and the
server's metrics name the tiers."""

from __future__ import annotations

import threading
from contextlib import nullcontext

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.cli.main import main
from deepinfer.engine.sequence import SequenceStatus
from deepinfer.kv_tiers.host_store import HostStore

from waits import HANG_S

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


class GatedStore(HostStore):
    """A store whose reads wait until the test opens the gate: a remote store that answers late."""

    def __init__(self):
        super().__init__(1 << 30)
        self.gate = threading.Event()
        self.reading = threading.Event()

    def get(self, key):
        self.reading.set()
        assert self.gate.wait(HANG_S), "the test never opened the gate"
        return super().get(key)


@pytest.fixture
def gated(monkeypatch):
    store = GatedStore()
    import deepinfer.kv_tiers.open_store as open_store_mod

    monkeypatch.setattr(open_store_mod, "open_store", lambda url, **options: store)
    return store


def prompt(seed: int, length: int = 70) -> list[int]:
    return torch.randint(0, 1000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def llm_with(store_url: str = "gated://", **kw) -> LLM:
    return LLM(model="tiny-v3", backend="reference", num_kv_blocks=40, max_num_seqs=2, announce=False, kv_store_url=store_url, **kw)


def test_the_batch_steps_while_a_request_waits_for_a_slow_store(gated):
    llm = llm_with()
    engine = llm.engine
    stored = prompt(1)
    gated.gate.set()
    llm.generate([{"prompt_token_ids": stored}], GREEDY, use_tqdm=False)  # its blocks reach the store
    assert llm.kv_tier_stats()["store"]["stores"] == 4
    engine.reset_prefix_cache()  # off the device: only the store has them
    runner = engine.add_request(prompt(2), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    while runner.status is not SequenceStatus.RUNNING:  # its lookup (a miss) and its prefill
        engine.step()
    gated.gate.clear()
    gated.reading.clear()
    waiter = engine.add_request(stored, GREEDY)
    before = len(runner.token_ids)
    for _ in range(5):
        engine.step()
    assert gated.reading.is_set() and waiter.status is SequenceStatus.WAITING  # its prefix is still being read
    assert len(runner.token_ids) == before + 5  # the batch did not wait for it
    gated.gate.set()
    while waiter.status is not SequenceStatus.FINISHED:
        engine.step()
    assert waiter.num_cached_tokens == 64 and llm.kv_tier_stats()["store"]["hit_blocks"] == 4
    plain = LLM(model="tiny-v3", backend="reference", num_kv_blocks=40, announce=False)
    assert waiter.output_token_ids == plain.generate([{"prompt_token_ids": stored}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_an_aborted_load_gives_its_blocks_back(gated):
    llm = llm_with()
    engine = llm.engine
    stored = prompt(3)
    gated.gate.set()
    llm.generate([{"prompt_token_ids": stored}], GREEDY, use_tqdm=False)
    engine.reset_prefix_cache()
    gated.gate.clear()
    gated.reading.clear()
    opener = threading.Thread(target=lambda: gated.reading.wait(HANG_S) and gated.gate.set())
    opener.start()
    waiter = engine.add_request(stored, GREEDY)
    engine.step()  # nothing else can run: the engine waits for the store, which answers once it was asked
    opener.join()
    while engine.tiers.busy():
        engine.step()
    assert waiter.status is SequenceStatus.WAITING  # loaded, not admitted yet
    assert engine.abort(waiter)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # its loaded blocks are free again (still cached)
    again = engine.add_request(stored, GREEDY)
    while again.status is not SequenceStatus.FINISHED:
        engine.step()
    assert again.num_cached_tokens == 64  # the aborted load's blocks stayed in the device cache


def test_the_run_summary_names_the_tiers(tmp_path, capsys):
    argv = ["run", "--backend", "reference", "--no-progress", "--num-kv-blocks", "64", "--max-tokens", "2", "--prompt", "Hello there",
            "--kv-offload-cpu-gib", "0.01", "--kv-offload-dir", str(tmp_path / "kv")]  # fmt: skip
    assert main(argv) == 0
    summary = capsys.readouterr().err
    assert "kv tiers" in summary and "host: " in summary and "disk: " in summary


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--kv-offload-cpu-gib", "0"], "--kv-offload-cpu-gib must be > 0"),
        (["--kv-offload-disk-gib", "4"], "--kv-offload-disk-gib sizes the disk tier: give --kv-offload-dir too"),
        (["--kv-offload-ttl", "60"], "--kv-offload-ttl is the lifetime"),
        (["--kv-offload-cpu-gib", "1", "--no-prefix-caching"], "do not combine with --no-prefix-caching"),
        (["--kv-store-url", "nosuch://x"], "unknown KV store"),
    ],
)
def test_bad_tier_flags_are_one_line(flags, needle, capsys):
    assert main(["run", "--backend", "reference", "--no-progress", "--prompt", "Hi", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_metrics_show_each_tier():
    from deepinfer.serve.metrics import ServeMetrics

    metrics = ServeMetrics()
    assert b"deepinfer_kv_tier" not in metrics.text()
    llm = LLM(model="tiny-v3", backend="reference", num_kv_blocks=20, max_num_seqs=2, announce=False, kv_offload_cpu_gib=0.01)
    llm.generate([{"prompt_token_ids": prompt(s)} for s in range(6)] * 2, GREEDY, use_tqdm=False)
    metrics.kv_tiers(llm.kv_tier_stats())
    text = metrics.text().decode()
    for name in ("hit_blocks_total", "hit_bytes_total", "loads_total", "stores_total", "evictions_total", "expired_total", "errors_total"):
        assert f'deepinfer_kv_tier_{name}{{tier="host"}}' in text, name
    assert 'deepinfer_kv_tier_entries{tier="host"}' in text
    hits = next(line for line in text.splitlines() if line.startswith('deepinfer_kv_tier_hit_blocks_total{tier="host"}'))
    assert float(hits.split()[-1]) > 0


class GatedCopies:
    """The tiers' copies as on an accelerator, whose completion the test decides: `done` gives events that complete
    when the test opens them (the copies themselves run at once, on the CPU)."""

    pinned = False

    def __init__(self):
        self.events = []

    def on(self, name):
        return nullcontext()

    def done(self, name):
        event = GatedEvent()
        self.events.append(event)
        return event

    def open_all(self):
        for event in self.events:
            event.complete = True


class GatedEvent:
    def __init__(self):
        self.complete = False

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.complete = True  # a wait: the copy is done when it returns


def test_copies_in_flight_hold_up_no_step():
    llm = LLM(model="tiny-v3", backend="reference", num_kv_blocks=40, max_num_seqs=2, announce=False, kv_offload_cpu_gib=0.01)
    engine, tiers = llm.engine, llm.engine.tiers
    tiers.copies = copies = GatedCopies()
    runner = engine.add_request(prompt(5), SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    first = engine.add_request(prompt(6), GREEDY)
    while first.status is not SequenceStatus.FINISHED:
        engine.step()
    keys = [tiers.namespace.key(first.block_hash(i, 16)) for i in range(4)]
    assert all(k in tiers.host.pending for k in keys)  # copied out on its own stream, not complete yet
    before = len(runner.token_ids)
    for _ in range(3):
        engine.step()
    assert len(runner.token_ids) == before + 3 and all(k in tiers.host.pending for k in keys)  # steps went on
    copies.open_all()
    engine.step()
    assert all(k in tiers.host.entries for k in keys)  # the next poll found the copies complete
    bm = engine.block_manager
    bm.release_loaded(bm.take_blocks(bm.num_free_blocks))  # evict every cached block the requests do not hold
    again = engine.add_request(prompt(6), GREEDY)
    engine.step()
    assert again.status is SequenceStatus.WAITING and copies.events[-1].complete is False  # its blocks are being copied in
    before = len(runner.token_ids)
    for _ in range(3):
        engine.step()
    assert len(runner.token_ids) == before + 3 and again.status is SequenceStatus.WAITING  # the batch did not wait for the load
    copies.open_all()
    while again.status is not SequenceStatus.FINISHED:
        engine.step()
    assert again.num_cached_tokens == 64 and again.output_token_ids == first.output_token_ids
    assert tiers.timing.stalls == 0 and tiers.timing.stalled_s == 0.0 and tiers.timing.engine_s > 0  # no step blocked on a copy


def test_copies_go_in_chunks_and_bound_the_staging_in_flight(monkeypatch):
    from deepinfer.kv_tiers import tiered_cache

    llm = LLM(model="tiny-v3", backend="reference", num_kv_blocks=40, max_num_seqs=2, announce=False, kv_offload_cpu_gib=0.01)
    engine, tiers = llm.engine, llm.engine.tiers
    block = tiers.rows.block_bytes
    monkeypatch.setattr(tiered_cache, "CHUNK_BYTES", block)  # one block a chunk
    monkeypatch.setattr(tiered_cache, "IN_FLIGHT_BYTES", 2 * block)  # two chunks waiting for their copy at most
    tiers.copies = copies = GatedCopies()
    runner = engine.add_request(prompt(7), SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    first = engine.add_request(prompt(8), GREEDY)
    while first.status is not SequenceStatus.FINISHED:
        engine.step()
    assert len(copies.events) == 4 and [e.complete for e in copies.events] == [True, True, False, False]  # the engine waited for two
    assert tiers.timing.stalls == 2  # and counted those waits as stalls of a step
    assert len(tiers.offloads) == 2 and all(off.staging.shape[0] == 1 for off in tiers.offloads)
    copies.open_all()
    bm = engine.block_manager
    engine.step()
    bm.release_loaded(bm.take_blocks(bm.num_free_blocks))  # evict every cached block the requests do not hold
    again = engine.add_request(prompt(8), GREEDY)
    while again.status is not SequenceStatus.FINISHED:
        copies.open_all()
        engine.step()
    assert runner.status is SequenceStatus.RUNNING and again.num_cached_tokens == 64 and again.output_token_ids == first.output_token_ids


def test_a_load_copies_runs_of_consecutive_host_rows_and_the_stores_rows_at_once():
    """_copy_in's sources: one copy per run of consecutive host-tier rows, one for the stores' contiguous rows, each
    block's row in its place."""
    from types import SimpleNamespace

    from deepinfer.kv_tiers.tiered_cache import KVTiers, _Fetch

    host_rows = torch.arange(10 * 4, dtype=torch.uint8).view(10, 4)
    stored = torch.arange(100, 100 + 3 * 4, dtype=torch.uint8).view(3, 4)
    fetch = _Fetch(hashes=[], blocks=8, device_hit=[], host_rows=[5, 6, 7, 2, 3])
    fetch.rows = stored
    tiers = SimpleNamespace(host=SimpleNamespace(rows=host_rows))
    expected = torch.cat([host_rows[[5, 6, 7, 2, 3]], stored])
    for start, end in ((0, 8), (1, 6), (4, 7)):
        runs = list(KVTiers._runs(tiers, fetch, start, end))
        assert [(lo, hi) for lo, hi, _ in runs][0][0] == start and runs[-1][1] == end
        assert torch.equal(torch.cat([source for _, _, source in runs]), expected[start:end])
    assert [(lo, hi) for lo, hi, _ in KVTiers._runs(tiers, fetch, 0, 8)] == [(0, 3), (3, 5), (5, 8)]
