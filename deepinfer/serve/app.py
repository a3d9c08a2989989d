"""The HTTP routes of `deepinfer serve` (FastAPI): OpenAI's /v1/completions, /v1/chat/completions
and /v1/models, plus /health and /metrics.

A generation request is read exactly as a run-batch line's body is (deepinfer.cli.batch_requests
.read_body: the field table of deepinfer/cli/request_fields.py; sampling_params: the endpoint's
defaults and the seeds; run_batch.engine_prompts: chat messages through the chat template), except
"stream" and "stream_options", which only a server can honour. Its prompts are then tokenized and
checked against the engine (LLM.make_requests) off the event loop, and handed to the engine thread
as a Job (deepinfer.serve.engine_loop). A problem is an error answer before anything runs: 400 for
the body (the field to blame as "param"; a body that is not JSON, nests deeper than
deepinfer.cli.json_input reads, holds text that is not valid Unicode, or makes more sequences,
prompts times n, than --max-queue lets wait: it never could), 413 for a body over
--max-request-bytes (refused before it is read whole), 404 for a model the server does not serve,
401 without the API key, 429 when the engine's queue is full, 503 while the server shuts down; 408
when a request outlives --request-timeout. A client that goes away aborts its request (streaming or
not), which frees its KV pages at the next step boundary.

fastapi is imported here at the top (FastAPI reads the routes' annotations): only deepinfer serve
imports this module.

Without a "seed", a request samples with a seed derived from --seed and the request's arrival
number, as a run-batch line's derives from its line number.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from deepinfer.cli import json_input
from deepinfer.cli.batch_requests import BatchRequest, read_body, sampling_params
from deepinfer.cli.batch_rows import failed_param, response_body
from deepinfer.cli.request_fields import CHAT, COMPLETIONS, short
from deepinfer.cli.run_requests import lone_surrogate, surrogate_message
from deepinfer.errors import UserError
from deepinfer.serve.engine_loop import EngineLoop, Job, QueueFull, ShuttingDown, TooLarge
from deepinfer.serve.metrics import CONTENT_TYPE, ServeMetrics
from deepinfer.serve.protocol import DONE, ApiError, StreamWriter, error_body, sse

log = logging.getLogger(__name__)

SOURCE = "the request"  # how read_body's messages name the body; cut from the answer's message


@dataclass
class ServeConfig:
    served_models: list[str]
    api_key: str | None = None
    chat_template: str | None = None
    base_seed: int = 0
    request_timeout_s: float | None = None
    poll_disconnect_s: float = 0.5  # how often a waiting non-streamed request looks for its client
    max_request_bytes: int = json_input.MAX_REQUEST_BYTES  # a longer body is refused (413) before it is read whole


def refuse_lone_surrogates(body: dict) -> None:
    """400 naming the field whose text (or whose name) holds a lone surrogate: such text cannot be
    tokenized, nor quoted in an answer (deepinfer.cli.run_requests.lone_surrogate)."""
    for key, value in body.items():
        path = lone_surrogate(key, "a field name") or lone_surrogate(value, key)
        if path is not None:
            raise ApiError(400, surrogate_message(path), None if path == "a field name" else key)


async def read_json_body(request: Request, limit: int):
    """The request's body as JSON: 413 past `limit` bytes (by its Content-Length, or as it arrives),
    400 when it is not JSON deepinfer reads (deepinfer.cli.json_input) or nests too deeply."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, too_large(f"{int(declared)} bytes", limit))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, too_large(f"more than {limit} bytes", limit))
        chunks.append(chunk)
    try:
        body = json_input.parse(b"".join(chunks))
    except json_input.NotJson as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc})") from None
    if json_input.too_deep(body):
        # blame the top-level field that nests too deep, as OpenAI's 400 names its param
        field = next((key for key, value in body.items() if json_input.too_deep(value, json_input.MAX_DEPTH - 1)), None) if isinstance(body, dict) else None
        raise ApiError(400, f"the request body {json_input.depth_problem()}", field)
    return body


def too_large(size: str, limit: int) -> str:
    return f"the request body is {size}; this server reads at most {limit} bytes (deepinfer serve --max-request-bytes)"


class Frontend:
    """What the routes share: the LLM (tokenizer, chat template, checks), the engine thread, the metrics."""

    def __init__(self, llm, loop: EngineLoop, metrics: ServeMetrics, config: ServeConfig):
        self.llm = llm
        self.loop = loop
        self.metrics = metrics
        self.config = config
        self.draining = False
        self._arrivals = itertools.count()

    def authorize(self, request) -> None:
        key = self.config.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), key.encode()):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the server's --api-key")

    def read_request(self, body, url: str) -> tuple[BatchRequest, list, bool, bool]:
        """The body read and checked (ApiError otherwise): the request, a SamplingParams per prompt,
        whether to stream, whether a streamed answer ends with the usage."""
        if not isinstance(body, dict):
            raise ApiError(400, f"the request body must be a JSON object, got a {type(body).__name__}")
        stream = body.get("stream")
        if stream not in (None, True, False):
            raise ApiError(400, f'"stream" must be true or false, got {short(stream)}', "stream")
        options = body.get("stream_options")
        include_usage = False
        if options is not None:
            if not stream:
                raise ApiError(400, '"stream_options" needs "stream": true', "stream_options")
            if not isinstance(options, dict) or set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool):
                raise ApiError(400, f'"stream_options" must be {{"include_usage": true | false}}, got {short(options)}', "stream_options")
            include_usage = options.get("include_usage", False)
        refuse_lone_surrogates(body)
        request = BatchRequest("", SOURCE, next(self._arrivals), url=url)
        read_body(body, request, self.config.served_models, skip=("stream", "stream_options"), where="", listed="")
        params = sampling_params(request, self.config.base_seed) if request.failure is None else None
        if request.failure is not None:
            failure = request.failure
            raise ApiError(failure.status, failure.message.removeprefix(f"{SOURCE}: "), failure.param)
        self.refuse_what_never_fits(request, params)
        return request, params, bool(stream), include_usage

    def refuse_what_never_fits(self, request: BatchRequest, params: list) -> None:
        """400 for a request of more sequences (prompts times n) than the queue lets wait: it would
        be refused with 429 forever (checked before its prompts are tokenized)."""
        prompts, n = max(1, len(request.prompts)), params[0].n
        limit = self.loop.max_queue
        if prompts * n > limit:
            param = "prompt" if prompts > limit else request.fields.sources.get("n", "n")
            raise ApiError(400, f"the request makes {prompts * n} sequences ({prompts} prompt{'s' if prompts > 1 else ''} times n = {n}), more than "
                                f"the server lets wait at once (--max-queue {limit}); split it into smaller requests", param)  # fmt: skip

    def prepare(self, request: BatchRequest, params: list) -> list:
        """The engine requests of a read request: chat rendered, prompts tokenized and checked (ApiError otherwise)."""
        from deepinfer.cli.run_batch import engine_prompts

        try:
            prompts = engine_prompts(self.llm, request, self.config.chat_template)
            names = ["the request" if len(prompts) == 1 else f"prompt {i}" for i in range(len(prompts))]
            return self.llm.make_requests(prompts, params, names)
        except UserError as exc:
            param = getattr(exc, "param", None)  # an InvalidRequestError names the SamplingParams field to blame, if one is
            field = request.fields.sources.get(param, param) if param is not None else "messages" if request.messages is not None else "prompt"
            raise ApiError(400, str(exc).removeprefix(f"{SOURCE}: "), field) from None

    def deadline(self) -> float | None:
        timeout = self.config.request_timeout_s
        return time.monotonic() + timeout if timeout is not None else None


def build_app(front: Frontend):
    app = FastAPI(title="deepinfer", docs_url=None, redoc_url=None, openapi_url=None)

    def error_response(endpoint: str, status: int, message: str, param: str | None = None, headers=None):
        front.metrics.request(endpoint, status)
        return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return error_response(request.url.path, exc.status, exc.message, exc.param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):  # unknown routes, wrong methods: OpenAI's shape too
        return error_response(request.url.path, exc.status_code, f"{exc.detail}: {request.method} {request.url.path}")

    @app.get("/health")
    async def health():
        if not front.loop.alive and not front.draining:
            return error_response("/health", 503, f"the engine stopped: {front.loop.error!r}")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request):
        front.authorize(request)
        return Response(front.metrics.text(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request):
        front.authorize(request)
        front.metrics.request("/v1/models", 200)
        created = int(time.time())
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "deepinfer", "root": front.llm.model_path}
                                           for name in front.config.served_models]}  # fmt: skip

    @app.post(COMPLETIONS)
    async def completions(request: Request):
        return await generate(request, COMPLETIONS)

    @app.post(CHAT)
    async def chat(request: Request):
        return await generate(request, CHAT)

    async def generate(request: Request, url: str):
        front.authorize(request)
        if front.draining:
            raise ApiError(503, "the server is shutting down and takes no new requests")
        body = await read_json_body(request, front.config.max_request_bytes)
        read, params, stream, include_usage = front.read_request(body, url)
        prompts = await run_in_threadpool(front.prepare, read, params)
        model = read.fields.model or front.config.served_models[0]
        updates: asyncio.Queue = asyncio.Queue()
        event_loop = asyncio.get_running_loop()

        def sink(update) -> None:  # on the engine thread
            try:
                event_loop.call_soon_threadsafe(updates.put_nowait, update)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

        job = Job(prompts, sink, stream, front.deadline())
        try:
            key = front.loop.submit(job)
        except QueueFull as exc:
            return error_response(url, 429, str(exc), headers={"Retry-After": "1"})
        except TooLarge as exc:  # (read_request refuses these first)
            return error_response(url, 400, str(exc))
        except ShuttingDown as exc:
            return error_response(url, 503, str(exc))
        hex_id = uuid.uuid4().hex
        if stream:
            writer = StreamWriter(url, model, hex_id, front.llm.tokenizer, params, read.fields.sampling.get("logprobs"))
            writer.prompt_tokens = sum(len(ids) for ids, _, _ in prompts)
            front.metrics.request(url, 200)
            return AbortOnClose(events(updates, writer, read, include_usage), on_close=lambda: front.loop.abort(key), media_type="text/event-stream")
        return await answer(request, url, key, updates, read, model, hex_id)

    async def events(updates: asyncio.Queue, writer: StreamWriter, read: BatchRequest, include_usage: bool):
        while True:
            update = await updates.get()
            chunk = writer.chunk(update.deltas)
            if chunk is not None:
                yield sse(chunk)
            if update.kind == "tokens":
                continue
            if update.kind == "done":
                failed = next((c.error for o in update.outputs for c in o.outputs if c.error is not None), None)
                if failed is not None:
                    yield sse(error_body(400, failed, failed_param(read)))
                elif include_usage:
                    yield sse(writer.usage_chunk(sum(o.num_cached_tokens for o in update.outputs)))
            else:
                yield sse(error_body(update.status, update.message))
            yield DONE
            return

    async def answer(request: Request, url: str, key: int, updates: asyncio.Queue, read: BatchRequest, model: str, hex_id: str):
        """A non-streamed request's answer; its client is looked for while it runs (gone: aborted)."""
        while True:
            try:
                update = await asyncio.wait_for(updates.get(), front.config.poll_disconnect_s)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    front.loop.abort(key)
                    front.metrics.request(url, 499)  # nginx's "client closed request": nobody reads it
                    return Response(status_code=499)
                continue
            if update.kind == "tokens":
                continue
            if update.kind != "done":
                return error_response(url, update.status, update.message)
            failed = next((c.error for o in update.outputs for c in o.outputs if c.error is not None), None)
            if failed is not None:
                return error_response(url, 400, failed, failed_param(read))
            front.metrics.request(url, 200)
            return JSONResponse(response_body(read, update.outputs, model, hex_id))

    class AbortOnClose(StreamingResponse):
        """A stream that aborts its request when it ends before the request did (the client went away)."""

        def __init__(self, content, on_close, **kwargs):
            super().__init__(content, **kwargs)
            self.on_close = on_close

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.on_close()  # a no-op once the request finished

    return app
