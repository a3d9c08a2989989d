"""A hostile checkpoint folder (issue 13, item 9): shard paths that leave the folder, symlinks out,
FIFOs and devices in place of files, and malformed index / tokenizer config files. Every one is
refused with one line before the file is opened."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.errors import UserError
from deepinfer.model import folder as folder_module
from deepinfer.model.errors import CheckpointError
from deepinfer.model.loader import load_model

from waits import HANG_S

INDEX = "model.safetensors.index.json"


def _tensors(folder):
    return load_file(str(folder / "model.safetensors"))


def _refused(folder, ops, *needles) -> str:
    with pytest.raises(CheckpointError) as info:
        load_model(str(folder), ops, "cpu", torch.float32)
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, UserError) and info.value.exit_code == 2
    for needle in needles:
        assert needle in message, message
    return message


def _shard(folder, weight_map: dict) -> None:
    """Replace the single file by an index naming `weight_map`'s shards."""
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "model.safetensors").unlink()


def _split(folder, outside_name: str, outside_path) -> dict:
    """Split the checkpoint: embed_tokens goes to `outside_path` (named `outside_name` in the
    index), the rest into an inside shard. Returns the weight map."""
    tensors = _tensors(folder)
    embed = {"model.embed_tokens.weight": tensors.pop("model.embed_tokens.weight")}
    outside_path.parent.mkdir(parents=True, exist_ok=True)
    save_file(embed, str(outside_path))
    save_file(tensors, str(folder / "rest.safetensors"))
    return {"model.embed_tokens.weight": outside_name, **{name: "rest.safetensors" for name in tensors}}


def test_index_shard_path_out_of_the_folder_is_refused(ckpt, ops):
    """`../other/model.safetensors` used to load a tensor from outside and exit 0."""
    _shard(ckpt, _split(ckpt, "../other/model.safetensors", ckpt.parent / "other" / "model.safetensors"))
    message = _refused(
        ckpt, ops, INDEX, "weight_map entry 'model.embed_tokens.weight'", "'../other/model.safetensors'", "outside the model folder", "fix the index"
    )
    assert str(ckpt.parent / "other" / "model.safetensors") in message


def test_index_naming_a_system_file_is_refused_unopened(ckpt, ops, monkeypatch):
    """`../../../../etc/passwd` and absolute paths were opened and read as safetensors."""
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *args, **kwargs: opened.append(str(path)) or real_open(path, *args, **kwargs))
    tensors = _tensors(ckpt)
    for shard in ("../../../../../../../../etc/passwd", "/etc/passwd"):
        _shard(ckpt, {name: shard if name == "model.norm.weight" else "model.safetensors" for name in tensors})
        save_file(tensors, str(ckpt / "model.safetensors"))
        _refused(ckpt, ops, "'model.norm.weight'", repr(shard), "resolves to /etc/passwd", "outside the model folder")
    assert opened and not [p for p in opened if p.endswith((".safetensors", "passwd"))]  # the index only: no shard opened


def test_symlink_inside_the_folder_pointing_out_is_refused(ckpt, ops):
    outside = ckpt.parent / "elsewhere" / "embed.safetensors"
    weight_map = _split(ckpt, "embed.safetensors", outside)
    os.symlink(outside, ckpt / "embed.safetensors")
    _shard(ckpt, weight_map)
    _refused(ckpt, ops, "names 'embed.safetensors'", f"resolves to {outside}", "outside the model folder")


def test_single_file_symlinked_from_outside_is_refused(ckpt, ops):
    outside = ckpt.parent / "elsewhere.safetensors"
    shutil.move(ckpt / "model.safetensors", outside)
    os.symlink(outside, ckpt / "model.safetensors")
    _refused(ckpt, ops, "model.safetensors resolves to", "outside the model folder", "copy the file into the folder")
    os.unlink(ckpt / "config.json")
    os.symlink("/etc/hostname", ckpt / "config.json")
    _refused(ckpt, ops, "config.json resolves to /etc/hostname")


def test_symlinks_and_subfolders_inside_the_folder_load(ckpt, ops):
    tensors = _tensors(ckpt)
    (ckpt / "shards").mkdir()
    shutil.move(ckpt / "model.safetensors", ckpt / "shards" / "all.safetensors")
    os.symlink("shards/all.safetensors", ckpt / "link.safetensors")
    _shard_map = {name: ("link.safetensors" if "embed" in name else "shards/./all.safetensors") for name in tensors}
    (ckpt / INDEX).write_text(json.dumps({"weight_map": _shard_map}))
    loaded = load_model(str(ckpt), ops, "cpu", torch.float32)
    assert torch.equal(loaded.model.embed_tokens, tensors["model.embed_tokens.weight"])


def test_hugging_face_hub_snapshot_links_into_its_blobs(ckpt, ops, tmp_path):
    """The hub cache's layout: snapshots/<rev>/<file> -> ../../blobs/<hash>; that stays allowed."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(ckpt.iterdir())):
        shutil.copy(file, repo / "blobs" / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snapshot / file.name)
    assert load_model(str(snapshot), ops, "cpu", torch.float32).config.vocab_size == 1000
    os.unlink(snapshot / "config.json")
    os.symlink("../../../config.json", snapshot / "config.json")  # models--org--tiny/config.json: not in blobs/
    (repo / "config.json").write_text("{}")
    _refused(snapshot, ops, "outside the model folder")


# Run in a child process: before the fix a FIFO blocks the load for ever; a timeout turns that into a failure.
FIFO_LOADER = textwrap.dedent(
    """
    import json, sys, torch
    from deepinfer.model.errors import LoadError
    from deepinfer.model.loader import load_model
    from deepinfer.runtime import open_runtime
    ops = open_runtime("reference", dtype=torch.float32).ops
    for folder in sys.argv[1:]:
        try:
            load_model(folder, ops, "cpu", torch.float32)
            print(json.dumps("loaded"))
        except LoadError as exc:
            print(json.dumps(str(exc)))
    """
)


def test_fifos_in_place_of_any_file_are_refused_without_blocking(ckpt, tmp_path):
    from deepinfer.model.embedded import _package_tokenizer

    shutil.copy(_package_tokenizer(), ckpt / "tokenizer.json")
    (ckpt / "tokenizer_config.json").write_text("{}")
    folders = {}
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", INDEX, "shard.safetensors"):
        folder = tmp_path / f"fifo-{name}"
        shutil.copytree(ckpt, folder)
        if name == "shard.safetensors":  # a shard the index names
            (folder / INDEX).write_text(json.dumps({"weight_map": {n: "shard.safetensors" for n in _tensors(folder)}}))
        if (folder / name).exists():
            (folder / name).unlink()
        os.mkfifo(folder / name)
        folders[name] = folder
    try:
        run = subprocess.run([sys.executable, "-c", FIFO_LOADER, *map(str, folders.values())], capture_output=True, text=True, timeout=HANG_S)
    except subprocess.TimeoutExpired:
        pytest.fail("loading a folder with a FIFO blocked")
    assert run.returncode == 0, run.stderr
    messages = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(messages) == len(folders)
    for (name, folder), message in zip(folders.items(), messages):
        assert f"{folder / name} is a FIFO (named pipe), not a regular file" in message, message
        assert "\n" not in message


def test_a_device_is_not_a_regular_file():
    with pytest.raises(CheckpointError, match="/dev/null is a character device, not a regular file"):
        folder_module.open_regular(folder_module.Path("/dev/null"))
    with pytest.raises(CheckpointError, match="is a folder, not a regular file"):
        folder_module.folder_file(folder_module.Path("/tmp"), ".")


def test_index_weight_map_of_the_wrong_type(ckpt, ops):
    tensors = _tensors(ckpt)
    for weight_map, needles in (
        ([1, 2], ["weight_map is [1, 2]", "expected an object mapping tensor names to shard files"]),
        ({"model.norm.weight": 1}, ["weight_map entry 'model.norm.weight' is 1", "expected a shard file name"]),
        ({"model.norm.weight": ["a"]}, ["weight_map entry 'model.norm.weight' is [\"a\"]"]),
        ({"model.norm.weight": "a\0b"}, ["which is not a file name"]),
        (None, ["weight_map is null"]),
    ):
        (ckpt / INDEX).write_text(json.dumps({"weight_map": weight_map}))
        _refused(ckpt, ops, INDEX, *needles)
    (ckpt / INDEX).write_text("[1]")
    _refused(ckpt, ops, INDEX, "the top level is a list, expected a JSON object")
    (ckpt / INDEX).write_text("[" * 100000)
    _refused(ckpt, ops, INDEX, "not valid JSON")
    assert tensors


def test_tokenizer_config_of_the_wrong_type(ckpt, ops):
    from deepinfer.model.embedded import _package_tokenizer

    shutil.copy(_package_tokenizer(), ckpt / "tokenizer.json")
    for text, needles in (
        ("[1]", ["tokenizer_config.json: the top level is a list, expected a JSON object"]),
        ('{"add_bos_token": "yes"}', ['add_bos_token is "yes", expected true or false']),
        ('{"bos_token": 5}', ["bos_token is 5, expected a string or an object"]),
        ('{"eos_token": {"content": 1}}', ['eos_token is {"content": 1}']),
        ('{"chat_template": 3}', ["chat_template is 3, expected a string or a list of"]),
        ('{"chat_template": [{"name": "default"}]}', ["chat_template is [{\"name\": \"default\"}]"]),
    ):
        (ckpt / "tokenizer_config.json").write_text(text)
        _refused(ckpt, ops, "tokenizer_config.json", *needles)
    (ckpt / "tokenizer_config.json").write_text('{"add_bos_token": true, "bos_token": {"content": "<｜begin▁of▁sentence｜>"}}')
    assert load_model(str(ckpt), ops, "cpu", torch.float32).tokenizer.add_bos


def test_header_entry_of_the_wrong_type_is_one_line(ckpt, ops):
    """A header whose entry has a list for a dtype used to raise TypeError (unhashable) later."""
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    for bad in ({"dtype": ["F32"]}, {"shape": [-1, 2]}, {"shape": "12"}, {"data_offsets": [5, 2]}, {"data_offsets": [0, 1.5]}):
        name = "model.norm.weight"
        broken = {**header, name: {**header[name], **bad}}
        raw = json.dumps(broken).encode()
        raw += b" " * (n - len(raw)) if len(raw) <= n else b""
        path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n :])
        _refused(ckpt, ops, "model.safetensors", "corrupt safetensors header entry for 'model.norm.weight'")
