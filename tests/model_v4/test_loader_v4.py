"""Loading DeepSeek-V4 checkpoints: both name schemes, FP8 (e8m0 block scales) and MXFP4 experts kept
packed, MTP tensors kept, and one line per broken checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from deepinfer.model.deepseek_v4.model import DeepseekV4ForCausalLM
from deepinfer.model.embedded import V4_CONFIG, random_v4_weights
from deepinfer.model.errors import LoadError
from deepinfer.model.loader import load_model
from deepinfer.ops import quant
from deepinfer.runtime import open_runtime

from waits import HANG_S

TINY = {**V4_CONFIG, "sliding_window": 16, "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        "index_topk": 8, "max_position_embeddings": 512, "num_nextn_predict_layers": 1, "o_lora_rank": 128}  # fmt: skip
# o_lora_rank 128: each output group keeps whole FP8 blocks, so wo_a runs as an FP8 grouped GEMM (as V4's 1024 does)
MTP = {"mtp.0.enorm.weight": torch.ones(128), "mtp.0.e_proj.weight": torch.randn(128, 128)}


@pytest.fixture(scope="module")
def ops():
    return open_runtime("reference", dtype=torch.float32).ops


def write(folder, tensors, config=TINY):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def fp8_e8m0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with a power-of-two scale per 128x128 block, as DeepSeek's V4 release stores them."""
    _, scale = quant.quantize_weight_fp8_block(w)
    exponent = torch.ceil(torch.log2(scale)).clamp(-127, 127)
    pow2 = torch.exp2(exponent)
    full = pow2.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
    return (w.float() / full).to(torch.float8_e4m3fn), (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def quantized_release(tensors: dict, *, fp8: bool = True, fp4: bool = True) -> tuple[dict, dict]:
    """(the release-format checkpoint, the float checkpoint it dequantises to): attention projections
    FP8 with e8m0 `.scale`, routed experts MXFP4 packed in int8 with e8m0 `.scale`."""
    release, dense = {}, {}
    for name, w in tensors.items():
        base = name.removesuffix(".weight")
        if fp4 and ".experts." in name:
            packed, scale = quant.quantize_weight_mxfp4(w.float())
            release[name], release[f"{base}.scale"] = packed.view(torch.int8), scale.view(torch.float8_e8m0fnu)
            dense[name] = quant.dequantize_mxfp4(packed, scale, dtype=torch.float32)
        elif fp8 and name.endswith((".wq_a.weight", ".wq_b.weight", ".wkv.weight", ".wo_a.weight", ".wo_b.weight")) and ".indexer" not in name:
            w8, scale = fp8_e8m0(w)
            release[name], release[f"{base}.scale"] = w8, scale
            factor = torch.exp2(scale.view(torch.uint8).float() - 127)
            dense[name] = quant.dequantize_weight_fp8_block(w8, factor, dtype=torch.float32)
        else:
            release[name] = dense[name] = w
    return release, dense


def last_logits(folder, prompt: list[int]) -> torch.Tensor:
    """The logits the engine samples the first token from."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(model=str(folder), backend="reference", dtype="float32")
    seen, sample = [], llm.engine.runner.ops.sample
    llm.engine.runner.ops.sample = lambda **kw: seen.append(kw["logits"][0].clone()) or sample(**kw)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return seen[0]


@pytest.fixture(scope="module")
def weights():
    return random_v4_weights(TINY, seed=3, mtp=False)  # the tests add (partial) MTP tensors of their own


def test_deepseek_and_transformers_names_load_alike(tmp_path, ops, weights):
    ds = load_model(str(write(tmp_path / "ds", {**weights, **MTP})), ops, "cpu", torch.float32)
    hf_names = {("model." + n if not n.startswith(("head.", "mtp.")) else n): t for n, t in {**weights, **MTP}.items()}
    hf_names = {n.replace("model.embed.", "model.embed_tokens.").replace("model.hc_head_", "model.hc_head.hc_"): t for n, t in hf_names.items()}
    hf = load_model(str(write(tmp_path / "hf", hf_names)), ops, "cpu", torch.float32)
    assert isinstance(ds.model, DeepseekV4ForCausalLM) and isinstance(hf.model, DeepseekV4ForCausalLM)
    assert torch.equal(ds.model.embed, hf.model.embed)
    # an incomplete MTP block loads (the model runs) but is not offered as a drafter, with the reason
    assert not ds.model.mtp_layers and not hf.model.mtp_layers
    with pytest.raises(LoadError, match="cannot draft for speculative decoding: its MTP tensors are not the V4 block layout"):
        ds.model.build_mtp_layers()


def test_release_formats_stay_packed_and_match_their_dequantised_weights(tmp_path, ops, weights):
    release, dense = quantized_release(weights)
    loaded = load_model(str(write(tmp_path / "release", release)), ops, "cpu", torch.float32)
    layer = loaded.model.layers[1]
    assert layer.attn.wq_a.fmt == "fp8_block" and layer.attn.wq_a.weight.dtype == torch.float8_e4m3fn
    assert layer.attn.wo_a.fmt == "fp8_block" and layer.attn.wo_a.weight.shape[0] == TINY["o_groups"]  # one FP8 "expert" per group
    assert layer.ffn.down.fmt == "mxfp4" and layer.ffn.down.weight.dtype == torch.uint8  # packed in memory
    assert layer.ffn.down.weight.shape[-1] == TINY["moe_intermediate_size"] // 2
    prompt = [(5 * i + 7) % 1000 for i in range(70)]
    # MXFP4 experts are W4A16: exactly their dequantised weights.
    fp4, fp4_dense = quantized_release(weights, fp8=False)
    got, want = last_logits(write(tmp_path / "fp4", fp4), prompt), last_logits(write(tmp_path / "fp4_dense", fp4_dense), prompt)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # FP8 projections also quantise their activations (DeepSeek's W8A8), so they are compared with the
    # same FP8 bytes under V3's float32 `weight_scale_inv`: the e8m0 scales must read as exactly those.
    v3_style = {}
    for name, t in release.items():
        if name.endswith(".scale") and ".experts." not in name:
            v3_style[name.removesuffix(".scale") + ".weight_scale_inv"] = torch.exp2(t.view(torch.uint8).float() - 127)
        else:
            v3_style[name] = t
    got, want = last_logits(tmp_path / "release", prompt), last_logits(write(tmp_path / "v3_style", v3_style), prompt)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def poke(tensors: dict, name: str, value: int) -> None:
    """One element of tensors[name] set to `value` (its bytes, for an e8m0 scale), on a copy: the others share the module's weights."""
    tensor = tensors[name].clone()
    (tensor.view(torch.uint8) if tensor.dtype == torch.float8_e8m0fnu else tensor).view(-1)[-1] = value
    tensors[name] = tensor


@pytest.mark.parametrize(
    "break_it, message",
    [
        (lambda t, c: t.pop("layers.1.attn.compressor.wkv.weight"), "tensor layers.1.attn.compressor.wkv.weight (shape [128, 128]) is missing"),
        (lambda t, c: c.update(n_routed_experts=8), "tensor layers.0.ffn.gate.weight has shape [16, 128], config.json implies [8, 128]"),
        (lambda t, c: t.pop("layers.2.ffn.experts.15.w3.weight"), "tensor layers.2.ffn.experts.15.w3.weight (shape [64, 128]) is missing"),
        (lambda t, c: t.update({"layers.2.ffn.experts.16.w3.weight": torch.zeros(64, 128)}), "unexpected tensor layers.2.ffn.experts.16.w3.weight"),
        (lambda t, c: t.update({"layers.1.ffn.experts.0.w2.scale": torch.zeros(128, 3, dtype=torch.uint8)}),
         "expected an e8m0 (F8_E8M0 or U8) MXFP4 scale of shape [128, 2]"),
        (lambda t, c: t.pop("layers.1.ffn.experts.0.w2.scale"), "tensor layers.1.ffn.experts.0.w2.scale (shape [128, 2]) is missing"),
        (lambda t, c: t.update({"layers.0.attn.wq_a.scale": torch.zeros(2, 2, dtype=torch.uint8)}),
         "expected an e8m0 or float FP8 block scale of shape [1, 1]"),
        (lambda t, c: t.update({"layers.0.ffn.gate.tid2eid": torch.zeros(1000, 4)}),
         "tensor layers.0.ffn.gate.tid2eid has shape [1000, 4], config.json implies [129280, 4]"),
        (lambda t, c: c.update(layer_types=["sliding_attention"]), "layer_types has 1 entries for num_hidden_layers=4"),
        (lambda t, c: c.update(index_topk="many"), "index_topk"),
        (lambda t, c: c.update(n_routed_experts=2**24), "implies about 201326752 tensors, the checkpoint holds"),
        (lambda t, c: c.update(max_position_embeddings=10**11), "RoPE table"),
        # issue 38 (T8, U1): values that used to fail at the first forward, or load and yield NaN logprobs
        (lambda t, c: poke(t, "layers.0.ffn.gate.tid2eid", 1000),
         "tensor layers.0.ffn.gate.tid2eid holds expert id 1000, outside [0, n_routed_experts=16)"),
        (lambda t, c: poke(t, "layers.0.ffn.gate.tid2eid", -1), "tensor layers.0.ffn.gate.tid2eid holds expert id -1"),
        (lambda t, c: poke(t, "layers.2.ffn.experts.3.w1.scale", 0xFF),
         "tensor layers.2.ffn.experts.3.w1.scale holds NaN or Inf values (e8m0 scale bytes 0xFF)"),
        (lambda t, c: poke(t, "layers.0.attn.wq_a.scale", 0xFF), "tensor layers.0.attn.wq_a.scale holds NaN or Inf values"),
    ],
)
def test_broken_checkpoints_fail_with_one_line(tmp_path, ops, weights, break_it, message):
    tensors, config = quantized_release(weights)[0], dict(TINY)
    break_it(tensors, config)
    folder = write(tmp_path / "broken", tensors, config)
    with pytest.raises(LoadError) as info:  # CheckpointError is one; the memory check raises LoadError itself
        load_model(str(folder), ops, "cpu", torch.float32)
    text = str(info.value)
    assert message in text and "\n" not in text


def test_the_cli_runs_a_v4_folder_and_refuses_expert_parallelism(tmp_path, weights):
    import shutil
    import subprocess
    import sys

    from deepinfer.model.embedded import ensure_embedded

    folder = write(tmp_path / "v4", weights)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_embedded(alias="tiny-v4") / name, folder / name)
    run = [sys.executable, "-m", "deepinfer", "run", "--model", str(folder), "--prompt", "hi", "--max-tokens", "3", "--backend", "reference"]
    done = subprocess.run(run, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "completion" in done.stdout
    from cli_helpers import run_main

    refused = run_main(*run[3:], "--ep", "2")  # the same command line, in this process
    assert refused.returncode == 2 and "not implemented for DeepSeek-V4" in refused.stderr and "Traceback" not in refused.stderr
