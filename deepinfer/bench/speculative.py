"""Speculative decoding's verification policies on the V2-Lite-shaped random model: fixed k against
confidence-driven (calibrated online, `confidence`; or read off a confidence head as DSpark's is, `head`),
at a given number of concurrent requests.

Random weights accept no MTP draft, so the drafts come from a ControlledDraft: each request's
greedy continuation is recorded by a run without speculation, and draft i agrees with it with
probability first * decay^i (times a per-request factor in [1 - spread, 1], so some requests are
more predictable than others), reporting that probability as its confidence (a calibrated
confidence head: exactly what DSpark's head is trained to predict, so the `head` rows measure DSpark's
policy on drafts of known acceptance). What is measured is the policy itself: how many drafts it verifies, how many it
keeps, and the tokens per second of the whole run (prefill included, the same for every mode),
against the run without speculation (CUDA graphs on in both: verification steps replay graphs of
their padded shape; the MTP drafter's passes and prefill steps run eagerly).

The engines run in deterministic mode by default (batch-invariant kernels): a verification step is
not a decode step, and with the backend's fastest kernels a request's logits depend on the step's
shape, so in bf16 near-ties resolve differently with speculation than in the recorded run; from
there the output leaves its recorded continuation, its drafts stop agreeing and acceptance counts
nothing (on an H100: acceptance length 1.05 and 0/16 outputs equal, against 2.37 and 16/16). So
the rows whose outputs left their continuations are flagged (`left_continuations`): in
deterministic mode that is a bug, without it (`deterministic=False`) the figures under-count.
Deterministic kernels are slower than the fastest ones (on the reference backend much slower: its
sums are exact), so tokens/s compare modes with each other, not with a production run.
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
    mode: str  # "no speculation", "fixed-5", "confidence-5", "head-5"
    seconds: float
    tokens_per_s: float
    acceptance_length: float | None
    drafts_verified_per_step: float | None
    accepted_per_verified: float | None
    outputs_equal: int  # requests whose tokens equal the run without speculation

    @property
    def left_continuations(self) -> int:
        """Requests whose output left its recorded continuation (module docstring)."""
        return self.concurrency - self.outputs_equal


def run(backend: str, concurrency: tuple[int, ...], *, layers: int | None, prompt_len: int, new_tokens: int, num_drafts: int,
        first: float, decay: float, spread: float, json_path: Path | None = None, on_result=None, deterministic: bool = True,
        config_overrides: dict | None = None, policies: tuple[str, ...] = ("fixed", "confidence"),
        ) -> list[SpecResult]:  # fmt: skip
    """policies: the rows measured with speculation (SpeculativeConfig's policies), in order.
    on_result(SpecResult): called as each row is measured (a run cut short keeps what it measured).
    deterministic: every engine in deterministic mode (the default; module docstring), so that a
    request's logits, and its greedy continuation, do not depend on the step's batch shapes.
    config_overrides: change the model's shape (tests: a tiny one)."""
    from deepinfer.bench.e2e import V2_LITE, build_v2_lite
    from deepinfer.engine.llm import LLM
    from deepinfer.engine.llm_engine import EngineConfig, LLMEngine
    from deepinfer.engine.sampling_params import SamplingParams
    from deepinfer.engine.speculative.controlled_draft import ControlledDraft, geometric_profile
    from deepinfer.engine.speculative.metrics import SpeculativeMetrics
    from deepinfer.engine.warmup import capture_graphs

    cfg = {**V2_LITE, **(config_overrides or {}), **({"num_hidden_layers": layers} if layers else {})}
    runtime = open_speculative_runtime(backend, deterministic)
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
            return LLM.from_engine(LLMEngine(loaded, runtime, torch.bfloat16, config, draft_source=draft, announce=True))

        def timed(llm):
            capture_graphs(llm.engine)  # every verification width's graph: the policies pick widths step by step
            llm.generate(prompts, greedy, use_tqdm=False)  # warm-up: compiles, calibrates
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
        for policy in policies:
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
        rows = [{**asdict(r), "left_continuations": r.left_continuations} for r in results]
        json_path.write_text(json.dumps({"machine": info, "results": rows}, indent=1))
    return results


def open_speculative_runtime(backend: str, deterministic: bool):
    """The runtime, in deterministic mode unless asked otherwise (module docstring)."""
    from deepinfer.bench.deterministic_runtime import open_deterministic_runtime

    return open_deterministic_runtime(
        backend, torch.bfloat16, deterministic, "bench speculative runs in deterministic mode so that outputs keep to their recorded continuations",
        "measures with the backend's own kernels (rows whose outputs leave them are flagged, their acceptance under-counts)",
    )


def notes(results: list[SpecResult], deterministic: bool) -> list[str]:
    """What the table's figures cannot be trusted for: rows whose outputs left their recorded continuations."""
    left = [r for r in results if r.left_continuations]
    if not left:
        return []
    rows = ", ".join(f"{r.mode} at {r.concurrency} ({r.left_continuations} of {r.concurrency})" for r in left)
    if deterministic:
        return [f"error: outputs left their recorded continuations in deterministic mode: {rows}; speculation must keep a greedy "
                "request's tokens there, so this is a bug (please report it), and these rows' acceptance figures do not measure the policy"]  # fmt: skip
    return [f"warning: outputs left their recorded continuations: {rows}. Without --deterministic a verification step's logits differ "
            "from a decode step's, near-ties resolve differently, and from there a request's drafts stop agreeing: these rows' acceptance "
            "figures under-count. The default (deterministic mode) measures the policy."]  # fmt: skip


def format_results(results: list[SpecResult]) -> str:
    lines = ["concurrent  mode            tok/s  vs none  accept len  verified/step  accepted/verified  outputs equal"]
    base = {r.concurrency: r.tokens_per_s for r in results if r.acceptance_length is None}
    for r in results:
        spec = (f"{r.acceptance_length:10.2f}  {r.drafts_verified_per_step:13.2f}  {r.accepted_per_verified:17.1%}"
                if r.acceptance_length is not None else f"{'-':>10}  {'-':>13}  {'-':>17}")  # fmt: skip
        ratio = r.tokens_per_s / base[r.concurrency]
        flag = "  (left their continuations)" if r.left_continuations else ""
        lines.append(f"{r.concurrency:10d}  {r.mode:<14}  {r.tokens_per_s:5.0f}  {ratio:6.2f}x  {spec}  {r.outputs_equal:>5}/{r.concurrency}{flag}")
    return "\n".join(lines)
