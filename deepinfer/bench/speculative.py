"""Speculative decoding's verification policies on the V2-Lite-shaped random model: fixed k against
confidence-driven, at a given number of concurrent requests.

Random weights accept no MTP draft, so the drafts come from a ControlledDraft: each request's
greedy continuation is recorded by a run without speculation, and draft i agrees with it with
probability first * decay^i (times a per-request factor in [1 - spread, 1], so some requests are
more predictable than others), reporting that probability as its confidence (a calibrated
confidence head). What is measured is the policy itself: how many drafts it verifies, how many it
keeps, and the tokens per second of the whole run (prefill included, the same for every mode),
against the run without speculation (CUDA graphs on in both: verification steps replay graphs of
their padded shape; the MTP drafter's passes and prefill steps run eagerly).
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from deepinfer.bench.device_api import device_name, empty_cache, synchronize

KV_CACHE_GIB = 4.0  # each engine's cache: the runs' contexts are short


@dataclass
class SpecResult:
    concurrency: int
    mode: str  # "no speculation", "fixed-5", "confidence-5"
    seconds: float
    tokens_per_s: float
    acceptance_length: float | None
    drafts_verified_per_step: float | None
    accepted_per_verified: float | None
    outputs_equal: int  # requests whose tokens equal the run without speculation


def run(backend: str, concurrency: tuple[int, ...], *, layers: int | None, prompt_len: int, new_tokens: int, num_drafts: int,
        first: float, decay: float, spread: float, json_path: Path | None = None, on_result=None, deterministic: bool = False) -> list[SpecResult]:  # fmt: skip
    """on_result(SpecResult): called as each row is measured (a run cut short keeps what it measured).
    deterministic: every engine in deterministic mode, so that a request's logits, and its greedy
    continuation, do not depend on the step's batch shapes (verification steps are not decode
    steps): in bf16 the default mode's near-ties resolve differently with speculation, the
    continuation is left and the controlled drafts stop agreeing."""
    from deepinfer.bench.e2e import V2_LITE, build_v2_lite
    from deepinfer.engine.llm import LLM
    from deepinfer.engine.llm_engine import EngineConfig, LLMEngine
    from deepinfer.engine.sampling_params import SamplingParams
    from deepinfer.engine.speculative.controlled_draft import ControlledDraft, geometric_profile
    from deepinfer.engine.speculative.metrics import SpeculativeMetrics
    from deepinfer.runtime import open_runtime

    cfg = dict(V2_LITE, **({"num_hidden_layers": layers} if layers else {}))
    runtime = open_runtime(backend, dtype=torch.bfloat16, deterministic=deterministic)
    device = runtime.device
    loaded, hf = build_v2_lite(runtime, cfg)
    del hf
    gc.collect()
    empty_cache(device)
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    results = []
    for n in concurrency:
        prompts = [{"prompt_token_ids": p.tolist()} for p in torch.randint(0, cfg["vocab_size"], (n, prompt_len), generator=gen)]

        def engine(spec=None, draft=None):
            # no prefix cache: the warm-up run and the timed one do the same work (a hit's prefill is another kernel variant)
            config = EngineConfig(max_num_seqs=n, max_num_batched_tokens=max(n * prompt_len, 8192), kv_cache_memory_gib=KV_CACHE_GIB, speculative=spec,
                                  enable_prefix_caching=False, deterministic=deterministic)  # fmt: skip
            return LLM.from_engine(LLMEngine(loaded, runtime, torch.bfloat16, config, draft_source=draft))

        def timed(llm):
            llm.generate(prompts, greedy, use_tqdm=False)  # warm-up: compiles, captures graphs, calibrates
            if llm.engine.speculative is not None:
                llm.engine.speculative.metrics = SpeculativeMetrics()  # count the timed run only
            synchronize(device)
            start = time.perf_counter()
            out = llm.generate(prompts, greedy, use_tqdm=False)
            synchronize(device)
            return time.perf_counter() - start, [o.outputs[0].token_ids for o in out]

        plain = engine()
        seconds, want = timed(plain)
        results.append(SpecResult(n, "no speculation", seconds, n * new_tokens / seconds, None, None, None, n))
        if on_result:
            on_result(results[-1])
        del plain
        continuations = {tuple(p["prompt_token_ids"]): w for p, w in zip(prompts, want)}
        for policy in ("fixed", "confidence"):
            draft = ControlledDraft(continuations, geometric_profile(first, decay, num_drafts), cfg["vocab_size"], spread=spread)
            llm = engine({"method": "mtp", "num_drafts": num_drafts, "policy": policy}, draft)
            seconds, got = timed(llm)
            m = llm.engine.speculative.metrics.summary()
            equal = sum(g == w for g, w in zip(got, want))
            results.append(SpecResult(n, f"{policy}-{num_drafts}", seconds, n * new_tokens / seconds, m["acceptance_length"],
                                      m["drafts_verified_per_step"], m["accepted_per_verified"], equal))  # fmt: skip
            if on_result:
                on_result(results[-1])
            del llm
            gc.collect()
            empty_cache(device)
    if json_path is not None:
        info = {"device": device_name(device), "torch": torch.__version__, "layers": cfg["num_hidden_layers"], "backend": runtime.backend.name,
                "prompt_len": prompt_len, "new_tokens": new_tokens, "deterministic": deterministic,
                "profile": {"first": first, "decay": decay, "spread": spread}, "date": time.strftime("%Y-%m-%d")}  # fmt: skip
        json_path.write_text(json.dumps({"machine": info, "results": [asdict(r) for r in results]}, indent=1))
    return results


def format_results(results: list[SpecResult]) -> str:
    lines = ["concurrent  mode            tok/s  vs none  accept len  verified/step  accepted/verified  outputs equal"]
    base = {r.concurrency: r.tokens_per_s for r in results if r.acceptance_length is None}
    for r in results:
        spec = (f"{r.acceptance_length:10.2f}  {r.drafts_verified_per_step:13.2f}  {r.accepted_per_verified:17.1%}"
                if r.acceptance_length is not None else f"{'-':>10}  {'-':>13}  {'-':>17}")  # fmt: skip
        ratio = r.tokens_per_s / base[r.concurrency]
        lines.append(f"{r.concurrency:10d}  {r.mode:<14}  {r.tokens_per_s:5.0f}  {ratio:6.2f}x  {spec}  {r.outputs_equal:>5}/{r.concurrency}")
    return "\n".join(lines)
