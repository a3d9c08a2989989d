"""DeepSeek-V4.1 decode steps in device graphs, on the embedded tiny-v41 (float32) through a backend whose graphs are the
test suite's recording ones (tests/fake_backend.py: the reference kernels; a replay runs the captured step again on the
static buffers, so it sees only what the graph's inputs hold): greedy tokens with graphs are those of eager decode on
the device plan (decode_plan.py) and of eager decode on the per-span path, over prompts longer than the window (128)
and shorter, past the candidate blocks' bound (64 ratio-1 entries) and with ratio-2 groups closing in the decode steps,
in a batch of 5 that the graph of 8 pads with 3 rows, with the bounded replay on and off (DSpark off). A padding row
writes nothing of any sequence, and the decode step's model code reads no device value on the host, so that a real
device graph captures all of it (the recording graphs, which run the step again, would not notice)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.model.deepseek_v41 import decode_plan
from deepinfer.model.forward_batch import ForwardBatch

from fake_backend import random_prompts, recording_graphs_llm
from model_v4.test_graphs_v4 import RecordedOps

PROMPT_LENS = (150, 40, 200, 7, 131)  # three past the window (and the 133-token replay tail), two inside it
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
SMALL = dict(max_num_seqs=8, max_model_len=512)  # graphs of at most 8 rows over 32 pages


def prompts(lens=PROMPT_LENS, seed: int = 1) -> list[dict]:
    return random_prompts(lens, 3, 129000, seed)


@pytest.fixture(scope="module")
def graphs_llm(tmp_path_factory):
    """tiny-v41 loaded once on the fake backend with recording graphs."""
    return recording_graphs_llm("tiny-v41", tmp_path_factory.mktemp("cache"), **SMALL)


def engine_over(llm, **config):
    """Another LLM over llm's loaded model and runtime (its recording graphs), with its own engine config and caches;
    prefix caching off unless asked (with it on, prompt chunks end on block boundaries for the state snapshots, so
    the sequences would not all start decoding in one step)."""
    from deepinfer.engine.llm import LLM
    from deepinfer.engine.llm_engine import EngineConfig, LLMEngine

    engine = llm.engine
    return LLM.from_engine(LLMEngine(engine.loaded, engine.runtime, engine.dtype, EngineConfig(**{**SMALL, "enable_prefix_caching": False, **config})))


def tokens(llm, batch=None) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(batch or prompts(), GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("bounded_replay", [True, False], ids=["bounded_replay", "every_layer_every_token"])
def test_graph_replayed_decode_gives_the_eager_and_the_per_span_tokens(graphs_llm, bounded_replay, monkeypatch):
    model = graphs_llm.engine.runner.model
    monkeypatch.setattr(model, "swa_bounded_replay", bounded_replay)
    with monkeypatch.context() as mp:  # eager decode on the per-span path (the host's spans): the tokens to give
        mp.setattr(decode_plan, "plans_on_device", lambda batch, config: False)
        per_span = tokens(engine_over(graphs_llm, enforce_eager=True))
    planned, plan = [], decode_plan.plan_decode
    monkeypatch.setattr(decode_plan, "plan_decode", lambda *a: planned.append(a[2].input_ids.shape[0]) or plan(*a))
    eager = engine_over(graphs_llm, enforce_eager=True)
    assert eager.engine.runner.graphs is None and tokens(eager) == per_span
    assert planned and set(planned) == {5}, "eager decode steps ran on the device plan"
    planned.clear()
    llm = engine_over(graphs_llm)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.max_tokens_per_seq == 1
    replays, captured = graphs.api.replays, len(graphs.api.captured)  # the recording graphs are the runtime's, shared
    assert tokens(llm) == per_span
    assert graphs.api.replays - replays == GREEDY.max_tokens - 1 and len(graphs.api.captured) - captured == 1, "every decode step replayed the graph of 8"
    assert set(planned) == {8}, "the graph's steps planned at the bucket's 8 rows, 3 of them padding"


@pytest.fixture(scope="module")
def per_span_tokens(graphs_llm):
    """Eager decode on the per-span path, the bounded replay on (the default): the tokens every other run must give."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decode_plan, "plans_on_device", lambda batch, config: False)
        return tokens(engine_over(graphs_llm, enforce_eager=True))


def test_prefix_hits_and_preemption_with_graphs(graphs_llm, per_span_tokens):
    """One engine with prefix caching and too few blocks for every request's new tokens: the second run hits the cache
    (restored from a state snapshot, the cached blocks' history not rewritten) and decoding preempts (recomputed)."""
    blocks = sum(-(-n // 16) for n in PROMPT_LENS)  # every prompt's blocks, not all their new tokens'
    llm = engine_over(graphs_llm, enable_prefix_caching=True, num_kv_blocks=blocks)
    replays = llm.engine.runner.graphs.api.replays
    first = tokens(llm)
    outputs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert first == per_span_tokens and [o.outputs[0].token_ids for o in outputs] == per_span_tokens
    assert any(o.num_cached_tokens > 0 for o in outputs), "the second run hit the prefix cache"
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.runner.graphs.api.replays > replays


def test_a_step_that_gathers_logprobs_replays_the_forward_only_graph(graphs_llm, per_span_tokens):
    """Logprobs are gathered outside the graph: the decode step replays the bucket's forward-only graph (the model's
    forward with hidden_states, DSpark's target features beside the logits) and samples eagerly."""
    llm = engine_over(graphs_llm)
    graphs = llm.engine.runner.graphs
    params = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=0, ignore_eos=True, logprobs=1)
    outputs = llm.generate(prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == per_span_tokens
    assert list(graphs.row_graphs) == [(8, 1)] and not graphs.graphs


def _decode_batch(model, caches, positions: list[int], padding: int) -> ForwardBatch:
    """A decode step of sequences in slots 0.. at `positions`, sequence b in blocks b * 32 .., then `padding` rows as a
    device graph pads (slot_mapping and state slot -1, block table 0, a stale position)."""
    live = len(positions)
    pos = torch.tensor(positions + [300] * padding)
    tables = torch.zeros(live + padding, 32, dtype=torch.int32)
    tables[:live] = torch.arange(live * 32, dtype=torch.int32).view(live, 32)
    slots = tables.long().gather(1, (pos // 16)[:, None])[:, 0] * 16 + pos % 16
    slots[live:] = -1
    state_slots = torch.tensor(list(range(live)) + [-1] * padding, dtype=torch.int32)
    n = live + padding
    return ForwardBatch(is_prefill=False, input_ids=torch.arange(5, 5 + n), positions=pos, slot_mapping=slots,
                        cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32), seq_lens=(pos + 1).int(), block_tables=tables,
                        logits_indices=torch.arange(n), state_slots=state_slots)  # fmt: skip


def _state_tensors(caches) -> list[tuple[torch.Tensor, bool]]:
    """Every state tensor, and whether it is kept per slot (else paged)."""
    per_slot = [t for layer in caches.layers for t in (layer.ring, layer.pending) if t is not None] + [caches.engram_ids]
    paged = [t for layer in caches.layers for t in (layer.entries, layer.index_keys) if t is not None]
    return [(t, True) for t in per_slot] + [(t, False) for t in paged]


def test_padding_rows_write_only_the_scratch_slot_and_block(graphs_llm):
    """Two live rows (a ratio-2 group closing at 201, none at 64) and two padding rows: every state row the step
    changes is a live row's own (its slot, its blocks) or the scratch slot's / block's."""
    runner = engine_over(graphs_llm, enforce_eager=True).engine.runner
    model, caches = runner.model, runner.kv_caches
    state = _state_tensors(caches)
    for t, _ in state:  # every row a sequence might have left (the ring's bytes, however they decode)
        t.copy_(torch.randint(0, 100, t.shape, dtype=t.dtype) if not t.is_floating_point() else torch.randn(t.shape))
    before = [t.clone() for t, _ in state]
    model.forward(_decode_batch(model, caches, [201, 64], padding=2), caches)
    for old, (new, per_slot) in zip(before, state):
        changed = set((old != new).flatten(1).any(dim=1).nonzero().flatten().tolist())
        if per_slot:  # slots 0, 1 and the scratch slot
            assert changed <= {0, 1, caches.scratch_slot}, changed
        else:  # the blocks of positions 201 (sequence 0's 13th: 12) and 64 (sequence 1's 5th: 32 + 4), and the scratch block
            assert changed <= {12, 36, new.shape[0] - 1}, changed


def test_the_decode_step_reads_nothing_on_the_host(graphs_llm, monkeypatch):
    """tiny-v41's decode forward (window, Full layers of ratio 2 and 1, Reuse, Reindex in the candidate blocks, Engram,
    MoE, the head) over fake tensors (FakeTensorMode: a host read of a device value, `.item()`, `.tolist()`, `bool()`,
    `nonzero`, a boolean mask, raises), the ops answering with their recorded output shapes: the plan and every line
    of glue between the ops keep to shapes, as a device graph needs."""
    runner = engine_over(graphs_llm, enforce_eager=True).engine.runner
    model, caches = runner.model, runner.kv_caches
    batch = _decode_batch(model, caches, [201, 64, 0], padding=1)
    calls, ops = [], model.ops
    monkeypatch.setattr(model, "ops", RecordedOps(ops, calls, record=True))
    model.forward(batch, caches)
    assert {"compress_kv", "indexer_topk", "candidate_blocks", "indexer_topk_in_blocks", "sparse_attention", "engram_hash"} <= {n for n, _ in calls}
    monkeypatch.setattr(model, "ops", RecordedOps(ops, calls, record=False))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:  # the weights and caches join as fakes
        fake = ForwardBatch(**{k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in vars(batch).items()})
        logits = model.forward(fake, caches)
    assert logits.shape == (4, model.config.vocab_size) and not calls, "every recorded op was called"
    # The check bites: a host read planted in the plan raises under it.
    monkeypatch.setattr(model, "ops", RecordedOps(ops, [], record=False))
    monkeypatch.setattr(decode_plan, "plan_decode", lambda ops, config, batch, caches: batch.positions.max().item())
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, pytest.raises((DataDependentOutputException, DynamicOutputShapeException)):
        model.forward(ForwardBatch(**{k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in vars(batch).items()}), caches)
