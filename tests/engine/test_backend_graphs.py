"""Decode-step device graphs and the KV-cache budget are asked from the backend (BackendSpec
.graph_capture / .memory_info), never from a device type: a fake backend whose graph API records its
use gets graphs on the CPU; the reference backend, which declares none, gets eager steps."""

from __future__ import annotations

import pytest

import deepinfer.plugins as plugins_mod
from deepinfer.backends import reference
from deepinfer.engine.llm import LLM
from deepinfer.engine.model_runner import GiB, kv_cache_budget
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.plugins import Plugins

from fake_backend import FakeBackend, RecordingGraphs

PROMPTS = ["hello there", "a second, longer prompt for the batch", "three"]
GREEDY = SamplingParams(temperature=0, max_tokens=6)


def llm_on(monkeypatch, backend, name: str, **kwargs) -> LLM:
    monkeypatch.setattr(plugins_mod, "load_plugins", lambda: Plugins(load_entry_points=False, extra_plugins=(backend, reference)))
    return LLM(backend=name, announce=False, num_kv_blocks=64, max_num_seqs=4, **kwargs)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_decode_graphs_come_from_the_backend(monkeypatch):
    graphs = RecordingGraphs()
    llm = llm_on(monkeypatch, FakeBackend(graphs=graphs), "fake")
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.api is graphs and graphs.pools == 1
    got = tokens(llm)
    assert graphs.captured and graphs.warmups == 2 * len(graphs.captured) and graphs.replays > 0
    eager = llm_on(monkeypatch, FakeBackend(graphs=RecordingGraphs()), "fake", enforce_eager=True)
    assert eager.engine.runner.graphs is None
    assert got == tokens(eager)  # replayed steps give the eager steps' tokens


def test_a_backend_without_graphs_runs_eagerly(monkeypatch):
    llm = llm_on(monkeypatch, FakeBackend(), "reference")
    assert llm.engine.runtime.graph_capture is None and llm.engine.runner.graphs is None
    assert len(tokens(llm)) == len(PROMPTS)


def test_the_kv_cache_budget_asks_the_backend_for_device_memory(monkeypatch):
    asked = []

    def memory_info(device):
        asked.append(device)
        return 3 * GiB, 10 * GiB

    assert kv_cache_budget(None, memory_info, 0.9) == 2 * GiB  # free - 10% of total
    monkeypatch.setattr(plugins_mod, "load_plugins", lambda: Plugins(load_entry_points=False, extra_plugins=(FakeBackend(memory_info=memory_info), reference)))
    llm = LLM(backend="fake", announce=False, max_num_seqs=2)
    assert asked and llm.engine.num_kv_blocks >= 1
    assert kv_cache_budget(None, None, 0.9) <= 256 * (1 << 20)  # no device memory reported: a share of the host's RAM


@pytest.mark.parametrize("forbidden", ['device.type == "cuda"', "torch.cuda", "getattr(torch, device.type"])
def test_the_engine_names_no_device_api(forbidden):
    from pathlib import Path

    from deepinfer import engine

    for path in Path(engine.__file__).parent.glob("*.py"):
        assert forbidden not in path.read_text(), f"{path.name} has {forbidden}"


def test_decode_steps_that_process_their_logits_replay_the_forward_and_sample_outside_it(monkeypatch):
    """Penalties, a logit bias and logprobs: such a decode step cannot sample inside the whole-step
    graph, so it replays the forward-only graph of its bucket and samples from its logits; tokens
    and logprobs equal the eager run's, and the model runs eagerly only in prefill steps."""
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, repetition_penalty=1.3, presence_penalty=0.5, logit_bias={5: 2.0}, logprobs=2)
    plain = llm_on(monkeypatch, FakeBackend(), "reference").generate(PROMPTS, params, use_tqdm=False)
    graphs = RecordingGraphs()
    llm = llm_on(monkeypatch, FakeBackend(graphs=graphs), "fake")
    runner = llm.engine.runner
    eager, forward = [], runner.model.forward
    monkeypatch.setattr(runner.model, "forward", lambda batch, *a, **kw: eager.append(batch.is_prefill) or forward(batch, *a, **kw))
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    for got, expected in zip(outputs, plain):
        assert got.outputs[0].cumulative_logprob == pytest.approx(expected.outputs[0].cumulative_logprob, abs=1e-4)
    assert not runner.graphs.graphs and set(runner.graphs.row_graphs) == {(4, 1)}, "the steps replayed forward-only graphs"
    assert graphs.replays == 5  # the 5 decode steps after the prefill
    decode_forwards = len(eager) - sum(eager)  # the recording graphs call the forward to capture and to replay
    assert decode_forwards == graphs.warmups + len(graphs.captured) + graphs.replays, "a decode step ran its forward eagerly"


def test_overlapped_grammar_steps_replay_the_forward_graph_then_sample(monkeypatch):
    """Overlap scheduling with grammars on a backend with graphs: a constrained decode step goes
    ahead as a replay of its bucket's forward-only graph, sampled once the step before's tokens have
    advanced the matchers; the tokens are those of the same backend without overlap, and the model
    runs eagerly only in prefill steps."""
    params = [
        SamplingParams(seed=1, max_tokens=10, structured_outputs={"regex": "[0-9]{5}"}),
        SamplingParams(temperature=0.8, seed=2, max_tokens=8, repetition_penalty=1.3, logprobs=1),
        SamplingParams(seed=3, max_tokens=10, presence_penalty=0.5, structured_outputs={"choice": ["north", "south", "east"]}),
    ]
    # Each engine's first run compiles the grammars (cached after it): the compared runs admit every
    # request in the first step, whatever the machine's load, so the batches are the same.
    without = llm_on(monkeypatch, FakeBackend(graphs=RecordingGraphs()), "fake", overlap=False)
    without.generate(PROMPTS, params, use_tqdm=False)
    plain = without.generate(PROMPTS, params, use_tqdm=False)
    graphs = RecordingGraphs()
    llm = llm_on(monkeypatch, FakeBackend(graphs=graphs), "fake", overlap=True)
    llm.generate(PROMPTS, params, use_tqdm=False)
    runner = llm.engine.runner
    eager, forward = [], runner.model.forward
    monkeypatch.setattr(runner.model, "forward", lambda batch, *a, **kw: eager.append(batch.is_prefill) or forward(batch, *a, **kw))
    pending, launch_forward = [], runner.launch_forward
    monkeypatch.setattr(runner, "launch_forward", lambda batch, inputs_from=None: pending.append(len(batch.seqs)) or launch_forward(batch, inputs_from))
    before = graphs.warmups + len(graphs.captured) + graphs.replays
    ahead = llm.engine.overlap.steps_ahead
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in plain]
    assert outputs[1].outputs[0].cumulative_logprob == pytest.approx(plain[1].outputs[0].cumulative_logprob, abs=1e-4)
    assert [o.outputs[0].finish_reason for o in outputs] == ["stop", "length", "stop"]
    assert len(pending) > 1 and llm.engine.overlap.steps_ahead - ahead >= len(pending)
    decode_forwards = len(eager) - sum(eager)  # the recording graphs call the forward to capture and to replay
    assert decode_forwards == graphs.warmups + len(graphs.captured) + graphs.replays - before, "a decode step ran its forward eagerly"


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0, max_tokens=6, repetition_penalty=0.4, logit_bias={5: 2.0}, logprobs=2)],
                         ids=["greedy", "options"])  # fmt: skip
def test_verification_steps_replay_graphs_of_their_padded_shape(monkeypatch, params):
    """Speculative verification on a backend with graphs: each step replays the graph of (batch
    bucket, longest request's rows), shorter requests padded; greedy tokens (and logprobs) stay those
    of eager steps without speculation, with options processed on the replay's logits too."""
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.engine.speculative.controlled_draft import ControlledDraft, geometric_profile

    plain = llm_on(monkeypatch, FakeBackend(), "reference").generate(PROMPTS, params, use_tqdm=False)
    want = [o.outputs[0].token_ids for o in plain]
    graphs = RecordingGraphs()
    spec = {"method": "mtp", "num_drafts": 3, "policy": "confidence", "cost_model": {"1": 0.01, "4096": 0.01, "draft": 0.0}}
    base = llm_on(monkeypatch, FakeBackend(graphs=graphs), "fake", speculative=spec)
    prompts = [base.engine.tokenizer.encode(p) for p in PROMPTS]
    draft = ControlledDraft({tuple(p): w for p, w in zip(prompts, want)}, geometric_profile(0.9, 0.7, 3), base.engine.vocab_size, spread=0.9)
    llm = LLM.from_engine(LLMEngine(base.engine.loaded, base.engine.runtime, base.engine.dtype, base.engine.config, draft_source=draft))
    runner = llm.engine.runner
    shapes, forward_rows = [], runner.forward_rows
    monkeypatch.setattr(runner, "forward_rows", lambda seqs, starts, rows: shapes.append(sorted({len(r) for r in rows})) or forward_rows(seqs, starts, rows))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == want
    for got, expected in zip(outputs, plain):
        assert got.outputs[0].cumulative_logprob == pytest.approx(expected.outputs[0].cumulative_logprob, abs=1e-4)
    assert runner.graphs.row_graphs and all(per_seq <= 4 for _, per_seq in runner.graphs.row_graphs)
    assert any(len(s) > 1 for s in shapes), "no step mixed request lengths: padding went untested"
    assert llm.speculative_metrics()["accepted_per_verified"] > 0


def test_the_confidence_policy_prices_graph_steps(monkeypatch):
    """With graphs, the start-up cost probe times verification graphs (capturing them) and the
    confidence policy prices a step by its padded rows; greedy tokens stay the eager run's. (cost_model
    "measure": measured now, whatever an earlier run kept for this machine.)"""
    want = tokens(llm_on(monkeypatch, FakeBackend(), "reference"))
    graphs = RecordingGraphs()
    spec = {"method": "mtp", "num_drafts": 3, "policy": "confidence", "cost_model": "measure"}
    llm = llm_on(monkeypatch, FakeBackend(graphs=graphs), "fake", speculative=spec)
    probed = set(llm.engine.runner.graphs.row_graphs)
    assert probed and max(per_seq for _, per_seq in probed) == 4  # 4 sequences x 4 rows: the most a step holds
    assert llm.engine.speculative.policy.padded
    assert tokens(llm) == want
