"""`deepinfer bench prefix-reuse` on the CPU: a tiny V2-shaped model on the reference backend, a workload whose working
set is three times the device pool. Every configuration keeps the device-only run's greedy tokens (deterministic
mode), the host tier serves hits that the device pool lost and saves prefill work, the restart process finds the
first process's blocks on disk, the unbounded pool reaches exactly what the workload offers in full blocks, and the
JSON holds every figure. No timing is asserted (CPU timings mean nothing)."""

from __future__ import annotations

import contextlib
import json

import pytest

from deepinfer.bench import prefix_reuse
from deepinfer.bench.prefix_reuse_model import ModelSpec
from deepinfer.bench.prefix_reuse_workload import Workload
from deepinfer.cli.main import main

from tiny_shapes import TINY_V2

WORKLOAD = dict(conversations=6, turns=3, prompt_len=40, turn_tokens=12, output_len=6, seed=0)
ROW_FIELDS = {"config", "label", "num_kv_blocks", "tiers", "requests", "prompt_tokens", "cached_tokens", "hit_rate", "tokens_by_tier", "rate_by_tier",
              "prefill_tokens_computed", "prefill_vs_device", "ttft_ms", "ttft_hit_ms", "ttft_miss_ms", "output_tokens", "output_tokens_per_s",
              "wall_s", "outputs_equal", "outputs_differ", "preemptions", "tier_stats", "steps", "tier_timing", "per_request"}  # fmt: skip


def test_every_configuration_on_a_working_set_three_times_the_pool(tmp_path):
    out = tmp_path / "reuse.json"
    spec = ModelSpec(shape="v2-lite", backend="reference", layers=2, deterministic=True, config_overrides=TINY_V2)
    report = prefix_reuse.run(spec, WORKLOAD, working_set_multiple=3.0, max_num_batched_tokens=256, json_path=out, progress=lambda line: None)
    rows = {r["config"]: r for r in report["results"]}
    assert list(rows) == list(prefix_reuse.CONFIGS)
    workload = Workload(vocab_size=TINY_V2["vocab_size"], **WORKLOAD)
    block_size = report["settings"]["block_size"]
    assert report["settings"]["num_kv_blocks"] * 3 == workload.working_set_blocks(block_size) == report["workload"]["working_set_blocks"]
    for row in rows.values():
        assert row["requests"] == 18 and row["outputs_equal"] == 18 and row["outputs_differ"] == 0, row["label"]
        assert row["prompt_tokens"] == workload.total_prompt_tokens
        assert sum(row["tokens_by_tier"].values()) == row["cached_tokens"]
    device, host, disk, restart, unbounded = (rows[c] for c in prefix_reuse.CONFIGS)
    assert host["tokens_by_tier"]["host"] > 0 and host["prefill_tokens_computed"] < device["prefill_tokens_computed"]
    assert disk["tokens_by_tier"]["host"] > 0 and disk["prefill_tokens_computed"] < device["prefill_tokens_computed"]
    assert set(disk["tier_stats"]) == {"host", "disk"} and disk["tier_stats"]["disk"]["stores"] > 0
    assert set(restart["tier_stats"]) == {"disk"} and restart["tokens_by_tier"]["disk"] > 0 and restart["tokens_by_tier"]["host"] == 0
    assert restart["tier_stats"]["disk"]["hit_blocks"] * block_size == restart["tokens_by_tier"]["disk"]
    assert any(r["turn"] == 0 and r["cached_tokens"] > 0 for r in restart["per_request"])  # a first turn hits: the first process's blocks
    assert unbounded["hit_rate"] == workload.reusable_rate(block_size) and unbounded["tier_stats"] is None  # a pool that never evicts
    assert device["hit_rate"] < unbounded["hit_rate"] and device["prefill_vs_device"] == 1.0
    # the host tier holds the working set: every hit an unbounded pool gets, the tiers give (nothing lost to evictions
    # of a device hit before admission, or to blocks held for loads); a restart finds the first process's blocks too
    assert host["hit_rate"] == disk["hit_rate"] == unbounded["hit_rate"]
    assert restart["hit_rate"] == workload.reusable_rate(block_size, previous_run=True)
    assert prefix_reuse.notes(report) == []
    data = json.loads(out.read_text())
    assert data["kind"] == "prefix-reuse" and data["machine"]["backend"] == "reference" and data["machine"]["deterministic"] is True
    assert {"device", "torch", "date", "model", "layers", "dtype", "kv_cache_dtype", "cpu", "cpu_threads"} <= set(data["machine"])
    assert {"num_kv_blocks", "unbounded_blocks", "max_concurrency", "kv_offload_cpu_gib", "kv_offload_disk_gib", "block_size", "block_bytes",
            "working_set_multiple", "submission", "configs"} <= set(data["settings"])  # fmt: skip
    assert {"reuse_rate", "reusable_rate", "reusable_rate_after_a_run", "working_set_blocks", "prompt_tokens", "requests"} <= set(data["workload"])
    for row in data["results"]:
        assert set(row) == ROW_FIELDS and set(row["ttft_ms"]) == {"p50", "p99", "mean", "max"} and len(row["per_request"]) == 18
        assert set(row["tokens_by_tier"]) == set(row["rate_by_tier"]) == {"device", "host", "disk", "store"}
        for key, value in row.items():
            assert value is not None or (key in ("tier_stats", "tier_timing") and row["config"] in ("device", "unbounded")), (row["config"], key)
        assert row["steps"] > 0
        later = [r for r in row["per_request"] if r["turn"] > 0]
        assert row["ttft_hit_ms"]["requests"] == sum(r["cached_tokens"] > 0 for r in later)
        assert row["ttft_hit_ms"]["requests"] + row["ttft_miss_ms"]["requests"] == len(later) == 12
        if row["tier_timing"] is not None:  # the engine thread's time in the tiers is counted (on the CPU the copies are in it)
            assert set(row["tier_timing"]) == {"engine_s", "stalled_s", "stalls", "idle_s"} and row["tier_timing"]["engine_s"] > 0
            assert row["tier_timing"]["stalls"] == 0  # copies are synchronous here: nothing is left in flight to stall on
    table = prefix_reuse.format_report(report)
    assert all(label in table for label in ("device", "+host", "+host+disk", "restart", "unbounded")) and "18/18" in table
    assert "step ms  tiers ms/step  stalls  equal" in table and "TTFT p50 / p99 ms of the requests with a prefix hit" in table


def test_the_workload_grows_each_conversation_by_appending():
    w = Workload(conversations=3, turns=3, prompt_len=10, turn_tokens=4, output_len=2, vocab_size=100, seed=5)
    assert w.order() == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    state, again = w.conversations_state(), w.conversations_state()
    first = state.prompt(0, 1)
    assert first == again.prompt(0, 1) and len(first) == 10 and first != state.prompt(0, 0)  # the seed decides, each conversation its own
    with pytest.raises(RuntimeError, match="before turn 1 finished"):
        state.prompt(1, 1)
    state.record(0, 1, [7, 8])
    second = state.prompt(1, 1)
    assert second[:12] == first + [7, 8] and len(second) == w.prompt_tokens(1) == 16
    assert w.longest == 22 + 2 and w.total_prompt_tokens == 3 * (10 + 16 + 22)
    assert w.reuse_rate() == pytest.approx((12 + 18) / 48)  # turn 2 reuses 10 + 2, turn 3 16 + 2
    # blocks of 4: turn 2 (16 tokens) may hit 11 computed tokens -> 2 blocks; turn 3 (22) 17 -> 4 blocks
    assert w.reusable_tokens(0, 4) == 0 and w.reusable_tokens(1, 4) == 8 and w.reusable_tokens(2, 4) == 16
    assert w.reusable_tokens(0, 4, previous_run=True) == 8  # a rerun: all but the block holding the prompt's last token
    assert w.working_set_blocks(4) == 3 * 6


def test_the_command_line_runs_and_writes_its_json(tmp_path, monkeypatch, capsys):
    from deepinfer.bench import e2e

    tiny = {**TINY_V2, "num_hidden_layers": 2}  # this process's shape (the restart process would not see it)
    monkeypatch.setattr(e2e, "V2_LITE", {**e2e.V2_LITE, **tiny})
    monkeypatch.setattr(e2e, "V2_LITE_LONG_CONTEXT", {**e2e.V2_LITE_LONG_CONTEXT, **tiny})
    out = tmp_path / "reuse.json"
    argv = ["bench", "prefix-reuse", "--backend", "reference", "--configs", "device,host", "--conversations", "4", "--turns", "2", "--prompt-len", "40",
            "--turn-tokens", "8", "--output-len", "4", "--working-set-multiple", "2", "--max-num-batched-tokens", "256", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "+host" in printed and "2.00x the pool" in printed and "8/8" in printed
    data = json.loads(out.read_text())
    assert [r["config"] for r in data["results"]] == ["device", "host"] and data["settings"]["working_set_multiple"] == 2.0


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--model-shape", "v41-flash"], "does not build the DeepSeek-V4.1 shape yet"),
        (["--configs", "device,restart"], "restart replays the disk tier the disk configuration fills: add disk"),
        (["--configs", "device,device"], "--configs lists distinct configurations of device, host, disk, restart, unbounded"),
        (["--turns", "0"], "--turns must be at least 1, not 0"),
        (["--working-set-multiple", "-1"], "--working-set-multiple must be > 0"),
        (["--num-kv-blocks", "8", "--kv-cache-gib", "1"], "not allowed with argument --num-kv-blocks"),
        (["--prompt-len", "163840"], "exceed the v2-lite shape's 163840 positions"),
        (["--kv-offload-dir", "/"], "give an empty or new folder"),
        (["--kv-offload-disk-gib", "1", "--configs", "device,host"], "--kv-offload-disk-gib is the disk configuration's"),
    ],
)
def test_bad_flags_are_one_line(capsys, flags, needle):
    assert main(["bench", "prefix-reuse", "--backend", "reference", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_differing_outputs_are_an_error_in_deterministic_mode():
    row = {"label": "+host", "outputs_differ": 2, "requests": 18}
    (error,) = prefix_reuse.notes({"machine": {"deterministic": True}, "results": [row]})
    assert error.startswith("error: greedy tokens differ from the device-only run's in deterministic mode: +host (2 of 18)") and "bug" in error
    (warning,) = prefix_reuse.notes({"machine": {"deterministic": False}, "results": [row]})
    assert warning.startswith("warning:") and "near-ties" in warning


class LaggingCopies:
    """Copies as on an accelerator: each completes at the third look (the copies themselves run at once, on the CPU),
    so loads and offloads stay in flight across engine steps."""

    pinned = False

    class Event:
        def __init__(self):
            self.looks = 0

        def query(self) -> bool:
            self.looks += 1
            return self.looks >= 3

        def synchronize(self) -> None:
            self.looks = 3

    def on(self, name):
        return contextlib.nullcontext()

    def done(self, name):
        return self.Event()


@pytest.mark.parametrize("copies", ["synchronous", "lagging"])
def test_a_pool_of_one_long_request_still_gets_every_hit_from_the_host_tier(copies, monkeypatch):
    """The pool holds one longest request: loads take blocks in request order, later requests leave free the blocks an
    earlier load waits for, a later request holds no device hit that an earlier load or admission needs, and later
    loads' held blocks give way: no request is admitted without its prefix (on the H100 a pool of one 32k-token request
    got 8% host hits of 66% offered, before). Lagging copies keep loads in flight across steps, as on a GPU."""
    if copies == "lagging":
        from deepinfer.kv_tiers import copy_streams

        monkeypatch.setattr(copy_streams, "SyncCopies", LaggingCopies)
    workload = dict(conversations=8, turns=3, prompt_len=160, turn_tokens=16, output_len=4, seed=0)
    spec = ModelSpec(shape="v2-lite", backend="reference", layers=2, deterministic=True, config_overrides=TINY_V2)
    report = prefix_reuse.run(spec, workload, configs=("device", "host", "unbounded"), working_set_multiple=10.0, max_num_batched_tokens=256,
                              progress=lambda line: None)  # fmt: skip
    rows = {r["config"]: r for r in report["results"]}
    block_size = report["settings"]["block_size"]
    longest = Workload(vocab_size=TINY_V2["vocab_size"], **workload).longest
    assert report["settings"]["num_kv_blocks"] == -(-longest // block_size)  # the pool: one longest request
    assert rows["host"]["hit_rate"] == rows["unbounded"]["hit_rate"] > 0.6 and rows["host"]["outputs_equal"] == rows["host"]["requests"]
    assert rows["host"]["tokens_by_tier"]["host"] > 0 and rows["host"]["tier_timing"]["stalls"] == 0
