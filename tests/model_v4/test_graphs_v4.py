"""DeepSeek-V4 decode steps in device graphs, on the embedded tiny-v4 (float32) through a backend whose graphs are the
test suite's recording ones (tests/fake_backend.py: the reference kernels; a replay runs the captured step again on the
static buffers, so it sees only what the graph's inputs hold): greedy tokens with graphs are those of eager decode
and of eager decode on the host plan (step.py), with windows closing and not closing in the decode steps (CSA every 4
tokens, HCA at 127 / 255 / 511), with prefix hits and bounded replay, preemption and an FP8 cache in one run, with
overlap scheduling, and with speculative decoding (verification steps run eagerly on the host plan). And the decode
step's model code (the plan and the glue between the ops) reads no device value on the host, so that a real device
graph captures all of it (the recording graphs, which run the step again, would not notice)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.model.deepseek_v4 import model as v4_model
from deepinfer.model.forward_batch import ForwardBatch

from fake_backend import random_prompts, recording_graphs_llm

PROMPT_LENS = (250, 120, 500, 77, 9)  # decode crosses HCA windows closing at 255, 127 and 511
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
SMALL = dict(max_num_seqs=8, max_model_len=1024)  # graphs of at most 8 rows over 64 pages


def prompts(lens=PROMPT_LENS, seed: int = 1) -> list[dict]:
    return random_prompts(lens, 2, 129280, seed)


@pytest.fixture(scope="module")
def graphs_llm(tmp_path_factory):
    """tiny-v4 loaded once on the fake backend with recording graphs."""
    return recording_graphs_llm("tiny-v4", tmp_path_factory.mktemp("cache"), **SMALL)


def engine_over(llm, draft_source=None, **config):
    """Another LLM over llm's loaded model and runtime (its recording graphs), with its own engine config and caches."""
    from deepinfer.engine.llm import LLM
    from deepinfer.engine.llm_engine import EngineConfig, LLMEngine

    engine = llm.engine
    return LLM.from_engine(LLMEngine(engine.loaded, engine.runtime, engine.dtype, EngineConfig(**{**SMALL, **config}), draft_source=draft_source))


def tokens(llm, batch=None, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(batch or prompts(), params, use_tqdm=False)]


@pytest.fixture(scope="module")
def host_plan_tokens(graphs_llm):
    """Eager decode on the host plan (the former path): the tokens every other run must give."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(v4_model, "plans_on_device", lambda batch: False)
        llm = engine_over(graphs_llm, enforce_eager=True, enable_prefix_caching=False)
        return tokens(llm)


def count_forwards(monkeypatch, llm) -> list[bool]:
    """Records batch.is_prefill of every model forward (the recording graphs call it to capture and to replay)."""
    calls, forward = [], llm.engine.runner.model.forward
    monkeypatch.setattr(llm.engine.runner.model, "forward", lambda batch, *a, **kw: calls.append(batch.is_prefill) or forward(batch, *a, **kw))
    return calls


def test_graph_replayed_decode_gives_the_eager_tokens(graphs_llm, host_plan_tokens, monkeypatch):
    runner = graphs_llm.engine.runner
    graphs = runner.graphs.api
    assert runner.graphs is not None and runner.graphs.max_tokens_per_seq == 1
    forwards = count_forwards(monkeypatch, graphs_llm)
    planned, plan = [], v4_model.plan_decode
    monkeypatch.setattr(v4_model, "plan_decode", lambda *a, **kw: planned.append(a[2].shape[0]) or plan(*a, **kw))
    before = (graphs.warmups, len(graphs.captured), graphs.replays)
    assert tokens(graphs_llm) == host_plan_tokens
    warmups, captured, replays = (now - then for now, then in zip((graphs.warmups, len(graphs.captured), graphs.replays), before))
    assert replays == GREEDY.max_tokens - 1 and captured >= 1, "every decode step replayed a graph"
    decode_forwards = len(forwards) - sum(forwards)
    assert decode_forwards == warmups + captured + replays, "a decode step ran its forward outside a graph"
    assert planned and set(planned) == {8}, "the captured steps planned on the device at the bucket's 8 rows"
    eager = engine_over(graphs_llm, enforce_eager=True)
    assert eager.engine.runner.graphs is None and tokens(eager) == host_plan_tokens


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_prefix_hits_replay_and_preemption_with_graphs(graphs_llm, host_plan_tokens, kv_cache_dtype):
    """One engine with prefix caching and too few blocks for every request's new tokens: the second run hits the
    cache (bounded replay rebuilds the rings) and decoding preempts; tokens are those of the eager host-plan run
    (with an FP8 cache: of the eager host-plan run with that cache)."""
    if kv_cache_dtype == "auto":
        want = host_plan_tokens
    else:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(v4_model, "plans_on_device", lambda batch: False)
            want = tokens(engine_over(graphs_llm, enforce_eager=True, kv_cache_dtype=kv_cache_dtype))
    blocks = sum(-(-n // 16) for n in PROMPT_LENS) + 1  # every prompt, not their new tokens
    llm = engine_over(graphs_llm, enable_prefix_caching=True, num_kv_blocks=blocks, kv_cache_dtype=kv_cache_dtype)
    assert llm.engine.runner.graphs is not None
    first = tokens(llm)
    outputs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    assert first == want and [o.outputs[0].token_ids for o in outputs] == want
    assert any(o.num_cached_tokens > 0 for o in outputs), "the second run hit the prefix cache"
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.runner.graphs.api.replays > 0


def test_overlap_scheduling_with_graphs(graphs_llm, host_plan_tokens):
    llm = engine_over(graphs_llm, overlap=True)
    assert llm.engine.overlap is not None and llm.engine.runner.graphs is not None
    ahead = llm.engine.overlap.steps_ahead
    assert tokens(llm) == host_plan_tokens
    assert llm.engine.overlap.steps_ahead > ahead


def test_speculative_decoding_with_graphs(graphs_llm, host_plan_tokens):
    """MTP drafts, verified in steps of up to 4 rows a sequence: those run eagerly on the host plan (V4 captures decode
    steps only, so no graph of several rows a sequence is captured)."""
    spec = {"method": "mtp", "num_drafts": 3, "policy": "fixed"}
    llm = engine_over(graphs_llm, speculative=spec)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.max_tokens_per_seq == 1
    assert tokens(llm) == host_plan_tokens
    assert llm.speculative_metrics()["verifications"] > 0
    assert all(per_seq == 1 for _, per_seq in graphs.row_graphs)
    rings = [c.compressor.ring - c.compressor.ratio * (2 if c.compressor.overlap else 1) for c in llm.engine.runner.kv_caches if c.compressor]
    assert sorted(set(rings)) == [4, 128], "the lookahead of 3 rows, rounded up to whole windows of 4 and 128"


# ---- the whole decode step reads nothing on the host -----------------------------------------------------------------


def _shapes(out):
    if out is None or isinstance(out, torch.Tensor):
        return out if out is None else (out.shape, out.dtype)
    return tuple(_shapes(o) for o in out)


def _empty(spec):
    if spec is None:
        return None
    if isinstance(spec[0], torch.Size):
        return torch.zeros(spec[0], dtype=spec[1])
    return tuple(_empty(s) for s in spec)


class RecordedOps:
    """The model's ops, recording each call's output shapes (record=True), or answering each call, in the same order,
    with zeros of the recorded shapes (the ops are the backends' to prove graph-safe; this checks the code between them)."""

    def __init__(self, ops, calls: list, record: bool):
        self._ops, self._calls, self._record = ops, calls, record

    def __getattr__(self, name):
        attr = getattr(self._ops, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            if self._record:
                out = attr(*args, **kwargs)
                self._calls.append((name, _shapes(out)))
                return out
            recorded, spec = self._calls.pop(0)
            assert recorded == name, f"the step called {name} where the recorded one called {recorded}"
            return _empty(spec)

        return call


def test_the_decode_step_reads_nothing_on_the_host(graphs_llm, monkeypatch):
    """tiny-v4's decode forward (sliding, CSA and HCA layers, hash and routed MoE, the head) over fake tensors
    (FakeTensorMode: a host read of a device value, `.item()`, `.tolist()`, `bool()`, `nonzero`, a boolean mask, raises),
    the ops answering with their recorded output shapes: the device plan, the compressors' ring path, the indexer's row
    gather and every other line of glue keep to shapes, as a device graph needs."""
    runner = engine_over(graphs_llm, enforce_eager=True).engine.runner
    model, caches = runner.model, runner.kv_caches
    positions = torch.tensor([200, 127, 5, 0])  # windows closing (127: HCA and CSA), not closing, the first token
    tables = torch.arange(4 * 16, dtype=torch.int32).view(4, 16)
    slots = tables.long().gather(1, (positions // 16)[:, None])[:, 0] * 16 + positions % 16
    slots[3] = -1  # a padding row
    batch = ForwardBatch(is_prefill=False, input_ids=torch.tensor([5, 6, 7, 0]), positions=positions, slot_mapping=slots,
                         cu_seqlens_q=torch.arange(5, dtype=torch.int32), seq_lens=(positions + 1).int(), block_tables=tables,
                         logits_indices=torch.arange(4), state_slots=torch.tensor([0, 1, 2, -1], dtype=torch.int32))  # fmt: skip
    calls, ops = [], model.ops
    monkeypatch.setattr(model, "ops", RecordedOps(ops, calls, record=True))
    model.forward(batch, caches)
    assert {"compress_kv", "indexer_topk", "sparse_attention", "kv_cache_write", "hc_pre", "dispatch"} <= {name for name, _ in calls}
    monkeypatch.setattr(model, "ops", RecordedOps(ops, calls, record=False))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:  # the weights and caches join as fakes
        fake = ForwardBatch(**{k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in vars(batch).items()})
        logits = model.forward(fake, caches)
    assert logits.shape == (4, model.config.vocab_size) and not calls, "every recorded op was called"
    # The check bites: a host read planted in the plan raises under it.
    monkeypatch.setattr(model, "ops", RecordedOps(ops, [], record=False))
    monkeypatch.setattr(v4_model, "plan_decode", lambda *args: args[2].max().item())
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, pytest.raises((DataDependentOutputException, DynamicOutputShapeException)):
        model.forward(ForwardBatch(**{k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in vars(batch).items()}), caches)
