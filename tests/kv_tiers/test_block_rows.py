"""BlockRows moves blocks between paged caches and flat byte rows whatever the caches' dtypes: an fp8 cache (the
V4 default, `--kv-cache-dtype fp8`) too, which torch's index_copy_ does not take on the CPU."""

from __future__ import annotations

import torch

from deepinfer.kv_tiers.block_rows import BlockRows


def _caches() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "window": torch.randn(6, 4, 8, generator=gen).to(torch.float8_e4m3fn),
        "latent": torch.randn(6, 4, 3, generator=gen).to(torch.bfloat16),
        "scale": torch.randn(6, 4, generator=gen),
    }


def test_blocks_round_trip_through_rows_in_every_dtype():
    source, target = _caches(), {name: torch.zeros_like(t) for name, t in _caches().items()}
    rows = BlockRows(source)
    assert rows.block_bytes == 4 * 8 * 1 + 4 * 3 * 2 + 4 * 4
    picked = rows.gather(torch.tensor([4, 1]))
    assert picked.dtype == torch.uint8 and tuple(picked.shape) == (2, rows.block_bytes)
    BlockRows(target).scatter(torch.tensor([0, 5]), picked)
    for name, t in source.items():
        assert torch.equal(target[name][0].view(torch.uint8), t[4].view(torch.uint8)), name
        assert torch.equal(target[name][5].view(torch.uint8), t[1].view(torch.uint8)), name
        assert not target[name][1:5].view(torch.uint8).any(), name  # nothing else written
    split = rows.split(picked[0])
    assert all(torch.equal(split[name].view(torch.uint8), source[name][4].view(torch.uint8)) for name in source)
