"""`deepinfer serve`: an OpenAI-compatible HTTP server on the engine.

- engine_loop.py: the engine's own thread, a thread-safe inbox, updates to each request's asyncio queue
- ep_loop.py: serve --ep N: every rank's engine loop in lockstep, rank 0's inbox broadcast, updates gathered to rank 0
- protocol.py: OpenAI's errors, streamed chunks and server-sent events
- app.py: the FastAPI routes (request bodies read by run-batch's field table)
- metrics.py: the Prometheus metrics
- server.py: uvicorn with the engine thread, and the graceful shutdown

fastapi, uvicorn and prometheus_client (the serve extra) are imported only by these modules, never
by `import deepinfer`.
"""
