"""The number formats in deepinfer.ops.quant, against hand-built values and plain-Python definitions."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.ops import quant

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e4m3_half_ulp(v: torch.Tensor) -> torch.Tensor:
    """Half the e4m3 spacing at |v| (float64): 3 mantissa bits, normals from 2^-6, subnormal step 2^-9."""
    exponent = torch.floor(torch.log2(v.abs().clamp(min=2.0**-6)))
    return 2.0 ** (exponent - 3) / 2


def seeded(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


# ------------------------------------------------------------------------------------------------
# FP8 weights, 128x128 blocks


def test_fp8_weight_scales_are_block_amax_over_448_with_partial_edge_blocks():
    w = seeded(200, 300).float()
    w[128:, 256:] = 0.0  # the bottom-right (partial, 72x44) block is all zero
    w_fp8, scale = quant.quantize_weight_fp8_block(w)
    assert w_fp8.dtype == torch.float8_e4m3fn and w_fp8.shape == (200, 300)
    assert scale.dtype == torch.float32 and scale.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            amax = max(block.abs().max().item(), 1e-4)
            assert scale[i, j].item() == pytest.approx(amax / 448, rel=1e-6)
    assert scale[1, 2].item() == pytest.approx(1e-4 / 448, rel=1e-6)


def test_fp8_weight_round_trip_error_is_at_most_half_an_ulp_of_the_block_scale():
    rows = torch.logspace(-3, 2, 300, dtype=torch.float64).unsqueeze(1)  # magnitudes vary inside blocks
    w = (seeded(300, 257, seed=1) * rows).float()
    w_fp8, scale = quant.quantize_weight_fp8_block(w)
    back = quant.dequantize_weight_fp8_block(w_fp8, scale, torch.float64)
    for i in range(0, 300, 37):  # rows from every block, column blocks by explicit loop
        for j in range(3):
            cols = slice(j * 128, min((j + 1) * 128, 257))
            s = scale[i // 128, j].double()
            err = (back[i, cols] - w[i, cols].double()).abs()
            bound = s * e4m3_half_ulp(w[i, cols].double() / s) * (1 + 1e-6)
            assert torch.all(err <= bound), (i, j)
    assert (back.abs() <= scale.double().max() * 448 * (1 + 1e-6)).all()


def test_fp8_weight_representable_values_round_trip_exactly():
    codes = torch.randint(0, 256, (256, 384), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    codes = codes.to(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x10  # drop the NaN encodings
    values = codes.view(torch.float8_e4m3fn).float()
    values[::128, ::128] = 448.0  # one element per block at the top of the range: amax/448 is the power of two
    block_scale = torch.tensor([[2.0**-8, 2.0**3, 1.0], [2.0**-20, 0.5, 2.0**10]])
    w = values * block_scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    w_fp8, scale = quant.quantize_weight_fp8_block(w)
    assert torch.equal(scale, block_scale)
    assert torch.equal(w_fp8.view(torch.uint8), values.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(quant.dequantize_weight_fp8_block(w_fp8, scale, torch.float32), w)


def test_fp8_weight_leading_expert_dim_matches_per_expert_quantisation():
    w = seeded(3, 130, 140, seed=3).float()
    w_fp8, scale = quant.quantize_weight_fp8_block(w)
    assert scale.shape == (3, 2, 2)
    for e in range(3):
        one_fp8, one_scale = quant.quantize_weight_fp8_block(w[e])
        assert torch.equal(w_fp8[e].view(torch.uint8), one_fp8.view(torch.uint8))
        assert torch.equal(scale[e], one_scale)


def test_fp8_dequantize_rejects_a_scale_of_the_wrong_grid():
    w_fp8, scale = quant.quantize_weight_fp8_block(seeded(576, 7168 // 8).float())
    assert scale.shape == (5, 7)
    with pytest.raises(ValueError, match="scale"):
        quant.dequantize_weight_fp8_block(w_fp8, scale[:4], torch.float32)  # floor instead of ceil


# ------------------------------------------------------------------------------------------------
# FP8 activations, per token and 128-column group


def act_quant_by_loops(x: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
    """The activation recipe written out token by token, group by group (float32 throughout)."""
    codes, scales = [], []
    for row in x.float():
        row_codes, row_scales = [], []
        for start in range(0, row.shape[0], 128):
            group = row[start : start + 128]
            amax = torch.maximum(group.abs().max(), torch.tensor(1e-4, dtype=torch.float32))
            s = amax / torch.tensor(448.0, dtype=torch.float32)
            row_scales.append(s.item())
            row_codes += (group / s).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
        codes.append(row_codes)
        scales.append(row_scales)
    return codes, scales


def test_act_quant_matches_the_recipe_bit_for_bit_with_a_partial_and_a_zero_group():
    x = seeded(5, 300, seed=4, scale=3.0)
    x[:, 3] *= 1e3  # large dynamic range inside the first group
    x[2, 128:256] = 0.0  # a zero group: scale from the 1e-4 floor, codes zero
    x = x.to(torch.bfloat16)
    x_fp8, x_scale = quant.quantize_act_fp8(x)
    assert x_fp8.shape == (5, 300) and x_scale.shape == (5, 3) and x_scale.dtype == torch.float32
    codes, scales = act_quant_by_loops(x)
    assert x_fp8.view(torch.uint8).tolist() == codes
    assert x_scale.tolist() == scales
    assert x_scale[2, 1].item() == torch.tensor(1e-4 / 448, dtype=torch.float32).item()
    assert (x_fp8[2, 128:256].float() == 0).all()


def test_act_quant_of_float64_input_equals_the_float32_kernel_recipe():
    # The golden run feeds bf16/fp32 values upcast to float64; quantisation must still be float32's.
    x32 = seeded(4, 256, seed=5).float()
    q32, s32 = quant.quantize_act_fp8(x32)
    q64, s64 = quant.quantize_act_fp8(x32.double())
    assert torch.equal(q64.view(torch.uint8), q32.view(torch.uint8))
    assert s64.dtype == torch.float32 and torch.equal(s64, s32)


def test_act_quant_round_trip_error_is_at_most_half_an_ulp():
    x = seeded(3, 384, seed=6).float()
    x_fp8, x_scale = quant.quantize_act_fp8(x)
    back = quant.dequantize_act_fp8(x_fp8, x_scale, torch.float64)
    s = x_scale.double().repeat_interleave(128, dim=1)
    assert torch.all((back - x.double()).abs() <= s * e4m3_half_ulp(x.double() / s) * (1 + 1e-6))
    assert torch.all(x_fp8.float().abs().amax(dim=1) == 448.0)  # each row's largest value maps to the top


# ------------------------------------------------------------------------------------------------
# MX FP4


def test_mxfp4_codes_decode_to_the_e2m1_table_low_nibble_first():
    # Byte 0x10 holds code 0 (low nibble, even k) then code 1 (high nibble, odd k), and so on.
    one_block = [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2
    packed = torch.tensor([one_block, one_block, one_block], dtype=torch.uint8)
    scale = torch.tensor([[127], [129], [124]], dtype=torch.uint8)
    w = quant.dequantize_mxfp4(packed, scale, torch.float32)
    table = E2M1 + [-v for v in E2M1]
    assert w.shape == (3, 32)
    assert w[0].tolist() == table * 2
    assert w[1].tolist() == [4 * v for v in table] * 2
    assert w[2].tolist() == [v / 8 for v in table] * 2
    assert torch.signbit(w[0, 8])  # code 8 is -0


def test_mxfp4_pack_order_low_nibble_first():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 1.0, 6.0  # codes 2 and 7 in byte 0 -> 0x72
    w[0, 3] = -0.5  # code 0x9 in the high nibble of byte 1
    packed, scale = quant.quantize_weight_mxfp4(w)
    assert scale.tolist() == [[127]]  # amax 6: floor(log2 6) - 2 = 0
    assert packed[0, :2].tolist() == [0x72, 0x90]
    assert packed[0, 2:].tolist() == [0] * 14


def mxfp4_by_python(w: list[list[float]]) -> tuple[list[list[int]], list[list[int]]]:
    """OCP MX FP4 per element in plain Python: shared exponent, nearest e2m1, ties to the even code."""
    codes, scales = [], []
    for row in w:
        row_codes, row_scales = [], []
        for start in range(0, len(row), 32):
            block = row[start : start + 32]
            amax = max(abs(v) for v in block)
            x = max(-127, math.floor(math.log2(amax)) - 2) if amax > 0 else -127
            row_scales.append(x + 127)
            for v in block:
                m = min(abs(v) / 2.0**x, 6.0)
                best = min(range(8), key=lambda c: (abs(E2M1[c] - m), c % 2))  # nearest, then even
                row_codes.append(best | (8 if v < 0 else 0))
        codes.append(row_codes)
        scales.append(row_scales)
    return codes, scales


def unpack_by_python(packed: torch.Tensor) -> list[list[int]]:
    return [[nibble for byte in row for nibble in (byte & 15, byte >> 4)] for row in packed.tolist()]


def test_mxfp4_quantiser_matches_the_ocp_recipe():
    w = seeded(4, 96, seed=7) * torch.tensor([[1e-3], [1.0], [37.0], [1e5]], dtype=torch.float64)
    w = w.float()
    w[1, 32:64] = 0.0  # an all-zero block
    packed, scale = quant.quantize_weight_mxfp4(w)
    assert packed.shape == (4, 48) and scale.shape == (4, 3)
    codes, scales = mxfp4_by_python(w.double().tolist())
    assert scale.tolist() == scales
    assert unpack_by_python(packed) == codes
    assert scales[1][1] == 0 and codes[1][32:64] == [0] * 32


def test_mxfp4_ties_go_to_the_even_code_and_large_values_saturate():
    # amax 7 gives X = floor(log2 7) - 2 = 0: the values are already in e2m1 units.
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0]
    w = torch.tensor([mids + [-v for v in mids] + [0.0] * 16])
    packed, scale = quant.quantize_weight_mxfp4(w)
    assert scale.tolist() == [[127]]
    expected = [0, 2, 2, 4, 4, 6, 6, 7]
    assert unpack_by_python(packed)[0][:16] == expected + [c | 8 for c in expected]


def test_mxfp4_representable_values_round_trip_exactly():
    gen = torch.Generator().manual_seed(8)
    codes = torch.randint(0, 16, (6, 128), generator=gen)
    codes[:, ::32] = 7  # each block holds 6 * 2^X: its shared exponent is X
    exponents = torch.randint(-20, 20, (6, 4), generator=gen)
    table = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float64)
    w = (table[codes] * torch.exp2(exponents.double()).repeat_interleave(32, dim=1)).float()
    packed, scale = quant.quantize_weight_mxfp4(w)
    assert torch.equal(scale.long(), exponents + 127)
    assert torch.equal(quant.dequantize_mxfp4(packed, scale, torch.float32), w)


def test_mxfp4_rejects_k_not_a_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize_weight_mxfp4(torch.ones(4, 48))
    with pytest.raises(ValueError, match="scale"):
        quant.dequantize_mxfp4(torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 3, dtype=torch.uint8))


def test_mxfp8_weight_quantiser_matches_the_ocp_recipe_and_round_trips():
    w = torch.randn(3, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float32) * torch.tensor([[1e-3], [1.0], [1e3]])
    w[1, 32:] = 0.0
    q, s = quant.quantize_weight_mxfp8(w)
    assert q.dtype == quant.FP8_DTYPE and s.dtype == torch.uint8 and s.shape == (3, 2)
    amax = w.abs().unflatten(-1, (2, 32)).amax(-1)
    want = torch.where(amax > 0, torch.floor(torch.log2(amax)).to(torch.int64) - 8, -127) + 127
    assert torch.equal(s.long(), want)
    assert s[1, 1] == 0  # all-zero block: X = -127
    back = quant.dequantize_mxfp8(q, s, dtype=torch.float32)
    # half of e4m3's top-binade step (32 * 2^X), or the saturation 448 -> up to 512 (64 * 2^X)
    bound = 64 * torch.exp2(s.float() - 127).repeat_interleave(32, -1)
    assert ((back - w).abs() <= bound).all()
    assert torch.equal(quant.quantize_weight_mxfp8(back)[0].view(torch.uint8), q.view(torch.uint8))


def test_mxfp8_activation_quantiser_saturates():
    x = torch.tensor([[500.0] + [1.0] * 31, [0.0] * 32], dtype=torch.float32)
    q, s = quant.quantize_act_mxfp8(x)
    assert s.tolist() == [[127], [0]]  # X = floor(log2 500) - 8 = 0; an all-zero group gets X = -127
    assert q.float()[0, :2].tolist() == [448.0, 1.0]  # 500 / 2^0 saturates at e4m3's 448


# ------------------------------------------------------------------------------------------------
# FP8 e4m3 with e8m0 scales per 32x32 block (DeepSeek-V4.1)


def test_fp8_block32_scales_round_amax_over_448_up_to_a_power_of_two_with_partial_edge_blocks():
    w = torch.randn(40, 70, generator=torch.Generator().manual_seed(3))  # a 2x3 grid: the last row and column partial
    w[0, 0] = 448.0 * 2.0**-3  # block (0, 0): amax / 448 exactly 2^-3, kept (not rounded up)
    w[:32, :32].clamp_(-56.0, 56.0)
    w[35, 65] = 1000.0  # block (1, 2), partial both ways: 1000 / 448 = 2.23 -> 2^2
    w[32:, 32:64] = 0.0  # block (1, 1) all zero: the 1e-4 floor -> 2^ceil(log2(1e-4 / 448)) = 2^-22
    q, scale = quant.quantize_weight_fp8_block32(w)
    assert q.dtype == quant.FP8_DTYPE and scale.dtype == torch.uint8 and tuple(scale.shape) == (2, 3)
    assert scale[0, 0] == 127 - 3 and scale[1, 2] == 127 + 2 and scale[1, 1] == 127 - 22
    # every value within the block's scale: |w| / scale <= 448, no saturation, and the round trip is e4m3's rounding
    back = quant.dequantize_weight_fp8_block32(q, scale, torch.float64)
    factor = torch.exp2(scale.double() - 127).repeat_interleave(32, 0)[:40].repeat_interleave(32, 1)[:, :70]
    assert (q.double().abs() <= 448).all()
    assert torch.equal(back, (w.double() / factor).to(quant.FP8_DTYPE).double() * factor)


def test_fp8_block32_matches_the_checkpoint_writer_and_decodes_leading_dims():
    from deepinfer.model.embedded_v41 import fp8_e8m0  # the tiny V4.1 checkpoints' writer, DeepSeek's ue8m0 rule

    w = torch.randn(3, 48, 80, generator=torch.Generator().manual_seed(4)) * torch.logspace(-3, 1, 48)[:, None]
    q, scale = quant.quantize_weight_fp8_block32(w)
    for e in range(3):
        q_e, s_e = fp8_e8m0(w[e], (32, 32))
        assert torch.equal(q[e].view(torch.uint8), q_e.view(torch.uint8)) and torch.equal(scale[e], s_e.view(torch.uint8))
        assert torch.equal(quant.dequantize_weight_fp8_block32(q, scale, torch.float32)[e], quant.dequantize_weight_fp8_block32(q[e], scale[e], torch.float32))


def test_fp8_block32_dequantize_rejects_a_scale_of_the_wrong_grid_or_dtype():
    q, scale = quant.quantize_weight_fp8_block32(torch.randn(40, 70))
    with pytest.raises(ValueError, match=r"needs a scale of shape \(2, 3\)"):
        quant.dequantize_weight_fp8_block32(q, scale[:, :2])
    with pytest.raises(ValueError, match="uint8"):
        quant.dequantize_weight_fp8_block32(q, scale.float())
    nan = quant.dequantize_weight_fp8_block32(q, torch.full_like(scale, 255), torch.float32)
    assert nan.isnan().all()  # e8m0's 255 is NaN
