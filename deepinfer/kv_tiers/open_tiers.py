"""The KV tiers an engine's configuration asks for, bound to its caches: `open_tiers(engine)`.

- `kv_offload_cpu_gib`: the host tier (`HostTier`: pinned rows, bounded in bytes; with state snapshots, DeepSeek-V4.1,
  half of it holds the snapshots);
- `kv_offload_dir` (+ `kv_offload_disk_gib`, `kv_offload_ttl_s`): the disk tier (`DiskStore`), readable after a
  restart and by every process pointed at the directory;
- `kv_store_url`: a shared store by URL (`open_store`: redis://, valkey://, file://, or a plugin's scheme).

A block's key binds its chain hash to this engine's `KVNamespace`: the checkpoint (its path and its weight
files' names, sizes and modification times, or the embedded model's name), the model config, the paged cache
tensors' layout (names, dtypes, shapes: the MTP layer's cache included when speculation runs), the dtypes, the
KV row layout version and the block size. Anything else reads another key.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from deepinfer.engine.sampling_params import InvalidRequestError
from deepinfer.kv_tiers.block_rows import BlockRows
from deepinfer.kv_tiers.keys import KVNamespace, config_hash
from deepinfer.kv_tiers.tiered_cache import KVTiers, snapshot_rows

log = logging.getLogger(__name__)

GiB = 1 << 30
DISK_SHARE_OF_FREE = 0.5  # kv_offload_dir without kv_offload_disk_gib: this share of the file system's free space at start


def open_tiers(engine) -> KVTiers | None:
    """The engine's KV tiers (None when its config asks for none); one-line InvalidRequestErrors for what cannot run."""
    config = engine.config
    if not (config.kv_offload_cpu_gib or config.kv_offload_dir or config.kv_store_url):
        return None
    if not config.enable_prefix_caching:
        raise InvalidRequestError("the KV tiers keep prefix-cache blocks, and prefix caching is off: drop --no-prefix-caching or the kv offload flags")
    model = engine.loaded.model
    if not hasattr(model, "paged_cache_tensors"):
        raise InvalidRequestError(f"the KV tiers do not run {type(model).__name__} (it names no paged cache tensors); run it without the kv offload flags")
    rows = BlockRows(model.paged_cache_tensors(engine.runner.kv_caches, engine.runner.draft_kv_caches))
    states = snapshot_rows(engine.block_manager.snapshots)
    namespace = kv_namespace(engine, rows, states)
    from deepinfer.kv_tiers.copy_streams import StreamCopies, SyncCopies

    copies = StreamCopies(engine.runtime.device) if engine.runtime.async_execution else SyncCopies()
    host = host_states = None
    if config.kv_offload_cpu_gib:
        from deepinfer.kv_tiers.host_tier import HostTier

        budget = int(config.kv_offload_cpu_gib * GiB)
        if states is not None:  # half the bytes for the blocks, half for the snapshots they end on
            host_states = HostTier(budget // 2, states.block_bytes, pinned=copies.pinned)
            budget -= budget // 2
        host = HostTier(budget, rows.block_bytes, pinned=copies.pinned)
    stores = []
    if config.kv_offload_dir:
        stores.append(("disk", _disk_store(config)))
    if config.kv_store_url:
        stores.append(("store", _shared_store(config)))
    tiers = KVTiers(rows, namespace, engine.block_manager, host, stores, copies, states, host_states)
    described = [f"host {host.capacity} blocks ({config.kv_offload_cpu_gib:g} GiB)"] if host is not None else []
    described += [f"{name} {store!r}" for name, store in stores]
    log.info("KV tiers behind the prefix cache: %s; blocks of %d bytes", ", ".join(described), rows.block_bytes)
    return tiers


def kv_namespace(engine, rows: BlockRows, states: BlockRows | None = None) -> KVNamespace:
    """Everything a stored block's KV (and a state snapshot) depends on (module docstring)."""
    loaded = engine.loaded
    identity = {
        "config": repr(loaded.config),
        "dummy_weights": loaded.dummy_weights,
        "weights": _weight_files(loaded.path),
        "layout": rows.layout(),
        "state_layout": states.layout() if states is not None else None,
        "model_class": type(loaded.model).__name__,
    }
    from deepinfer.ops import kv_cache_format

    return KVNamespace(
        model=str(loaded.path),
        config_hash=config_hash(identity),
        dtype=str(engine.dtype).removeprefix("torch."),
        kv_cache_dtype=str(engine.cache_dtype).removeprefix("torch."),
        kv_layout_version=kv_cache_format.LAYOUT_VERSION,
        block_size=engine.block_size,
    )


def _weight_files(path) -> list:
    """(name, size, modification time) of the checkpoint's weight files: a changed checkpoint reads other keys."""
    folder = Path(path)
    if not folder.is_dir():
        return []
    return sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.glob("*.safetensors"))


def _disk_store(config):
    from deepinfer.kv_tiers.disk_store import DiskStore

    root = Path(config.kv_offload_dir).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidRequestError(f"kv_offload_dir {root}: cannot create the directory ({exc.strerror}); point it at a writable one") from None
    if config.kv_offload_disk_gib is not None:
        capacity = int(config.kv_offload_disk_gib * GiB)
    else:
        capacity = int(shutil.disk_usage(root).free * DISK_SHARE_OF_FREE)
        log.info("KV disk tier %s: %.1f GiB, half the free space (kv_offload_disk_gib sets it)", root, capacity / GiB)
    return DiskStore(root, max(1, capacity), ttl_s=config.kv_offload_ttl_s)


def _shared_store(config):
    from urllib.parse import parse_qs, urlsplit

    from deepinfer.kv_tiers.open_store import open_store

    options = {}
    parts = urlsplit(config.kv_store_url)
    if config.kv_offload_ttl_s is not None and parts.scheme != "host" and "ttl_s" not in parse_qs(parts.query):
        options["ttl_s"] = config.kv_offload_ttl_s
    try:
        return open_store(config.kv_store_url, **options)
    except ValueError as exc:
        raise InvalidRequestError(f"kv_store_url: {exc}") from None
