"""The compute floor of a DeepSeek-V4 prefill (deepinfer/bench/v4_prefill_floor.py): its FLOPs against a hand
count on a tiny two-layer config, its causal sums against a query-by-query count, each projection's rate
against the format the bench keeps it in, and the floor's seconds from the measured rates."""

from __future__ import annotations

import pytest

from deepinfer.bench import e2e_v4, v4_prefill_floor
from deepinfer.bench.v4_prefill_floor import prefill_flops

# V4's window (128), ratios (4 / 128) and top-k rule at small widths.
TINY = dict(vocab_size=512, hidden_size=256, num_attention_heads=4, head_dim=128, qk_rope_head_dim=32, q_lora_rank=128, o_groups=2,
            o_lora_rank=128, index_n_heads=4, index_head_dim=64, index_topk=16, n_routed_experts=16, num_experts_per_tok=4,
            moe_intermediate_size=64, compress_ratios=[4, 128], num_hash_layers=1)  # fmt: skip


def test_flops_of_a_hand_counted_prefill():
    """Two layers (CSA with hash routing, HCA with scored routing), 2 prompts of 300 tokens: 600 tokens."""
    config = e2e_v4.flash_config(2, TINY)
    flops = prefill_flops(config, batch=2, prompt_len=300)
    tokens = 600
    # Multiply-adds per token and layer: wq_a 128x256 = 32768, wq_b 512x128 = 65536, wkv 128x256 = 32768, wo_a's 2 groups of
    # 128 x 256 = 65536, wo_b 256x256 = 65536; both layers.
    assert flops["attention projections"] == 2 * tokens * 2 * (32768 + 65536 + 32768 + 65536 + 65536)
    assert flops["indexer q projection"] == 2 * tokens * (256 * 128)  # CSA only: 4 heads x 64 from q_lora 128
    assert flops["indexer weights projection"] == 2 * tokens * (4 * 256)
    assert flops["shared expert"] == 2 * tokens * 2 * (3 * 64 * 256)
    # CSA: the entries' compressor 2 x (256x256), the indexer's 2 x (128x256); HCA: 2 x (128x256).
    assert flops["compressor projections"] == 2 * tokens * (2 * 65536 + 2 * 32768 + 2 * 32768)
    assert flops["routed experts"] == 2 * tokens * 2 * 4 * (3 * 64 * 256)  # top-4 of 16 in both layers (hash-routed too)
    # Window rows read over positions 0..299: 1 + 2 + ... + 128, then 172 x 128 = 8256 + 22016 = 30272 per prompt and layer.
    # CSA: entries complete at p, (p+1)//4, sum 11175 (scored); selected min(16, (p+1)//4): 480 before p = 63, then 237 x 16: 4272.
    # HCA: (p+1)//128: 128 ones and 45 twos: 218.
    assert flops["indexer scoring"] == 2 * 2 * 4 * 64 * 11175
    assert flops["attention"] == 2 * 4 * 4 * 128 * ((30272 + 4272) + (30272 + 218))
    # Pooling: CSA's 75 entries per prompt, 8 slots, 128 + 64 channels (two compressors); HCA's 2 entries, 128 slots, 128 channels.
    assert flops["compressor pooling"] == 2 * (75 * 2 * 8 * (128 + 64) + 2 * 2 * 128 * 128)
    assert set(flops) == set(v4_prefill_floor.RATE_OF_PART)


@pytest.mark.parametrize("n", [1, 3, 4, 5, 63, 64, 65, 127, 128, 129, 300, 1000])
def test_the_causal_sums_count_query_by_query(n):
    queries = range(1, n + 1)  # p + 1 for positions 0 .. n - 1
    assert v4_prefill_floor._sum_min(n, 128) == sum(min(128, q) for q in queries)
    for ratio in (4, 128):
        assert v4_prefill_floor._sum_floor_div(n, ratio) == sum(q // ratio for q in queries)
        assert v4_prefill_floor._sum_min_floor_div(n, ratio, 16) == sum(min(16, q // ratio) for q in queries)


def test_the_count_scales_with_the_prompts():
    config = e2e_v4.flash_config(4, TINY | {"compress_ratios": [0, 0, 4, 128], "num_hash_layers": 3})
    one = prefill_flops(config, 1, 700)
    assert prefill_flops(config, 3, 700) == {part: 3 * value for part, value in one.items()}


def test_each_projection_is_divided_by_the_rate_of_the_format_the_bench_keeps_it_in():
    """fp8_block weights at the fp8 rate; bf16 ones and the mxfp4 experts (bf16 activations) at the bf16 rate."""
    from deepinfer.bench.v4_weights import weight_format
    from deepinfer.model.deepseek_v4.model import model_tensor_specs
    from deepinfer.model.deepseek_v4.moe import EXPERT
    from deepinfer.model.weights import LINEAR

    rate_of_format = {"fp8_block": "fp8", "dtype": "bf16", "mxfp4": "bf16"}
    seen = set()
    for name, spec in model_tensor_specs(e2e_v4.flash_config()).items():
        if spec.kind in (LINEAR, EXPERT):
            part = v4_prefill_floor.projection_part(name)
            assert v4_prefill_floor.RATE_OF_PART[part] == rate_of_format[weight_format(name, spec)], name
            seen.add(part)
    assert seen == {"attention projections", "indexer q projection", "shared expert", "compressor projections", "indexer weights projection",
                    "routed experts"}  # fmt: skip
    with pytest.raises(ValueError, match="does not know the projection layers.0.attn.new_proj.weight"):
        v4_prefill_floor.projection_part("layers.0.attn.new_proj.weight")


def test_the_floor_divides_each_part_by_its_rate():
    flops = dict.fromkeys(v4_prefill_floor.RATE_OF_PART, 0.0) | {"attention projections": 4e12, "routed experts": 3e12, "attention": 1e12}
    assert v4_prefill_floor.floor_seconds(flops, {"fp8": 2e12, "bf16": 1e12}) == pytest.approx(4 / 2 + 3 + 1)


def test_a_v4_flash_token_costs_what_its_widths_say():
    """The full shape at one 8192-token prompt: about 0.6 GFLOP of projections and experts per token and layer, and the
    routed experts the largest part (6 of 256 experts of 3 x 2048 x 4096, 302 M multiply-adds per token and layer)."""
    config = e2e_v4.flash_config()
    flops = prefill_flops(config, 1, 8192)
    per_token_layer = {part: value / 8192 / 43 for part, value in flops.items()}
    assert per_token_layer["routed experts"] == 2 * 6 * 3 * 2048 * 4096
    assert per_token_layer["routed experts"] == max(per_token_layer.values())
    assert 0.5e9 < sum(per_token_layer.values()) < 1.5e9
