"""The HTTP routes of `deepinfer serve` (FastAPI): OpenAI's /v1/completions, /v1/chat/completions
and /v1/models, plus /health and /metrics.

A generation request is read exactly as a run-batch line's body is (deepinfer.cli.batch_requests
.read_body: the field table of deepinfer/cli/request_fields.py; sampling_params: the endpoint's
defaults and the seeds; run_batch.engine_prompts: chat messages through the chat template), except
"stream" and "stream_options", which only a server can honour. Its prompts are then tokenized and
checked against the engine (LLM.make_requests) off the event loop, and handed to the engine thread
as a Job (deepinfer.serve.engine_loop). A problem is an error answer before anything runs: 400 for
the body (the field to blame as "param"), 404 for a model the server does not serve, 401 without
the API key, 429 when the engine's queue is full, 503 while the server shuts down; 408 when a
request outlives --request-timeout. A client that goes away aborts its request (streaming or not),
which frees its KV pages at the next step boundary.

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

from deepinfer.cli.batch_requests import BatchRequest, read_body, sampling_params
from deepinfer.cli.batch_rows import response_body
from deepinfer.cli.request_fields import CHAT, COMPLETIONS
from deepinfer.errors import UserError
from deepinfer.serve.engine_loop import EngineLoop, Job, QueueFull, ShuttingDown
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
            raise ApiError(400, f'"stream" must be true or false, got {stream!r}', "stream")
        options = body.get("stream_options")
        include_usage = False
        if options is not None:
            if not stream:
                raise ApiError(400, '"stream_options" needs "stream": true', "stream_options")
            if not isinstance(options, dict) or set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool):
                raise ApiError(400, f'"stream_options" must be {{"include_usage": true | false}}, got {options!r}', "stream_options")
            include_usage = options.get("include_usage", False)
        request = BatchRequest("", SOURCE, next(self._arrivals), url=url)
        read_body(body, request, self.config.served_models, skip=("stream", "stream_options"), where="")
        params = sampling_params(request, self.config.base_seed) if request.failure is None else None
        if request.failure is not None:
            failure = request.failure
            raise ApiError(failure.status, failure.message.removeprefix(f"{SOURCE}: "), failure.param)
        return request, params, bool(stream), include_usage

    def prepare(self, request: BatchRequest, params: list) -> list:
        """The engine requests of a read request: chat rendered, prompts tokenized and checked (ApiError otherwise)."""
        from deepinfer.cli.run_batch import engine_prompts

        try:
            prompts = engine_prompts(self.llm, request, self.config.chat_template)
            names = ["the request" if len(prompts) == 1 else f"prompt {i}" for i in range(len(prompts))]
            return self.llm.make_requests(prompts, params, names)
        except UserError as exc:
            raise ApiError(400, str(exc).removeprefix(f"{SOURCE}: "), "messages" if request.messages is not None else "prompt") from None

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
        try:
            body = await request.json()
        except ValueError as exc:
            raise ApiError(400, f"the request body is not valid JSON ({exc})") from None
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
        except ShuttingDown as exc:
            return error_response(url, 503, str(exc))
        hex_id = uuid.uuid4().hex
        if stream:
            writer = StreamWriter(url, model, hex_id, front.llm.tokenizer, params, read.fields.sampling.get("logprobs"))
            writer.prompt_tokens = sum(len(ids) for ids, _, _ in prompts)
            front.metrics.request(url, 200)
            return AbortOnClose(events(updates, writer, include_usage), on_close=lambda: front.loop.abort(key), media_type="text/event-stream")
        return await answer(request, url, key, updates, read, model, hex_id)

    async def events(updates: asyncio.Queue, writer: StreamWriter, include_usage: bool):
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
                    yield sse(error_body(400, failed, "structured_outputs"))
                elif include_usage:
                    yield sse(writer.usage_chunk())
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
                return error_response(url, 400, failed, "structured_outputs")
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
