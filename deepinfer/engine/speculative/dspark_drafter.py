"""Drafts from DeepSeek-V4.1's DSpark blocks (deepinfer.model.deepseek_v41.dspark): one block of drafts per request.

DSpark drafts `dspark_block_size` tokens at once from the target's features of the window before an anchor
(the newest token, not yet computed by the target). Each request keeps its context keys in its state slot's
ring (the model's draft cache): after every target step they are written for the positions it computed and
kept, from the target features that step returned (every prefill row; a verification's accepted rows), and
the block is drafted at once, anchored at the token just emitted. `propose` hands out the first drafts of it.

Drafts are the greedy tokens of each slot (the verification rule for point-mass drafts, as for MTP:
deepinfer.ops.rejection_sampling); each comes with the confidence head's probability that it is accepted given
the drafts before it were, which the `head` policy reads as is.
"""

from __future__ import annotations

import torch


class DSparkDrafter:
    def __init__(self, model, runner):
        self.model = model
        self.runner = runner
        self.dspark = model.build_dspark()
        self.context = runner.draft_kv_caches[0]  # [slots, stages, window, head_dim] (model.new_draft_caches)
        self.state: dict[int, tuple[list[int], list[float]]] = {}  # seq_id -> (its drafts, their confidences)

    def _keep_context(self, slots: list[int], positions: list[list[int]], features: torch.Tensor, rows: list[list[int]]) -> None:
        """Write the context keys of sequence b's positions[b] (target features at rows[b]) into its slot's ring;
        only the last window of each, the rest would be overwritten."""
        window = self.dspark.window
        picked = [(s, p, r) for s, ps, rs in zip(slots, positions, rows) for p, r in list(zip(ps, rs))[-window:]]
        if not picked:
            return
        device = features.device
        slot_t, position_t, row_t = (torch.tensor(v, dtype=torch.int64, device=device) for v in zip(*picked))
        keys = self.dspark.context_kv(self.runner.ops, features[row_t], position_t)  # [stages, N, head_dim]
        self.context[slot_t, :, position_t % window] = keys.transpose(0, 1).to(self.context.dtype)

    def _draft(self, seqs, anchors: list[int], anchor_positions: list[int]) -> None:
        device, window = self.context.device, self.dspark.window
        slots = torch.tensor([s.state_slot for s in seqs], dtype=torch.int64, device=device)
        anchor_t = torch.tensor(anchors, dtype=torch.int64, device=device)
        at = torch.tensor(anchor_positions, dtype=torch.int64, device=device)
        positions = at[:, None] - window + torch.arange(window, device=device)  # a - window .. a - 1
        context = self.context[slots[:, None], :, positions % window]  # [B, window, stages, head_dim]
        ops = self.runner.ops
        h = self.dspark.hidden(ops, anchor_t, at, context.permute(2, 0, 1, 3), positions >= 0)
        tokens, confidences, _ = self.dspark.draft(ops, h, anchor_t)
        # one copy to the host for both (token ids < 2^24 are exact in float32)
        tokens, confidences = torch.stack((tokens.to(confidences.dtype), confidences)).tolist()
        for seq, t, c in zip(seqs, tokens, confidences):
            self.state[seq.seq_id] = ([int(x) for x in t], c)

    def after_prefill(self, batch, forward_batch, features, samplers, sampled: list[int]) -> None:
        """Keep the context of the step's rows; draft a block for the sequences that sampled (anchor: the token sampled)."""
        slots, positions, rows, offset, ends = [], [], [], 0, {}
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            slots.append(seq.state_slot)
            positions.append(list(range(start, start + n)))
            rows.append(list(range(offset, offset + n)))
            offset += n
            ends[seq.seq_id] = start + n  # the sampled token's position: the anchor's
        self._keep_context(slots, positions, features, rows)
        if samplers:
            self._draft(samplers, sampled, [ends[seq.seq_id] for seq in samplers])

    def after_verify(self, seqs, starts: list[int], emitted: list[list[int]], features: torch.Tensor, rows: list[list[int]]) -> None:
        """Keep the context of the positions a verification computed and kept (starts[b] ..., features at rows[b]);
        draft each sequence's next block, anchored at its last emitted token."""
        positions = [list(range(start, start + len(e))) for start, e in zip(starts, emitted)]
        self._keep_context([s.state_slot for s in seqs], positions, features, rows)
        self._draft(seqs, [e[-1] for e in emitted], [start + len(e) for start, e in zip(starts, emitted)])

    def propose(self, seqs, caps: list[int]) -> tuple[list[list[int]], list[list[float]]]:
        """Up to caps[b] drafts for each sequence (its block's first ones), with their confidences."""
        drafts = [self.state[s.seq_id][0][:cap] for s, cap in zip(seqs, caps)]
        confidences = [self.state[s.seq_id][1][:cap] for s, cap in zip(seqs, caps)]
        return drafts, confidences

    def forget(self, seq_id: int) -> None:
        self.state.pop(seq_id, None)
