"""What the engine hands the model for one step: the contract between engine/ and model/."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class HostBatch:
    """The step's per-sequence facts on the host, for models that plan cache rows there (DeepSeek-V4, every step
    but a decode step, which it plans on the device; a device graph's batch has none)."""

    starts: list[int]  # position of each sequence's first new token
    lengths: list[int]  # its new tokens
    cached: list[int]  # positions below this have their KV in the cache already (a prefix hit's replayed tokens)
    slots: list[int]  # its state slot (-1: the model keeps no per-sequence state)
    pages: list[list[int]]  # its block table
    # DeepSeek-V4.1's decoder SWA bounded replay: each sequence's first position its decoder layers compute (the
    # model's `decoder_replay_start`); None: every layer computes every position.
    decoder_from: list[int] | None = None
    # Host tensors -> the same on the model's device through one copy that does not wait (the engine's staging:
    # pinned where the device runs behind the host); None: each tensor copied on its own. [(tensor, dtype)] -> tensors.
    upload: Callable[[list[tuple[torch.Tensor, torch.dtype]]], list[torch.Tensor]] | None = None


@dataclass
class ForwardBatch:
    """One forward step over B sequences and T new tokens, all on the model's device.

    A step is either a prefill step (each sequence brings a chunk of new prompt tokens, possibly
    after a cached prefix) or a decode step (each sequence brings `tokens_per_seq` tokens, 1 unless
    speculative decoding verifies drafts).
    """

    is_prefill: bool
    input_ids: torch.Tensor  # [T] int64, the new tokens of every sequence, concatenated
    positions: torch.Tensor  # [T] int64, each new token's position in its sequence
    slot_mapping: torch.Tensor  # [T] int64, the KV-cache slot each new token is written to
    cu_seqlens_q: torch.Tensor  # [B+1] int32, prefix sums of new tokens per sequence
    seq_lens: torch.Tensor  # [B] int32, tokens in the cache per sequence after this step's writes
    block_tables: torch.Tensor  # [B, max_blocks] int32, pages of each sequence (padding: 0)
    logits_indices: torch.Tensor  # [B'] int64, rows of T whose logits are wanted (last token of each sequence that samples)
    max_query_len: int = 1  # host-side max of new tokens per sequence
    max_seq_len: int = 1  # host-side max of seq_lens
    host: HostBatch | None = None
    state_slots: torch.Tensor | None = None  # [B] int32, each sequence's state slot (-1: none; DeepSeek-V4's compressor rings)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])
