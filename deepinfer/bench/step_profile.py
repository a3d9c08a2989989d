"""`deepinfer bench e2e --profile`: where a decode step's time goes, kernel by kernel.

torch's profiler records a generation; each event name's self time, over the decode steps it
covers, is its time per step. The backend says which profiler activity records its device's kernels
(`BackendSpec.profiler_activity`, e.g. "CUDA"); with one, the rows are device kernels and their sum
set against the unprofiled step bounds the device's idle time from below (the profiler slows the
host, not the kernels). A backend without one (the reference, on the CPU) gets the host's ops by
self time instead, which says where a CPU step goes.

V2-Lite: two profiled generations that differ only in the tokens generated (1 and 1 + N); each
name's time in the second minus its time in the first, over N, is its time per decode step (the
prefill cancels). V4-Flash: N engine steps that only decode, profiled as they are; and each prefill
row's pass (its prompts from position 0 to their first token) once more, whole.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch

from deepinfer.bench.device_api import synchronize


@dataclass
class StepProfile:
    """Time per decode step by kernel (device=True) or by host op (device=False), in microseconds,
    largest first; `total_ms` sums every name that took time."""

    device: bool
    total_ms: float
    rows: list[tuple[str, float]] = field(default_factory=list)

    def to_json(self, limit: int) -> dict:
        return {"device_kernels": self.device, "total_ms_per_step": self.total_ms, "us_per_step": dict(self.rows[:limit])}


def activities(activity: str | None) -> list:
    """The profiler activities for a backend's `profiler_activity` (None: the host's ops only)."""
    from torch.profiler import ProfilerActivity

    if activity is None:
        return [ProfilerActivity.CPU]
    chosen = getattr(ProfilerActivity, activity, None)
    if chosen is None:
        raise ValueError(f"the backend's profiler_activity {activity!r} is not a torch.profiler.ProfilerActivity")
    return [ProfilerActivity.CPU, chosen]


def self_times(prof, device: bool) -> Counter:
    """Self time in microseconds by event name: the device's events (kernels, copies) when `device`,
    else the host's ops."""
    from torch.autograd import DeviceType

    times = Counter()
    for event in prof.key_averages():
        on_device = event.device_type != DeviceType.CPU
        if on_device != device:
            continue
        us = getattr(event, "self_device_time_total", None) if device else event.self_cpu_time_total
        if us is None:  # torch before 2.4 names it after CUDA
            us = getattr(event, "self_cuda_time_total", 0)
        if us:
            times[event.key] += us
    return times


def recorded(run: Callable[[], object], device: torch.device, activity: str | None) -> Counter:
    from torch.profiler import profile

    synchronize(device)
    with profile(activities=activities(activity)) as prof:
        run()
        synchronize(device)
    return self_times(prof, activity is not None)


def _profile(per_step: Counter, activity: str | None) -> StepProfile:
    rows = sorted(((name, us) for name, us in per_step.items() if us > 0), key=lambda row: -row[1])
    return StepProfile(device=activity is not None, total_ms=sum(us for _, us in rows) / 1e3, rows=rows)


def difference(generate: Callable[[int], object], new_tokens: int, device: torch.device, activity: str | None) -> StepProfile:
    """Per decode step: generate(1 + new_tokens) minus generate(1), over new_tokens."""
    short = recorded(lambda: generate(1), device, activity)
    long = recorded(lambda: generate(1 + new_tokens), device, activity)
    return _profile(Counter({name: (us - short.get(name, 0.0)) / new_tokens for name, us in long.items()}), activity)


def of_steps(run_steps: Callable[[], object], steps: int, device: torch.device, activity: str | None) -> StepProfile:
    """Per step of `run_steps`, which runs `steps` decode steps."""
    return _profile(Counter({name: us / steps for name, us in recorded(run_steps, device, activity).items()}), activity)


def format_profile(label: str, profile: dict, step_ms: float, unit: str = "decode step") -> str:
    """The lines `bench e2e --profile` prints for one batch (or, unit "prefill pass", one prefill row), from StepProfile.to_json."""
    device, total = profile["device_kernels"], profile["total_ms_per_step"]
    what = "kernels" if device else "host ops (self time: this backend names no device profiler activity)"
    short = unit.split()[-1]
    lines = [f"### {label}: {step_ms:.3f} ms per {unit}; {what} {total:.3f} ms per {short}"]
    if device and total > step_ms:
        # kernels overlapped (programmatic dependent launch: a kernel is resident, waiting, before the one it follows ends),
        # so their sum includes waits and bounds no idle time
        lines.append(f"### {label}: kernels overlap ({total:.3f} ms of kernel spans in a {step_ms:.3f} ms {short}): no idle bound from their sum")
    elif device:
        lines.append(f"### {label}: device idle at least {max(0.0, 1 - total / step_ms):.1%} of the {short} (1 - kernels / {short})")
    if not profile["us_per_step"]:
        lines.append("  (no events recorded)")
    for name, us in profile["us_per_step"].items():
        lines.append(f"  {us:9.1f} us  {us / 1e3 / total:6.1%}  {name[:100]}")
    return "\n".join(lines)
