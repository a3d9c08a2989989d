"""The forwards the cost model times at start-up: T one-token sequences at position 0, all writing
one slot of a block nobody holds yet (its rows are rewritten when it is handed out)."""

from __future__ import annotations

import torch

from deepinfer.bench.device_api import synchronize
from deepinfer.model.forward_batch import ForwardBatch, HostBatch


class CostProbe:
    def __init__(self, runner, model, block_manager):
        self.runner, self.model = runner, model
        self.device = runner.device
        self.block = block_manager.num_blocks - 1  # free at start-up, and handed out last
        self.hidden = None  # the last target probe's hidden states (the draft probe's input)

    def _batch(self, tokens: int) -> ForwardBatch:
        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(self.device)

        slot = self.block * self.runner.block_size
        return ForwardBatch(
            is_prefill=False,
            input_ids=tensor([0] * tokens, torch.int64),
            positions=tensor([0] * tokens, torch.int64),
            slot_mapping=tensor([slot] * tokens, torch.int64),
            cu_seqlens_q=tensor(list(range(tokens + 1)), torch.int32),
            seq_lens=tensor([1] * tokens, torch.int32),
            block_tables=tensor([[self.block]] * tokens, torch.int32),
            logits_indices=tensor(list(range(tokens)), torch.int64),
            host=HostBatch(starts=[0] * tokens, lengths=[1] * tokens, cached=[0] * tokens, slots=[-1] * tokens, pages=[[self.block]] * tokens),
        )

    @torch.inference_mode()
    def target(self, tokens: int) -> None:
        _, self.hidden = self.model.forward(self._batch(tokens), self.runner.kv_caches, hidden_states=True)

    @torch.inference_mode()
    def draft(self, tokens: int) -> None:
        """The MTP pass over the last target probe's hidden states (of the model's own shape: V4's are
        residual streams), as many rows as it had."""
        hidden = self.hidden[:tokens]
        self.model.forward_mtp(0, self._batch(hidden.shape[0]), hidden, self.runner.draft_kv_caches[0])

    def synchronize(self) -> None:
        synchronize(self.device)
