"""The embedded default: a tiny DeepSeek-V3 with dummy weights and DeepSeek's real tokenizer."""

from __future__ import annotations

import hashlib
import shutil

import pytest
import torch

from deepinfer.model import embedded
from deepinfer.model.errors import LoadError
from deepinfer.model.loader import load_model


def _digests(folder) -> dict[str, str]:
    return {f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in embedded.FILES}


@pytest.fixture(scope="module")
def embedded_model(tmp_path_factory, ops):
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE", str(root))
        return root, load_model(None, ops, "cpu", torch.float32)


def test_generated_deterministically(embedded_model, tmp_path):
    root, _ = embedded_model
    again = embedded.ensure_embedded(tmp_path)
    assert again == tmp_path / embedded.NAME
    assert _digests(again) == _digests(root / embedded.NAME)
    assert not [p for p in tmp_path.iterdir() if p.name != embedded.NAME]  # no staging folder left behind
    assert (root / embedded.NAME / "model.safetensors").stat().st_size < 80 * 2**20


def test_loads_as_dummy_weights_and_runs(embedded_model):
    from model.model_oracle import PagedRunner

    root, loaded = embedded_model
    assert loaded.dummy_weights is True and loaded.path == str(root / embedded.NAME)
    c = loaded.config
    assert c.model_type == "deepseek_v3" and c.vocab_size == 129280 and c.uses_correction_bias
    assert c.routing_groups == (4, 2) and [c.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    bias = loaded.model.layers[1].mlp.correction_bias
    assert float(bias.std()) > 0.05  # spread, so group-limited routing selects for real
    ids = loaded.tokenizer.encode("The capital of France is")
    logits = PagedRunner(loaded.model, block_size=4).step({0: ids}, is_prefill=True)
    assert logits.shape == (1, 129280) and torch.isfinite(logits).all()


def test_loaded_by_path_it_still_says_dummy_weights(embedded_model, ops):
    root, _ = embedded_model
    assert load_model(str(root / embedded.NAME), ops, "cpu", torch.float32).dummy_weights is True


def test_second_use_reuses_the_cache(embedded_model, monkeypatch):
    root, _ = embedded_model
    monkeypatch.setattr(embedded, "write_embedded", lambda folder: pytest.fail("regenerated an existing model"))
    assert embedded.ensure_embedded(root) == root / embedded.NAME


def test_interrupted_generation_leaves_nothing_behind(tmp_path, monkeypatch):
    def crash(folder, alias=None):
        (folder / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(embedded, "write_embedded", crash)
    with pytest.raises(KeyboardInterrupt):
        embedded.ensure_embedded(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_unwritable_cache_is_a_load_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(LoadError, match="DEEPINFER_CACHE"):
        embedded.ensure_embedded(blocker / "cache")


def test_real_deepseek_tokenizer(embedded_model):
    _, loaded = embedded_model
    tok = loaded.tokenizer
    assert tok.vocab_size == 129280 and tok.bos_token_id == 0 and tok.eos_token_id == 1 and 1 in tok.eos_token_ids
    ids = tok.encode("Hello world")
    assert ids[0] == 0 and tok.encode("Hello world", add_bos=False) == ids[1:]  # add_bos_token: true
    assert tok.decode(ids) == "Hello world"
    assert tok.decode(ids, skip_special_tokens=False) == "<｜begin▁of▁sentence｜>Hello world"
    prompt = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert prompt == "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜>"
    chat_ids = tok.encode(prompt)
    assert chat_ids.count(0) == 1  # the template's BOS is not doubled
    assert chat_ids[-1] == tok.token_to_id("<｜Assistant｜>")


@pytest.mark.parametrize(
    "corrupt, problem",
    [
        (lambda folder: (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:100000]), "model.safetensors: truncated"),
        (lambda folder: (folder / "tokenizer_config.json").write_text("{"), "tokenizer_config.json: not valid JSON"),
        (lambda folder: (folder / "config.json").write_text('{"model_type": "deepseek_v3"}'), "required field vocab_size is missing"),
    ],
)
def test_corrupt_embedded_cache_says_delete_the_folder_not_re_download(embedded_model, tmp_path, monkeypatch, ops, corrupt, problem):
    """The embedded model is generated locally: re-downloading it means nothing (issue 13, item 13)."""
    root, _ = embedded_model
    folder = tmp_path / embedded.NAME
    shutil.copytree(root / embedded.NAME, folder)
    corrupt(folder)
    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path))
    for path in (None, str(folder)):  # the default, and the same folder by path
        with pytest.raises(LoadError) as info:
            load_model(path, ops, "cpu", torch.float32)
        message = str(info.value)
        assert problem in message and f"delete {folder} and run again; it is regenerated" in message, message
        assert "download" not in message and "fetch" not in message and "\n" not in message
