"""Checkpoint loading: sharded files, MTP weights, and a one-line LoadError for every broken checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from deepinfer.errors import UserError
from deepinfer.model.errors import LoadError
from deepinfer.model.loader import load_model

from model.model_oracle import PROMPTS, PagedRunner


def _load(folder, ops):
    return load_model(str(folder), ops, "cpu", torch.float32)


def _raises(folder, ops, *needles) -> str:
    with pytest.raises(LoadError) as info:
        _load(folder, ops)
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, UserError) and info.value.exit_code == 2
    for needle in needles:
        assert needle in message, message
    return message


def test_sharded_checkpoint_loads_like_the_single_file(v3_checkpoint, tmp_path, ops):
    source, hf = v3_checkpoint
    hf.save_pretrained(tmp_path, max_shard_size="150KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 2
    chunks = {i: p for i, p in enumerate(PROMPTS)}
    sharded = PagedRunner(_load(tmp_path, ops).model).step(chunks, is_prefill=True)
    single = PagedRunner(_load(source, ops).model).step(chunks, is_prefill=True)
    assert torch.equal(sharded, single)


def test_bf16_checkpoint_is_cast_to_the_requested_dtype(v3_copy, ops):
    folder, tensors = v3_copy
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(folder / "model.safetensors"))
    loaded = _load(folder, ops)
    assert loaded.model.embed_tokens.dtype == torch.float32
    assert loaded.model.layers[1].mlp.down.weight.dtype == torch.float32
    assert loaded.model.layers[1].mlp.correction_bias.dtype == torch.float32
    assert loaded.tokenizer is None  # transformers wrote no tokenizer.json: token-id prompts only


def test_mtp_layer_weights_are_loaded_and_kept(v3_copy, ops):
    folder, tensors = v3_copy
    config = json.loads((folder / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    mtp = {
        "model.layers.3.eh_proj.weight": torch.randn(64, 128),
        "model.layers.3.enorm.weight": torch.ones(64),
        "model.layers.3.mlp.gate.e_score_correction_bias": torch.zeros(8, dtype=torch.bfloat16),
    }
    save_file({**tensors, **mtp}, str(folder / "model.safetensors"))
    loaded = _load(folder, ops)
    kept = loaded.model.mtp_weights[0]
    assert sorted(kept) == ["eh_proj.weight", "enorm.weight", "mlp.gate.e_score_correction_bias"]
    assert torch.equal(kept["eh_proj.weight"], mtp["model.layers.3.eh_proj.weight"])
    assert kept["mlp.gate.e_score_correction_bias"].dtype == torch.float32
    # one layer further is not an MTP layer of this config
    save_file({**tensors, "model.layers.4.enorm.weight": torch.ones(64)}, str(folder / "model.safetensors"))
    _raises(folder, ops, "unexpected tensor model.layers.4.enorm.weight")


def test_missing_tensor(v3_copy, ops):
    folder, tensors = v3_copy
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    _raises(folder, ops, "model.layers.1.mlp.experts.5.up_proj.weight", "missing")


def test_missing_correction_bias_is_a_missing_tensor(v3_copy, ops):
    folder, tensors = v3_copy
    del tensors["model.layers.2.mlp.gate.e_score_correction_bias"]
    save_file(tensors, str(folder / "model.safetensors"))
    _raises(folder, ops, "model.layers.2.mlp.gate.e_score_correction_bias")


def test_wrong_shape(v3_copy, ops):
    folder, tensors = v3_copy
    tensors["model.layers.0.self_attn.kv_b_proj.weight"] = torch.zeros(128, 31)
    save_file(tensors, str(folder / "model.safetensors"))
    _raises(folder, ops, "model.layers.0.self_attn.kv_b_proj.weight", "[128, 31]", "[128, 32]")


def test_unexpected_tensor(v3_copy, ops):
    folder, tensors = v3_copy
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(96, 64)
    save_file(tensors, str(folder / "model.safetensors"))
    _raises(folder, ops, "unexpected tensor model.layers.0.self_attn.q_proj.weight")


def test_fp8_weight_without_its_scale(v3_copy, ops):
    folder, tensors = v3_copy
    tensors["model.layers.0.self_attn.o_proj.weight"] = tensors["model.layers.0.self_attn.o_proj.weight"].to(torch.float8_e4m3fn)
    save_file(tensors, str(folder / "model.safetensors"))
    _raises(folder, ops, "model.layers.0.self_attn.o_proj.weight", "quantization_config")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (folder / "config.json").write_text(json.dumps(config))
    _raises(folder, ops, "model.layers.0.self_attn.o_proj.weight_scale_inv", "missing")


def test_pickle_only_folder_is_refused(v3_copy, ops):
    folder, _ = v3_copy
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not really a pickle")
    _raises(folder, ops, "pytorch_model.bin", "safetensors")


def test_truncated_safetensors(v3_copy, ops):
    folder, _ = v3_copy
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _raises(folder, ops, "model.safetensors", "truncated")
    path.write_bytes(data[:5])
    _raises(folder, ops, "model.safetensors")
    path.write_bytes(b"\xff" * 64)
    _raises(folder, ops, "model.safetensors", "header")


def test_unknown_model_type(v3_copy, ops):
    folder, _ = v3_copy
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "llama"
    (folder / "config.json").write_text(json.dumps(config))
    _raises(folder, ops, "'llama'", "deepseek_v2", "deepseek_v3")


def test_sharded_index_names_a_missing_shard(v3_checkpoint, tmp_path, ops):
    _, hf = v3_checkpoint
    hf.save_pretrained(tmp_path, max_shard_size="150KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    _raises(tmp_path, ops, shard.name, "missing")


def test_missing_config_and_missing_folder(v3_copy, tmp_path, ops):
    folder, _ = v3_copy
    (folder / "config.json").unlink()
    _raises(folder, ops, "config.json")
    _raises(tmp_path / "nowhere", ops, "nowhere", "does not exist")
    _raises(folder / "model.safetensors", ops, "is a file")


def test_no_weights_at_all(v3_copy, ops):
    folder, _ = v3_copy
    (folder / "model.safetensors").unlink()
    _raises(folder, ops, "model.safetensors")


def _cli_fails_with_one_line(folder, capsys) -> str:
    from deepinfer.cli.main import main

    code = main(["run", "--backend", "reference", "--model", str(folder), "--prompt", "hi", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("deepinfer: error: ") and "Traceback" not in err[0], err
    return err[0]


def test_deepinfer_run_reports_each_bad_checkpoint_in_one_line_with_exit_2(v3_copy, capsys):
    folder, tensors = v3_copy
    good = dict(tensors)
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    assert "experts.5.up_proj.weight" in _cli_fails_with_one_line(folder, capsys)
    tensors = dict(good)
    tensors["model.layers.0.self_attn.kv_b_proj.weight"] = torch.zeros(128, 31)
    save_file(tensors, str(folder / "model.safetensors"))
    assert "kv_b_proj.weight" in _cli_fails_with_one_line(folder, capsys)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "truncated" in _cli_fails_with_one_line(folder, capsys)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"x")
    assert "pytorch_model.bin" in _cli_fails_with_one_line(folder, capsys)
    save_file(good, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    assert "'llama'" in _cli_fails_with_one_line(folder, capsys)
