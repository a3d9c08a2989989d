"""`deepinfer bench structured`: structured output's cost (deepinfer/bench/structured.py): the host's
grammar-mask fill per step against batch size, and output tokens/s with 0%, 50% and 100% of a batch
constrained by a JSON schema (the overhead over free decoding), as JSON (--json) and a PNG (--plot).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from deepinfer.cli.bench_outputs import check_outputs
from deepinfer.errors import UserError

MASK_BATCHES = "1,2,4,8,16,32,64,128,256"


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
    p.add_argument("--batch", type=int, default=64, help="requests decoding together in the throughput runs (default 64)")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens of each request (default 32)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens of each request (default 64)")
    p.add_argument("--mask-batches", default=MASK_BATCHES, metavar="B,B,...", help=f"batch sizes of the mask-fill timing (default {MASK_BATCHES})")
    p.add_argument("--mask-steps", type=int, default=20, help="steps timed per mask batch size (default 20)")
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

    batches = _batches(args.mask_batches)
    for name in ("batch", "input_len", "output_len", "mask_steps"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    check_outputs(args.json, args.plot)
    from deepinfer.engine.grammar_source import require_llguidance

    require_llguidance()
    options = {"seed": args.seed, "max_num_seqs": max(args.batch, 1)}
    if args.model_shape is not None:
        if args.model is not None:
            raise UserError("give --model or --model-shape, not both")
        if args.layers is not None and args.layers < 1:
            raise UserError(f"--layers must be at least 1, not {args.layers}")
        llm = structured.deepseek_vocab_shape_llm(args.backend, args.layers, options)
        model = f"random {args.model_shape} ({llm.engine.loaded.config.num_hidden_layers} layers, DeepSeek-V3 tokenizer and vocabulary)"
    elif args.layers is not None:
        raise UserError("--layers cuts a --model-shape model; a --model checkpoint runs whole")
    else:
        from deepinfer import LLM

        llm = LLM(model=args.model, backend=args.backend, dtype=args.dtype, announce=False, **options)
        model = args.model or "tiny-v3"
        if llm.engine.tokenizer is None:
            raise UserError(f"model {model} has no tokenizer.json: grammars need one")
    masks = structured.mask_fill(llm, batches, args.mask_steps)
    runs = [] if args.no_throughput else structured.throughput(llm, args.batch, args.input_len, args.output_len, args.seed)
    print(structured.format_results(masks, runs))
    import torch

    machine = {"backend": llm.backend, "model": model, "device": str(llm.engine.runtime.device), "date": time.strftime("%Y-%m-%d"),
               "cpu_threads": torch.get_num_threads() if llm.engine.runtime.device.type == "cpu" else None}  # fmt: skip
    if args.json is not None:
        structured.write_json(args.json, masks, runs, machine)
    if args.plot is not None:
        import json

        from deepinfer.bench.plots import plot_structured

        data = json.loads(args.json.read_text()) if args.json is not None else None
        if data is None:
            from dataclasses import asdict

            data = {"kind": "structured", "machine": machine, "mask_fill": [asdict(m) for m in masks], "throughput": [asdict(r) for r in runs]}
        print(f"plot: {plot_structured(data, args.plot / 'structured.png')}")
    return 0
