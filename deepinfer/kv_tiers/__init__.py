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

Only the storage layer: nothing in the engine or the CLI uses it yet.
"""
