"""Cases for the gemm ops."""

CASES = []
