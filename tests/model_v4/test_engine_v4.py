"""DeepSeek-V4 in the engine, on the embedded tiny-v4 (V4's window 128 and ratios 4 / 128) in float32:
greedy tokens do not depend on how the engine runs a prompt (alone or batched, in chunks, after a
prefix-cache hit with bounded replay, after preemption, with prefix caching off), and the block
manager's state slots and replay bookkeeping.

Every engine here runs the one loaded model (`engine_over` builds engines over it), so the module
loads tiny-v4 once; the prompts reach past several HCA windows (600 tokens: 4 complete windows of 128).
"""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.engine.block_manager import BlockManager
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.sequence import Sequence

PROMPT_LENS = (600, 77, 300, 150, 9)  # past the window and 4 HCA windows; short; under one block
BLOCK = 16  # the reference backend's KV block size
REPLAY = 128  # tiny-v4's prefix_replay_tokens: max(window 128, 2 x 4, 128)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def random_prompts(lens, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 129280, (n,), generator=gen).tolist() for n in lens]


PROMPTS = random_prompts(PROMPT_LENS, seed=1)
TAILS = random_prompts((20, 5, 33, 1, 7), seed=2)  # what the extended prompts add


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The module's model cache folder (tiny-v4 is generated there on first use)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def nocache_llm(cache):
    """tiny-v4 on the reference backend without prefix caching, through the public constructor."""
    from deepinfer import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE", str(cache))
        return LLM(model="tiny-v4", backend="reference", dtype="float32", enable_prefix_caching=False, announce=False)


def engine_over(llm, **config):
    """Another LLM over llm's loaded model (no reload), with its own engine config and caches."""
    from deepinfer.engine.llm import LLM
    from deepinfer.engine.llm_engine import EngineConfig, LLMEngine

    engine = llm.engine
    return LLM.from_engine(LLMEngine(engine.loaded, engine.runtime, engine.dtype, EngineConfig(**config)))


def generate(llm, prompts):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def solo(nocache_llm):
    """Each prompt alone, no prefix caching: the reference every other way of running must match."""
    return [tokens(generate(nocache_llm, [p]))[0] for p in PROMPTS]


def test_batched_equals_one_at_a_time_without_prefix_caching(nocache_llm, solo):
    assert all(len(t) == 12 for t in solo)
    assert tokens(generate(nocache_llm, PROMPTS)) == solo


def test_prefix_hits_replay_the_window_and_match(nocache_llm, solo):
    """The same prompts twice in one engine, then prompts extending them: the second and third runs hit the
    cache, compute only the replayed tokens and the uncached ones, and sample the same tokens."""
    llm = engine_over(nocache_llm, num_kv_blocks=256)
    engine = llm.engine
    assert engine.block_manager.prefix_replay_tokens == REPLAY and engine.num_state_slots == engine.config.max_num_seqs
    first = generate(llm, PROMPTS)
    assert tokens(first) == solo and all(o.num_cached_tokens == 0 for o in first)
    assert engine.num_prompt_tokens_computed == sum(PROMPT_LENS)

    def check_hits(prompts, outputs, fully_cached):
        for prompt, out, cached in zip(prompts, outputs, fully_cached):
            assert out.num_cached_tokens == min(cached, (len(prompt) - 1) // BLOCK * BLOCK), len(prompt)
        return sum(len(p) - max(0, o.num_cached_tokens - REPLAY) for p, o in zip(prompts, outputs))

    before = engine.num_prompt_tokens_computed
    again = generate(llm, PROMPTS)
    assert tokens(again) == solo
    # Every full block of each prompt hits (the 9-token prompt has none); each prompt computes its replay and the rest.
    expected = check_hits(PROMPTS, again, [n // BLOCK * BLOCK for n in PROMPT_LENS])
    assert engine.num_prompt_tokens_computed - before == expected
    assert again[0].num_cached_tokens == 592 and expected < sum(PROMPT_LENS)

    extended = [p + t for p, t in zip(PROMPTS, TAILS)]
    before = engine.num_prompt_tokens_computed
    hit = generate(llm, extended)
    assert tokens(hit) == tokens(generate(nocache_llm, extended))
    # The cached blocks go on with the tokens generated after each prompt: the extension diverges at its end.
    expected = check_hits(extended, hit, [n // BLOCK * BLOCK for n in PROMPT_LENS])
    assert engine.num_prompt_tokens_computed - before == expected
    assert hit[0].num_cached_tokens >= 592 and engine.num_prompt_tokens_computed - before <= sum(REPLAY + BLOCK + len(t) for t in TAILS)
    assert sorted(engine.block_manager.free_slots) == list(range(engine.num_state_slots))  # every slot back


def test_chunked_prefill_and_chunked_replay(nocache_llm, solo):
    """37-token steps: chunks end off the ratio-4 and ratio-128 boundaries, windows span chunks; then the
    same prompts hit the cache and their replay runs in chunks too."""
    llm = engine_over(nocache_llm, num_kv_blocks=256, max_num_batched_tokens=37)
    assert tokens(generate(llm, PROMPTS)) == solo
    again = generate(llm, PROMPTS)
    assert again[0].num_cached_tokens == 592
    assert tokens(again) == solo


def test_preemption(nocache_llm, solo):
    """74 blocks hold every prompt (73 blocks) but not their 12 new tokens: decoding preempts, and the
    preempted sequences recompute; with prefix caching, after a hit on their own blocks (replay), which
    saves prefill work."""
    assert sum(-(-n // BLOCK) for n in PROMPT_LENS) == 73
    computed = {}
    for prefix_caching in (False, True):
        llm = engine_over(nocache_llm, num_kv_blocks=74, enable_prefix_caching=prefix_caching)
        assert tokens(generate(llm, PROMPTS)) == solo, f"prefix caching {prefix_caching}"
        assert llm.engine.scheduler.num_preemptions > 0
        computed[prefix_caching] = llm.engine.num_prompt_tokens_computed
    assert computed[True] < computed[False]


def test_fp8_cache_runs_alike_batched_chunked_and_after_replay(nocache_llm):
    """With an FP8 cache (e4m3 rows with a per-token scale: the window KV, the compressed entries and the
    indexer keys), greedy tokens still do not depend on how a prompt runs: every read, replay included,
    sees the same quantised rows."""
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[4]]
    alone = engine_over(nocache_llm, kv_cache_dtype="fp8", enable_prefix_caching=False)
    layer = alone.engine.runner.kv_caches[1]  # a CSA layer: window, entries and indexer keys
    assert {t.dtype for t in (layer.swa, layer.compressor.pool, layer.indexer.pool)} == {torch.float8_e4m3fn}
    assert layer.swa.shape[-1] == 64 + 16 and layer.indexer.pool.shape[-1] == 32 + 16  # tiny-v4: head_dim 64, index_head_dim 32
    solo = [tokens(generate(alone, [p]))[0] for p in prompts]
    llm = engine_over(nocache_llm, kv_cache_dtype="fp8", num_kv_blocks=256, max_num_batched_tokens=37)
    assert tokens(generate(llm, prompts)) == solo
    again = generate(llm, prompts)
    assert again[0].num_cached_tokens == 592 and tokens(again) == solo


def test_block_manager_state_slots_and_replay():
    ids = iter(range(100))

    def seq(tokens) -> Sequence:
        return Sequence(next(ids), list(tokens), SamplingParams(), seed=0)

    manager = BlockManager(num_blocks=16, block_size=4, num_state_slots=2, prefix_replay_tokens=6)
    a, b, c = seq(range(10)), seq(range(50, 55)), seq(range(90, 93))
    manager.allocate(a), manager.allocate(b)
    assert (a.state_slot, b.state_slot) == (0, 1)
    assert manager.num_free_blocks == 11 and not manager.can_allocate(c), "blocks are free, but no state slot"
    a.num_computed_tokens = a.num_tokens
    manager.commit(a, 0)  # registers a's 2 full blocks
    a_blocks = list(a.block_table)
    manager.free(a)
    assert a.state_slot == -1 and manager.free_slots == [0]
    assert manager.can_allocate(c)
    manager.allocate(c)
    assert c.state_slot == 0 and not manager.free_slots
    manager.free(c), manager.free(b)
    assert sorted(manager.free_slots) == [0, 1]

    # A hit of 8 tokens: their KV stays as cached, but the last 6 are computed again.
    d = seq([*range(10), 99])
    manager.allocate(d)
    assert d.block_table[:2] == a_blocks[:2] and d.state_slot in (0, 1)
    assert (d.num_cached_kv, d.num_computed_tokens) == (8, 2)
    manager.free(d)
    assert (d.num_cached_kv, d.num_computed_tokens, d.state_slot) == (0, 0, -1)
    # A replay longer than the hit starts from the first token; the hit is still reported.
    long_replay = BlockManager(num_blocks=16, block_size=4, num_state_slots=1, prefix_replay_tokens=20)
    e = seq(range(10))
    long_replay.allocate(e)
    e.num_computed_tokens = e.num_tokens
    long_replay.commit(e, 0)
    long_replay.free(e)
    f = seq([*range(10), 99])
    long_replay.allocate(f)
    assert (f.num_cached_kv, f.num_computed_tokens) == (8, 0)
    # Without state (V2 / V3): no slots taken, the hit is computed from its end.
    plain = BlockManager(num_blocks=16, block_size=4)
    g = seq(range(10))
    plain.allocate(g)
    assert g.state_slot == -1 and plain.can_allocate(seq(range(3)))
    g.num_computed_tokens = g.num_tokens
    plain.commit(g, 0)
    plain.free(g)
    h = seq([*range(10), 99])
    plain.allocate(h)
    assert (h.num_cached_kv, h.num_computed_tokens, h.state_slot) == (8, 8, -1)


# -- `deepinfer bench prefix-replay` ---------------------------------------------------------------


def test_bench_prefix_replay_cli(cache, tmp_path, monkeypatch, capsys):
    """Tiny sizes through the command line (in process): the JSON's fields, the replay count, identical tokens."""
    from deepinfer.cli.main import main

    monkeypatch.setenv("DEEPINFER_CACHE", str(cache))
    out = tmp_path / "replay.json"
    assert main(["bench", "prefix-replay", "--prefix-lens", "256", "512", "--new-tokens", "4", "--output-tokens", "3", "--repeat", "1",
                 "--no-cache-max-len", "256", "--json", str(out)]) == 0  # fmt: skip
    table = capsys.readouterr().out
    assert "hit tokens" in table and "identical" in table
    saved = json.loads(out.read_text())
    assert saved["machine"]["backend"] == "reference" and saved["settings"]["model"] == "tiny-v4"
    assert saved["settings"]["replay_tokens"] == REPLAY
    small, large = saved["results"]
    assert (small["prefix_len"], large["prefix_len"]) == (256, 512)
    for r in (small, large):
        assert r["cached_tokens"] == r["prefix_len"] and r["hit_prefill_tokens"] == REPLAY + 4
        assert r["hit_ms"] > 0 and len(r["output_tokens"]) == 3
    assert small["no_cache_prefill_tokens"] == 260 and small["no_cache_ms"] > 0 and small["identical"] is True
    assert large["no_cache_prefill_tokens"] is None and large["identical"] is None  # past --no-cache-max-len


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prefix-lens", "0"], "--prefix-lens must be at least 1, not 0"),
        (["--new-tokens", "0"], "--new-tokens must be at least 1, not 0"),
        (["--prefix-lens", "70000"], "exceeds the model's 65536 positions"),
    ],
)
def test_bench_prefix_replay_refuses_bad_arguments_in_one_line(cache, monkeypatch, capsys, args, message):
    from deepinfer.cli.main import main

    monkeypatch.setenv("DEEPINFER_CACHE", str(cache))
    assert main(["bench", "prefix-replay", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err
