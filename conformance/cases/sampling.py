"""Cases for the sampling ops."""

CASES = []
