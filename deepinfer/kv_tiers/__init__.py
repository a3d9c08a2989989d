"""Tiered KV storage: where a KV block can live behind the device prefix cache (host memory, a disk
directory, a Redis or Valkey server shared by several engines), one idea per module:

- `keys.py`: `KVNamespace`, a block's store key (its chain hash bound to everything that makes KV incompatible);
- `block_codec.py`: one block's tensors <-> bytes with a header and a checksum (`CorruptBlock`);
- `store.py`: the `KVStore` protocol and `StoreStats`;
- `host_store.py`: host memory, bounded in bytes, LRU;
- `disk_store.py`: a directory, bounded in bytes, TTL per entry, LRU within it, crash-safe, several processes;
- `redis_store.py`: a Redis or Valkey server (redis-py), shared by every engine that reaches it, TTL per entry
  refreshed on use, bounded by the server's maxmemory; a server that is down degrades to misses, with backoff;
- `open_store.py`: `open_store(url)`, stores as plugins (entry-point group "deepinfer.kv_stores").

The engine's side (LLM(kv_offload_cpu_gib=..., kv_offload_dir=..., kv_store_url=...), the --kv-offload-* flags):
- `open_tiers.py`: the tiers an engine's config asks for, bound to its caches and its `KVNamespace`;
- `tiered_cache.py`: `KVTiers`, what moves when: blocks copied out as they become evictable, a waiting request's
  prefix loaded back before it is admitted, without holding up the engine's steps;
- `block_rows.py`: one block's rows across a model's paged cache tensors, as one byte row (gather / scatter);
- `host_tier.py`: the host tier, raw rows in one pinned buffer, LRU;
- `copy_streams.py`: where the copies run (an accelerator's side streams, or synchronously on the CPU);
- `tier_stats.py`: what the engine reports per tier.
"""
