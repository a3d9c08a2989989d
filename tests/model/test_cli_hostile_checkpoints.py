"""`deepinfer run --model <folder>` on hostile checkpoints (issue 13, items 9 and 12): one line
`deepinfer: error: ...`, exit 2, and nothing read from outside the folder or allocated first."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from safetensors.torch import load_file, save_file

from deepinfer.cli.main import main

from cli_helpers import run_cli

RUN = ["run", "--backend", "reference", "--prompt", "hi", "--no-progress", "--max-tokens", "2"]


def _edit_config(folder, **change):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))


def _one_line(folder, capsys) -> str:
    code = main([*RUN, "--model", str(folder)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("deepinfer: error: ") and "Traceback" not in err[0], (code, err)
    return err[0]


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"hidden_size": "abc"}, 'config.json: hidden_size is "abc", expected an integer >= 1'),
        ({"hidden_size": 64.7}, "hidden_size is 64.7, expected an integer >= 1"),
        ({"rope_parameters": "yarn"}, 'rope_parameters is "yarn", expected an object'),
        ({"quantization_config": [1]}, "quantization_config is [1], expected an object"),
        ({"eos_token_id": {"a": 1}}, 'eos_token_id is {"a": 1}'),
        ({"max_position_embeddings": 1e11}, "max_position_embeddings is 100000000000.0, expected an integer >= 2"),
        ({"max_position_embeddings": -1}, "max_position_embeddings is -1, expected an integer >= 2"),
        ({"max_position_embeddings": 0}, "max_position_embeddings is 0, expected an integer >= 2"),
        ({"rms_norm_eps": -1}, "rms_norm_eps is -1, expected a finite number > 0"),
        ({"max_position_embeddings": 10**10}, "RoPE table for 10000000000 positions"),
        ({"n_routed_experts": 2**24}, "loading this model needs at least"),
    ],
)
def test_bad_config_is_one_line_exit_2(ckpt, capsys, change, needle):
    _edit_config(ckpt, **change)
    assert needle in _one_line(ckpt, capsys)


def test_yarn_factor_and_index_and_tokenizer_config_of_the_wrong_type(ckpt, capsys):
    config = json.loads((ckpt / "config.json").read_text())
    rope_key = "rope_parameters" if "rope_parameters" in config else "rope_scaling"
    _edit_config(ckpt, **{rope_key: {**config[rope_key], "factor": "abc"}})
    assert f'{rope_key}.factor is "abc"' in _one_line(ckpt, capsys)
    (ckpt / "config.json").write_text(json.dumps(config))
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": [1]}))
    assert "weight_map is [1]" in _one_line(ckpt, capsys)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": 1}}))
    assert "weight_map entry 'model.norm.weight' is 1" in _one_line(ckpt, capsys)
    (ckpt / "model.safetensors.index.json").unlink()
    from deepinfer.model.embedded import _package_tokenizer

    shutil.copy(_package_tokenizer(), ckpt / "tokenizer.json")
    (ckpt / "tokenizer_config.json").write_text("[1]")
    assert "tokenizer_config.json: the top level is a list" in _one_line(ckpt, capsys)


def test_index_naming_a_file_outside_the_folder(ckpt, capsys):
    tensors = load_file(str(ckpt / "model.safetensors"))
    other = ckpt.parent / "other"
    other.mkdir()
    save_file({"model.norm.weight": tensors.pop("model.norm.weight")}, str(other / "model.safetensors"))
    save_file(tensors, str(ckpt / "rest.safetensors"))
    (ckpt / "model.safetensors").unlink()
    weight_map = {"model.norm.weight": "../other/model.safetensors", **{n: "rest.safetensors" for n in tensors}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert "names '../other/model.safetensors', which resolves to" in _one_line(ckpt, capsys)
    weight_map["model.norm.weight"] = "../../../../../../../../../etc/passwd"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert "resolves to /etc/passwd, outside the model folder" in _one_line(ckpt, capsys)


def test_nan_weights(ckpt, capsys):
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["model.layers.0.input_layernorm.weight"][3] = float("nan")
    save_file(tensors, str(ckpt / "model.safetensors"))
    assert "tensor model.layers.0.input_layernorm.weight holds NaN or Inf values" in _one_line(ckpt, capsys)


def test_fifo_weights_fail_at_once_from_the_command_line(ckpt):
    """A FIFO named model.safetensors used to block `deepinfer run` for ever; the timeout turns a
    regression into a failure instead of a hung test run."""
    (ckpt / "model.safetensors").unlink()
    os.mkfifo(ckpt / "model.safetensors")
    try:
        run = run_cli(*RUN, "--model", str(ckpt))
    except subprocess.TimeoutExpired:
        pytest.fail("deepinfer run blocked on a FIFO")
    err = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(err) == 1, run.stderr
    assert err[0] == f"deepinfer: error: {ckpt / 'model.safetensors'} is a FIFO (named pipe), not a regular file; replace it with the real file"
