"""The offline engine: sequences, the paged KV block manager with prefix caching, the scheduler
(continuous batching, chunked prefill, preemption by recompute), the model runner and the
vLLM-shaped API (`LLM`, `SamplingParams`, `RequestOutput`).

Kept import-light: `import deepinfer.engine` pulls in nothing heavy; import the modules you need.
"""
