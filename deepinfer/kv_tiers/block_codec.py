"""One KV block's tensors <-> bytes, checked on the way back.

Layout (all integers little-endian):

    magic b"DIKVBLK\\0" (8) | format version u16 | header length u32 | header (JSON) | payload | crc32 u32

The header names the namespace digest (`KVNamespace.digest()`), the payload's length and, per tensor in order,
its name, dtype and shape. The payload is the tensors' bytes, contiguous, one after the other in that order:
exactly a tier's flat row of the block (`BlockRows`), so a read copies it into its pinned row in one copy
(`decode_row`) instead of one per tensor. (Format 1 held a safetensors file: safetensors orders tensors by
dtype and name, so a row took a copy per tensor, and with a cryptographic checksum checked twice a 290 KB
V4 block cost ~1.3 ms of a core to read on an H200's host: more than recomputing a 32k-token prefix.)

The checksum is CRC-32 (zlib) over everything before it, header included, as storage systems check their
blocks (a flipped bit, a truncated file, a header edited to claim another namespace: all caught; it guards
against damage, not against an adversary who can write the store). `decode` / `decode_row` raise
`CorruptBlock` for anything they cannot vouch for: a wrong checksum, a short or long buffer, another format
version, another namespace, a header that disagrees with the payload (or, for `decode_row`, with the reader's
layout). `verify` checks the framing and checksum alone (a store checks what it reads without knowing the
namespace; the key already binds it).
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from typing import NamedTuple

import numpy as np
import torch

from deepinfer.kv_tiers.keys import KVNamespace

MAGIC = b"DIKVBLK\0"
FORMAT_VERSION = 2
_PREFIX = struct.Struct("<8sHI")  # magic, version, header length
_CHECKSUM = struct.Struct("<I")
CHECKSUM_BYTES = _CHECKSUM.size


class CorruptBlock(ValueError):
    """A stored block that must not be used: damaged, truncated, of another format version or of another namespace.
    `reason` names the kind ("truncated", "magic", "version", "checksum", "header", "namespace", "layout"): stores log
    the first of each kind and count the rest (after an upgrade, every older block is one of "version")."""

    def __init__(self, message: str, reason: str = "damaged"):
        super().__init__(message)
        self.reason = reason


def _checksum(data: bytes | memoryview) -> bytes:
    return _CHECKSUM.pack(zlib.crc32(data))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def head(namespace: KVNamespace, layout: list[tuple[str, str, tuple[int, ...]]]) -> bytes:
    """The bytes every block of `namespace` whose tensors are `layout` (name, dtype, shape, in order: `BlockRows.layout()`)
    starts with: magic, format version, header. A reader that knows its layout compares them whole and reads the
    payload straight into its row (`DiskStore.get_into`, `payload_checked`)."""
    payload_bytes = sum(math.prod(shape) * getattr(torch, dtype).itemsize for _, dtype, shape in layout)
    header = json.dumps(
        {
            "namespace": namespace.digest(),
            "payload_bytes": payload_bytes,
            "tensors": [{"name": name, "dtype": dtype, "shape": list(shape)} for name, dtype, shape in layout],
        },
        separators=(",", ":"),
    ).encode()
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header


def encode(tensors: dict[str, torch.Tensor], namespace: KVNamespace) -> bytes:
    """The bytes of one block: `tensors` (name -> tensor, any device; copied to the CPU) under `namespace`."""
    if not tensors:
        raise ValueError("a KV block needs at least one tensor")
    host = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    payload = b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in host.values())
    body = head(namespace, [(n, _dtype_name(t.dtype), tuple(t.shape)) for n, t in host.items()]) + payload
    return body + _checksum(body)


def payload_checked(head_bytes: bytes | bytearray, payload, checksum: bytes | bytearray) -> bool:
    """Whether `checksum` (a block's last CHECKSUM_BYTES) is the CRC-32 of `head_bytes` followed by `payload` (any
    buffer: a pinned row the payload was read into), computed without joining them."""
    return _CHECKSUM.pack(zlib.crc32(payload, zlib.crc32(head_bytes))) == bytes(checksum)


def _framing(data: bytes) -> tuple[dict, memoryview]:
    """The header and the payload of a block whose framing and checksum hold; CorruptBlock otherwise."""
    view = memoryview(data)
    if len(view) < _PREFIX.size + CHECKSUM_BYTES:
        raise CorruptBlock(f"a KV block of {len(view)} bytes is shorter than the smallest block: truncated", "truncated")
    magic, version, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CorruptBlock("not a KV block: the magic bytes differ", "magic")
    if version != FORMAT_VERSION:
        raise CorruptBlock(f"a KV block of format version {version}; this reader reads version {FORMAT_VERSION}", "version")
    if _checksum(view[:-CHECKSUM_BYTES]) != bytes(view[-CHECKSUM_BYTES:]):
        raise CorruptBlock(f"a KV block's checksum does not match ({len(view)} bytes): damaged or truncated", "checksum")
    start = _PREFIX.size + header_len
    if start > len(view) - CHECKSUM_BYTES:
        raise CorruptBlock("a KV block's header runs past its end", "header")
    try:
        header = json.loads(bytes(view[_PREFIX.size : start]))
    except ValueError as e:
        raise CorruptBlock(f"a KV block's header is not JSON: {e}", "header") from None
    payload = view[start:-CHECKSUM_BYTES]
    if not isinstance(header, dict) or header.get("payload_bytes") != len(payload) or not isinstance(header.get("tensors"), list):
        raise CorruptBlock("a KV block's header does not describe its payload", "header")
    return header, payload


class _Entry(NamedTuple):
    """One tensor of a block, as its header names it, and its bytes in the payload."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    width: int


def _checked(data: bytes, namespace: KVNamespace) -> tuple[list[_Entry], memoryview]:
    """The tensor entries and the payload of a block of `namespace` whose entries account for the payload exactly."""
    header, payload = _framing(data)
    if header.get("namespace") != namespace.digest():
        raise CorruptBlock("a KV block of another namespace (another model, config, dtype, cache format or block size)", "namespace")
    entries = []
    for entry in header["tensors"]:
        try:
            shape = tuple(int(n) for n in entry["shape"])
            entries.append(_Entry(entry["name"], entry["dtype"], shape, math.prod(shape) * getattr(torch, entry["dtype"]).itemsize))
        except (AttributeError, KeyError, TypeError, ValueError):  # (a dtype name torch does not know: AttributeError)
            raise CorruptBlock(f"a KV block's header entry {entry!r} is not a tensor's name, dtype and shape", "header") from None
    total = sum(e.width for e in entries)
    if total != len(payload):
        raise CorruptBlock(f"a KV block's tensors take {total} bytes, its payload holds {len(payload)}", "header")
    return entries, payload


def verify(data: bytes) -> None:
    """Check a block's framing and checksum (not its namespace): CorruptBlock if they do not hold."""
    _framing(data)


def decode(data: bytes, namespace: KVNamespace) -> dict[str, torch.Tensor]:
    """The tensors of a block encoded under `namespace`, in the order they were saved (on the CPU, contiguous, sharing
    one private buffer); CorruptBlock if the bytes are damaged, truncated, of another format version or namespace."""
    entries, payload = _checked(data, namespace)
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
    out, at = {}, 0
    for e in entries:
        out[e.name] = flat[at : at + e.width].view(getattr(torch, e.dtype)).view(e.shape)
        at += e.width
    return out


def decode_row(data: bytes, namespace: KVNamespace, layout: list[tuple[str, str, tuple[int, ...]]], out: torch.Tensor) -> None:
    """Copy a block's payload into `out` (a flat uint8 row on the CPU: `BlockRows.block_bytes`), in one copy, after
    checking that its tensors are exactly `layout`'s (`BlockRows.layout()`: name, dtype, shape, in order); CorruptBlock
    as `decode`, and for a block of another layout."""
    entries, payload = _checked(data, namespace)
    if [(e.name, e.dtype, e.shape) for e in entries] != [(n, d, tuple(s)) for n, d, s in layout]:
        names = [e.name for e in entries][:3]
        raise CorruptBlock(f"a KV block's tensors {names}... are not this cache's layout {[n for n, _, _ in layout][:3]}...", "layout")
    if len(payload) != out.numel() or out.dtype != torch.uint8:
        raise ValueError(f"decode_row writes {len(payload)} bytes into a uint8 row, got {out.dtype} x {out.numel()}")
    np.copyto(out.numpy(), np.frombuffer(payload, dtype=np.uint8))
