"""What the engine's own sizes take, checked against free memory before any of it is allocated.

`num_kv_blocks` pages of KV cache (when the user sizes the cache; sized from the memory budget, it
fits by construction) and, per sequence slot (`max_num_seqs`), the model's state slot (DeepSeek-V4's
compressor rings), the penalty tables (allocated when the first request with a penalty samples) and
the decode graphs' block table; on the host, the block manager's bookkeeping of each page and the
per-slot lists. A hostile size (--num-kv-blocks 10**12, --max-num-seqs 10**12) used to run for a
minute and end in a MemoryError traceback; it now fails at once in one line naming the flag, what it
would take and what is free. The estimate is a floor (activations, the allocator's slack and small
buffers are left out); it counts the penalty tables before the first request with a penalty
allocates them, so a run that would fail then fails at the start instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.engine.sampling_params import InvalidRequestError
from deepinfer.model.memory import gib, host_available

HOST_BYTES_PER_BLOCK = 200  # a Block (__slots__: ~72 bytes), its free-queue entry (~100), its place in the list
HOST_BYTES_PER_SEQ = 16  # a sequence slot's entries in the per-slot lists (penalty history owners, free state slots)


@dataclass(frozen=True)
class EngineSizes:
    """The sizes the engine allocates by, and the bytes each unit takes."""

    num_kv_blocks: int  # 0: the cache is sized from the memory budget later (it fits by construction)
    block_bytes: int  # device bytes per KV block, over every layer
    max_num_seqs: int
    seq_bytes: int  # device bytes per sequence slot: state slot, penalty tables, graph block table
    snapshot_bytes: int = 0  # device bytes of the state snapshots kept for prefix hits (sized from num_kv_blocks)


def seq_device_bytes(vocab_size: int, state_slot_bytes: int, graph_blocks_per_seq: int) -> int:
    """Device bytes per sequence slot: the model's state slot, the penalty history's output counts
    [V] and prompt bit mask [ceil(V/32)] (int32), and with decode graphs a block-table row."""
    return state_slot_bytes + 4 * (vocab_size + -(-vocab_size // 32)) + 4 * graph_blocks_per_seq


def check_engine_memory(sizes: EngineSizes, device_free: tuple[int, str] | None, where: str) -> None:
    """InvalidRequestError naming the flag that asks for more than is free. `device_free`: (free bytes
    on the device, how they were measured); None: the device is the host, whose RAM holds all."""
    kv = sizes.num_kv_blocks * sizes.block_bytes + sizes.snapshot_bytes
    seqs = sizes.max_num_seqs * sizes.seq_bytes
    kv_host, seqs_host = sizes.num_kv_blocks * HOST_BYTES_PER_BLOCK, sizes.max_num_seqs * HOST_BYTES_PER_SEQ
    host_free = host_available()
    pools = [(host_free, "available RAM", where, {"num_kv_blocks": kv + kv_host, "max_num_seqs": seqs + seqs_host})]
    if device_free is not None:
        pools = [(*device_free, where, {"num_kv_blocks": kv, "max_num_seqs": seqs}),
                 (host_free, "available RAM", "the host", {"num_kv_blocks": kv_host, "max_num_seqs": seqs_host})]  # fmt: skip
    for free, measured, place, parts in pools:
        need = sum(parts.values())
        if free is None or need <= free:
            continue
        flag = max(parts, key=parts.get)
        value = getattr(sizes, flag)
        if flag == "num_kv_blocks":
            unit = f"KV blocks of {sizes.block_bytes} bytes"
        else:
            unit = f"sequence slots of {sizes.seq_bytes} bytes (state, penalty tables, decode-graph block table)"
        fix = "), or leave it unset to size the cache from the free memory" if flag == "num_kv_blocks" else "; the default is 256)"
        raise InvalidRequestError(
            f"{flag}={value} does not fit: {value} {unit} need {gib(parts[flag])} on {place}, but {gib(free)} is {measured}; "
            f"lower {flag} (--{flag.replace('_', '-')}{fix}"
        )
