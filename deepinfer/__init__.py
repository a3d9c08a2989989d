"""deepinfer: DeepSeek inference as a hardware-abstraction library."""

import os

# torch auto-loads torch_npu through an entry point, and a torch_npu without CANN breaks
# `import torch` itself; the ascend backend imports torch_npu explicitly when it is selected.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

__version__ = "0.1.0"

# The offline API, imported on first use so that `import deepinfer` stays light (no torch).
_LAZY_EXPORTS = {
    "LLM": "deepinfer.engine.llm",
    "SamplingParams": "deepinfer.engine.sampling_params",
    "StructuredOutputsParams": "deepinfer.engine.structured_params",
    "RequestOutput": "deepinfer.engine.outputs",
    "CompletionOutput": "deepinfer.engine.outputs",
    "Logprob": "deepinfer.engine.outputs",
}

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]


def __getattr__(name: str):
    if name in _LAZY_EXPORTS:
        import importlib

        value = getattr(importlib.import_module(_LAZY_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_EXPORTS))
