"""The start-up warm-up (engine/warmup.py): every power-of-two prefill up to the token budget, every
decode graph bucket, and afterwards an engine that runs and seeds requests as one never warmed up."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.engine.sampling_params import InvalidRequestError
from deepinfer.engine.warmup import prefill_sizes


def test_prefill_sizes_are_the_powers_of_two_then_the_budget():
    assert prefill_sizes(1) == [1]
    assert prefill_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert prefill_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]


class FakeGraphs:
    """Stands in for DecodeGraphs: records what is captured (the CPU has no device graphs)."""

    def __init__(self, buckets, max_tokens_per_seq=1):
        self.buckets, self.graphs, self.row_graphs, self.captured = buckets, {}, {}, []
        self.max_tokens_per_seq = max_tokens_per_seq

    def capture(self, size):
        self.captured.append(size)
        self.graphs[size] = object()

    def capture_rows(self, size, per_seq):
        self.captured.append((size, per_seq))
        self.row_graphs[(size, per_seq)] = object()


def test_warm_up_prefills_every_size_captures_every_bucket_and_leaves_no_trace():
    llm = LLM(backend="reference", announce=False, max_num_batched_tokens=40, seed=5)
    engine = llm.engine
    assert not llm.compiles_on_first_use, "the reference backend compiles nothing: serve skips the warm-up"
    prefills = []
    run = engine.runner.run
    engine.runner.run = lambda batch, *a, **kw: (prefills.append(sum(batch.num_new_tokens)) if batch.is_prefill else None) or run(batch, *a, **kw)
    engine.runner.graphs = graphs = FakeGraphs([1, 2, 4])
    graphs.graphs[2] = object()  # captured already: not again
    done = llm.warm_up()
    engine.runner.run, engine.runner.graphs = run, None
    assert prefills == [1, 2, 4, 8, 16, 32, 40] and done["prefills"] == 7 and done["largest_prefill"] == 40
    assert graphs.captured == [1, (1, 1), 2, (2, 1), 4, (4, 1)] and done["graphs_captured"] == 5  # whole-step and forward-only graphs
    assert not engine.has_unfinished() and not engine.block_manager.cached
    assert engine.num_generated_tokens == 0 and engine.num_prompt_tokens_computed == 0

    params = SamplingParams(temperature=1.0, max_tokens=6)  # unseeded: seeds derive from the engine's request index

    def sampled(engine):
        seqs = [engine.add_request([3, 1, 4, 1, 5], params), engine.add_request([9, 2, 6], params)]
        while engine.has_unfinished():
            engine.step()
        return [s.seq_id for s in seqs], [s.token_ids for s in seqs]

    cold = LLM(backend="reference", announce=False, max_num_batched_tokens=40, seed=5)
    assert sampled(engine) == sampled(cold.engine)


def test_warm_up_refuses_a_busy_engine():
    llm = LLM(backend="reference", announce=False)
    llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="before it takes requests"):
        llm.warm_up()


def test_every_verification_width_is_captured_up_front():
    """With speculative decoding (1 + k rows a sequence), every width's forward graph is captured at warm-up: the
    policies pick the width step by step, and a capture on first use costs that step (on the H100 the online
    confidence policy ran 0.81x of fixed-k at 16 requests with the same drafts verified, its widths captured mid-run)."""
    from deepinfer.engine.warmup import capture_graphs

    llm = LLM(backend="reference", announce=False, max_num_batched_tokens=40)
    llm.engine.runner.graphs = graphs = FakeGraphs([1, 2], max_tokens_per_seq=4)
    graphs.row_graphs[(2, 3)] = object()  # captured already: not again
    assert capture_graphs(llm.engine) == 9
    assert graphs.captured == [1, (1, 1), (1, 2), (1, 3), (1, 4), 2, (2, 1), (2, 2), (2, 3), (2, 4)]  # (asked; kept if captured)
    llm.engine.runner.graphs = None
