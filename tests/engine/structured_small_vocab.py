"""A checkpoint for structured output through the Triton kernels in the interpreter: the tiny model
with a 512-token vocabulary (engine.determinism.write_small_checkpoint: the 129k-wide lm_head and
sampling take minutes in the interpreter) and a byte-level tokenizer for it, so llguidance has a
vocabulary to build masks from: BOS 0, EOS 1 (the model's), the 256 bytes, then merges of digit
pairs and of a few JSON fragments; the ids past them are unused (never allowed by a grammar)."""

from __future__ import annotations

import json
from pathlib import Path

from engine.determinism import SMALL_VOCAB, write_small_checkpoint

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


def write_structured_checkpoint(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = write_small_checkpoint(folder, num_hidden_layers=2)  # a dense layer and a MoE layer
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: (ord(c) > 255, ord(c)))
    vocab = {BOS: 0, EOS: 1, **{c: 2 + i for i, c in enumerate(byte_chars)}}
    merges = [(a, b) for a in "0123456789" for b in "0123456789"] + [("{", '"'), ('"', ":"), ('"', ","), ("t", "r"), ("tr", "u"), ("tru", "e")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    assert len(vocab) <= SMALL_VOCAB
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS, EOS])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder
