"""The engine tests' greedy oracle: each next token from a fresh prefill of the whole sequence so far.

It needs no decode step and no cache reuse, so every other way of running a prompt (batched,
chunked, after a prefix hit or a preemption) must give its tokens.
"""

from __future__ import annotations

from deepinfer import SamplingParams

ONE_GREEDY_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def greedy_by_fresh_prefill(llm, tokenizer, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """`llm` must run without prefix caching (a hit would reuse the cache)."""
    want = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        out = []
        for _ in range(max_tokens):
            out.append(llm.generate({"prompt_token_ids": ids + out}, ONE_GREEDY_TOKEN, use_tqdm=False)[0].outputs[0].token_ids[0])
        want.append(out)
    return want


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]
