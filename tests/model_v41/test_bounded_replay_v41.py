"""DeepSeek-V4.1's decoder SWA bounded replay (swa_bounded_replay=True, the default) on the tiny oracle checkpoint,
reference backend, float32. The checkpoint's KV sources are layers 2 and 4, so its encoder is layers 0-4 and its
decoder layers 5-7 (a Reuse, a Reindex inside the candidate blocks, a Reuse); the tail is its window 16 plus a
DSpark block of 5 = 21 prompt tokens.

With it on, the engine's greedy tokens are deterministic and equal a reference written here from the model's
blocks (the encoder over every token, then the decoder over the last 21 prompt tokens and every generated one,
their windows starting at the tail); a prompt no longer than the tail gives exactly what the replay off gives;
chunked prefill, one request at a time, a batch, a preemption and a prefix hit give the one-shot tokens; the
decoder never reads a ring row below the tail. With it off every layer runs on every token (test_engine_v41.py: greedy tokens equal NeMo's).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.llm import LLM
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.model.deepseek_v41 import bounded_replay
from deepinfer.model.deepseek_v41.config import V41Config
from deepinfer.model.deepseek_v41.load import load_v41
from deepinfer.model.deepseek_v41.spans import SharedKV, Span
from deepinfer.runtime import open_runtime

from model_v41.test_oracle_v41 import BLOCKS, one_sequence_caches, prefill_batch
from model_v41.tiny_v41 import ORACLE_V41, write_oracle_checkpoint

CONFIG = V41Config.from_dict(ORACLE_V41)
TAIL = 21  # sliding_window 16 + dspark_block_size 5
SPLIT = 5  # the first decoder layer: after the last KV source (4)
NEW = 6  # greedy tokens per prompt


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_oracle_checkpoint(tmp_path_factory.mktemp("v41") / "oracle")


@pytest.fixture(scope="module")
def model(folder):
    ops = open_runtime("reference", dtype=torch.float32).ops
    return load_v41(folder, CONFIG, ops, torch.device("cpu"), torch.float32, 256, None)


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [_prompt(length, seed) for length, seed in ((90, 1), (57, 2), (130, 3))]


def _generate(folder, prompts, **engine) -> list[list[int]]:
    llm = LLM(model=str(folder), backend="reference", dtype="float32", max_model_len=256, announce=False, **engine)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def reference_logits(model, ids: list[int], start: int) -> torch.Tensor:
    """The last position's logits of `ids` with the encoder layers over every token and the decoder layers over
    positions start.. only, windows beginning at `start`: the bounded replay written out from the model's blocks."""
    ops, c, n = model.ops, model.config, len(ids)
    caches = one_sequence_caches(model)
    input_ids, positions = torch.tensor(ids), torch.arange(n)
    pages = torch.arange(BLOCKS, dtype=torch.int32)
    every = [Span(0, 0, n, 0, pages=pages)]
    engram_rows = model.engram_hashing(ops, input_ids, every, caches.engram_ids)
    streams = model.embed[input_ids].unsqueeze(1).expand(-1, c.hc_mult, -1).contiguous()
    pre = torch.zeros(streams.shape[:2])
    pre[:, 0] = 1
    shared = [SharedKV()]
    for layer, state in zip(model.layers[:SPLIT], caches.layers[:SPLIT]):
        streams, pre = layer(ops, streams, pre, positions, every, state, shared, model.ropes, engram_rows)
    # the decoder: the rows from `start` on, each keeping the encoder's selection at its position
    tail = [Span(0, start, n - start, 0, window_from=start, pages=pages)]
    kv = shared[0]
    kept = [SharedKV(kv.entries, kv.index_keys, kv.topk[start:], None if kv.blocks is None else kv.blocks[start:], kv.ratio)]
    streams, pre, positions = streams[start:], pre[start:], positions[start:]
    engram_rows = [rows[start:] for rows in engram_rows]
    for layer, state in zip(model.layers[SPLIT:], caches.layers[SPLIT:]):
        streams, pre = layer(ops, streams, pre, positions, tail, state, kept, model.ropes, engram_rows)
    return model._logits(ops, streams[-1:], pre[-1:])[0]


def bounded_prefill(model, ids: list[int], caches=None, bounded: bool = True) -> torch.Tensor:
    """The model's own prefill of `ids`, with the bounded replay's host facts (or without: every layer on every
    token), the last position's logits."""
    batch = prefill_batch(ids)
    batch.host.decoder_from = [model.decoder_replay_start(len(ids))] if bounded else None
    batch.logits_indices = torch.tensor([len(ids) - 1])
    return model.forward(batch, caches if caches is not None else one_sequence_caches(model))[0]


def test_the_split_and_the_tail_are_the_configs():
    assert bounded_replay.decoder_start(CONFIG) == SPLIT and bounded_replay.replay_tail(CONFIG) == TAIL
    assert [bounded_replay.decoder_from(CONFIG, n) for n in (1, TAIL, TAIL + 1, 90)] == [0, 0, 1, 90 - TAIL]


def test_the_models_prefill_equals_the_written_out_reference(model):
    for ids in PROMPTS:
        start = len(ids) - TAIL
        assert (bounded_prefill(model, ids) - reference_logits(model, ids, start)).abs().max() < 1e-4


def test_engine_greedy_tokens_are_deterministic_and_equal_the_reference(folder, model):
    engine = _generate(folder, PROMPTS)
    assert engine == _generate(folder, PROMPTS)
    for ids, tokens in zip(PROMPTS, engine):
        # each step as the reference takes it: the prompt and the tokens so far, the decoder from the prompt's tail
        start, seq = len(ids) - TAIL, list(ids)
        for _ in range(NEW):
            seq.append(int(reference_logits(model, seq, start).argmax()))
        assert seq[len(ids) :] == tokens


@pytest.mark.parametrize("engine", [{"max_num_batched_tokens": 16, "max_num_seqs": 1}, {"max_num_batched_tokens": 40}, {"max_num_seqs": 1}],
                         ids=["chunks_of_16_one_at_a_time", "chunks_of_40_batched", "one_at_a_time"])  # fmt: skip
def test_chunked_prefill_gives_the_one_shot_tokens(folder, engine):
    assert _generate(folder, PROMPTS, **engine) == _generate(folder, PROMPTS)


def test_a_prompt_no_longer_than_the_tail_equals_the_replay_off_exactly(folder, model):
    short = [_prompt(length, 10 + length) for length in (5, TAIL)]
    assert all(model.decoder_replay_start(len(ids)) == 0 for ids in short)
    for ids in short:
        assert torch.equal(bounded_prefill(model, ids), bounded_prefill(model, ids, bounded=False))
    assert _generate(folder, short) == _generate(folder, short, swa_bounded_replay=False)


def test_the_decoder_never_reads_a_ring_row_below_the_tail(model):
    """A slot's decoder rings below the tail hold whatever an earlier sequence left: NaN changes nothing."""
    ids = PROMPTS[0]
    caches = one_sequence_caches(model)
    for state in caches.layers[SPLIT:]:
        state.ring.fill_(255)  # NaN e4m3 codes, out-of-range scales
    assert torch.equal(bounded_prefill(model, ids, caches), bounded_prefill(model, ids))


def test_it_is_an_approximation_of_a_full_prefill(model):
    """On: the decoder runs on the tail only, so the last logits move (a little); the encoder is exact."""
    ids = PROMPTS[0]
    assert 0 < (bounded_prefill(model, ids) - bounded_prefill(model, ids, bounded=False)).abs().max() < 10


def test_a_cut_row_cannot_be_asked_for_its_logits(model):
    ids = PROMPTS[1]
    batch = prefill_batch(ids)
    batch.host.decoder_from = [model.decoder_replay_start(len(ids))]
    with pytest.raises(ValueError, match="before its sequence's decoder tail"):
        model.forward(batch, one_sequence_caches(model))


def test_a_request_for_prompt_logprobs_runs_every_layer_on_every_token(folder):
    llm = LLM(model=str(folder), backend="reference", dtype="float32", max_model_len=256, announce=False)
    off = LLM(model=str(folder), backend="reference", dtype="float32", max_model_len=256, announce=False, swa_bounded_replay=False)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, prompt_logprobs=0)
    ids = {"prompt_token_ids": PROMPTS[1]}
    on_out, off_out = llm.generate([ids], params, use_tqdm=False)[0], off.generate([ids], params, use_tqdm=False)[0]
    assert list(on_out.outputs[0].token_ids) == list(off_out.outputs[0].token_ids)
    assert len(on_out.prompt_logprobs) == len(PROMPTS[1])


def test_a_preempted_request_recomputes_the_one_shot_tokens(folder):
    """Ten blocks of 16 for three prompts and their tokens: one is preempted and recomputed (its prompt and the tokens
    it generated), the decoder again from its prompt's tail."""
    llm = LLM(model=str(folder), backend="reference", dtype="float32", max_model_len=256, announce=False, num_kv_blocks=10, max_num_seqs=3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert sum(o.metrics["num_preemptions"] for o in outs) >= 1
    one_shot = LLM(model=str(folder), backend="reference", dtype="float32", max_model_len=256, announce=False, max_num_seqs=1)
    assert [list(o.outputs[0].token_ids) for o in outs] == [list(o.outputs[0].token_ids) for o in one_shot.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]  # fmt: skip


def test_a_prefix_hit_gives_the_one_shot_tokens(folder):
    llm = LLM(model=str(folder), backend="reference", dtype="float32", max_model_len=256, announce=False, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    prompt = PROMPTS[2]
    llm.generate([{"prompt_token_ids": prompt[:100]}], params, use_tqdm=False)
    hit = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert hit.num_cached_tokens > 0
    assert list(hit.outputs[0].token_ids) == _generate(folder, [prompt])[0]
