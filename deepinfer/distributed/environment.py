"""The torch-free part of a multi-device run's set-up: torchrun's environment (RANK, WORLD_SIZE),
the collective timeout's bounds, a free port and the environment of a one-host rank.

Apart from deepinfer.distributed.group (which re-exports them) so that the command line checks its
flags and starts its ranks without importing torch: a usage error answers at once.
"""

from __future__ import annotations

import os
import socket

from deepinfer.errors import UserError

DEFAULT_TIMEOUT_S = 300.0
MAX_TIMEOUT_S = 1e9  # ~31 years: timedelta and the stores' millisecond counts hold it


class DistributedError(UserError):
    """A rank that never joined, died, or missed a collective; a collective that timed out."""


def env_int(name: str, default: int | None = None, minimum: int = 0) -> int:
    """An integer from torchrun's environment; a one-line error naming the variable otherwise."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise DistributedError(f"{name} is not set: launch every rank with torchrun (torchrun --nproc-per-node N -m deepinfer ...)")
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise DistributedError(
            f"environment variable {name}={raw[:40]!r} is not an integer >= {minimum}; torchrun sets it for each rank "
            "(unset RANK, WORLD_SIZE and LOCAL_RANK to run as one process)"
        )
    return value


def env_world_size() -> int:
    """WORLD_SIZE from the environment (1 when unset: one process)."""
    return env_int("WORLD_SIZE", 1, minimum=1)


def env_rank() -> int:
    """RANK from the environment, checked against WORLD_SIZE (0 when neither is set)."""
    world_size = env_world_size()
    rank = env_int("RANK", 0)
    if rank >= world_size:
        raise DistributedError(f"environment variable RANK={rank} is outside WORLD_SIZE={world_size}; torchrun sets both for each rank")
    return rank


def check_timeout(timeout_s, name: str = "dist_timeout") -> float:
    """The collective timeout in seconds: a finite number > 0 (at most MAX_TIMEOUT_S). `name`
    names it in the error (the CLI: --dist-timeout)."""
    ok = isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool) and 0 < timeout_s <= MAX_TIMEOUT_S
    if not ok:
        raise UserError(f"{name} must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {timeout_s!r}")
    return float(timeout_s)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on this host right now (for MASTER_PORT of a one-host run)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int, *, local_rank: int | None = None, addr: str = "127.0.0.1") -> dict[str, str]:
    """The environment torchrun gives rank `rank` of a one-host run (merge it into os.environ)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank if local_rank is None else local_rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
    }
