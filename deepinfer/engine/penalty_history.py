"""The token history of penalized requests, on the device: what `apply_penalties` reads.

One slot per running request with a penalty (SamplingParams.penalized), in two tables allocated
when the first such request samples: output_counts [slots, V] int32 (how many times it generated
each token) and prompt_mask [slots, ceil(V/32)] int32 (a bit per token of its prompt). A slot is
filled from the request's tokens when it is given (its first sampling step, or its first after a
preemption freed it), then kept up to date on the device: each step adds its sampled tokens to
their counts behind the sampling, so the host never sends a token list again and a step launched
before the previous one's tokens reached the host (overlap scheduling) still reads them.

A speculative verification's rows read their request's counts with the drafts before each row
added: a copy for the step (`with_tokens`); only the tokens the verification keeps are recorded.

Slots go back when their request is no longer running (finished, aborted or preempted): they are
reclaimed lazily, when a new request needs one. A preempted request that gets its slot back finds
its counts as it left them; one whose slot was taken is given another and refilled.
"""

from __future__ import annotations

import torch

from deepinfer.engine.sequence import Sequence, SequenceStatus


class PenaltyHistory:
    def __init__(self, num_slots: int, vocab_size: int, device: torch.device):
        """num_slots: the most requests that run at once (max_num_seqs)."""
        self.num_slots, self.vocab_size, self.device = num_slots, vocab_size, device
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None
        self.owners: list[Sequence | None] = [None] * num_slots
        self.slot_of_seq: dict[int, int] = {}

    def slot(self, seq: Sequence) -> int:
        """seq's slot, given (and filled from its tokens) if it has none."""
        slot = self.slot_of_seq.get(seq.seq_id)
        if slot is not None and self.owners[slot] is seq:
            return slot
        if self.output_counts is None:
            words = -(-self.vocab_size // 32)
            self.output_counts = torch.zeros(self.num_slots, self.vocab_size, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(self.num_slots, words, dtype=torch.int32, device=self.device)
        slot = self._free_slot()
        self.owners[slot] = seq
        self.slot_of_seq[seq.seq_id] = slot
        self._fill(slot, seq)
        return slot

    def _free_slot(self) -> int:
        for slot, owner in enumerate(self.owners):
            if owner is None or owner.status is not SequenceStatus.RUNNING:
                if owner is not None:
                    del self.slot_of_seq[owner.seq_id]
                    self.owners[slot] = None
                return slot
        raise RuntimeError(f"all {self.num_slots} penalty history slots are held by running requests")

    def _fill(self, slot: int, seq: Sequence) -> None:
        output = seq.output_token_ids
        if any(t < 0 for t in output):
            raise RuntimeError(f"{seq}: its penalty history is filled while one of its tokens is still being sampled")
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=self.vocab_size).to(torch.int32)
        bits = torch.zeros(self.prompt_mask.shape[1] * 32, dtype=torch.int64)
        bits[torch.tensor(seq.token_ids[: seq.num_prompt_tokens], dtype=torch.int64)] = 1
        words = (bits.view(-1, 32) << torch.arange(32)).sum(dim=1)
        self.output_counts[slot].copy_(counts)
        self.prompt_mask[slot].copy_(torch.where(words >= 2**31, words - 2**32, words).to(torch.int32))

    def with_tokens(self, slots: list[int], extra: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slots, output_counts, prompt_mask) for rows whose history runs past their slot's (a
        speculative verification's rows, each after the drafts before it): a table row per row with a
        slot (slots[r] >= 0), its slot's counts plus the tokens extra[r], and its slot's prompt bits;
        rows without a slot keep -1. Gathered on the device: [rows with a slot, V] int32 for the step."""
        held = [r for r, slot in enumerate(slots) if slot >= 0]
        index = torch.tensor([slots[r] for r in held], dtype=torch.int64).to(self.device, non_blocking=True)
        counts = self.output_counts.index_select(0, index)
        rows = [i for i, r in enumerate(held) for _ in extra[r]]
        if rows:
            tokens = torch.tensor([t for r in held for t in extra[r]], dtype=torch.int64)
            counts.index_put_((torch.tensor(rows).to(self.device), tokens.to(self.device)), torch.ones(len(rows), dtype=torch.int32, device=self.device),
                              accumulate=True)  # fmt: skip
        table_slots = [-1] * len(slots)
        for i, r in enumerate(held):
            table_slots[r] = i
        return torch.tensor(table_slots, dtype=torch.int64).to(self.device, non_blocking=True), counts, self.prompt_mask.index_select(0, index)

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count the sampled tokens of the rows with a slot (slots [B] int64 on the device, -1 for
        rows without one; tokens [B] int64, -1 for a row that kept no token: a speculative
        verification's rows after a rejected draft): on the device, behind the sampling, no host wait."""
        held = (slots >= 0) & (tokens >= 0)
        # Rows without a slot or a token add 0 (at slot 0, token 0 where they name none): the same shapes every step, no host look.
        self.output_counts.index_put_((slots.clamp(min=0), tokens.clamp(min=0)), held.to(torch.int32), accumulate=True)
