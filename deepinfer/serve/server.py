"""Running the app under uvicorn, with the engine thread beside it, and stopping both gracefully.

On SIGINT / SIGTERM (uvicorn's handlers): the listening socket closes (no new connections), new
requests on open connections get 503, the unfinished requests get --shutdown-timeout seconds to
finish, then are aborted, each told so in a final event (a streamed one: an error event and
[DONE]; a waiting one: 503), the engine thread ends, and uvicorn closes the connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading

from deepinfer.serve.app import Frontend, ServeConfig, build_app
from deepinfer.serve.engine_loop import EngineLoop
from deepinfer.serve.metrics import ServeMetrics

log = logging.getLogger(__name__)


def make_frontend(llm, config: ServeConfig, max_queue: int, loop_class=EngineLoop, ranks: int = 1, **loop_kwargs) -> Frontend:
    """ranks: the expert-parallel ranks the metrics show one by one (1: one process)."""
    metrics = ServeMetrics(ranks)
    loop = loop_class(llm, max_queue, metrics, **loop_kwargs)
    return Frontend(llm, loop, metrics, config)


def make_server(front: Frontend, host: str, port: int, shutdown_timeout_s: float, log_level: str = "warning", exit_if_engine_fails: bool = False):
    """A uvicorn Server for the app whose shutdown drains the engine first (module docstring).
    exit_if_engine_fails: stop serving once the engine loop died of an error (expert parallelism:
    the ranks' group is broken; one process keeps answering /health with 503 instead)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            """uvicorn's handlers, without re-raising the signal once the server has stopped (that
            would turn a graceful SIGTERM into a kill and a Ctrl-C into KeyboardInterrupt)."""
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        async def on_tick(self, counter: int) -> bool:
            if exit_if_engine_fails and front.loop.error is not None and not front.loop.alive:
                return True
            return await super().on_tick(counter)

        async def shutdown(self, sockets=None):
            for server in self.servers:  # stop accepting before the drain, not after it
                server.close()
            front.draining = True
            front.loop.stop(shutdown_timeout_s)
            while front.loop.alive:
                await asyncio.sleep(0.05)
            await super().shutdown(sockets)

    # timeout_graceful_shutdown: the final events are queued by now; this only bounds their delivery
    config = uvicorn.Config(build_app(front), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                            lifespan="off", access_log=False)  # fmt: skip
    return Server(config)


