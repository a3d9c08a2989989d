"""rms_norm, rope (+ the YaRN table) and silu_and_mul against independent float64 computations."""

import math

import pytest
import torch

from deepinfer.ops.activation import silu_and_mul
from deepinfer.ops.norm import rms_norm
from deepinfer.ops.rope import rope, rope_cos_sin_cache, rope_inv_freq, yarn_mscale


def test_rms_norm_matches_a_per_row_loop():
    x, w = torch.randn(5, 64, dtype=torch.float64), torch.randn(64, dtype=torch.float64)
    out, res = rms_norm(x, w, eps=1e-5)
    assert res is None
    for t in range(5):
        ms = sum(float(v) ** 2 for v in x[t]) / 64
        expect = [float(v) / math.sqrt(ms + 1e-5) * float(g) for v, g in zip(x[t], w)]
        assert torch.allclose(out[t], torch.tensor(expect, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_rms_norm_fuses_the_residual_add():
    x, r, w = torch.randn(3, 32), torch.randn(3, 32), torch.randn(32)
    out, h = rms_norm(x, w, residual=r)
    torch.testing.assert_close(h, x + r)
    torch.testing.assert_close(out, rms_norm(x + r, w)[0])


def test_rms_norm_bf16_statistics_are_taken_in_float32():
    x = (torch.randn(4, 4096) * 100).to(torch.bfloat16)
    w = torch.ones(4096, dtype=torch.bfloat16)
    out, _ = rms_norm(x, w)
    exact = x.double() / x.double().pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    assert out.dtype == torch.bfloat16
    assert ((out.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-6).all()


def _rotate_complex(x, positions, inv_freq):
    """Interleaved RoPE as complex multiplication: pairs (x[2i], x[2i+1]) are numbers a + ib."""
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
    angle = positions.double()[:, None] * inv_freq[None, :]
    return torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)[:, None, :]).flatten(-2)


def test_rope_interleaved_is_complex_rotation_of_adjacent_pairs():
    dim, max_pos = 16, 64
    x, pos = torch.randn(7, 3, dim, dtype=torch.float64), torch.randint(0, max_pos, (7,))
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    out = rope(x, pos, rope_cos_sin_cache(dim, max_pos, 10000.0, dtype=torch.float64), interleaved=True)
    torch.testing.assert_close(out, _rotate_complex(x, pos, inv_freq), rtol=1e-12, atol=1e-12)


def test_rope_half_layout_rotates_i_with_i_plus_half():
    dim, max_pos = 8, 32
    x, pos = torch.randn(4, 2, dim, dtype=torch.float64), torch.randint(0, max_pos, (4,))
    out = rope(x, pos, rope_cos_sin_cache(dim, max_pos, 500.0, dtype=torch.float64), interleaved=False)
    for t in range(4):
        for h in range(2):
            for i in range(dim // 2):
                theta = float(pos[t]) * 500.0 ** (-2 * i / dim)
                a, b = float(x[t, h, i]), float(x[t, h, i + dim // 2])
                assert out[t, h, i].item() == pytest.approx(a * math.cos(theta) - b * math.sin(theta), abs=1e-12)
                assert out[t, h, i + dim // 2].item() == pytest.approx(b * math.cos(theta) + a * math.sin(theta), abs=1e-12)


def test_rope_preserves_norms_and_position_zero_is_identity():
    x = torch.randn(2, 4, 64, dtype=torch.float64)
    cache = rope_cos_sin_cache(64, 128, 10000.0, dtype=torch.float64)
    out = rope(x, torch.tensor([0, 77]), cache, interleaved=True)
    torch.testing.assert_close(out[0], x[0], rtol=0, atol=0)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=1e-12)


def test_yarn_table_matches_transformers():
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    scaling = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
    config = AutoConfig.for_model("deepseek_v3", qk_rope_head_dim=64, max_position_embeddings=163840, rope_parameters=scaling)
    inv_freq, attention_factor = _compute_yarn_parameters(config)
    ours, factor = rope_inv_freq(64, 10000.0, scaling)
    torch.testing.assert_close(ours, inv_freq.double(), rtol=1e-6, atol=0)  # transformers computes in float32
    assert factor == pytest.approx(attention_factor)
    cache = rope_cos_sin_cache(64, 8, 10000.0, scaling, dtype=torch.float64)
    torch.testing.assert_close(cache[3, :32], (3 * ours).cos() * factor)
    assert yarn_mscale(40.0, 1.0) == pytest.approx(0.1 * math.log(40.0) + 1.0)


def test_yarn_correction_range_of_extreme_finite_configs_is_finite():
    """A tiny beta_slow over a huge original length used to overflow the ratio inside the log: an
    OverflowError traceback at load time for config values each of which is accepted (issue 38)."""
    scaling = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 10**12, "beta_fast": 1e300, "beta_slow": 1e-300}
    inv_freq, factor = rope_inv_freq(16, 160000.0, scaling)
    assert torch.isfinite(inv_freq).all() and math.isfinite(factor)


def test_unknown_rope_scaling_is_refused():
    with pytest.raises(ValueError, match="unsupported rope scaling type 'dynamic'"):
        rope_cos_sin_cache(64, 16, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


def test_silu_and_mul_is_silu_of_gate_times_up():
    x = torch.randn(6, 20, dtype=torch.float64)
    out = silu_and_mul(x)
    gate, up = x[:, :10], x[:, 10:]
    expect = torch.tensor([[float(g) / (1 + math.exp(-float(g))) * float(u) for g, u in zip(gr, ur)] for gr, ur in zip(gate, up)], dtype=torch.float64)
    torch.testing.assert_close(out, expect, rtol=1e-12, atol=1e-12)
    assert silu_and_mul(x.to(torch.bfloat16)).dtype == torch.bfloat16
