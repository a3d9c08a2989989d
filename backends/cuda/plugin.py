"""Entry point of the cuda backend."""
