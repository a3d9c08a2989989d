"""The model dtype names `LLM(dtype=...)` and `deepinfer run --dtype` accept, in one table.

vLLM's names (auto, half, float16, bfloat16, float, float32: half is float16, float is float32)
and the short ones (bf16, fp16, fp32), each mapped to the name of its torch dtype. Torch-free:
the CLI lists them as --dtype's choices before it imports torch.
"""

from __future__ import annotations

AUTO = "auto"  # bfloat16 on accelerators, float32 on the CPU (deepinfer.engine.llm.resolve_dtype)

TORCH_NAME = {
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
}

DTYPE_NAMES = (AUTO, *TORCH_NAME)


def torch_name(name: str) -> str:
    """The torch dtype name ("float16") of an accepted name ("half"); ValueError naming the accepted ones."""
    if not isinstance(name, str) or name not in TORCH_NAME:
        raise ValueError(f"unknown dtype {name!r}; use {', '.join(DTYPE_NAMES)}")
    return TORCH_NAME[name]
