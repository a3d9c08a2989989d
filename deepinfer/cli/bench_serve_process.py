"""The server of `deepinfer bench serve --server-process`, in a process of its own.

The benchmark's client runs an asyncio event loop in Python; a server in the same process shares
its interpreter lock with uvicorn's loop and the engine thread, which on one H200 cost 30 ms per
output token all at once against 8-9 ms with the client in a process of its own. This module runs
the server `bench serve` would have started (the same model flags), prints one JSON line (port,
model, backend, device, vocabulary, max_model_len) once it listens, and stops when its standard input closes (the
benchmark closes it, or ends). Not a command of its own: `bench serve` starts it with
`python -m deepinfer.cli.bench_serve_process`.
"""

from __future__ import annotations

import argparse
import json
import sys

from deepinfer.errors import UserError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepinfer bench serve --server-process", description=__doc__)
    p.add_argument("--backend", default="auto")
    p.add_argument("--model", default=None)
    p.add_argument("--model-shape", default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-queue", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    from deepinfer.cli.bench_serve import start_server

    args = parser().parse_args(argv)
    try:
        server, url, model, llm = start_server(args, max_queue=args.max_queue)
    except UserError as exc:
        print(f"deepinfer: error: {exc}", file=sys.stderr)
        return exc.exit_code
    facts = {"port": server.port, "model": model, "backend": llm.backend, "device": str(llm.engine.runtime.device), "vocab": llm.engine.vocab_size,
             "max_model_len": llm.engine.max_model_len}  # fmt: skip
    print(json.dumps(facts), flush=True)
    try:
        sys.stdin.read()  # until the benchmark closes our standard input
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
