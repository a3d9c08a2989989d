"""KVNamespace: a block's store key changes when anything that makes KV incompatible changes."""

from __future__ import annotations

import dataclasses

import pytest

from deepinfer.kv_tiers.keys import KVNamespace, config_hash

BASE = KVNamespace(model="tiny-v3", config_hash=config_hash({"layers": 2}), dtype="bfloat16", kv_cache_dtype="bfloat16", kv_layout_version=1, block_size=16)
OTHER_VALUES = {
    "model": "tiny-v4",
    "config_hash": config_hash({"layers": 3}),
    "dtype": "float32",
    "kv_cache_dtype": "fp8_e4m3",
    "kv_layout_version": 2,
    "block_size": 64,
    "kv_shard": "1/2",
}


def test_every_field_is_covered_here():
    assert set(OTHER_VALUES) == {f.name for f in dataclasses.fields(KVNamespace)}


@pytest.mark.parametrize("field", sorted(OTHER_VALUES))
def test_the_key_differs_when_any_field_differs(field):
    other = dataclasses.replace(BASE, **{field: OTHER_VALUES[field]})
    assert other.digest() != BASE.digest()
    assert other.key(b"\x01" * 16) != BASE.key(b"\x01" * 16)


def test_the_key_is_stable_hex_and_depends_on_the_block_hash():
    same = KVNamespace(**dataclasses.asdict(BASE))
    assert same.key(b"abc") == BASE.key(b"abc")
    key = BASE.key(b"abc")
    assert len(key) == 64 and int(key, 16) >= 0 and key == key.lower()
    assert BASE.key(b"abd") != key


def test_config_hash_ignores_key_order():
    assert config_hash({"a": 1, "b": [1, 2]}) == config_hash({"b": [1, 2], "a": 1})
    assert config_hash({"a": 1}) != config_hash({"a": 2})


def test_bad_namespaces_and_hashes_are_refused():
    with pytest.raises(ValueError, match="auto"):
        dataclasses.replace(BASE, kv_cache_dtype="auto")
    with pytest.raises(ValueError, match="block_size"):
        dataclasses.replace(BASE, block_size=0)
    with pytest.raises(ValueError, match="model"):
        dataclasses.replace(BASE, model="")
    with pytest.raises(ValueError, match="chain hash"):
        BASE.key(b"")
