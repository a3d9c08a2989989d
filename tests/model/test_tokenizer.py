"""Tokenizer: tokenizer.json through `tokenizers`, BOS policy, EOS ids, chat templates."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, processors

from deepinfer.model.errors import LoadError
from deepinfer.model.tokenizer import Tokenizer

VOCAB = {"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "[UNK]": 4, "<eot>": 5}


def _write(folder, *, bos_post_processor: bool = False, config: dict | None = None, template_file: str | None = None):
    tk = HFTokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.add_special_tokens(["<s>", "</s>", "<eot>"])
    if bos_post_processor:
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tk.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if template_file is not None:
        (folder / "chat_template.jinja").write_text(template_file)
    return folder


def test_add_bos_token_flag_wins(tmp_path):
    tok = Tokenizer.from_folder(_write(tmp_path, config={"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>"}))
    assert tok.encode("hello world") == [0, 2, 3]
    assert tok.encode("hello world", add_bos=False) == [2, 3]
    assert tok.encode("<s> hello") == [0, 2]  # never a doubled BOS
    assert tok.decode([0, 2, 3, 1]) == "hello world"
    assert tok.decode([0, 2], skip_special_tokens=False) == "<s> hello"


def test_without_a_flag_bos_follows_the_post_processor(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with_pp = Tokenizer.from_folder(_write(tmp_path / "a", bos_post_processor=True), bos_token_id=0, eos_token_ids=[1])
    without = Tokenizer.from_folder(_write(tmp_path / "b"), bos_token_id=0, eos_token_ids=[1])
    assert with_pp.encode("hello") == [0, 2] and without.encode("hello") == [2]
    assert with_pp.bos_token == "<s>" and with_pp.eos_token_id == 1  # from config.json's ids


def test_eos_ids_join_tokenizer_config_and_config_json(tmp_path):
    tok = Tokenizer.from_folder(_write(tmp_path, config={"eos_token": {"content": "<eot>"}}), eos_token_ids=[1])
    assert tok.eos_token_id == 5 and tok.eos_token_ids == (5, 1)


def test_chat_templates(tmp_path):
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    from_config = Tokenizer.from_folder(_write(tmp_path / "a", config={"bos_token": "<s>", "chat_template": [{"name": "default", "template": template}]}))
    from_file = Tokenizer.from_folder(_write(tmp_path / "b", config={"bos_token": "<s>"}, template_file=template))
    messages = [{"role": "user", "content": "hello"}]
    assert from_config.apply_chat_template(messages) == from_file.apply_chat_template(messages) == "<s>user: hello assistant:"
    assert from_file.apply_chat_template(messages, add_generation_prompt=False) == "<s>user: hello "
    none = Tokenizer.from_folder(_write(tmp_path / "c"))
    assert not none.has_chat_template
    with pytest.raises(LoadError, match="chat_template"):
        none.apply_chat_template(messages)


def test_raise_exception_in_a_template_is_a_load_error(tmp_path):
    tok = Tokenizer.from_folder(_write(tmp_path, config={"chat_template": "{{ raise_exception('roles must alternate') }}"}))
    with pytest.raises(LoadError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_or_broken_tokenizer(tmp_path):
    assert Tokenizer.from_folder(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(LoadError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)


def test_a_long_text_is_tokenized_without_holding_the_gil_and_to_the_same_tokens(tmp_path):
    """A server tokenizes prompts off its event loop, but `tokenizers`' encode holds the GIL: a
    prompt of megabytes stalled /health and every stream for seconds. Texts from LONG_TEXT_CHARS on
    go through encode_batch, which lets go of it; the tokens are the same. (Which call lets go of
    the GIL is `tokenizers`' own business: this checks that the long text takes that call.)"""
    from deepinfer.model.tokenizer import LONG_TEXT_CHARS

    tok = Tokenizer.from_folder(_write(tmp_path, config={"bos_token": "<s>", "eos_token": "</s>"}))

    class Recording:
        def __init__(self, backend):
            self.backend, self.calls = backend, []

        def __getattr__(self, name):
            self.calls.append(name)
            return getattr(self.backend, name)

    backend = tok._tk
    text = "hello world " * (LONG_TEXT_CHARS // 12 + 1)
    expected = backend.encode(text, add_special_tokens=False).ids
    tok._tk = Recording(backend)
    assert tok.encode(text, add_bos=False) == expected and tok._tk.calls == ["encode_batch"]
    tok._tk.calls.clear()
    assert tok.encode("hello world", add_bos=False) == [2, 3] and tok._tk.calls == ["encode"]
