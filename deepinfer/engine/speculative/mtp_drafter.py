"""Drafts from the checkpoint's MTP layer (deepinfer.model.mtp), with its own paged cache.

The MTP cache row of position p needs token p+1 and the target's hidden state at p, so it is
written right after the target computes p and the token after it is known: over each prefill
chunk (the chunk's next prompt token, or the token just sampled), and over each verification's
accepted positions (the emitted tokens). That pass's last row gives draft 1 and the hidden state to
chain from. Drafts 2..k come at the start of the next step (`propose`), once the scheduler has
given the positions they write: draft j runs the layer at position c + j - 2 (c: the request's
computed tokens) on draft j-1 and the previous draft's output. Those chained rows are written
again with the target's hidden states when their positions are verified.

A draft's confidence is the layer's top-1 probability (softmax at temperature 1); drafts are the
argmax (the verification rule for point-mass drafts: deepinfer.ops.rejection_sampling).
"""

from __future__ import annotations

import dataclasses

import torch


class MTPDrafter:
    def __init__(self, model, runner):
        model.build_mtp_layers()  # fails now, with a one-line message, when the checkpoint has none
        self.model = model
        self.runner = runner
        self.cache = runner.draft_kv_caches[0]
        self.state: dict[int, tuple[int, float, torch.Tensor]] = {}  # seq_id -> (draft 1, its confidence, hidden to chain from)

    def _run(self, batch, prev_hidden):
        logits, hidden = self.model.forward_mtp(0, batch, prev_hidden, self.cache)
        confidence, token = torch.softmax(logits.float(), dim=-1).max(dim=-1)
        # one copy to the host for both (token ids < 2^24 are exact in float32)
        confidences, tokens = torch.stack((confidence, token.to(confidence.dtype))).tolist()
        return [int(t) for t in tokens], confidences, hidden

    def after_prefill(self, batch, forward_batch, target_hidden, samplers, sampled: list[int]) -> None:
        """The MTP pass over a prefill step's tokens; draft 1 for the sequences that sampled."""
        token_of = {seq.seq_id: t for seq, t in zip(samplers, sampled)}
        next_ids = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            following = seq.token_ids[start + 1 : start + n + 1]
            if len(following) < n:  # the chunk ends the sequence: the token after it was just sampled
                following.append(token_of[seq.seq_id])
            next_ids.extend(following)
        mtp_batch = dataclasses.replace(forward_batch, input_ids=torch.tensor(next_ids, dtype=torch.int64).to(forward_batch.input_ids.device))
        if not samplers:
            self.model.forward_mtp(0, dataclasses.replace(mtp_batch, logits_indices=mtp_batch.logits_indices[:0]), target_hidden, self.cache)
            return
        tokens, confidences, hidden = self._run(mtp_batch, target_hidden)
        rows = forward_batch.logits_indices
        for i, seq in enumerate(samplers):
            self.state[seq.seq_id] = (tokens[i], confidences[i], hidden[rows[i]])

    def after_verify(self, seqs, starts: list[int], emitted: list[list[int]], target_hidden: torch.Tensor, rows: list[list[int]]) -> None:
        """The MTP pass over the positions a verification computed and kept: sequence b's starts[b],
        starts[b] + 1, ... with the tokens that follow them (emitted[b]) and the target's hidden
        states (rows[b] of target_hidden)."""
        batch = self.runner.rows_batch(seqs, starts, emitted, last_only=True)
        index = torch.tensor([r for rs in rows for r in rs], dtype=torch.int64).to(target_hidden.device)
        tokens, confidences, hidden = self._run(batch, target_hidden[index])
        last = batch.logits_indices
        for i, seq in enumerate(seqs):
            self.state[seq.seq_id] = (tokens[i], confidences[i], hidden[last[i]])

    def propose(self, seqs, caps: list[int]) -> tuple[list[list[int]], list[list[float]]]:
        """Up to caps[b] drafts for each sequence, with their confidences."""
        drafts = [[self.state[s.seq_id][0]] if cap > 0 else [] for s, cap in zip(seqs, caps)]
        confidences = [[self.state[s.seq_id][1]] if cap > 0 else [] for s, cap in zip(seqs, caps)]
        hidden = {s.seq_id: self.state[s.seq_id][2] for s, cap in zip(seqs, caps) if cap > 1}
        for j in range(2, max(caps, default=0) + 1):
            active = [b for b, cap in enumerate(caps) if cap >= j]
            chain = [seqs[b] for b in active]
            starts = [s.num_computed_tokens + j - 2 for s in chain]
            batch = self.runner.rows_batch(chain, starts, [[drafts[b][-1]] for b in active])
            tokens, confs, out = self._run(batch, torch.stack([hidden[s.seq_id] for s in chain]))
            for i, b in enumerate(active):
                drafts[b].append(tokens[i])
                confidences[b].append(confs[i])
                hidden[seqs[b].seq_id] = out[i]
        return drafts, confidences

    def forget(self, seq_id: int) -> None:
        self.state.pop(seq_id, None)
