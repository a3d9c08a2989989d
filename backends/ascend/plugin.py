"""Entry point of the ascend backend."""
