"""How many threads torch's CPU ops use in this process (intra-op parallelism).

The rule for a run on the CPU: an explicit `cpu_threads` wins; else OMP_NUM_THREADS, when set
(torchrun ranks get 1: several ranks share the cores); else every core this process may run on but
one, at least one, and never more than torch's own default (the physical cores). Why one core
short: an OpenMP team as wide as the machine waits at every op for its slowest thread, so one other
busy process (another rank, a build, a test run) stalls the whole team, while a team one thread
narrower loses at most 1/N of the idle machine (the same reserve as vLLM's CPU backend keeps).

torch is imported where a count is read or set: the command line checks --cpu-threads before it.
"""

from __future__ import annotations

import os

from deepinfer.engine.sampling_params import InvalidRequestError

MAX_CPU_THREADS = 1024


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_cpu_threads() -> int:
    """The rule's default: one core left for the rest of the machine (see the module docstring)."""
    import torch

    return max(1, min(torch.get_num_threads(), usable_cpus() - 1))


def check_cpu_threads(value) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_CPU_THREADS):
        raise InvalidRequestError(f"cpu_threads must be an integer in [1, {MAX_CPU_THREADS}] (or None: the default rule), got {value!r}")


def cpu_threads_for(requested: int | None, on_cpu: bool) -> int:
    """The thread count the rule gives, without setting it (`deepinfer backends` shows what a run would use)."""
    import torch

    if requested is not None:
        return requested
    if on_cpu and not os.environ.get("OMP_NUM_THREADS"):
        return default_cpu_threads()
    return torch.get_num_threads()  # the environment's choice (OMP_NUM_THREADS), or an accelerator run's: untouched


def use_cpu_threads(requested: int | None, on_cpu: bool) -> int:
    """Set torch's intra-op thread count by the rule and return it. `on_cpu`: the run's ops run on
    the CPU (the default rule applies only then; an explicit `requested` applies always)."""
    import torch

    check_cpu_threads(requested)
    threads = cpu_threads_for(requested, on_cpu)
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return torch.get_num_threads()
