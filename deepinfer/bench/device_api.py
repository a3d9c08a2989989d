"""The device calls the benchmarks make, through torch's device-generic API: torch.accelerator
(synchronise, empty the cache), torch.Event (timing events), torch.Stream (a side stream),
torch.get_device_module (what only a device's own module can tell: its name, peer access).

No benchmark names a device module (tests/core/test_bench_device_neutral.py checks it): the same
code times the cuda backend, the ascend backend and any other, and the CPU (the host: the reference
backend, or a backend's kernels under the interpreter) with the wall clock. Graph capture is not
here: it is the backend's capability (BackendSpec.graph_capture, deepinfer.device_graphs).
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def on_host(device: torch.device) -> bool:
    """The CPU: no queue to wait for, no device events; timed with the wall clock."""
    return torch.device(device).type == "cpu"


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if not on_host(device):
        torch.accelerator.synchronize(device)


def empty_cache(device: torch.device) -> None:
    """Hand the caching allocator's unused blocks of `device` back (nothing to do on the CPU)."""
    if not on_host(device):
        with torch.accelerator.device_index(torch.device(device).index):
            torch.accelerator.empty_cache()


def timing_event(device: torch.device) -> torch.Event:
    """An event that can time the device's work; record() puts it on the current stream."""
    return torch.Event(device=device, enable_timing=True)


def side_stream(device: torch.device) -> torch.Stream:
    """A new stream of `device`; `with stream:` makes it (and its device) current."""
    return torch.Stream(device=device)


def device_name(device: torch.device) -> str:
    """The device's own name where its module tells it (cuda, npu, ...), else its torch name."""
    if on_host(device):
        return str(device)
    get_name = getattr(torch.get_device_module(device), "get_device_name", None)
    return get_name(device) if get_name is not None else str(device)


def machine_name(device: torch.device) -> str:
    """What a timing on `device` depends on, for results kept across runs: the device's own name, or
    on the host the CPU's model and torch's thread count."""
    if not on_host(device):
        return device_name(device)
    threads = torch.get_num_threads()
    return f"cpu: {host_cpu_name()} ({threads} thread{'s' if threads != 1 else ''})"


def host_cpu_name() -> str:
    """The host CPU's model name (/proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peer_access(device_type: str, a: int, b: int) -> bool | None:
    """Whether device a can read device b's memory directly; None where the device module cannot say."""
    can = getattr(torch.get_device_module(device_type), "can_device_access_peer", None)
    return bool(can(a, b)) if can is not None else None
