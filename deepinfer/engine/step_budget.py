"""The default per-step token budget (max_num_batched_tokens), chosen from the device as vLLM chooses it.

A step computes at most max_num_batched_tokens tokens; a longer prompt prefills in chunks of that size. Larger
chunks fill the GEMMs better (DeepSeek-V4's routed experts get twice the rows each) at the cost of a longer step, so a
decode that shares the step waits longer for its token. vLLM's engine arguments settle it by where the engine runs:
offline (its LLM class) 16384 tokens on a device with at least 70 GiB of memory and 8192 below, an OpenAI server 8192
there (and 2048 below). deepinfer takes the offline rule for `LLM(...)`, `deepinfer run` and `run-batch`, and 8192 for
`deepinfer serve`. On an H100, 2026-12-07, the 8-layer V4-Flash prefill of 8 x 8192 tokens took 0.898 s in chunks of
16384 against 0.942-0.954 s in chunks of 8192 (docs/performance.md). vLLM also keeps the A100 at 8192 (a throughput
regression it measured there); deepinfer does not look at device names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the CLI reads SERVER_BUDGET before torch is imported)
    import torch

SMALL_DEVICE_BUDGET = 8192  # tokens a step: the host, and accelerators under LARGE_DEVICE_BYTES
LARGE_DEVICE_BUDGET = 16384
LARGE_DEVICE_BYTES = 70 << 30
SERVER_BUDGET = 8192  # `deepinfer serve`'s default: shorter steps keep the running requests' inter-token latency low


def default_max_num_batched_tokens(device: torch.device) -> int:
    """Tokens a step may compute when the user gives no max_num_batched_tokens (offline use; the module docstring)."""
    from deepinfer.model.memory import device_total

    total = device_total(device)
    return LARGE_DEVICE_BUDGET if total is not None and total >= LARGE_DEVICE_BYTES else SMALL_DEVICE_BUDGET
