"""Structured output's cost: the host's mask fill per step against batch size, and decode throughput
with 0%, 50% and 100% of a batch constrained by a JSON schema.

- Mask fill: B matchers of SCHEMA (each a copy of one compiled grammar), each at its own point of a
  valid document; a step fills all B rows' masks into one host bitmask (structured_output.
  fill_bitmasks, llguidance's executor) and then advances every matcher by its next token. The
  time is the fill's, median (min, max) over the steps, after one untimed fill (the first one sets
  up llguidance's tables: 1.6 s on a busy 2-core CPU).
- Throughput: `batch` requests of random prompt token ids decoding `output_len` tokens each at
  temperature 1, all in flight together; the constrained ones follow SCHEMA, with at least
  output_len / 4 items (an item is at least 4 tokens: {"id": a digit, ,"tag":" and a tag with its
  closing "} each take one token at best; DeepSeek's tokenizer spells the shortest item in 9), so no
  document ends first, every request produces output_len tokens and the runs differ only by the
  masks (a request that ended early fails the run). A bound of output_len items instead made
  llguidance's grammar, and its masks, ~2.5x costlier than the schema's (on the H200: 4.45 ms per
  64-row step against 1.8 ms). An untimed pass, every request constrained, first compiles the
  grammar and warms the kernels. Then `repeats` rounds each time every share once (each round in
  another order, so that a drift of the machine does not favour one share): a share's tokens/s is
  the median of its rounds, and its overhead, 1 - constrained tokens/s over free tokens/s, is taken
  per round (runs close in time) and reported as the median with the min and max over the rounds:
  on a busy CPU a single pair of runs gave -21% and +19%, noise.

`deepinfer bench structured` sizes the workload by the backend's bench_scale (BackendSpec): an
accelerator's batch of 64, a CPU's smaller one that two cores finish in a couple of minutes
(deepinfer/cli/bench_structured.py's DEFAULTS).

Grammars need the model's tokenizer: the embedded tiny models carry DeepSeek's (V3's, 129280 ids);
the random V2-Lite-shaped model is built here with that vocabulary and tokenizer instead of
V2-Lite's 102400 ids (its embedding and lm_head are ~26% larger; the layers are V2-Lite's).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

SCHEMA = {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                                     "tag": {"enum": ["alpha", "beta", "gamma"]}},
                                     "required": ["id", "tag"], "additionalProperties": False}}  # fmt: skip
# one valid document, tokenized, walked by the mask-fill matchers
DOCUMENT = json.dumps([{"id": i * 37 % 1000, "tag": ("alpha", "beta", "gamma")[i % 3]} for i in range(40)], separators=(",", ":"))
SHARES = (0.0, 0.5, 1.0)


def deepseek_vocab_shape_llm(backend: str, layers: int | None, engine_options: dict):
    """The random V2-Lite-shaped model with DeepSeek-V3's vocabulary, BOS/EOS ids and tokenizer (the
    embedded tiny model's copy), so grammars have a real tokenizer (module docstring)."""
    from deepinfer.bench.throughput import random_shape_llm
    from deepinfer.model import embedded
    from deepinfer.model.tokenizer import Tokenizer

    folder = embedded.ensure_embedded(alias="tiny-v3")
    ids = {key: embedded.CONFIG[key] for key in ("vocab_size", "bos_token_id", "eos_token_id")}
    tokenizer = Tokenizer.from_folder(folder, bos_token_id=ids["bos_token_id"], eos_token_ids=[ids["eos_token_id"]])
    return random_shape_llm(backend, layers, engine_options, overrides=ids, tokenizer=tokenizer)


def schema(min_items: int) -> dict:
    """SCHEMA with at least min_items items: a document cannot end before that many tokens."""
    return {**SCHEMA, "minItems": min_items}


@dataclass
class MaskFill:
    batch: int
    ms_per_step: float  # median
    us_per_row: float
    ms_min: float = 0.0  # the fastest and slowest step
    ms_max: float = 0.0


@dataclass
class Throughput:
    constrained_share: float
    constrained: int
    batch: int
    output_len: int
    output_tokens: int  # of one run
    wall_s: float  # median over the rounds
    output_tokens_per_s: float  # median over the rounds
    runs_wall_s: list[float] = field(default_factory=list)  # each round's run, in round order
    runs_tokens_per_s: list[float] = field(default_factory=list)


def min_items(output_len: int) -> int:
    """Items that take at least output_len tokens (module docstring: 4 tokens an item at best)."""
    return -(-output_len // 4)


def spec_of(min_items: int):
    from deepinfer.engine.structured_params import StructuredOutputsParams

    return StructuredOutputsParams(json=schema(min_items), disable_any_whitespace=True)


def mask_fill(llm, batches: list[int], steps: int) -> list[MaskFill]:
    """Mask fill time per step for each batch size (module docstring)."""
    from deepinfer.engine.structured_output import SequenceGrammar, fill_bitmasks

    engine = llm.engine
    template = engine._grammar_compiler().submit(spec_of(0)).result()
    tokens = engine.tokenizer.encode(DOCUMENT, add_bos=False)
    words = -(-engine.vocab_size // 32)
    fill_bitmasks([(0, SequenceGrammar(template), [])], torch.empty((1, words), dtype=torch.int32))  # untimed: llguidance's first fill sets up its tables
    results = []
    for batch in batches:
        grammars = [SequenceGrammar(template) for _ in range(batch)]
        at = [(b * 7) % (len(tokens) - steps - 1) for b in range(batch)]  # each at its own point of the document
        for grammar, start in zip(grammars, at):
            for token in tokens[:start]:
                grammar.accept(token)
        host = torch.empty((batch, words), dtype=torch.int32)
        rows = [(b, grammar, []) for b, grammar in enumerate(grammars)]
        times = []
        for step in range(steps):
            start = time.perf_counter()
            fill_bitmasks(rows, host)
            times.append(time.perf_counter() - start)
            for grammar, first in zip(grammars, at):
                grammar.accept(tokens[first + step])
        ms = statistics.median(times) * 1e3
        results.append(MaskFill(batch, ms, ms * 1e3 / batch, min(times) * 1e3, max(times) * 1e3))
    return results


def throughput(llm, batch: int, input_len: int, output_len: int, seed: int, repeats: int = 1) -> list[Throughput]:
    """Output tokens/s of `batch` requests with SHARES of them constrained, over `repeats` rounds
    (module docstring)."""
    from deepinfer.engine.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    prompts = [{"prompt_token_ids": torch.randint(2, llm.engine.vocab_size, (input_len,), generator=gen).tolist()} for _ in range(batch)]
    spec = spec_of(min_items(output_len))

    def params(constrained: int) -> list:
        return [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=output_len, ignore_eos=True, structured_outputs=spec if i < constrained else None)
                for i in range(batch)]  # fmt: skip

    def timed(constrained: int) -> tuple[float, int]:
        start = time.perf_counter()
        outs = llm.generate(prompts, params(constrained), use_tqdm=False)
        wall = time.perf_counter() - start
        llm.reset_prefix_cache()
        bad = [o.outputs[0].error for o in outs if o.outputs[0].finish_reason != "length"]
        if bad:
            raise RuntimeError(f"a benchmark request did not run to its length: {bad[0]}")
        return wall, sum(len(o.outputs[0].token_ids) for o in outs)

    counts = [round(share * batch) for share in SHARES]
    timed(max(counts))  # untimed: the grammar compiles, the kernels warm up
    walls: dict[int, list[float]] = {c: [] for c in counts}
    tokens = {}
    for r in range(repeats):
        for c in counts[r % len(counts) :] + counts[: r % len(counts)]:  # each round starts at another share
            wall, tokens[c] = timed(c)
            walls[c].append(wall)
    results = []
    for share, c in zip(SHARES, counts):
        rates = [tokens[c] / w for w in walls[c]]
        results.append(Throughput(share, c, batch, output_len, tokens[c], statistics.median(walls[c]), statistics.median(rates), walls[c], rates))
    return results


def overhead_spread(results: list[Throughput]) -> dict[str, dict]:
    """Per constrained share: 1 - its tokens/s over the free run's in the same round, for every
    round, with their min, median and max."""
    free = next(r for r in results if r.constrained == 0)
    spread = {}
    for r in results:
        if r.constrained:
            runs = [1 - rate / base for rate, base in zip(r.runs_tokens_per_s, free.runs_tokens_per_s)]
            spread[f"{r.constrained_share:.0%}"] = {"min": min(runs), "median": statistics.median(runs), "max": max(runs), "runs": runs}
    return spread


def overhead(results: list[Throughput]) -> dict[str, float]:
    """Per constrained share: the median over the rounds of 1 - its tokens/s over the free run's."""
    return {share: s["median"] for share, s in overhead_spread(results).items()}


def write_json(path: Path, masks: list[MaskFill], runs: list[Throughput], machine: dict, workload: dict | None = None) -> None:
    """The results; `overhead` per share is the median over the rounds, `overhead_spread` its min,
    median, max and every round's, `throughput` each share's runs."""
    data = {"kind": "structured", "machine": machine, "workload": workload or {}, "schema": SCHEMA, "mask_fill": [asdict(m) for m in masks],
            "throughput": [asdict(r) for r in runs], "overhead": overhead(runs) if runs else {},
            "overhead_spread": overhead_spread(runs) if runs else {}}  # fmt: skip
    path.write_text(json.dumps(data, indent=1))


def format_results(masks: list[MaskFill], runs: list[Throughput]) -> str:
    lines = ["mask fill per step (median, min..max over the steps):", "  batch  ms/step  min..max ms      us/row"]
    lines += [f"  {m.batch:5d}  {m.ms_per_step:7.3f}  {m.ms_min:6.3f}..{m.ms_max:<7.3f}  {m.us_per_row:6.1f}" for m in masks]
    if runs:
        rounds = len(runs[0].runs_tokens_per_s)
        lines += [f"decode, batch {runs[0].batch}, {runs[0].output_len} output tokens each, {rounds} round{'s' if rounds != 1 else ''} "
                  "(median, min..max over the rounds):",
                  "  constrained  out tok/s  min..max tok/s    overhead  min..max overhead"]  # fmt: skip
        spread = overhead_spread(runs)
        for r in runs:
            rates = f"{min(r.runs_tokens_per_s):7.1f}..{max(r.runs_tokens_per_s):<7.1f}"
            cost = spread.get(f"{r.constrained_share:.0%}")
            costs = f"{cost['median']:9.1%}  {cost['min']:+.1%}..{cost['max']:+.1%}" if cost else f"{'-':>9}  -"
            lines.append(f"  {r.constrained:4d} ({r.constrained_share:4.0%})  {r.output_tokens_per_s:9.1f}  {rates}  {costs}")
    return "\n".join(lines)
