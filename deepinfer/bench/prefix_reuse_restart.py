"""The restart process of `bench prefix-reuse`: a second process, as a restarted server would be, that builds the same
model (deepinfer/bench/prefix_reuse_model.py: same shape, same seeds), opens an engine with only the disk tier on the
folder the first process's "+host+disk" run filled, and replays the same workload: its prefix hits come from disk.

    python -m deepinfer.bench.prefix_reuse_restart SPEC.json RESULT.json

SPEC (written by prefix_reuse.run_restart): the model spec, the workload, the settings, the disk folder and the
CPU threads. RESULT: `drive`'s measurements and the digest of the weights built (the parent checks it is its own).
A UserError is one line on stderr and exit 2; anything else a traceback and exit 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    import torch

    from deepinfer.bench import prefix_reuse, prefix_reuse_model
    from deepinfer.bench.prefix_reuse import Settings
    from deepinfer.bench.prefix_reuse_model import ModelSpec
    from deepinfer.bench.prefix_reuse_workload import Workload
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.engine.warmup import capture_graphs
    from deepinfer.errors import UserError

    spec_path, out_path = Path(argv[0]), Path(argv[1])
    try:
        given = json.loads(spec_path.read_text())
        torch.set_num_threads(given["cpu_threads"])
        spec, workload, settings = ModelSpec(**given["model"]), Workload(**given["workload"]), Settings(**given["settings"])
        built = prefix_reuse_model.build(spec, workload.longest)
        if settings.warmup:
            prefix_reuse.warm_up_process(built.loaded, built.runtime, built.dtype, prefix_reuse.engine_config(spec, workload, settings, settings.num_kv_blocks))
        config = prefix_reuse.engine_config(spec, workload, settings, settings.num_kv_blocks, kv_offload_dir=given["kv_offload_dir"],
                                            kv_offload_disk_gib=settings.kv_offload_disk_gib)  # fmt: skip
        engine = LLMEngine(built.loaded, built.runtime, built.dtype, config)
        if settings.warmup:
            capture_graphs(engine)
        measured = prefix_reuse.drive(engine, workload, settings.max_concurrency)
    except UserError as exc:
        print(f"deepinfer: error: {exc}", file=sys.stderr)
        return 2
    out_path.write_text(json.dumps({"measured": measured, "weights_digest": prefix_reuse_model.weights_digest(built.loaded.model)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
