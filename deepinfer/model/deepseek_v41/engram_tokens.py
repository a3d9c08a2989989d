"""Engram's compressed token ids: every vocabulary id mapped to the id of its normalised text.

DeepSeek-V4.1's Engram hashes n-grams of *compressed* ids, so that tokens differing only in case,
accents or surrounding whitespace share their memory rows. The map is derived from the checkpoint's
own tokenizer, as DeepSeek's released `inference/engram.py` derives it (restated from NeMo Automodel
0.7.0's `deepseek_v41/engram.py`): decode each id alone (specials kept); a text holding U+FFFD (a
partial UTF-8 byte) keys by its raw vocabulary string; any other text keys by NFKC -> NFD -> strip
accents -> lowercase -> whitespace runs to one space -> strip (a lone space stays " "; an empty
result keys by the text itself). Compressed id = order of first appearance of the key.
"""

from __future__ import annotations

import torch

_SENTINEL = "\ue000"  # a private-use character standing in for a lone space while the text is stripped


def _normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), _SENTINEL),
        normalizers.Strip(), normalizers.Replace(_SENTINEL, " "),
    ])  # fmt: skip


def compressed_token_map(backend, vocab_size: int) -> tuple[torch.Tensor, int]:
    """(int64 [vocab_size] compressed id of every token id, the number of distinct compressed ids).

    backend: a `tokenizers.Tokenizer` (the checkpoint's tokenizer.json). Ids past the tokenizer's own
    vocabulary (a model vocab padded beyond it) key as their empty decoding would."""
    normalizer = _normalizer()
    ids: dict[str, int] = {}
    out = []
    for token_id in range(vocab_size):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = backend.id_to_token(token_id) or text
        else:
            key = normalizer.normalize_str(text) or text
        out.append(ids.setdefault(key, len(ids)))
    return torch.tensor(out, dtype=torch.int64), len(ids)
