"""Where a constrained decode step's host time goes (H200): `bench structured`'s model and requests
(batch 64, all constrained or none), with the overlap scheduler's pieces timed on the host:
launch_forward, _finish (waits for step n's tokens, feeds the matchers), sample_pending (fills the
masks, processes the logits, launches the sampling), the mask fill alone, and the step in all.
Prints ms per step for each, and tok/s."""

from __future__ import annotations

import argparse
import collections
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()

    from deepinfer.bench import structured as bench
    from deepinfer.engine import logits_processing, overlap
    from deepinfer.engine.model_runner import ModelRunner
    from deepinfer.engine.sampling_params import SamplingParams

    llm = bench.deepseek_vocab_shape_llm("cuda", args.layers, {"seed": 0})
    spent = collections.defaultdict(float)
    calls = collections.Counter()

    def timed(owner, name, key):
        inner = getattr(owner, name)

        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                spent[key] += time.perf_counter() - start
                calls[key] += 1

        setattr(owner, name, wrapper)

    timed(ModelRunner, "launch_forward", "launch_forward")
    timed(ModelRunner, "sample_pending", "sample_pending")
    timed(ModelRunner, "launch", "launch (whole step)")
    timed(overlap.OverlapScheduler, "_finish", "_finish")
    timed(overlap.OverlapScheduler, "step", "step")
    timed(logits_processing.GrammarMasks, "fill", "mask fill")
    timed(logits_processing.LogitsProcessing, "apply", "processing apply")
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(2, llm.engine.vocab_size, (32,), generator=gen).tolist()} for _ in range(args.batch)]
    spec = bench.spec_of(bench.min_items(args.output_len))
    for share in (0.0, 1.0):
        constrained = round(share * args.batch)
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.output_len, ignore_eos=True, structured_outputs=spec if i < constrained else None)
                  for i in range(args.batch)]  # fmt: skip
        llm.generate(prompts, params, use_tqdm=False)
        llm.reset_prefix_cache()
        spent.clear()
        calls.clear()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        llm.reset_prefix_cache()
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        steps = calls["step"] or 1
        print(f"constrained {constrained}/{args.batch}: {tokens / wall:.0f} tok/s, {1e3 * wall / steps:.2f} ms per step over {steps} steps")
        for key in sorted(spent, key=lambda k: -spent[k]):
            print(f"  {key:22s} {1e3 * spent[key] / steps:7.3f} ms/step ({calls[key]} calls)")


if __name__ == "__main__":
    main()
