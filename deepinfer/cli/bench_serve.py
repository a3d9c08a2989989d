"""`deepinfer bench serve`: serving latency and throughput over HTTP at a sweep of request rates.

It starts a server in this process (on a free loopback port: --model, or --model-shape v2-lite |
v4-flash for bench e2e's random-weight DeepSeek-V2-Lite- or V4-Flash-shaped model, cut with --layers;
v4-flash as bench throughput builds it, deepinfer/bench/v4_flash_llm.py: FP8 KV, cut to fit,
max_model_len the workload's longest request unless --max-model-len) or drives one already running
(--url), with Poisson arrivals at each --request-rate (inf: all at once) of --num-prompts random
token-id prompts, streamed. It prints TTFT, TPOT and ITL percentiles and the throughputs per rate,
and, from the server's /metrics, the engine steps each rate took and their mean time; writes them to
--json, and with --plot DIR a PNG (deepinfer/bench/serve.py, plots.py).

`--server-process` starts the server in a process of its own instead of a thread of this one: the
client's event loop then no longer shares the interpreter lock with the server (at high load that
lock, not the engine, set the in-process figures: deepinfer/cli/bench_serve_process.py).
"""

from __future__ import annotations

import argparse
import math
import threading
import time
from pathlib import Path

from deepinfer.cli.bench_outputs import check_outputs
from deepinfer.cli.bench_throughput import MODEL_SHAPES, check_shape_layers
from deepinfer.errors import UserError


def add_parser(what) -> None:
    p = what.add_parser("serve", help="a server's TTFT / TPOT / throughput over HTTP at a sweep of request rates (vLLM's bench serve shape)",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--url", default=None, help="a running server (e.g. http://127.0.0.1:8000); default: start one here")
    p.add_argument("--api-key", default=None, help="the --url server's API key")
    p.add_argument("--served-model", default=None, metavar="NAME", help="the model name the requests give (default: the server's first)")
    p.add_argument("--model", default=None, metavar="PATH", help="the server started here: an HF checkpoint folder or an embedded tiny model")
    p.add_argument("--model-shape", choices=MODEL_SHAPES, default=None,
                   help="instead of --model: a random-weight model, bench e2e's: DeepSeek-V2-Lite-shaped (bf16), or DeepSeek-V4-Flash-shaped "
                        "(fp8 projections, mxfp4 experts, FP8 KV cache)")
    p.add_argument("--layers", type=int, default=None,
                   help="--model-shape: cut the model to this many layers (default: v2-lite all 27; v4-flash as many as fit)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="the server started here: its longest sequence, prompt and output (default: v4-flash the workload's longest request; "
                        "else the model's)")
    p.add_argument("--backend", default="auto", help="the server started here: auto or a backend from `deepinfer backends`")
    p.add_argument("--max-num-seqs", type=int, default=256, help="the server started here: its running-request cap (default 256)")
    p.add_argument("--server-process", action="store_true",
                   help="start the server in a process of its own (the client then shares no interpreter lock with it); default: a thread here")
    p.add_argument("--vocab", type=int, default=None, help="--url: the model's vocabulary size, for the random prompts (default: 32000)")
    p.add_argument("--request-rate", type=float, action="append", default=None, metavar="R",
                   help="requests per second, Poisson arrivals (repeatable: the sweep; inf: all at once; default 1, 4, 16, inf)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per rate (default 64)")
    p.add_argument("--input-len", type=int, default=128, help="mean prompt tokens (default 128)")
    p.add_argument("--output-len", type=int, default=128, help="mean output tokens (default 128)")
    p.add_argument("--range-ratio", type=float, default=0.5, help="lengths drawn uniformly in [len x (1 - r), len x (1 + r)] (default 0.5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and the arrivals (default 0)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed pass before the sweep (compiles and captures then land in the first rate)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results to FILE")
    p.add_argument("--plot", type=Path, default=None, metavar="DIR", help="also write the plot (PNG) into DIR (needs matplotlib)")
    p.set_defaults(func=run_bench_serve)


def check(args) -> list[float]:
    rates = args.request_rate or [1.0, 4.0, 16.0, math.inf]
    if any(not r > 0 for r in rates):
        raise UserError(f"--request-rate must be > 0 (or inf), got {min(rates)}")
    for name in ("num_prompts", "input_len", "output_len", "max_num_seqs"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    if not 0 <= args.range_ratio < 1:
        raise UserError(f"--range-ratio must lie in [0, 1), not {args.range_ratio}")
    check_outputs(args.json, args.plot)
    if args.url is not None and (args.model or args.model_shape or args.layers or args.server_process or args.max_model_len):
        raise UserError("--url drives a running server: --model, --model-shape, --layers, --max-model-len and --server-process are for one started here")
    if args.model is not None and args.model_shape is not None:
        raise UserError("give --model or --model-shape, not both")
    if args.layers is not None and args.model_shape is None:
        raise UserError("--layers cuts a --model-shape model")
    if args.layers is not None:
        if args.layers < 1:
            raise UserError(f"--layers must be at least 1, not {args.layers}")
        check_shape_layers(args.model_shape, args.layers)
    if args.url is None:
        args.max_model_len = serve_max_model_len(args)
    return sorted(rates)


def serve_max_model_len(args) -> int | None:
    """The started server's max_model_len: --max-model-len (refused in one line when the workload's longest
    request does not fit), by default that longest request for --model-shape v4-flash (its device decode plan
    is as wide as max_model_len allows), else None (the model's own)."""
    from deepinfer.bench.throughput import longest_request

    need = longest_request([args.input_len], [args.output_len], args.range_ratio)
    if args.max_model_len is None:
        return need if args.model_shape == "v4-flash" else None
    if args.max_model_len < need:
        raise UserError(f"--max-model-len {args.max_model_len} is shorter than the workload's longest request ({need} tokens, prompt and output)")
    return args.max_model_len


def run_bench_serve(args) -> int:
    from deepinfer.bench import serve as bench
    from deepinfer.cli.serve import require_serve_extra

    rates = check(args)
    require_serve_extra()
    server = None
    if args.server_process:
        server = ServerProcess(args)
        url, model, vocab = f"http://127.0.0.1:{server.facts['port']}", server.facts["model"], server.facts["vocab"]
        machine = {"backend": server.facts["backend"], "device": server.facts["device"], "model": model, "server": "a process of its own",
                   "max_model_len": server.facts.get("max_model_len")}  # fmt: skip
    elif args.url is None:
        server, url, model, llm = start_server(args)
        vocab = llm.engine.vocab_size
        machine = {"backend": llm.backend, "device": str(llm.engine.runtime.device), "model": model, "server": "a thread of the client's process",
                   "max_model_len": llm.engine.max_model_len}  # fmt: skip
    else:
        url, model, vocab = args.url.rstrip("/"), args.served_model or first_model(args.url, args.api_key), args.vocab or 32000
        machine = {"url": url, "model": model}
    machine["date"] = time.strftime("%Y-%m-%d")
    try:
        def workload(seed: int):
            return bench.random_workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio, vocab, seed)

        results = bench.sweep(url, model, workload, rates, args.seed, api_key=args.api_key, warmup=not args.no_warmup,
                              server_steps=lambda: bench.server_step_totals(url, args.api_key))  # fmt: skip
    finally:
        if server is not None:
            server.stop()
    print(bench.format_results(results))
    data = bench.to_json(results, machine, {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                                            "range_ratio": args.range_ratio, "seed": args.seed})  # fmt: skip
    if args.json is not None:
        import json

        args.json.write_text(json.dumps(data, indent=2) + "\n")
    if args.plot is not None:
        from deepinfer.bench.plots import plot_serve

        print(f"plot: {plot_serve(data, args.plot / 'serve.png')}")
    return 0


def first_model(url: str, api_key: str | None) -> str:
    import httpx2

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        reply = httpx2.get(f"{url.rstrip('/')}/v1/models", headers=headers, timeout=30)
        reply.raise_for_status()
        return reply.json()["data"][0]["id"]
    except (httpx2.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise UserError(f"--url {url}: cannot list its models ({exc})") from None


class InProcessServer:
    """`deepinfer serve` on a free loopback port, in a thread of this process (the benchmark's client runs beside it)."""

    def __init__(self, llm, model: str, max_queue: int):
        from deepinfer.cli.serve import listen
        from deepinfer.serve.app import ServeConfig
        from deepinfer.serve.server import make_frontend, make_server

        self.sock = listen("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.front = make_frontend(llm, ServeConfig([model]), max_queue)
        self.server = make_server(self.front, "127.0.0.1", self.port, shutdown_timeout_s=0)
        self.front.loop.start()
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise UserError("the benchmark's server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.front.loop.stop(0)
        self.front.loop.join(30)


class ServerProcess:
    """The server `start_server` would start, in a process of its own (deepinfer/cli/bench_serve_process.py):
    started, waited for until it listens (its one JSON line), stopped by closing its standard input."""

    def __init__(self, args):
        import json
        import subprocess
        import sys

        # its stderr is ours: the model's progress and any error show as they come
        self.proc = subprocess.Popen([sys.executable, *server_argv(args)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # blocks until it listens or exits
        if not line:
            code = self.proc.wait()
            raise UserError(f"the benchmark's server process exited with code {code} before it listened (its message is above)")
        self.facts = json.loads(line)

    def stop(self) -> None:
        import subprocess

        self.proc.stdin.close()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def server_argv(args) -> list[str]:
    """The arguments of `python` that start `ServerProcess`'s server: the model flags of a run without --url."""
    argv = ["-m", "deepinfer.cli.bench_serve_process", "--backend", args.backend, "--max-num-seqs", str(args.max_num_seqs),
            "--seed", str(args.seed), "--max-queue", str(max(1024, args.num_prompts))]  # fmt: skip
    for flag, value in (("--model", args.model), ("--model-shape", args.model_shape), ("--layers", args.layers), ("--max-model-len", args.max_model_len)):
        if value is not None:
            argv += [flag, str(value)]
    if args.no_warmup:
        argv.append("--no-warmup")
    return argv


def start_server(args, max_queue: int | None = None):
    """The server of a run without --url, in a thread of this process: (server, url, model name, LLM)."""
    engine_options = {"seed": args.seed, "max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len}
    if args.model_shape is not None:
        from deepinfer.bench.throughput import shape_llm

        llm = shape_llm(args.model_shape, args.backend, args.layers, engine_options, "bench serve")
        model = f"random-{args.model_shape}-{llm.engine.loaded.config.num_hidden_layers}-layers"
    else:
        from deepinfer import LLM

        llm = LLM(model=args.model, backend=args.backend, announce=False, **engine_options)
        model = args.model or "tiny-v3"
    if llm.compiles_on_first_use and not args.no_warmup:
        llm.warm_up()  # as `deepinfer serve` does before its first request
    server = InProcessServer(llm, model, max_queue=max_queue or max(1024, args.num_prompts))
    return server, f"http://127.0.0.1:{server.port}", model, llm
