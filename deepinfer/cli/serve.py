"""`deepinfer serve`: an OpenAI-compatible HTTP server on the engine (deepinfer.serve).

  deepinfer serve --model PATH [--host 127.0.0.1] [--port 8000] [--api-key KEY]

Routes: POST /v1/completions and /v1/chat/completions (streamed by server-sent events with
"stream": true, or whole), GET /v1/models, /health (never needs the key) and /metrics (Prometheus
text). The request bodies are read by the field table `deepinfer run-batch` reads
(deepinfer/cli/request_fields.py: the same fields, the same refusals), plus "stream" and
"stream_options": {"include_usage": true}. Errors are OpenAI's {"error": {"message", "type",
"param", "code"}}.

Limits, so that one hostile request fails alone: a body over --max-request-bytes (default 8 MiB) is
answered 413; a body nested more than 100 levels deep, a text too long for --max-model-len whatever
its tokens, or n over 16384 (vLLM's bound) is answered 400 before anything is tokenized.

Requests join the running batch at the next engine step. A client that disconnects aborts its
request and frees its KV pages. --max-queue bounds the sequences (prompts times n) waiting for the
running batch (then 429; a request that alone makes more: 400); --request-timeout aborts a request
that runs longer (408, or an error event when streamed);
SIGINT / SIGTERM stop taking requests, give the unfinished ones --shutdown-timeout seconds, then
abort them with a final event.

The engine flags are `deepinfer run`'s. Expert parallelism: --ep N starts N ranks on this host
(one process per device; or start them yourself with torchrun): rank 0 serves HTTP and deals each
request to the rank with the fewest requests, every rank steps its own engine in lockstep (idle
ranks run idle steps), and the tokens flow back to rank 0 (deepinfer/serve/ep_loop.py). SIGINT /
SIGTERM to the launcher stop rank 0 gracefully, which stops the other ranks.

Needs the serve extra: pip install 'deepinfer[serve]'. docs/serving.md describes it all, with examples.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import socket
import sys

from deepinfer.cli.engine_flags import add_engine_flags, check_engine_flags, load_llm, read_chat_template
from deepinfer.cli.flag_help import add_grouped_help
from deepinfer.cli.json_input import MAX_REQUEST_BYTES
from deepinfer.errors import UserError

SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client")


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming, metrics)",
                       description=__doc__, usage="%(prog)s [--model PATH] [--host HOST] [--port PORT] [FLAG ...]",
                       formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False)  # fmt: skip
    add_grouped_help(p)
    server = p.add_argument_group("server", "the HTTP server: address, key, model names, queue and time limits")
    server.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1; 0.0.0.0: every interface)")
    server.add_argument("--port", type=int, default=8000, help="the port to listen on (default 8000; 0: any free port, printed)")
    server.add_argument("--api-key", metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every route but /health (printable ASCII without spaces, as a header carries it)")
    server.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="the model names requests may give (default: --model as given); answers carry the first")
    server.add_argument("--max-queue", type=int, default=1024, metavar="N",
                        help="sequences (a request's prompts times its n) that may wait for the running batch; more are answered 429, "
                             "and a request that alone makes more, 400 (default 1024)")
    server.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES, metavar="N",
                        help=f"the largest request body read; a longer one is answered 413 before it is read whole (default {MAX_REQUEST_BYTES}: 8 MiB)")
    server.add_argument("--request-timeout", type=float, metavar="S", help="abort a request still unfinished after S seconds (default: none)")
    server.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                        help="on SIGINT/SIGTERM, seconds the unfinished requests get before they are aborted (default 30)")
    server.add_argument("--no-warmup", action="store_true",
                        help="take requests at once, without first compiling every step size and capturing the decode graphs "
                             "(default: warm up where the backend compiles on first use; the first requests of each size then wait)")
    server.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"), help="uvicorn's log level")
    add_engine_flags(p, server=True)
    p.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)  # --ep N: the socket the launcher bound, passed to rank 0
    p.set_defaults(func=serve)
    global _PARSER
    _PARSER = p


_PARSER: argparse.ArgumentParser | None = None


def require_serve_extra() -> None:
    import importlib.util

    missing = [m for m in SERVE_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"deepinfer serve needs {', '.join(missing)}: pip install 'deepinfer[serve]'")


def check_flags(args) -> None:
    check_engine_flags(args)
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must lie in [0, 65535], got {args.port}")
    if args.max_queue < 1:
        raise UserError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.request_timeout is not None and not args.request_timeout > 0:
        raise UserError(f"--request-timeout must be > 0 seconds, got {args.request_timeout}")
    if not args.shutdown_timeout >= 0:
        raise UserError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if args.max_request_bytes < 1:
        raise UserError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.api_key is not None:
        check_api_key(args.api_key)
    for served in args.served_model_name or ():
        if not served.strip():
            raise UserError("--served-model-name: a name may not be empty")


def check_api_key(key: str) -> None:
    """A key a client can send: printable ASCII without spaces. An HTTP header carries ASCII, and the
    server strips the spaces around the key it is sent, so any other key could never be matched."""
    if not key.strip():
        raise UserError("--api-key may not be empty")
    bad = next((c for c in key if not "!" <= c <= "~"), None)
    if bad is not None:
        what = "a space" if bad.isspace() else f"U+{ord(bad):04X}, which is not printable ASCII"
        raise UserError(f"--api-key holds {what}: no client could send it in its 'Authorization: Bearer KEY' header; "
                        "choose a key of printable ASCII characters without spaces")  # fmt: skip


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a taken port is a one-line error at once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UserError(f"--host {host}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(args) -> int:
    from deepinfer.cli.launch import launched_by_torchrun, run_as_rank

    require_serve_extra()
    check_flags(args)
    if launched_by_torchrun():
        from deepinfer.distributed.group import env_rank

        rank = env_rank()
        return run_as_rank(lambda: serve_ep_rank(args), rank)
    if (args.ep or 1) > 1:
        from deepinfer.cli.serve_launch import launch_serve_ranks

        return launch_serve_ranks(args, _PARSER)
    return serve_rank(args)


def torch_distributed_barrier(group) -> None:
    import torch.distributed as dist

    dist.barrier(group=group)


def served_models(args) -> list[str]:
    from deepinfer.model.embedded_names import DEFAULT

    return list(args.served_model_name or [args.model or DEFAULT])


def serve_rank(args, llm=None, sock=None, chat_template=None, loop_class=None, **loop_kwargs) -> int:
    """The whole server in this process: the engine thread and uvicorn (blocks until a signal stops
    it). With expert parallelism, rank 0's: its loaded `llm`, its socket and an EpEngineLoop."""
    from deepinfer.serve.app import ServeConfig
    from deepinfer.serve.engine_loop import EngineLoop
    from deepinfer.serve.server import make_frontend, make_server

    grammars = None  # (--ep N: its ranks take no structured output)
    if llm is None:
        sock = listen(args.host, args.port)
        chat_template = read_chat_template(args.chat_template)
        llm = load_llm(args, None)
        # llguidance's view of the tokenizer (a second, the GIL held) is built now, beside the warm-up,
        # not when the first structured request comes while others stream (None: no structured output here)
        grammars = llm.engine.prepare_grammars()
        if llm.compiles_on_first_use and not args.no_warmup:  # (one process; the ranks of --ep N skip it: warm_up refuses)
            done = llm.warm_up()
            print(f"deepinfer: warmed up in {done['seconds']:.1f} s ({done['prefills']} prefill sizes up to {done['largest_prefill']} tokens, "
                  f"{done['graphs_captured']} decode graphs)", file=sys.stderr, flush=True)  # fmt: skip
    if grammars is not None:
        concurrent.futures.wait([grammars])  # a failure is each structured request's own error, not the server's
    config = ServeConfig(served_models(args), args.api_key, chat_template, args.seed, args.request_timeout, max_request_bytes=args.max_request_bytes)
    ranks = llm.world_size
    front = make_frontend(llm, config, args.max_queue, loop_class or EngineLoop, ranks=ranks, **loop_kwargs)
    server = make_server(front, args.host, args.port, args.shutdown_timeout, args.log_level, exit_if_engine_fails=ranks > 1)
    host, port = sock.getsockname()[:2]
    where = f"backend {llm.backend}" + (f", {ranks} expert-parallel ranks" if ranks > 1 else "")
    print(f"deepinfer: serving {', '.join(config.served_models)} on http://{host}:{port} ({where}; Ctrl-C stops)", file=sys.stderr, flush=True)
    front.loop.start()
    try:
        server.run(sockets=[sock])
    finally:
        front.loop.stop(0)
        front.loop.join(30)
    error = front.loop.error
    if error is not None:
        if ranks > 1 and isinstance(error, UserError):  # a rank's collective broke: its one line (PeerFailure: another rank's fault)
            raise error
        raise UserError(f"the engine failed: {type(error).__name__}: {error}")
    return 0


def serve_ep_rank(args) -> int:
    """One rank of `serve --ep N`: rank 0 the server and its engine loop, the others their engine
    loop in this thread, until rank 0 says stop (deepinfer.serve.ep_loop)."""
    import signal

    from deepinfer.cli.run import join_run
    from deepinfer.distributed.group import destroy_distributed
    from deepinfer.serve.ep_loop import EpEngineLoop, control_group

    ctx = join_run(args)
    if ctx is None:  # torchrun with one process
        return serve_rank(args)
    if ctx.rank != 0:  # rank 0 stops the ranks (a signal here would break the lockstep under it)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = (socket.socket(fileno=args.listen_fd) if args.listen_fd is not None else listen(args.host, args.port)) if ctx.rank == 0 else None
    chat_template = read_chat_template(args.chat_template)
    llm = load_llm(args, ctx)
    group = control_group(ctx)
    try:
        if ctx.rank != 0:
            EpEngineLoop(llm, args.max_queue, ctx=ctx, group=group).run_rank()
            code = 0
        else:
            code = serve_rank(args, llm=llm, sock=sock, chat_template=chat_template, loop_class=EpEngineLoop, ctx=ctx, group=group)
        torch_distributed_barrier(group)  # every rank is past its last order before any leaves
    finally:
        destroy_distributed()
    return code  # (a rank other than 0 then ends without the interpreter's teardown: launch.run_as_rank)
