"""A KV block's store key: its prefix-cache chain hash bound to everything that makes KV incompatible.

The device prefix cache keys a block by its chain hash (`Sequence.block_hash`: the tokens of the block
and of every block before it). That says which tokens produced the KV, not which model, weights, dtype or
layout did: two models reading the same prompt share chain hashes. A store outlives a process and may be
shared by several engines, so its key is sha256 over the namespace's digest and the chain hash; a block
is never found, let alone read, by a model it does not belong to. The codec checks the namespace again
when it decodes (`block_codec.decode`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

NAMESPACE_DOMAIN = b"deepinfer-kv-namespace-v1\0"  # changes only if the digest's own encoding changes


@dataclass(frozen=True)
class KVNamespace:
    """Everything that must agree for a stored block's KV to be valid for a reader. A field left out
    here is a field whose change would let a model read another's KV, so when in doubt add one.

    model: the model's identity: a hub id or a checkpoint's name, with its revision where it has one
        ("deepseek-ai/DeepSeek-V3@<commit>"); the embedded tiny models use their names ("tiny-v3").
    config_hash: a hash of the model config and weights identity that KV depends on (layers, ranks,
        rope scaling, quantisation of the weights...): `config_hash(mapping)` makes one.
    dtype: the model's compute dtype ("bfloat16").
    kv_cache_dtype: the cache's element format as resolved, never "auto" ("bfloat16", "fp8_e4m3").
    kv_layout_version: the version of the cache rows' layout (`ops/kv_cache_format.py`: e.g. an fp8 row's
        scale and padding); bump it whenever a row's bytes change meaning.
    block_size: tokens per block, the backend's page size (cuda 64, ascend 128, reference 16): a chain
        hash covers `block_size` tokens, so blocks of different sizes never share one anyway, but a
        reader's pages must also have that shape.
    kv_shard: which part of the KV this process keeps where it is split (tensor or context parallel):
        "0/1" when one process holds all of it (MLA's latent cache is whole on every rank).
    """

    model: str
    config_hash: str
    dtype: str
    kv_cache_dtype: str
    kv_layout_version: int
    block_size: int
    kv_shard: str = "0/1"

    def __post_init__(self) -> None:
        for name in ("model", "config_hash", "dtype", "kv_cache_dtype", "kv_shard"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"KVNamespace.{name} must be a non-empty string, got {getattr(self, name)!r}")
        if self.kv_cache_dtype == "auto":
            raise ValueError("KVNamespace.kv_cache_dtype must be the resolved format (the model dtype or fp8_e4m3), not 'auto'")
        if self.kv_layout_version < 0 or self.block_size < 1:
            raise ValueError(f"KVNamespace needs kv_layout_version >= 0 and block_size >= 1, got {self.kv_layout_version} and {self.block_size}")

    @cached_property
    def _digest(self) -> bytes:
        fields = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(NAMESPACE_DOMAIN + fields).digest()

    def digest(self) -> str:
        """sha256 (hex) of every field, by name: two namespaces have equal digests exactly when all fields are equal."""
        return self._digest.hex()

    def key(self, block_hash: bytes) -> str:
        """The store key (64 lowercase hex characters) of the block whose chain hash is `block_hash`."""
        if not isinstance(block_hash, (bytes, bytearray)) or not block_hash:
            raise ValueError(f"block_hash must be the block's chain hash (non-empty bytes), got {type(block_hash).__name__}")
        return hashlib.sha256(self._digest + bytes(block_hash)).hexdigest()


def config_hash(config: dict[str, Any]) -> str:
    """sha256 (hex) of a JSON-serialisable mapping, independent of key order: a `KVNamespace.config_hash`."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()
