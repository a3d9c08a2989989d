"""`deepinfer bench throughput` and `deepinfer bench sweep`: offline serving throughput as vLLM's
`bench throughput` measures it (random prompts of given input/output lengths, or a JSONL file of
real prompts; at most --concurrency requests in flight), with each request's time to first token
and time per output token; `sweep` runs a grid of concurrencies and lengths and, where matplotlib
is installed, plots throughput against per-token latency. `deepinfer bench plot FILE...` draws
the plots of `throughput`/`sweep` and `e2e` --json files (deepinfer/bench/throughput.py, plots.py).

`--model-shape v2-lite | v4-flash` builds bench e2e's random-weight model on the device instead of
loading one. v4-flash: fp8 projections, mxfp4 experts and an FP8 KV cache, cut to the layers that
fit (or --layers), its max_model_len the workload's longest request (prompt and output) unless
--max-model-len says otherwise: a V4 decode step's device plan is as wide as max_model_len allows,
so the config's 1M positions would slow every step (deepinfer/bench/v4_flash_llm.py).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from deepinfer.cli.bench_outputs import check_outputs
from deepinfer.errors import UserError

MODEL_SHAPES = ("v2-lite", "v4-flash")


def _workload_flags(p: argparse.ArgumentParser, repeatable: bool) -> None:
    many = {"action": "append", "default": None} if repeatable else {}
    again = " (repeatable: a grid)" if repeatable else ""
    p.add_argument("--model", default=None, metavar="PATH", help="an HF checkpoint folder, or an embedded tiny model (default: the embedded tiny-v3)")
    p.add_argument("--model-shape", choices=MODEL_SHAPES, default=None,
                   help="instead of --model: a random-weight model built on the device, bench e2e's: DeepSeek-V2-Lite-shaped (bf16), or "
                        "DeepSeek-V4-Flash-shaped (fp8 projections, mxfp4 experts, FP8 KV cache)")
    p.add_argument("--layers", type=int, default=None,
                   help="--model-shape: cut the model to this many layers (default: v2-lite all 27; v4-flash as many as fit)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="the engine's longest sequence, prompt and output (default: v4-flash the workload's longest request; else the model's)")
    p.add_argument("--backend", default="auto", help="auto (as for `run`: cuda, then ascend, then reference) or a backend from `deepinfer backends`")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                   help="auto: bfloat16 on accelerators, float32 on the CPU (--model-shape v2-lite: bfloat16)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests in the workload (default 64)")
    p.add_argument("--input-len", type=int, metavar="N", help=f"mean prompt tokens of random prompts (default 128){again}", **many)
    p.add_argument("--output-len", type=int, metavar="N", help=f"mean output tokens (default 128){again}", **many)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths drawn uniformly in [len x (1 - r), len x (1 + r)] (default 0: fixed)")
    p.add_argument("--concurrency", type=int, metavar="N", help=f"most requests in flight (default: all of them){again}", **many)
    p.add_argument("--dataset", type=Path, default=None, metavar="FILE.jsonl",
                   help='real prompts instead: one {"prompt": ...} or {"prompt_token_ids": [...]} per line, optional "max_tokens"')
    p.add_argument("--max-num-seqs", type=int, default=None, help="the engine's running-request cap (default: the largest concurrency)")
    p.add_argument("--enforce-eager", action="store_true", help="no device graphs")
    p.add_argument("--no-overlap", action="store_true", help="each decode step waits for the one before (default: overlap scheduling on cuda and ascend)")
    p.add_argument("--no-mixed-steps", action="store_true",
                   help="prefill steps do not also decode running requests (default: they do, except in deterministic mode)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and of sampling (default 0)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results to FILE")


def add_parser(what) -> None:
    p = what.add_parser("throughput", help="offline throughput with per-request latencies (vLLM's bench throughput shape)",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    _workload_flags(p, repeatable=False)
    p.set_defaults(func=run_throughput, sweep=False)
    s = what.add_parser("sweep", help="throughput over a grid of concurrencies and lengths, with a throughput vs latency plot",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    _workload_flags(s, repeatable=True)
    s.add_argument("--plot", type=Path, default=None, metavar="DIR", help="also write the plot (PNG) into DIR (needs matplotlib)")
    s.set_defaults(func=run_throughput, sweep=True)
    g = what.add_parser("plot", help="PNG plots of `throughput`/`sweep`/`e2e` --json files (needs matplotlib)", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    g.add_argument("files", type=Path, nargs="+", metavar="FILE", help="--json files of `bench throughput`, `bench sweep` or `bench e2e`")
    g.add_argument("--out", type=Path, default=Path("."), metavar="DIR", help="folder for the PNGs (default: here)")
    g.set_defaults(func=run_plot)


def _positive(name: str, values) -> None:
    for value in values:
        if value < 1:
            raise UserError(f"{name} must be at least 1, not {value}")


def run_throughput(args: argparse.Namespace) -> int:
    from deepinfer.bench import throughput

    as_list = (lambda v, d: v or [d]) if args.sweep else (lambda v, d: [v if v is not None else d])  # noqa: E731
    input_lens, output_lens = as_list(args.input_len, 128), as_list(args.output_len, 128)
    concurrencies = as_list(args.concurrency, args.num_prompts)
    _positive("--num-prompts", [args.num_prompts])
    _positive("--input-len", input_lens)
    _positive("--output-len", output_lens)
    _positive("--concurrency", concurrencies)
    if not 0 <= args.range_ratio < 1:
        raise UserError(f"--range-ratio must lie in [0, 1), not {args.range_ratio}")
    if args.dataset is not None and not args.dataset.is_file():
        raise UserError(f"--dataset {args.dataset}: no such file")
    plot = getattr(args, "plot", None)  # `throughput` has no --plot, `sweep` has
    check_outputs(args.json, plot)
    if args.max_model_len is not None:
        _positive("--max-model-len", [args.max_model_len])
    engine_options = {"seed": args.seed, "max_num_seqs": args.max_num_seqs or max(concurrencies), "enforce_eager": args.enforce_eager,
                      "overlap": False if args.no_overlap else None, "mixed_steps": False if args.no_mixed_steps else None}  # fmt: skip
    if args.model_shape is not None:
        if args.model is not None:
            raise UserError("give --model or --model-shape, not both")
        if args.dataset is not None and any('"prompt"' in line for line in args.dataset.read_text().splitlines()):
            raise UserError("--model-shape builds a model without a tokenizer: give the --dataset lines as prompt_token_ids")
        if args.layers is not None:
            _positive("--layers", [args.layers])
            check_shape_layers(args.model_shape, args.layers)
    engine_options["max_model_len"] = max_model_len(args, input_lens, output_lens)
    if args.model_shape is not None:
        llm = throughput.shape_llm(args.model_shape, args.backend, args.layers, engine_options, f"bench {'sweep' if args.sweep else 'throughput'}", args.dtype)
    elif args.layers is not None:
        raise UserError("--layers cuts a --model-shape model; a --model checkpoint runs whole")
    else:
        from deepinfer import LLM

        llm = LLM(model=args.model, backend=args.backend, dtype=args.dtype, announce=False, **engine_options)
    vocab = llm.engine.vocab_size

    def make(input_len: int, output_len: int):
        if args.dataset is not None:
            return throughput.jsonl_requests(args.dataset, llm.engine.tokenizer, output_len)
        return throughput.random_requests(args.num_prompts, input_len, output_len, args.range_ratio, vocab, args.seed)

    grid = [(c, i, o) for i in input_lens for o in output_lens for c in concurrencies]
    results = throughput.sweep(llm, grid, make)
    print(throughput.format_results(results))
    model = args.model or "tiny-v3"
    if args.model_shape is not None:
        model = f"random {args.model_shape} ({llm.engine.loaded.config.num_hidden_layers} layers)"
    machine = {"backend": llm.backend, "model": model, "device": str(llm.engine.runtime.device), "date": time.strftime("%Y-%m-%d"),
               "overlap": llm.engine.overlap is not None, "mixed_steps": llm.engine.scheduler.mixed_steps,
               "max_model_len": llm.engine.max_model_len}  # fmt: skip
    if args.json is not None:
        throughput.write_json(args.json, results, machine)
    if plot is not None:
        from dataclasses import asdict

        from deepinfer.bench.plots import plot_throughput

        out = plot_throughput({"kind": "throughput", "machine": machine, "results": [asdict(r) for r in results]}, plot / "sweep.png")
        print(f"plot: {out}")
    return 0


def check_shape_layers(shape: str, layers: int) -> None:
    """--layers cuts a --model-shape model: at most its layers (one line past them)."""
    if shape == "v4-flash":
        from deepinfer.bench.e2e_v4 import FULL_LAYERS

        if layers > FULL_LAYERS:
            raise UserError(f"--layers cuts the model: at most {FULL_LAYERS} (V4-Flash), not {layers}")


def max_model_len(args: argparse.Namespace, input_lens, output_lens) -> int | None:
    """The engine's max_model_len: --max-model-len, refused in one line when the workload's longest request
    (where it can be told before the model is built) does not fit; by default that longest request for
    --model-shape v4-flash (its device decode plan's tables are as wide as max_model_len allows), else
    None (the model's own)."""
    from deepinfer.bench import throughput

    if args.dataset is None:
        need = throughput.longest_request(input_lens, output_lens, args.range_ratio)
    elif args.model_shape is not None:  # token ids only (checked): the requests are known before the model is built
        need = max(len(r.prompt_token_ids) + r.output_len for n in output_lens for r in throughput.jsonl_requests(args.dataset, None, n))
    else:
        need = None  # text prompts: their lengths are known once the model's tokenizer is
    if args.max_model_len is not None:
        if need is not None and args.max_model_len < need:
            raise UserError(f"--max-model-len {args.max_model_len} is shorter than the workload's longest request ({need} tokens, prompt and output)")
        return args.max_model_len
    return need if args.model_shape == "v4-flash" else None


def run_plot(args: argparse.Namespace) -> int:
    from deepinfer.bench.plots import plot_file

    if not args.out.is_dir():
        raise UserError(f"--out {args.out}: no such folder")
    for path in args.files:
        if not path.is_file():
            raise UserError(f"{path}: no such file")
    for path in args.files:
        print(f"plot: {plot_file(path, args.out)}")
    return 0
