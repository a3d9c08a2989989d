"""DeepSeek-V4.1's caches in the release's storage formats: the stored rows read back to exactly what the
rounding gives (so the oracle's numbers stand), their sizes are the release's, and the state and its budget
count those bytes."""

from __future__ import annotations

import pytest
import torch

from deepinfer.model.deepseek_v41 import caches
from deepinfer.model.deepseek_v41.config import V41Config
from deepinfer.ops.cache_rounding import cache_round
from deepinfer.ops.cache_storage import cache_pack, cache_unpack, row_bytes

from model_v41.test_config_v41 import FLASH
from model_v41.tiny_v41 import tiny_config


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("channels", [512, 128, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stored_rows_read_back_to_the_rounded_values_bit_for_bit(fmt, channels, dtype):
    gen = torch.Generator().manual_seed(channels)
    x = torch.randn(9, channels, generator=gen, dtype=torch.float64) * torch.exp2(10 * torch.rand(9, channels, generator=gen, dtype=torch.float64) - 5)
    x = x.to(dtype)
    x[0] = 0  # the scale's floor
    x[1, 5] = -0.0
    rows = cache_pack(x, fmt=fmt)
    assert rows.dtype == torch.uint8 and rows.shape == (9, row_bytes(channels, fmt))
    assert torch.equal(_bits(cache_unpack(rows, torch.empty_like(x), fmt=fmt)), _bits(cache_round(x, fmt=fmt)))


def test_the_rows_have_the_release_sizes():
    assert (row_bytes(512, "fp8"), row_bytes(512, "nvfp4"), row_bytes(128, "mxfp4")) == (512 + 16, 256 + 32, 64 + 4)
    with pytest.raises(ValueError, match="even channel count"):
        row_bytes(33, "nvfp4")
    with pytest.raises(ValueError, match="cache_unpack wants rows uint8"):
        cache_unpack(torch.zeros(2, 10, dtype=torch.uint8), torch.empty(2, 16), fmt="mxfp4")


def test_the_release_holds_890_bytes_a_token_and_its_window_rings():
    config = V41Config.from_dict(FLASH)
    assert caches.history_bytes_per_token(config) == 2.5 * (288 + 68) == 890
    rings = 40 * 128 * 528  # every layer's ring of FP8 rows
    pending = (3 * 2 + 1) * 2 * 512 * 4  # each KV source's open group of float32 projections
    assert caches.fixed_bytes_per_request(config) == rings + pending + 4 * 8  # Engram's last 3 ids and the new one's row


def test_the_state_is_stored_bytes_and_its_budget_counts_them():
    """The history in token blocks (block_bytes each), the rest in state slots (fixed_bytes_per_request each); one
    more block and slot are the decode steps' scratch (decode_plan.py)."""
    config = V41Config.from_dict(tiny_config())
    state = caches.allocate(config, 3, 16, 2, "cpu")
    paged = [t for layer in state.layers for t in (layer.entries, layer.index_keys) if t is not None]
    fixed = [t for layer in state.layers for t in (layer.ring, layer.pending) if t is not None] + [state.engram_ids]
    assert all(layer.ring.dtype == torch.uint8 for layer in state.layers) and all(t.shape[0] == 3 + 1 for t in paged)
    assert state.scratch_slot == 2 and all(t.shape[0] == 2 + 1 for t in fixed)
    assert (3 + 1) * caches.block_bytes(config, 16) == sum(t.numel() * t.element_size() for t in paged)
    assert (2 + 1) * caches.fixed_bytes_per_request(config) == sum(t.numel() * t.element_size() for t in fixed)
    assert caches.block_bytes(config, 16) == 16 * caches.history_bytes_per_token(config)
    with pytest.raises(ValueError, match="multiple of every DeepSeek-V4.1 compression ratio"):
        caches.allocate(config, 3, 15, 2, "cpu")


def test_deepinfer_runs_report_names_the_bytes_per_token_held():
    from deepinfer.engine.llm import LLM

    llm = LLM(model="tiny-v41", backend="reference", dtype="float32", max_model_len=256, announce=False)
    per_token, per_request = llm.cache_bytes_held()
    # tiny-v41: KV sources of ratio 2, 2 and 1 with 32-wide entries (18 B) and keys (17 B); ten rings of 128 33-byte rows
    assert per_token == (0.5 + 0.5 + 1) * (18 + 17) == 70
    assert per_request == 10 * 128 * 33 + (2 + 2 + 1) * 2 * 32 * 4 + 4 * 8  # Engram: its last 3 ids and the new one's row
