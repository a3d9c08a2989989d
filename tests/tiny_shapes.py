"""Model shapes small enough for the benchmarks' CPU tests (their timings mean nothing there)."""

# A DeepSeek-V2-Lite-shaped model cut to a few thousand parameters per layer (config_overrides of bench e2e,
# speculative and prefix-reuse); the BOS and EOS ids lie inside the tiny vocabulary.
TINY_V2 = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
    num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256,
    bos_token_id=510, eos_token_id=511,
)  # fmt: skip
