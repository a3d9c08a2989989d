"""DeepSeek V2/V3 written only against registry ops."""
