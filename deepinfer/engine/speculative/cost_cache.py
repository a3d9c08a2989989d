"""The confidence policy's step costs, measured once per machine and model shape and kept.

Measuring takes seconds on an accelerator and tens of seconds on a CPU (every point's forwards up to
the most tokens a step holds), and a measurement on a busy machine is noisy: so the timed runs are
kept in the cache folder ($DEEPINFER_CACHE, else ~/.cache/deepinfer), under speculative-costs/, one
JSON file per key, and the model is fitted from them (cost_model.fit) whenever an engine starts.

The key is what the times depend on: the backend, its options and the device (on the host: the CPU
model and torch's thread count), the model's config, dtype and KV cache dtype, deterministic mode,
the device graphs' batch buckets, the most tokens a step holds and whether a draft model runs; the
torch and deepinfer versions. `cost_model: "measure"` (SpeculativeConfig) measures again and
replaces the file. A file that cannot be read is measured again; one that cannot be written is a
warning (the engine runs with what it measured).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from deepinfer.engine.speculative.cost_measure import CostSamples, measure, token_points
from deepinfer.engine.speculative.cost_model import HingeFit, StepCostModel, fit

log = logging.getLogger(__name__)

FOLDER = "speculative-costs"
FORMAT = 1  # bump when the stored samples change meaning


def cost_key(engine, most: int, drafts: bool) -> dict:
    """The cache key of an engine's step costs (module docstring)."""
    import torch

    import deepinfer
    from deepinfer.bench.device_api import machine_name

    runtime, config, graphs = engine.runtime, engine.config, engine.runner.graphs
    model_config = repr(engine.loaded.config)
    return {
        "format": FORMAT,
        "backend": runtime.backend.name,
        "options": dict(sorted(runtime.options.items())),
        "device": machine_name(runtime.device),
        "model": getattr(engine.loaded.config, "model_type", type(engine.loaded.config).__name__),
        "model_config": hashlib.sha256(model_config.encode()).hexdigest()[:16],
        "dtype": str(engine.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(engine.cache_dtype).removeprefix("torch."),
        "deterministic": config.deterministic,
        "graph_buckets": list(graphs.buckets) if graphs is not None else None,
        "max_tokens": most,
        "draft_model": drafts,
        "torch": torch.__version__,
        "deepinfer": deepinfer.__version__,
    }


def cache_path(key: dict, root: Path | None = None) -> Path:
    from deepinfer.model.embedded import cache_root

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return (root or cache_root()) / FOLDER / f"{digest}.json"


def load(path: Path, key: dict) -> CostSamples | None:
    """The samples stored for `key` at `path`; None when there are none, or they cannot be read (logged)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("cannot read the speculative step costs in %s (%s): measuring them again", path, exc)
        return None
    try:
        data = json.loads(text)
        if data["key"] != key:
            raise ValueError("its key is another machine's or model's")
        samples = CostSamples.from_dict(data["samples"])
        fit(samples.steps, samples.draft_tokens, samples.draft)  # the samples must fit
        return samples
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        log.warning("the speculative step costs in %s are unusable (%s): measuring them again", path, exc)
        return None


def store(path: Path, key: dict, samples: CostSamples, fitted: HingeFit, seconds: float) -> bool:
    """Write the samples (atomically: a reader never sees half a file); False, with a warning, when
    the folder is not writable."""
    data = {"key": key, "measured": time.strftime("%Y-%m-%d %H:%M:%S"), "measure_seconds": round(seconds, 3),
            "fit": {"flat_s": fitted.flat, "knee_tokens": fitted.knee, "per_token_s": fitted.per_token, "draft_s": fitted.draft},
            "samples": samples.as_dict()}  # fmt: skip
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(data, indent=1))
        os.replace(tmp, path)
        return True
    except OSError as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        log.warning("cannot keep the speculative step costs in %s (%s); set DEEPINFER_CACHE to a writable folder", path, exc)
        return False


def step_cost_model(probe, key: dict, remeasure: bool, announce: bool, warm_each_shape: bool = True) -> StepCostModel:
    """The fitted step costs for `key`: from the cache, or measured now with `probe` (CostProbe) and
    kept. remeasure: measure even when the cache has them. announce: tell the user on stderr what is
    measured (before it starts, with a progress bar on a terminal) and what was found.
    warm_each_shape: see cost_measure.measure."""

    def tell(line: str) -> None:
        log.info(line)
        if announce:
            print(f"deepinfer: {line}", file=sys.stderr, flush=True)

    path = cache_path(key)
    samples = None if remeasure else load(path, key)
    if samples is not None:
        fitted = fit(samples.steps, samples.draft_tokens, samples.draft)
        tell(f"speculative step costs from {path}: {fitted.describe()} (cost_model \"measure\" measures them again)")
        return fitted.model()
    most = key["max_tokens"]
    points = len(token_points(most)) + int(key["draft_model"])
    drafts = ", and the draft layer's" if key["draft_model"] else ""
    tell(f"measuring the speculative step costs on {key['device']}: target forwards of 1 to {most} tokens{drafts}, once per machine and model shape ...")
    from tqdm import tqdm

    bar = tqdm(total=points, desc="Step costs", unit="size", file=sys.stderr, disable=not (announce and sys.stderr.isatty()), leave=False)
    start = time.perf_counter()
    with bar:
        samples = measure(probe.target, probe.draft if key["draft_model"] else None, most, probe.synchronize, warm_each_shape, on_point=bar.update)
    seconds = time.perf_counter() - start
    fitted = fit(samples.steps, samples.draft_tokens, samples.draft)
    kept = store(path, key, samples, fitted, seconds)
    tell(f"speculative step costs measured in {seconds:.1f} s: {fitted.describe()}" + (f"; kept in {path}" if kept else ""))
    return fitted.model()

