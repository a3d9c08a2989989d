"""One KV block's tensors <-> bytes, checked on the way back.

Layout (all integers little-endian):

    magic b"DIKVBLK\\0" (8) | format version u16 | header length u32 | header (JSON) | payload | checksum (32)

The header names the namespace digest (`KVNamespace.digest()`), the payload's length and, per tensor, its
name, dtype and shape. The payload is a safetensors file (`safetensors.torch.save`), which carries every
dtype the cache uses (bfloat16, float8_e4m3fn, uint8...). The checksum is blake2b-256 over everything
before it, header included, so a flipped bit, a truncated file and a header edited to claim another
namespace are all caught. `decode` raises `CorruptBlock` for anything it cannot vouch for: a wrong
checksum, a short or long buffer, another format version, another namespace, a header that disagrees
with the payload. `verify` checks the framing and checksum alone (a store checks what it reads without
knowing the namespace; the key already binds it).

Tensors come back on the CPU, contiguous, with the dtypes and shapes they were saved with.
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from deepinfer.kv_tiers.keys import KVNamespace

MAGIC = b"DIKVBLK\0"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sHI")  # magic, version, header length
CHECKSUM_BYTES = 32


class CorruptBlock(ValueError):
    """A stored block that must not be used: damaged, truncated, of another format version or of another namespace."""


def _checksum(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=CHECKSUM_BYTES).digest()


def encode(tensors: dict[str, torch.Tensor], namespace: KVNamespace) -> bytes:
    """The bytes of one block: `tensors` (name -> tensor, any device; copied to the CPU) under `namespace`."""
    if not tensors:
        raise ValueError("a KV block needs at least one tensor")
    host: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        if t.numel() and t.untyped_storage().data_ptr() in seen:  # safetensors refuses tensors sharing memory
            t = t.clone()
        if t.numel():
            seen.add(t.untyped_storage().data_ptr())
        host[name] = t
    payload = st_save(host)
    header = json.dumps(
        {
            "namespace": namespace.digest(),
            "payload_bytes": len(payload),
            "tensors": [{"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for n, t in host.items()],
        },
        separators=(",", ":"),
    ).encode()
    body = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header + payload
    return body + _checksum(body)


def _framing(data: bytes) -> tuple[dict, memoryview]:
    """The header and the payload of a block whose framing and checksum hold; CorruptBlock otherwise."""
    view = memoryview(data)
    if len(view) < _PREFIX.size + CHECKSUM_BYTES:
        raise CorruptBlock(f"a KV block of {len(view)} bytes is shorter than the smallest block: truncated")
    magic, version, header_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise CorruptBlock("not a KV block: the magic bytes differ")
    if version != FORMAT_VERSION:
        raise CorruptBlock(f"a KV block of format version {version}; this reader reads version {FORMAT_VERSION}")
    if _checksum(view[:-CHECKSUM_BYTES]) != bytes(view[-CHECKSUM_BYTES:]):
        raise CorruptBlock(f"a KV block's checksum does not match ({len(view)} bytes): damaged or truncated")
    start = _PREFIX.size + header_len
    if start > len(view) - CHECKSUM_BYTES:
        raise CorruptBlock("a KV block's header runs past its end")
    try:
        header = json.loads(bytes(view[_PREFIX.size : start]))
    except ValueError as e:
        raise CorruptBlock(f"a KV block's header is not JSON: {e}") from None
    payload = view[start:-CHECKSUM_BYTES]
    if not isinstance(header, dict) or header.get("payload_bytes") != len(payload):
        raise CorruptBlock("a KV block's header does not describe its payload")
    return header, payload


def verify(data: bytes) -> None:
    """Check a block's framing and checksum (not its namespace): CorruptBlock if they do not hold."""
    _framing(data)


def decode(data: bytes, namespace: KVNamespace) -> dict[str, torch.Tensor]:
    """The tensors of a block encoded under `namespace`, in the order they were saved; CorruptBlock if the
    bytes are damaged, truncated, of another format version or of another namespace."""
    header, payload = _framing(data)
    if header.get("namespace") != namespace.digest():
        raise CorruptBlock("a KV block of another namespace (another model, config, dtype, cache format or block size)")
    try:
        loaded = st_load(bytes(payload))
    except Exception as e:  # safetensors raises its own error types for a malformed file
        raise CorruptBlock(f"a KV block's payload is not a safetensors file: {e}") from None
    out: dict[str, torch.Tensor] = {}
    for entry in header.get("tensors", []):
        t = loaded.get(entry.get("name"))
        if t is None or str(t.dtype).removeprefix("torch.") != entry.get("dtype") or list(t.shape) != entry.get("shape"):
            raise CorruptBlock(f"a KV block's header and payload disagree about tensor {entry.get('name')!r}")
        out[entry["name"]] = t
    if len(out) != len(loaded):
        raise CorruptBlock("a KV block's payload holds tensors its header does not name")
    return out
