"""deepinfer's cuda backend (package deepinfer_cuda)."""
