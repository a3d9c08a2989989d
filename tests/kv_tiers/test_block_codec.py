"""block_codec: a block's tensors survive encode/decode bit for bit; damaged, truncated, other-version and
other-namespace bytes raise CorruptBlock."""

from __future__ import annotations

import dataclasses
import struct

import pytest
import torch

from deepinfer.kv_tiers import block_codec
from deepinfer.kv_tiers.block_codec import CorruptBlock, decode, encode, verify
from deepinfer.kv_tiers.keys import KVNamespace

NS = KVNamespace(model="tiny-v3", config_hash="c0ffee", dtype="bfloat16", kv_cache_dtype="fp8_e4m3", kv_layout_version=1, block_size=16)


def sample_block() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 16, 36, generator=g)
    return {
        "layer0.kv": base.to(torch.bfloat16),
        "layer0.kv_fp8": base.to(torch.float8_e4m3fn),
        "layer0.rows_u8": torch.randint(0, 256, (16, 592), dtype=torch.uint8, generator=g),
        "layer1.scales": torch.rand(16, generator=g),
        "transposed": base[0].t(),  # not contiguous
    }


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_round_trip_bf16_fp8_uint8_bit_exact():
    block = sample_block()
    out = decode(encode(block, NS), NS)
    assert list(out) == list(block)
    for name in block:
        assert same(out[name], block[name]), name


def test_views_of_one_tensor_are_stored_apart():
    base = torch.arange(32, dtype=torch.bfloat16)
    out = decode(encode({"a": base[:16], "b": base[16:], "all": base}, NS), NS)
    assert same(out["a"], base[:16]) and same(out["b"], base[16:]) and same(out["all"], base)


def test_a_flipped_byte_anywhere_is_caught():
    data = bytearray(encode(sample_block(), NS))
    for at in (20, len(data) // 2, len(data) - 40, len(data) - 1):
        damaged = bytearray(data)
        damaged[at] ^= 0x01
        with pytest.raises(CorruptBlock):
            decode(bytes(damaged), NS)
        with pytest.raises(CorruptBlock):
            verify(bytes(damaged))


@pytest.mark.parametrize("keep", [0, 5, 14, 100, -1, -33])
def test_truncated_blocks_are_caught(keep):
    data = encode(sample_block(), NS)
    with pytest.raises(CorruptBlock):
        decode(data[:keep], NS)


def test_another_format_version_is_refused_even_with_a_valid_checksum():
    data = encode(sample_block(), NS)
    body = bytearray(data[: -block_codec.CHECKSUM_BYTES])
    struct.pack_into("<H", body, 8, block_codec.FORMAT_VERSION + 1)
    body = bytes(body)
    with pytest.raises(CorruptBlock, match="version"):
        decode(body + block_codec._checksum(body), NS)


def test_another_namespace_is_refused():
    data = encode(sample_block(), NS)
    verify(data)  # the framing holds: only the namespace differs
    with pytest.raises(CorruptBlock, match="namespace"):
        decode(data, dataclasses.replace(NS, kv_cache_dtype="bfloat16"))


def test_not_a_block_at_all():
    with pytest.raises(CorruptBlock, match="magic"):
        decode(b"x" * 100, NS)


def test_decode_row_copies_the_flat_row_and_refuses_another_layout():
    from deepinfer.kv_tiers.block_rows import BlockRows

    g = torch.Generator().manual_seed(1)
    caches = {"win": torch.randn(3, 16, 8, generator=g).to(torch.bfloat16), "cmp": torch.randint(0, 256, (3, 4, 592), dtype=torch.uint8, generator=g)}
    rows = BlockRows(caches)
    flat = rows.gather(torch.tensor([2]))[0]
    data = encode(rows.split(flat), NS)
    out = torch.zeros(rows.block_bytes, dtype=torch.uint8)
    block_codec.decode_row(data, NS, rows.layout(), out)
    assert torch.equal(out, flat)
    other = BlockRows({"win": caches["win"], "cmp": caches["cmp"][:, :2].contiguous()})  # same names, another shape
    with pytest.raises(CorruptBlock, match="layout"):
        block_codec.decode_row(data, NS, other.layout(), torch.zeros(other.block_bytes, dtype=torch.uint8))
    with pytest.raises(CorruptBlock, match="namespace"):
        block_codec.decode_row(data, dataclasses.replace(NS, block_size=64), rows.layout(), out)
