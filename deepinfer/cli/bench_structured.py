"""`deepinfer bench structured`: structured output's cost (deepinfer/bench/structured.py): the host's
grammar-mask fill per step against batch size, and output tokens/s with 0%, 50% and 100% of a batch
constrained by a JSON schema (the overhead over free decoding, with its spread over --repeats rounds),
as JSON (--json) and a PNG (--plot). The workload's defaults are the backend's: an accelerator's
(batch 64, 64 output tokens, mask fill up to 256 rows) or a CPU's (batch 16, 32 output tokens, mask
fill up to 64 rows: a couple of minutes on two cores); each flag given overrides its default.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from deepinfer.cli.bench_outputs import check_outputs
from deepinfer.errors import UserError

# The workload's defaults by the backend's bench_scale (BackendSpec): an accelerator's, and a CPU's
# that two cores finish in a couple of minutes (a batch of 64 took 9.5 minutes there).
DEFAULTS = {
    "device": {"batch": 64, "input_len": 32, "output_len": 64, "mask_batches": "1,2,4,8,16,32,64,128,256", "mask_steps": 20, "repeats": 3},
    "host": {"batch": 16, "input_len": 16, "output_len": 32, "mask_batches": "1,4,16,64", "mask_steps": 20, "repeats": 3},
}


def _default(name: str) -> str:
    """A flag's defaults as --help says them: the accelerator's, then the CPU's."""
    device, host = DEFAULTS["device"][name], DEFAULTS["host"][name]
    return f"default {device} on an accelerator, {host} on a CPU" if device != host else f"default {device}"


def add_parser(what) -> None:
    p = what.add_parser("structured", help="structured output: mask fill time per step vs batch, tokens/s with 0/50/100%% constrained",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, metavar="PATH", help="an HF checkpoint folder with a tokenizer, or an embedded tiny model (default: tiny-v3)")
    p.add_argument("--model-shape", choices=("v2-lite",), default=None,
                   help="instead of --model: the random V2-Lite-shaped model (bench throughput's), with DeepSeek's tokenizer and its 129280-id vocabulary")
    p.add_argument("--layers", type=int, default=None, help="--model-shape: cut the model to this many layers (default: all 27)")
    p.add_argument("--backend", default="auto", help="auto (cuda, then ascend, then reference) or a backend from `deepinfer backends`")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                   help="--model: auto is bfloat16 on accelerators, float32 on the CPU")
    p.add_argument("--batch", type=int, default=None, help=f"requests decoding together in the throughput runs ({_default('batch')})")
    p.add_argument("--input-len", type=int, default=None, help=f"prompt tokens of each request ({_default('input_len')})")
    p.add_argument("--output-len", type=int, default=None, help=f"output tokens of each request ({_default('output_len')})")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"timed rounds of the throughput runs, each share once a round; overheads are their median, min and max ({_default('repeats')})")
    p.add_argument("--mask-batches", default=None, metavar="B,B,...", help=f"batch sizes of the mask-fill timing ({_default('mask_batches')})")
    p.add_argument("--mask-steps", type=int, default=None, help=f"steps timed per mask batch size ({_default('mask_steps')})")
    p.add_argument("--no-throughput", action="store_true", help="time the mask fill only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results to FILE")
    p.add_argument("--plot", type=Path, default=None, metavar="DIR", help="also write structured.png into DIR (needs matplotlib)")
    p.set_defaults(func=run_structured)


def _batches(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise UserError(f"--mask-batches must be integers separated by commas, not {text!r}") from None
    if not values or min(values) < 1:
        raise UserError(f"--mask-batches must be integers >= 1, not {text!r}")
    return values


def run_structured(args: argparse.Namespace) -> int:
    from deepinfer.bench import structured

    if args.mask_batches is not None:
        _batches(args.mask_batches)
    for name in ("batch", "input_len", "output_len", "mask_steps", "repeats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    check_outputs(args.json, args.plot)
    from deepinfer.engine.grammar_source import require_llguidance

    require_llguidance()
    from deepinfer.cli.bench import choose_backend
    from deepinfer.plugins import load_plugins

    backend = choose_backend(load_plugins(), args.backend)
    workload = {name: given if (given := getattr(args, name)) is not None else default for name, default in DEFAULTS[backend.bench_scale].items()}
    batches = _batches(workload["mask_batches"])
    options = {"seed": args.seed, "max_num_seqs": workload["batch"]}
    if args.model_shape is not None:
        if args.model is not None:
            raise UserError("give --model or --model-shape, not both")
        if args.layers is not None and args.layers < 1:
            raise UserError(f"--layers must be at least 1, not {args.layers}")
        llm = structured.deepseek_vocab_shape_llm(backend.name, args.layers, options)
        model = f"random {args.model_shape} ({llm.engine.loaded.config.num_hidden_layers} layers, DeepSeek-V3 tokenizer and vocabulary)"
    elif args.layers is not None:
        raise UserError("--layers cuts a --model-shape model; a --model checkpoint runs whole")
    else:
        from deepinfer import LLM

        llm = LLM(model=args.model, backend=backend.name, dtype=args.dtype, announce=False, **options)
        model = args.model or "tiny-v3"
        if llm.engine.tokenizer is None:
            raise UserError(f"model {model} has no tokenizer.json: grammars need one")
    print(f"deepinfer: workload ({backend.bench_scale} defaults, flags given override them): " + ", ".join(f"{k} {v}" for k, v in workload.items()),
          file=sys.stderr)  # fmt: skip
    masks = structured.mask_fill(llm, batches, workload["mask_steps"])
    sizes = (workload["batch"], workload["input_len"], workload["output_len"], args.seed, workload["repeats"])
    runs = [] if args.no_throughput else structured.throughput(llm, *sizes)
    print(structured.format_results(masks, runs))
    import torch

    machine = {"backend": llm.backend, "model": model, "device": str(llm.engine.runtime.device), "date": time.strftime("%Y-%m-%d"),
               "cpu_threads": torch.get_num_threads() if llm.engine.runtime.device.type == "cpu" else None}  # fmt: skip
    if args.json is not None:
        structured.write_json(args.json, masks, runs, machine, workload)
    if args.plot is not None:
        import json

        from deepinfer.bench.plots import plot_structured

        data = json.loads(args.json.read_text()) if args.json is not None else None
        if data is None:
            from dataclasses import asdict

            data = {"kind": "structured", "machine": machine, "mask_fill": [asdict(m) for m in masks], "throughput": [asdict(r) for r in runs]}
        print(f"plot: {plot_structured(data, args.plot / 'structured.png')}")
    return 0
