"""Start-up warm-up: compile and capture before the first request what serving would otherwise
compile in the middle of it.

The Triton kernels specialise on a step's size: the cuda backend makes every compile-time choice
(tiles, split-K) from the power-of-two bucket of the step's tokens and leaves its size arguments
unspecialised, so one step of each power of two compiles every kernel a step of that bucket needs;
and a decode batch replays the device graph of its size bucket, captured on first use. Without a warm-up the first requests of each new size stall every running
request for the compile or capture (on the H200, a second or more at a time in `bench serve`: the
p99 inter-token gaps). The warm-up runs one prefill of every power of two up to the step's token
budget (random prompts, one token each) and captures the decode graphs of every bucket (the whole
step's, and the forward-only one that steps with processed logits or logprobs replay), then forgets
the prefix cache and the counters it moved: requests after it run, and are seeded, as without it.
"""

from __future__ import annotations

import time

import torch

from deepinfer.engine.sampling_params import InvalidRequestError, SamplingParams


def prefill_sizes(budget: int) -> list[int]:
    """1, 2, 4, ... up to `budget`, and `budget` itself."""
    sizes, n = [], 1
    while n < budget:
        sizes.append(n)
        n *= 2
    return sizes + [budget]


def warm_up(engine, seed: int = 0) -> dict[str, float]:
    """Warm `engine` up (module docstring); returns what it did: prefills, graphs, seconds."""
    if engine.dist is not None:
        raise InvalidRequestError("the start-up warm-up does not run under expert parallelism yet (its steps would need every rank); leave it off")
    if engine.has_unfinished():
        raise InvalidRequestError("warm up an engine before it takes requests, not while requests run")
    start = time.perf_counter()
    counters = engine.num_prompt_tokens_computed, engine.num_generated_tokens, engine._next_request_index
    budget = min(engine.config.max_num_batched_tokens, engine.max_model_len - 1, engine.num_kv_blocks * engine.block_size - 1)
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    sizes = prefill_sizes(max(1, budget))
    for i, n in enumerate(sizes):  # one at a time: each step is exactly n tokens
        prompt = torch.randint(0, engine.vocab_size, (n,), generator=gen).tolist()
        engine.add_request(prompt, params, what="a warm-up prompt", index=counters[2] + i)
        while engine.has_unfinished():
            engine.step()
    captured = capture_graphs(engine)
    engine.reset_prefix_cache()
    engine.num_prompt_tokens_computed, engine.num_generated_tokens, engine._next_request_index = counters
    return {"prefills": len(sizes), "largest_prefill": sizes[-1], "graphs_captured": captured, "seconds": time.perf_counter() - start}


def capture_graphs(engine) -> int:
    """Capture every decode graph the engine's steps may replay, now rather than on first use (a capture mid-run
    costs that step tens of milliseconds): per batch bucket the whole step and the forward alone of 1 to
    max_tokens_per_seq rows a sequence (speculative verification: 1 + k; the policies pick the width step by step).
    Returns how many were captured (those captured already are kept)."""
    graphs = engine.runner.graphs
    if graphs is None:
        return 0
    captured = 0
    for size in graphs.buckets:
        captured += size not in graphs.graphs
        graphs.capture(size)
        for per_seq in range(1, graphs.max_tokens_per_seq + 1):  # the forward alone: steps that process their logits sample outside it
            captured += (size, per_seq) not in graphs.row_graphs
            graphs.capture_rows(size, per_seq)
    return captured
