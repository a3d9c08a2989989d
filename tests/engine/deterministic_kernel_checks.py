"""Deterministic mode end to end through the cuda and ascend Triton kernels, in the interpreter on
the CPU (on a GPU: `TRITON_INTERPRET=0 pytest tests/engine/test_deterministic_kernels_cuda.py`, as tools/gpu/check.sh runs
it): the tiny V3 with a 512-token vocabulary and one layer (MLA attention and a MoE), float32. A request's
logits are bit-identical at every step alone and among 17 and 64 other requests, prefilled in chunks and
after a prefix hit; 200 seeded temperature-1 one-token completions over differently composed batches are
identical (on a GPU only: the decode steps' logits are the first test's). Sizes are the smallest that still cross what the
kernels' plans depend on (a second 64-row GEMM tile, a second KV page, chunk boundaries): the
interpreter pays per program.

The checks take the backend from a `backend` fixture: test_deterministic_kernels_cuda.py and
test_deterministic_kernels_ascend.py import them, one file per backend (two files spread over CI's
two workers)."""

from __future__ import annotations

import os

import pytest

from engine.determinism import SMALL_VOCAB, ProbeLogits, differing_steps, neighbour_prompts, run_probe, write_small_checkpoint

SHORT = (1, 4)  # neighbours' prompt lengths


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_small_checkpoint(tmp_path_factory.mktemp("small") / "tiny-v3-small-vocab", num_hidden_layers=1, first_k_dense_replace=0)


def _llm(checkpoint, backend, **kwargs):
    from deepinfer import LLM

    from triton_mode import GPU, mode

    interpret = not (backend == "cuda" and mode() == GPU)  # TRITON_INTERPRET=0 on a GPU: the cuda kernels compiled
    return LLM(model=str(checkpoint), backend=backend, interpret=interpret, dtype="float32", announce=False, num_kv_blocks=64,
               deterministic=True, **kwargs)  # fmt: skip


def test_logits_do_not_depend_on_the_batch(checkpoint, backend):
    llm = _llm(checkpoint, backend, enable_prefix_caching=False)
    recorder = ProbeLogits(llm)
    probe = list(range(100, 106))
    alone, tokens, _ = run_probe(llm, recorder, probe, [], 2)
    for n in (17, 64):  # past the 16-row tile of the float32 GEMM plan; past a 64-row tile
        steps, got, _ = run_probe(llm, recorder, probe, neighbour_prompts(n, SMALL_VOCAB, seed=n, lengths=SHORT), 2)
        assert (differing_steps(alone, steps), got) == ([], tokens), f"{n} neighbours"


def test_chunked_prefill_and_a_prefix_hit_give_the_same_logits(checkpoint, backend):
    whole = _llm(checkpoint, backend, enable_prefix_caching=False)
    probe = list(range(100, 102 + whole.engine.block_size))  # a full page and two tokens (cuda: 64 tokens a page, ascend: 128)
    alone, tokens, _ = run_probe(whole, ProbeLogits(whole), probe, [], 2)
    chunked = _llm(checkpoint, backend, max_num_batched_tokens=40)
    recorder = ProbeLogits(chunked)
    steps, got, _ = run_probe(chunked, recorder, probe, neighbour_prompts(2, SMALL_VOCAB, seed=7, lengths=SHORT), 2)
    assert (differing_steps(alone, steps), got) == ([], tokens), "chunked prefill"
    steps, got, cached = run_probe(chunked, recorder, probe, [], 2)  # the probe's full pages are cached now
    assert cached > 0
    assert (differing_steps(alone, steps), got) == ([], tokens), "after a prefix hit"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="runs with the kernels compiled on a GPU (TRITON_INTERPRET=0): in CI the reference backend's 200 completions "
                    "(tests/engine/test_deterministic.py) and the sampling kernels' batch invariance cover it; "
                    "the interpreter took a minute of a 20-minute CI")
def test_seeded_sampling_is_identical_over_200_completions(checkpoint, backend):
    from deepinfer import SamplingParams

    llm = _llm(checkpoint, backend, enable_prefix_caching=False)
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=1, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    completions = []
    for i, (probes, others) in enumerate([(1, 0), (7, 5), (64, 3), (128, 0)]):
        prompts = [{"prompt_token_ids": [5, 6]}] * probes + neighbour_prompts(others, SMALL_VOCAB, seed=100 + i, lengths=SHORT)
        outs = llm.generate(prompts, [params] * probes + [greedy] * others, use_tqdm=False)
        completions += [tuple(o.outputs[0].token_ids) for o in outs[:probes]]
    assert len(completions) == 200
    assert len(set(completions)) == 1, sorted(set(completions))


def test_speculative_verification_gives_the_decode_steps_logits(checkpoint, backend):
    """Deterministic mode with speculation: a verification step scores the request's last token and
    its drafts together (S = 4 query tokens); each kept row's logits are the bits the plain decode
    step of that position gives (drafts from a source that always agrees: every row is kept)."""
    import dataclasses

    from deepinfer import LLM
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.engine.speculative.controlled_draft import ControlledDraft

    from engine.determinism import PROBE_SEED

    plain = _llm(checkpoint, backend, enable_prefix_caching=False)
    probe = list(range(100, 106))
    alone, tokens, _ = run_probe(plain, ProbeLogits(plain), probe, [], 5)
    engine = plain.engine
    config = dataclasses.replace(engine.config, speculative={"method": "mtp", "num_drafts": 3})
    config.validate()
    draft = ControlledDraft({tuple(probe): tokens}, [1.0], SMALL_VOCAB)
    spec = LLM.from_engine(LLMEngine(engine.loaded, engine.runtime, engine.dtype, config, draft_source=draft))
    ops, verified = spec.engine.runner.ops, {}
    inner = ops.rejection_sample

    def recording(logits, draft_tokens, cu_rows, temperature, top_k, top_p, min_p, seeds, positions):
        out = inner(logits, draft_tokens, cu_rows, temperature, top_k, top_p, min_p, seeds, positions)
        for b, seed in enumerate(seeds.tolist()):
            if seed == PROBE_SEED:
                for i, row in enumerate(range(int(cu_rows[b]), int(cu_rows[b + 1]))):
                    if int(out[row]) >= 0:
                        verified[int(positions[b]) + i] = logits[row].detach().to("cpu", copy=True)
        return out

    ops.rejection_sample = recording
    try:
        recorder = ProbeLogits(spec)
        first, got, _ = run_probe(spec, recorder, probe, neighbour_prompts(1, SMALL_VOCAB, seed=3, lengths=SHORT), 5)
    finally:
        ops.rejection_sample = inner
    assert got == tokens
    assert len(verified) >= 3  # the probe's 4 decoded tokens came from verification rows (several per step)
    steps = {**first, **verified}
    assert differing_steps(alone, {p: steps[p] for p in alone}) == []
