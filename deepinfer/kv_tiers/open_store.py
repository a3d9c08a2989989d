"""Stores as plugins: `open_store(url)` picks a store by the URL's scheme from the entry-point group
"deepinfer.kv_stores" (the entry point's name is the scheme). The built-in stores register there
exactly as a third-party store would, in pyproject.toml:

    [project.entry-points."deepinfer.kv_stores"]
    file = "deepinfer.kv_tiers.disk_store:open_url"
    host = "deepinfer.kv_tiers.host_store:open_url"
    redis = "deepinfer.kv_tiers.redis_store:open_url"   # and rediss, valkey, valkeys

An entry point names a factory `open_url(url: str, **options) -> KVStore`; `options` are open_store's
keyword arguments, and the factory reads its own from the URL's query too.

- `file:///path?size=100GiB&ttl_s=3600` (or `capacity_bytes=`, `ttl_s=` as keyword arguments): a `DiskStore`.
- `host://16GiB`, `host://?size=16GiB` or a bare size `16GiB`: a `HostStore`.
- `redis://[:password@]host:6379/0?ttl_s=3600`, `rediss://` (TLS), `valkey://`, `valkeys://` (the same protocol):
  a `RedisStore` on a server shared by several engines (needs redis-py: pip install 'deepinfer[redis]').
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlsplit

from deepinfer.discovery import entry_points_of
from deepinfer.kv_tiers.store import KVStore

ENTRY_POINT_GROUP = "deepinfer.kv_stores"
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes from an int or a size: "1048576", "512MB", "16GiB", "1.5G" (K/M/G/T: powers of 1000; KiB/MiB/GiB/TiB: of 1024)."""
    if isinstance(text, int):
        return text
    m = _SIZE.fullmatch(str(text))
    if m is None:
        raise ValueError(f"not a size: {text!r} (write bytes, or a number with K/M/G/T or KiB/MiB/GiB/TiB: 16GiB)")
    unit = (m.group(2) or "").lower().removesuffix("b")
    return int(float(m.group(1)) * _UNITS[unit])


def url_options(url: str, options: dict, known: tuple[str, ...]) -> dict:
    """A factory's options: the URL's query (`size` is read as `capacity_bytes` where `known` has it) under the keyword arguments,
    which win; a query name outside `known` is a ValueError naming the known ones."""
    merged: dict = {}
    sized = "capacity_bytes" in known
    for name, value in parse_qsl(urlsplit(url).query, keep_blank_values=True):
        name = "capacity_bytes" if name == "size" and sized else name
        if name not in known:
            raise ValueError(f"{url!r}: unknown option {name!r}; this store reads {', '.join(known)}{' (size = capacity_bytes)' if sized else ''}")
        merged[name] = value
    merged.update(options)
    if "capacity_bytes" in merged:
        merged["capacity_bytes"] = parse_size(merged["capacity_bytes"])
    return merged


def store_factories() -> dict[str, object]:
    """The entry points of "deepinfer.kv_stores", by scheme (not loaded)."""
    return {ep.name: ep for ep in entry_points_of(ENTRY_POINT_GROUP)}


def store_entry_point(url: str):
    """(scheme, entry point) of the store `url` names, not loaded (a check before anything starts); ValueError, one
    line naming the known schemes, for an unknown one."""
    scheme = urlsplit(url).scheme.lower()
    found = store_factories()
    ep = found.get(scheme)
    if ep is None:
        known = ", ".join(f"{name}://" for name in found) or "none (reinstall deepinfer: pip install -e . registers its entry points)"
        raise ValueError(
            f"unknown KV store {url!r}: known schemes are {known}, or a bare size for a host store; "
            f'a plugin adds a scheme as an entry point in group "{ENTRY_POINT_GROUP}" (name = the scheme, value = a factory open_url(url, **options))'
        )
    return scheme, ep


def open_store(url: str, **options) -> KVStore:
    """The store that `url` names, opened with `options`. A bare size ("16GiB") is a host store."""
    if _SIZE.fullmatch(url):
        url, options = "host://", {"capacity_bytes": parse_size(url), **options}
    scheme, ep = store_entry_point(url)
    try:
        factory = ep.load()
    except Exception as e:
        raise ValueError(f"the KV store plugin for {scheme}:// ({ep.value}) failed to load: {type(e).__name__}: {e}") from e
    return factory(url, **options)
