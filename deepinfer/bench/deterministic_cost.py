"""`deepinfer bench e2e --deterministic-cost`: what deterministic mode costs a decode step, both modes
measured in one process, alternately.

Two runs of `bench e2e`, one per mode, set deterministic mode's cost at batch 64 anywhere between
+4% and +19% on one H200 while the kernels of the two modes differed by 5%: a decode step there was
partly host-bound and the host's share wandered from run to run. Here deepinfer's side is built twice
over the same random V2-Lite-shaped weights (default and deterministic mode), and the two engines take
turns, `repeat` rounds; each batch's step time per mode (generation of 1 + N tokens minus 1 token, over
N, as `bench e2e`) is the median over the rounds, and the cost is the ratio of the medians. No HF peer.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from deepinfer.bench import e2e
from deepinfer.bench.device_api import device_name


@dataclass
class CostResult:
    batch: int
    default_ms: float  # median ms per decode step over the rounds
    deterministic_ms: float
    cost: float  # deterministic_ms / default_ms - 1
    default_runs: list[float]
    deterministic_runs: list[float]


def run(
    backend: str = "auto",
    batches=(1, 64, 256),
    prompt_len: int = 128,
    new_tokens: int = 64,
    layers: int | None = None,
    repeat: int = 5,
    json_path: Path | None = None,
    config_overrides: dict | None = None,
    backend_options: dict[str, str] | None = None,
    overlap: bool | None = None,
) -> list[CostResult]:
    from deepinfer.runtime import open_runtime

    cfg = dict(e2e.V2_LITE, **(config_overrides or {}), **({"num_hidden_layers": layers} if layers else {}))
    engines = {}
    for deterministic in (False, True):
        runtime = open_runtime(backend, dtype=torch.bfloat16, options=backend_options, deterministic=deterministic)
        if not engines:  # both engines' weights and caches, checked before the first is built
            parts = e2e.memory_needed(cfg, max(batches), prompt_len, new_tokens, with_hf=False, copy_gib=0.0)
            twice = {f"{name}, both modes": 2 * value for name, value in parts.items() if value}
            e2e.check_fits(twice, e2e.free_memory(runtime.device, runtime.memory_info), runtime.device, cfg["num_hidden_layers"])
        loaded, hf = e2e.build_v2_lite(runtime, cfg)  # seed 0 both times: the same weights
        del hf  # deepinfer's model holds the tensors it runs
        engines[deterministic] = (e2e.bench_llm(loaded, runtime, max(batches), prompt_len, deterministic, overlap), runtime)
    gen = torch.Generator().manual_seed(1)
    results = []
    for batch in batches:
        prompts = e2e.random_prompts(cfg, batch, prompt_len, gen)
        for llm, _ in engines.values():  # compiles and graph captures stay out of the timing
            e2e.greedy(llm, prompts, 1), e2e.greedy(llm, prompts, 1 + new_tokens)
        steps = {False: [], True: []}
        for _ in range(repeat):
            for deterministic, (llm, runtime) in engines.items():
                t1 = e2e._timed(lambda: e2e.greedy(llm, prompts, 1), runtime.device)
                tn = e2e._timed(lambda: e2e.greedy(llm, prompts, 1 + new_tokens), runtime.device)
                steps[deterministic].append((tn - t1) / new_tokens * 1e3)
        default, det = statistics.median(steps[False]), statistics.median(steps[True])
        results.append(CostResult(batch, default, det, det / default - 1, steps[False], steps[True]))
    if json_path is not None:
        runtime = engines[False][1]
        info = {"gpu": device_name(runtime.device), "torch": torch.__version__, "layers": cfg["num_hidden_layers"], "backend": runtime.backend.name,
                "backend_options": dict(runtime.options), "prompt_len": prompt_len, "new_tokens": new_tokens, "repeat": repeat,
                "overlap": engines[False][0].engine.overlap is not None, "date": time.strftime("%Y-%m-%d")}  # fmt: skip
        json_path.write_text(json.dumps({"kind": "deterministic_cost", "machine": info, "results": [asdict(r) for r in results]}, indent=1))
    return results


def format_results(results: list[CostResult]) -> str:
    lines = ["batch  default ms/step (min-max)    deterministic ms/step (min-max)   cost"]
    for r in results:
        lines.append(f"{r.batch:5d}  {r.default_ms:8.2f} ({min(r.default_runs):.2f}-{max(r.default_runs):.2f})  "
                     f"{r.deterministic_ms:14.2f} ({min(r.deterministic_runs):.2f}-{max(r.deterministic_runs):.2f})  {r.cost:+6.1%}")  # fmt: skip
    return "\n".join(lines)
