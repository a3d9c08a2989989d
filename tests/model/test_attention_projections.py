"""MLA's first projections share one GEMM: q_proj (V2 without a q LoRA) or q_a_proj (V3) and
kv_a_proj_with_mqa read the same hidden states, so their weights are concatenated at load time."""

from __future__ import annotations

import pytest
import torch

from deepinfer.model.loader import load_model


@pytest.mark.parametrize("checkpoint", ["v2_checkpoint", "v3_checkpoint"])
def test_q_and_kv_a_run_as_one_linear_call(checkpoint, ops, request, monkeypatch):
    source, hf = request.getfixturevalue(checkpoint)
    loaded = load_model(str(source), ops, "cpu", torch.float32)
    attn = loaded.model.layers[0].attn
    assert len(attn.q_kv_a.parts) == 1, "dense weights always fuse"
    q_name = "q_proj" if hf.config.q_lora_rank is None else "q_a_proj"
    state = {k: v for k, v in hf.state_dict().items() if k.startswith("model.layers.0.self_attn.")}
    expected = torch.cat([state[f"model.layers.0.self_attn.{q_name}.weight"], state["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]])
    assert torch.equal(attn.q_kv_a.parts[0].weight, expected.float())
    calls = []
    linear = ops.linear
    monkeypatch.setattr(ops, "linear", lambda x, w, **kw: calls.append(w.shape) or linear(x, w, **kw), raising=False)
    x = torch.randn(3, expected.shape[1])
    attn.q_kv_a(ops, x)
    assert calls == [expected.shape]
