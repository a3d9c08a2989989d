"""DeepSeek-V4: config, layers, caches and checkpoint names, written against registry ops only."""
