"""FP8 block-scaled checkpoints (DeepSeek-V3's format) stay FP8 and run through fp8_block ops."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.model.linear import FusedLinear, LinearWeight
from deepinfer.model.loader import load_model
from deepinfer.ops import quant

from model.model_oracle import PROMPTS, PagedRunner, rel_err

FP8 = torch.float8_e4m3fn


def _is_projection(name: str) -> bool:
    # every DeepSeek projection ends in _proj / _proj_with_mqa; router, embeddings, lm_head, norms stay
    return name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight")


@pytest.fixture(scope="module")
def fp8_pair(v3_checkpoint, tmp_path_factory, ops):
    """(the FP8 checkpoint loaded, the same weights dequantised into a dense checkpoint, loaded)."""
    source, _ = v3_checkpoint
    tensors = load_file(str(source / "model.safetensors"))
    fp8_dir, dense_dir = tmp_path_factory.mktemp("v3_fp8"), tmp_path_factory.mktemp("v3_fp8_dequantised")
    fp8_tensors, dense_tensors = {}, {}
    for name, t in tensors.items():
        if _is_projection(name):
            w, scale = quant.quantize_weight_fp8_block(t)
            fp8_tensors[name], fp8_tensors[f"{name}_scale_inv"] = w, scale
            dense_tensors[name] = quant.dequantize_weight_fp8_block(w, scale, dtype=torch.float32)
        else:
            fp8_tensors[name] = dense_tensors[name] = t
    save_file(fp8_tensors, str(fp8_dir / "model.safetensors"))
    save_file(dense_tensors, str(dense_dir / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    shutil.copy(source / "config.json", dense_dir / "config.json")
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (fp8_dir / "config.json").write_text(json.dumps(config))
    return load_model(str(fp8_dir), ops, "cpu", torch.float32), load_model(str(dense_dir), ops, "cpu", torch.float32)


def test_fp8_weights_stay_fp8_in_memory(fp8_pair):
    fp8, _ = fp8_pair
    dense_layer, moe_layer = fp8.model.layers[0], fp8.model.layers[1]
    attn = dense_layer.attn
    for w in (*attn.q_kv_a.parts, attn.q_b_proj, attn.kv_b_proj, attn.o_proj, dense_layer.mlp.down):
        assert w.weight.dtype == FP8 and w.scale.dtype == torch.float32 and w.fmt == "fp8_block"
    assert all(p.weight.dtype == FP8 for p in dense_layer.mlp.gate_up.parts)
    assert moe_layer.mlp.down.weight.dtype == FP8 and moe_layer.mlp.down.scale.shape == (8, 1, 1)
    assert all(p.weight.dtype == FP8 for p in moe_layer.mlp.gate_up.parts)
    assert moe_layer.mlp.router.dtype == torch.float32  # the router stays in float32
    assert fp8.model.embed_tokens.dtype == torch.float32 and fp8.model.lm_head.dtype == torch.float32
    assert attn.w_uk.dtype == torch.float32  # kv_b_proj dequantised once for the absorbed path


def test_fp8_logits_close_to_dequantised_model(fp8_pair):
    """Same weights; the difference left is the per-token fp8 quantisation of activations.

    In this tiny random model, quantising the weights alone moves the logits by ~8% (relative
    norm) and quantising activations adds about as much (more where a routing decision flips), so
    the bound is loose; a missing or misplaced scale gives errors of order 1 or more.
    """
    fp8, dense = fp8_pair
    chunks = {i: p for i, p in enumerate(PROMPTS)}
    ours = PagedRunner(fp8.model).step(chunks, is_prefill=True)
    ref = PagedRunner(dense.model).step(chunks, is_prefill=True)
    for a, b in zip(ours, ref):
        assert 0 < rel_err(a, b) < 0.35
    r1, r2 = PagedRunner(fp8.model), PagedRunner(dense.model)
    r1.step({0: PROMPTS[2]}, is_prefill=True)
    r2.step({0: PROMPTS[2]}, is_prefill=True)
    assert rel_err(r1.step({0: [7]}, is_prefill=False)[0], r2.step({0: [7]}, is_prefill=False)[0]) < 0.35


def test_fp8_model_equals_dequantised_without_activation_quantisation(fp8_pair, monkeypatch):
    """With the reference gemm's activation quantisation switched off, FP8 weights (scales, stacked
    experts, split gate/up, partial edge blocks) must reproduce the dequantised model to float32 rounding."""
    from deepinfer.ops import gemm

    monkeypatch.setattr(gemm, "_activation_for_product", lambda x, fmt, acc: x.to(acc))
    fp8, dense = fp8_pair
    chunks = {i: p for i, p in enumerate(PROMPTS)}
    ours = PagedRunner(fp8.model).step(chunks, is_prefill=True)
    ref = PagedRunner(dense.model).step(chunks, is_prefill=True)
    for a, b in zip(ours, ref):
        assert rel_err(a, b) < 1e-5
    r1, r2 = PagedRunner(fp8.model), PagedRunner(dense.model)
    r1.step({0: PROMPTS[2]}, is_prefill=True)
    r2.step({0: PROMPTS[2]}, is_prefill=True)
    assert rel_err(r1.step({0: [7]}, is_prefill=False)[0], r2.step({0: [7]}, is_prefill=False)[0]) < 1e-5


def test_fp8_gate_up_fuses_only_on_whole_blocks(ops):
    """gate/up concatenated along N keep their 128x128 blocks only when N is a multiple of 128."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 160, generator=gen)
    for n, fused_parts in ((128, 1), (96, 2)):
        parts = [LinearWeight(*quant.quantize_weight_fp8_block(torch.randn(n, 160, generator=gen))) for _ in range(2)]
        fused = FusedLinear.of(parts)
        assert len(fused.parts) == fused_parts
        separate = torch.cat([p(ops, x) for p in parts], dim=-1)
        assert torch.equal(fused(ops, x), separate)
