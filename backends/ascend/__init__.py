"""deepinfer's ascend backend (package deepinfer_ascend)."""
