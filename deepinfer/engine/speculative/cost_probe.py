"""The forwards the cost model times at start-up: T tokens as sequences at position 0 onwards, all
writing slots of a block nobody holds yet (its rows are rewritten when it is handed out).

Eagerly, T one-token sequences. With device graphs a verification step is a graph replay of
(batch bucket, S rows per sequence), so T is timed as such a replay: S = ceil(T / the largest
bucket), ceil(T / S) sequences (the replay also captures that graph at start-up)."""

from __future__ import annotations

import torch

from deepinfer.bench.device_api import synchronize
from deepinfer.model.forward_batch import ForwardBatch, HostBatch


class CostProbe:
    def __init__(self, runner, model, block_manager, dspark: bool = False):
        """dspark: the draft timed is DeepSeek-V4.1's DSpark block (model.build_dspark), not an MTP pass."""
        self.runner, self.model = runner, model
        self.dspark = model.build_dspark() if dspark else None
        self.device = runner.device
        self.block = block_manager.num_blocks - 1  # free at start-up, and handed out last
        self.hidden = None  # the last target probe's hidden states (the draft probe's input)

    def _batch(self, seqs: int, per_seq: int = 1) -> ForwardBatch:
        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(self.device)

        bs = self.runner.block_size
        pages = [self.block] * -(-per_seq // bs)
        rows = seqs * per_seq
        return ForwardBatch(
            is_prefill=False,
            input_ids=tensor([0] * rows, torch.int64),
            positions=tensor(list(range(per_seq)) * seqs, torch.int64),
            slot_mapping=tensor([self.block * bs + p % bs for p in range(per_seq)] * seqs, torch.int64),
            cu_seqlens_q=tensor([b * per_seq for b in range(seqs + 1)], torch.int32),
            seq_lens=tensor([per_seq] * seqs, torch.int32),
            block_tables=tensor([pages] * seqs, torch.int32),
            logits_indices=tensor(list(range(rows)), torch.int64),
            max_query_len=per_seq,
            max_seq_len=per_seq,
            host=HostBatch(starts=[0] * seqs, lengths=[per_seq] * seqs, cached=[0] * seqs, slots=[-1] * seqs, pages=[pages] * seqs),
        )

    @torch.inference_mode()
    def target(self, tokens: int) -> None:
        graphs = self.runner.graphs
        if graphs is not None:
            per_seq = -(-tokens // graphs.buckets[-1])
            seqs = -(-tokens // per_seq)
            if graphs.rows_replayable(seqs, per_seq):
                _, self.hidden = graphs.run_rows(self._batch(seqs, per_seq), per_seq)
                return
        _, self.hidden = self.model.forward(self._batch(tokens), self.runner.kv_caches, hidden_states=True)

    @torch.inference_mode()
    def draft(self, tokens: int) -> None:
        """The MTP pass over the last target probe's hidden states (of the model's own shape: V4's are
        residual streams), as many rows as it had; DSpark: a block for each of `tokens` requests, over a
        full window of context keys (the last target probe's features, keyed)."""
        if self.dspark is not None:
            self._dspark_blocks(tokens)
            return
        hidden = self.hidden[:tokens]
        self.model.forward_mtp(0, self._batch(hidden.shape[0]), hidden, self.runner.draft_kv_caches[0])

    def _dspark_blocks(self, requests: int) -> None:
        dspark, ops = self.dspark, self.runner.ops
        window = dspark.window
        rows = self.hidden[torch.arange(window, device=self.device) % self.hidden.shape[0]]
        keys = dspark.context_kv(ops, rows, torch.arange(window, device=self.device))  # [stages, window, head_dim]
        context = keys[:, None].expand(-1, requests, -1, -1)
        anchors = torch.zeros(requests, dtype=torch.int64, device=self.device)
        positions = torch.full((requests,), window, dtype=torch.int64, device=self.device)
        visible = torch.ones(requests, window, dtype=torch.bool, device=self.device)
        dspark.draft(ops, dspark.hidden(ops, anchors, positions, context, visible), anchors)

    def synchronize(self) -> None:
        synchronize(self.device)
