"""Cases for the moe ops."""

CASES = []
