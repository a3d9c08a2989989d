"""The process group of a multi-device run: one process per device, launched by torchrun.

`init_distributed` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) and forms the default process group with the collective library of the device: NCCL
for cuda, HCCL for npu (torch_npu registers it), gloo for the CPU. Every collective of the group
(and the rendezvous itself) fails after `timeout_s` instead of hanging: a rank that never starts,
dies, or never reaches a collective ends the run on every other rank with a `DistributedError`.

With NCCL, a collective that times out is detected by the process group's watchdog, which tears
the process down with its own message (TORCH_NCCL_ASYNC_ERROR_HANDLING, on by default); gloo and
HCCL raise in the calling thread, where the callers wrap the error in a `PeerFailure` (a
`DistributedError` that says the cause is another rank: `collective_failure`; `is_collective_error`
tells such errors from a rank's own), so the launcher reports the rank that failed first.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from deepinfer.distributed.environment import (  # noqa: F401 (the torch-free part, re-exported here)
    DEFAULT_TIMEOUT_S,
    MAX_TIMEOUT_S,
    DistributedError,
    check_timeout,
    env_int,
    env_rank,
    env_world_size,
    free_port,
    rank_env,
)

log = logging.getLogger(__name__)

# The collective library for each torch device type.
PROCESS_GROUP_BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}
# The libraries' own switches for a fixed reduction order (read when their communicators form).
DETERMINISTIC_COLLECTIVES = {"nccl": {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}, "hccl": {"HCCL_DETERMINISTIC": "true"}}


class PeerFailure(DistributedError):
    """This rank stopped because of another: a collective failed as a peer died or stopped
    answering, or torchrun stopped this rank after another failed (the launcher reports the cause)."""


@dataclass(frozen=True)
class DistContext:
    """This process's place in the run: its rank, the group, the device it drives."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    group: dist.ProcessGroup
    backend: str = "gloo"  # the collective library: nccl | hccl | gloo
    timeout_s: float = DEFAULT_TIMEOUT_S


def collective_failure(ctx: DistContext, what: str, exc: BaseException) -> DistributedError:
    """A one-line error for a collective that failed: a rank died, or it timed out (a
    DistributedError already raised is passed on as it is)."""
    if isinstance(exc, DistributedError):
        return exc
    return PeerFailure(
        f"rank {ctx.rank} of {ctx.world_size}: {what} failed ({type(exc).__name__}: {_first_line(exc)}); "
        f"another rank died or stopped answering within the timeout of {ctx.timeout_s:g} s (--dist-timeout)"
    )


# What the collective libraries' errors say when a peer is gone or silent (gloo raises a plain
# RuntimeError: "Connection reset by peer", "Timed out waiting 3000ms for send operation").
_PEER_MARKERS = ("gloo", "Gloo", "NCCL", "HCCL", "Connection closed", "Connection reset", "Broken pipe", "timed out", "Timed out")


def is_collective_error(exc: BaseException) -> bool:
    """Errors that come from the process group rather than from this rank's own computation."""
    if isinstance(exc, DistributedError):
        return True
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    return isinstance(exc, RuntimeError) and any(marker in str(exc) for marker in _PEER_MARKERS)


def default_device_type() -> str:
    """cuda when a GPU is visible, npu when torch_npu has a device, else cpu."""
    if torch.cuda.is_available():
        return "cuda"
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return "npu"
    return "cpu"


def init_distributed(
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    device: str | torch.device | None = None,
    backend: str | None = None,
    deterministic: bool = False,
) -> DistContext | None:
    """Join the run's process group from torchrun's environment; None for a one-process run.

    device: the torch device type this process drives ("cuda", "npu", "cpu"; default: the first
    available of those). Rank r drives device LOCAL_RANK of that type. backend: the collective
    library, by default the device's (nccl, hccl, gloo). The rendezvous and every collective of the
    group time out after timeout_s; a rank missing at the rendezvous raises DistributedError.
    Calling it again returns the group already formed.

    deterministic: pin the collective library's reduction order before the group forms (NCCL: the
    ring algorithm with the simple protocol; HCCL: its deterministic switch; gloo reduces in a fixed
    order already), unless the user set those variables. Today's data path reduces no floats across
    ranks (all_to_all moves rows; the all_reduces sum integer flags and loads), so this guards any
    float collective rather than changing one.
    """
    timeout_s = check_timeout(timeout_s)
    world_size = env_world_size()
    if world_size <= 1:
        return None
    env_int("RANK")  # set: a rank that torchrun did not start says so
    rank = env_rank()
    local_rank = env_int("LOCAL_RANK", rank)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise DistributedError(f"{name} is not set: launch every rank with torchrun, or set MASTER_ADDR and MASTER_PORT")
    device_type = torch.device(device).type if device is not None else default_device_type()
    if device_type not in PROCESS_GROUP_BACKENDS:
        raise DistributedError(f"no collective library for device type {device_type!r}; known: {', '.join(PROCESS_GROUP_BACKENDS)}")
    backend = backend or PROCESS_GROUP_BACKENDS[device_type]
    torch_device = _bind_device(device_type, local_rank)
    if deterministic:
        for name, value in DETERMINISTIC_COLLECTIVES.get(backend, {}).items():
            os.environ.setdefault(name, value)

    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise DistributedError(
                f"a process group of {dist.get_world_size()} ranks (this is rank {dist.get_rank()}) already exists; "
                f"the environment says rank {rank} of {world_size}"
            )
        return DistContext(rank, world_size, local_rank, torch_device, dist.group.WORLD, dist.get_backend(), timeout_s)

    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    kwargs = {}
    if device_type == "cuda":
        kwargs["device_id"] = torch_device  # NCCL communicators form now: a bad rank fails here, not mid-run
    try:
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            **kwargs,
        )
    except Exception as exc:  # DistStoreError (rendezvous timeout), RuntimeError (connection), ValueError
        raise DistributedError(
            f"rank {rank} of {world_size}: the process group did not form at {where} within {timeout_s:g} s "
            f"({type(exc).__name__}: {_first_line(exc)}); every rank must be started and reach the same "
            "MASTER_ADDR:MASTER_PORT (torchrun --nproc-per-node N, and --nnodes/--node-rank/--master-addr on each node)"
        ) from exc
    log.info("rank %d of %d joined the %s process group at %s (device %s)", rank, world_size, backend, where, torch_device)
    return DistContext(rank, world_size, local_rank, torch_device, dist.group.WORLD, backend, timeout_s)


def _bind_device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, device_type)
    count = module.device_count()
    if local_rank >= count:
        raise DistributedError(f"LOCAL_RANK={local_rank} but this host has {count} {device_type} device(s): start at most {count} ranks per node")
    module.set_device(local_rank)
    return torch.device(device_type, local_rank)


def destroy_distributed() -> None:
    """Leave the process group (safe to call when there is none)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
