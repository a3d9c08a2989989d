"""Where a constrained decode step's host time goes (H200): `bench structured`'s model and requests
(batch 64, all constrained or none), with the overlap scheduler's pieces timed on the host:
launch_forward, _finish (waits for step n's tokens, feeds the matchers), sample_pending (fills the
masks, processes the logits, launches the sampling), the mask fill alone, the matchers' accepts, the
host's waits for the device (step n's tokens; the mask buffer's last copy) and the step in all.
Prints ms per step for each, and tok/s; then the mask fill of 64 rows at each llguidance executor
thread count (`--threads`)."""

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
    p.add_argument("--threads", default="1,2,4,8,12", help="executor thread counts for the mask-fill sweep")
    args = p.parse_args()

    from deepinfer.bench import structured as bench
    from deepinfer.engine import logits_processing, overlap, structured_output
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.engine.model_runner import ModelRunner
    from deepinfer.engine.sampling_params import SamplingParams
    from deepinfer.engine.scheduler import Scheduler

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
    timed(structured_output.SequenceGrammar, "accept", "grammar accept")
    timed(Scheduler, "schedule_decode_ahead", "schedule ahead")
    timed(LLMEngine, "step", "engine step")
    finish, fill = overlap.OverlapScheduler._finish, logits_processing.GrammarMasks.fill

    def finish_waited(self, step):  # the host idles here until the device has step n's tokens
        if step.copied is not None:
            start = time.perf_counter()
            step.copied.synchronize()
            spent["wait: step n tokens"] += time.perf_counter() - start
        return finish(self, step)

    def fill_waited(self, num_rows, rows):
        if self._copied is not None:
            start = time.perf_counter()
            self._copied.synchronize()
            spent["wait: mask buffer"] += time.perf_counter() - start
        return fill(self, num_rows, rows)

    overlap.OverlapScheduler._finish = finish_waited
    logits_processing.GrammarMasks.fill = fill_waited
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
    import llguidance

    for threads in (int(t) for t in args.threads.split(",")):
        structured_output._executor = llguidance.LLExecutor(threads)
        (fill,) = bench.mask_fill(llm, [args.batch], steps=30)
        print(f"mask fill, {args.batch} rows, {threads} executor threads: {fill.ms_per_step:.3f} ms")


if __name__ == "__main__":
    main()
