"""The KV tiers behind the engine's prefix cache, end to end on the CPU (the embedded tiny DeepSeek-V3 and V4, the
reference backend): prompts whose prefixes fell out of a small device pool come back from the host tier, from the
disk tier after a restart, never from a damaged or foreign block, and greedy tokens stay those of a run without
tiers; a full disk degrades to recomputing."""

from __future__ import annotations

import errno
import logging

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.sampling_params import InvalidRequestError

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
BLOCKS = 20  # 16-token blocks: two requests of 5 blocks run at once, six prompts of 4 full blocks do not stay cached


def prompts(count: int = 6, length: int = 70, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(0, 1000, (length,), generator=g).tolist()} for _ in range(count)]


def engine(model: str = "tiny-v3", **tiers) -> LLM:
    return LLM(model=model, backend="reference", num_kv_blocks=BLOCKS, max_num_seqs=2, announce=False, **tiers)


def twice(llm: LLM, batch: list[dict]) -> tuple[list, list, list]:
    """Greedy tokens of two rounds of the same prompts, and each round's num_cached_tokens."""
    first = llm.generate(batch, GREEDY, use_tqdm=False)
    second = llm.generate(batch, GREEDY, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in first + second]
    return tokens, [o.num_cached_tokens for o in first], [o.num_cached_tokens for o in second]


@pytest.fixture(scope="module")
def plain_v3():
    """Tokens and cached counts without tiers: the device pool alone keeps only the last prompts' blocks."""
    return twice(engine(), prompts())


def test_the_host_tier_brings_back_what_the_device_pool_dropped(plain_v3):
    tokens, _, second = plain_v3
    assert second == [0] * 6  # each prompt's blocks were evicted before its turn came again
    llm = engine(kv_offload_cpu_gib=0.01)
    got, first, again = twice(llm, prompts())
    assert got == tokens and first == [0] * 6
    assert again == [64] * 6  # every full block but the last token's came back from host memory
    host = llm.kv_tier_stats()["host"]
    assert host["hit_blocks"] == 24 and host["loads"] == 6 and host["hit_bytes"] == 24 * llm.engine.tiers.rows.block_bytes
    assert host["stores"] >= 24 and host["errors"] == 0


def test_overlap_scheduling_loads_the_same(plain_v3):
    llm = engine(kv_offload_cpu_gib=0.01, overlap=True)
    got, _, again = twice(llm, prompts())
    assert got == plain_v3[0] and again == [64] * 6


def test_a_restart_reads_the_disk_tier(tmp_path, plain_v3):
    first = engine(kv_offload_dir=str(tmp_path))
    tokens = [o.outputs[0].token_ids for o in first.generate(prompts(), GREEDY, use_tqdm=False)]
    assert first.kv_tier_stats()["disk"]["stores"] == 24
    del first
    restarted = engine(kv_offload_dir=str(tmp_path))  # a new engine: nothing on its device, everything on disk
    outs = restarted.generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == tokens == plain_v3[0][:6]
    assert [o.num_cached_tokens for o in outs] == [64] * 6
    disk = restarted.kv_tier_stats()["disk"]
    assert disk["hit_blocks"] == 24 and disk["loads"] == 6 and disk["stores"] == 0  # found there: not written again


def test_damaged_blocks_are_recomputed_never_used(tmp_path, plain_v3, caplog):
    first = engine(kv_offload_dir=str(tmp_path))
    first.generate(prompts(), GREEDY, use_tqdm=False)
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file() and not p.name.startswith("."))
    assert len(files) >= 24
    for i, path in enumerate(files):
        data = bytearray(path.read_bytes())
        if i % 2:
            data[len(data) // 2] ^= 0xFF  # a flipped bit
        else:
            data = data[: len(data) // 3]  # truncated
        path.write_bytes(bytes(data))
    restarted = engine(kv_offload_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING):
        outs = restarted.generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain_v3[0][:6]
    assert [o.num_cached_tokens for o in outs] == [0] * 6
    disk = restarted.kv_tier_stats()["disk"]
    assert disk["hit_blocks"] == 0 and disk["corrupt"] >= 6  # each request's first block was found damaged, and dropped


def test_another_models_blocks_are_a_miss(tmp_path):
    engine(kv_offload_dir=str(tmp_path)).generate(prompts(), GREEDY, use_tqdm=False)
    fp8 = LLM(model="tiny-v3", backend="reference", num_kv_blocks=BLOCKS, max_num_seqs=2, announce=False, kv_cache_dtype="fp8",
              kv_offload_dir=str(tmp_path))  # fmt: skip
    outs = fp8.generate(prompts(), GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0] * 6  # same prompts, another cache format: other keys
    assert fp8.kv_tier_stats()["disk"]["hit_blocks"] == 0


def test_a_full_disk_degrades_to_recomputing(tmp_path, plain_v3, monkeypatch, caplog):
    from deepinfer.kv_tiers import disk_store

    def full(src, dst):
        if str(dst).startswith(str(tmp_path)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return replace(src, dst)

    replace = disk_store.os.replace
    monkeypatch.setattr(disk_store.os, "replace", full)
    llm = engine(kv_offload_dir=str(tmp_path), kv_offload_cpu_gib=0.01)
    with caplog.at_level(logging.WARNING):
        got, _, again = twice(llm, prompts())
    assert got == plain_v3[0] and again == [64] * 6  # the host tier still works
    stats = llm.kv_tier_stats()
    assert stats["disk"]["errors"] >= 1 and stats["disk"]["entries"] == 0 and stats["host"]["hit_blocks"] == 24
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "disk" in r.getMessage().lower()]
    assert 1 <= len(warnings) <= 2, [r.getMessage() for r in warnings]
    assert not list(tmp_path.rglob("*.kvb")) and not list(tmp_path.rglob(".tmp.*"))  # nothing half-written left behind


def test_deepseek_v4_restores_its_blocks_and_replays_the_window(tmp_path):
    """A V4 block carries each layer's window rows, compressed entries and indexer keys; the compressors' open windows
    are per sequence, rebuilt by the bounded replay of the last tokens before the hit's end."""
    batch = prompts(length=200)  # 12 full blocks, more than the 128 tokens replayed
    plain = twice(engine("tiny-v4"), batch)
    llm = engine("tiny-v4", kv_offload_cpu_gib=0.05)
    names = list(llm.engine.tiers.rows.tensors)
    assert any(n.endswith(".swa") for n in names) and any(n.endswith(".compressed") for n in names) and any(n.endswith(".index_keys") for n in names)
    got, _, again = twice(llm, batch)
    assert got == plain[0] and plain[2] == [0] * 6 and again == [192] * 6
    replay = llm.engine.block_manager.prefix_replay_tokens
    assert replay == 128 and llm.engine.num_prompt_tokens_computed == 6 * 200 + 6 * (200 - 192 + replay)


def test_tiers_need_prefix_caching_and_valid_sizes(tmp_path):
    with pytest.raises(InvalidRequestError, match="prefix caching is off"):
        LLM(model="tiny-v3", backend="reference", num_kv_blocks=BLOCKS, enable_prefix_caching=False, announce=False, kv_offload_cpu_gib=1)
    with pytest.raises(InvalidRequestError, match="kv_offload_disk_gib sizes the disk tier"):
        LLM(model="tiny-v3", backend="reference", announce=False, kv_offload_disk_gib=1)
    with pytest.raises(InvalidRequestError, match="kv_offload_cpu_gib must be a number > 0"):
        LLM(model="tiny-v3", backend="reference", announce=False, kv_offload_cpu_gib=-1)


def test_blocks_a_full_host_tier_cannot_keep_still_reach_the_disk(tmp_path):
    llm = engine(kv_offload_dir=str(tmp_path), kv_offload_cpu_gib=2 * 20480 / 2**30)  # room for two blocks of tiny-v3
    assert llm.engine.tiers.host.capacity == 2
    llm.generate(prompts(), GREEDY, use_tqdm=False)
    stats = llm.kv_tier_stats()
    assert stats["disk"]["stores"] == 24 and stats["host"]["entries"] == 2


def test_deepseek_v41_restores_blocks_and_their_snapshots(tmp_path):
    """A V4.1 block carries the KV sources' compressed entries and index keys; a hit must end on a state snapshot
    (window rings, open groups, Engram's ids), which the tiers keep too (copied out when filed): from host memory, and
    from disk after a restart, the tokens are those of a run without tiers."""
    batch = prompts(length=200)
    plain = LLM(model="tiny-v41", backend="reference", num_kv_blocks=40, max_num_seqs=2, announce=False)
    want = twice(plain, batch)
    assert want[2] == [0] * 6  # the device pool keeps neither the blocks nor the snapshots (two of them) of a later turn
    host = LLM(model="tiny-v41", backend="reference", num_kv_blocks=40, max_num_seqs=2, announce=False, kv_offload_cpu_gib=0.05)
    names = list(host.engine.tiers.rows.tensors)
    assert names and all(n.endswith((".entries", ".index_keys")) for n in names)
    got, _, again = twice(host, batch)
    limit = host.engine.loaded.model.prefix_hit_limit(200) // 16 * 16  # the bounded replay's decoder tail starts there
    assert got == want[0] and again == [limit] * 6 and limit > 0
    assert host.kv_tier_stats()["host"]["hit_blocks"] == 6 * limit // 16
    first = LLM(model="tiny-v41", backend="reference", num_kv_blocks=40, max_num_seqs=2, announce=False, kv_offload_dir=str(tmp_path))
    first.generate(batch, GREEDY, use_tqdm=False)
    restarted = LLM(model="tiny-v41", backend="reference", num_kv_blocks=40, max_num_seqs=2, announce=False, kv_offload_dir=str(tmp_path))
    outs = restarted.generate(batch, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want[0][:6] and [o.num_cached_tokens for o in outs] == [limit] * 6
