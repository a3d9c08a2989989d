"""DeepSeek-V4.1: config, layer roles and checkpoint tensors (loading and validation; no forward yet)."""
