"""Cases for kv_cache_write, mla_decode and prefill."""

CASES = []
