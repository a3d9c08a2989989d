"""Deterministic mode's cost on the reference backend (docs/performance.md, "Deterministic mode"):
decode ms/step at batch 1 and 64 and the prefill of 128 tokens per request, default against
deterministic, the embedded tiny V3 in float32. Decode: (time of 9 tokens - time of 1) / 8;
prefill: the time of 1 token."""

from __future__ import annotations

import time

from deepinfer import LLM, SamplingParams


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    for deterministic in (False, True):
        llm = LLM(backend="reference", dtype="float32", announce=False, num_kv_blocks=2048, deterministic=deterministic, enable_prefix_caching=False)
        for batch in (1, 64):
            prompts = [{"prompt_token_ids": list(range(10, 138))} for _ in range(batch)]

            def generate(n: int):
                return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)

            generate(1)
            one = timed(lambda: generate(1))
            nine = timed(lambda: generate(9))
            print(f"deterministic={deterministic} batch={batch}: decode {(nine - one) / 8 * 1e3:.1f} ms/step, prefill {one * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
