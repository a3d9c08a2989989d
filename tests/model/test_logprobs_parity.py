"""logprobs and prompt_logprobs against transformers: the log_softmax of the same tiny V3 and V2
checkpoints' logits (written by transformers, float32 on the CPU), within 1e-4, for sampled tokens
and for prompt tokens, through the engine on the reference backend (chunked prefill and decode
steps, processed logits beside them)."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer import LLM, SamplingParams

from model.model_oracle import PROMPTS

TOL = 1e-4
TOP = 5


@pytest.fixture(scope="module", params=["v3", "v2"])
def pair(request):
    folder, hf = request.getfixturevalue(f"{request.param}_checkpoint")
    # A 4-token step budget: the 23-token prompt prefills in chunks, its prompt logprobs gathered chunk by chunk.
    llm = LLM(model=str(folder), backend="reference", dtype="float32", announce=False, num_kv_blocks=64, max_num_batched_tokens=8)
    return llm, hf


@torch.no_grad()
def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row p is transformers' log_softmax of the logits after ids[: p + 1]."""
    return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check(position, chosen: int, reference: torch.Tensor):
    """Every entry within TOL of transformers; the top ids are transformers' top ones (up to ties within TOL)."""
    assert next(iter(position)) == chosen
    for token, entry in position.items():
        assert abs(entry.logprob - float(reference[token])) < TOL, (token, entry.logprob, float(reference[token]))
    top = [t for t, entry in position.items() if entry.rank <= TOP]  # the top ones carry ranks 1..TOP; a chosen token outside them ranks lower
    kth = float(torch.topk(reference, TOP).values[-1])
    assert len(top) == TOP and all(float(reference[t]) >= kth - TOL for t in top)


def test_logprobs_match_transformers_log_softmax(pair):
    llm, hf = pair
    params = SamplingParams(temperature=0.9, seed=4, max_tokens=6, ignore_eos=True, logprobs=TOP, prompt_logprobs=TOP, repetition_penalty=1.3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        completion = out.outputs[0]
        ids = prompt + completion.token_ids
        reference = hf_logprobs(hf, ids)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for p in range(1, len(prompt)):
            check(out.prompt_logprobs[p], prompt[p], reference[p - 1])
        assert len(completion.logprobs) == len(completion.token_ids) == 6
        total = 0.0
        for i, (token, position) in enumerate(zip(completion.token_ids, completion.logprobs)):
            row = reference[len(prompt) + i - 1]
            check(position, token, row)
            total += float(row[token])
        assert math.isclose(completion.cumulative_logprob, total, abs_tol=6 * TOL)
