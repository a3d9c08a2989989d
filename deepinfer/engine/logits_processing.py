"""What runs on a step's logits between the model and `sample`, for the requests that ask for it:
structured output, allowed_token_ids, bad_words, min_tokens, logit_bias and the penalties, through
registry ops.

Order (vLLM's), on the model's float32 logits, in place:
  0. apply_token_bitmask: tokens the request's grammar does not allow next -> -inf (structured
     output: the masks are filled on the host by llguidance, deepinfer.engine.structured_output,
     into one int32 bitmask [rows, ceil(V/32)], all ones for the free rows: `GrammarMasks`);
  1. apply_token_bitmask: tokens outside allowed_token_ids -> -inf;
  2. apply_token_bias: bad-word bans (their preceding tokens matched on the device against each
     row's last generated tokens), min_tokens' bans of EOS and the stop token ids, logit_bias;
  3. apply_penalties: repetition, frequency, presence, from the token history on the device
     (deepinfer.engine.penalty_history);
then `sample` (temperature, top-k, top-p, min-p) draws from the result, and the sampled tokens are
counted into the history. A speculative verification brings several rows per request: row i is
processed as the step after the drafts before it would be (`plan`'s drafts), and `rejection_sample`
draws from the result. Requests without these options are rows the ops leave alone; a step in
which no request has any runs none of them, so it samples exactly as before.

The host's part per step is small: each row's entries were listed when its request was queued
(deepinfer.engine.token_constraints) and are only concatenated; a row's last generated tokens come
from its token list, the newest one from the step's input on the device (with overlap scheduling
the host does not know it yet). Steps that process logits run eagerly, never as a device graph
(`needs_processing` tells the runner): the graphs hold no buffers for these inputs, and steps
without them keep the graphs' speed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.engine.penalty_history import PenaltyHistory
from deepinfer.engine.sequence import Sequence, SequenceStatus


def needs_processing(seq: Sequence) -> bool:
    """Whether seq's next token needs any of the steps above (min_tokens only until it is met)."""
    params = seq.params
    constraints = seq.constraints
    if params.penalized or (params.allowed_token_ids is not None) or seq.grammar is not None:
        return True
    if constraints is None:
        return False
    return bool(constraints.tokens.numel()) or seq.num_output_tokens < constraints.min_tokens


class GrammarMasks:
    """A step's grammar bitmask: filled on the host into one reused buffer (pinned where the device
    runs behind the host), then one non_blocking copy to the device. `plan` runs after the step's
    forward is launched, so on an asynchronous backend the host fills the masks while the device
    runs the forward, and the copy queues behind it, ahead of the step's sampling."""

    def __init__(self, device: torch.device, vocab_size: int, pinned: bool):
        self.device, self.words, self.pinned = device, -(-vocab_size // 32), pinned
        self._host: torch.Tensor | None = None  # [rows, words] int32, grown to the largest step
        self._copied = None  # an event after the last copy out of _host: refill only once it has passed
        self.copies = 0  # host -> device copies issued (one per step with a grammar row)

    def fill(self, num_rows: int, rows: list) -> torch.Tensor:
        """The device bitmask [num_rows, words]: rows' (row, SequenceGrammar, drafts) masks filled by
        llguidance (structured_output.fill_bitmasks), every other row all ones."""
        from deepinfer.engine.structured_output import fill_bitmasks

        if self._copied is not None:
            self._copied.synchronize()
        if self._host is None or self._host.shape[0] < num_rows:
            self._host = torch.empty((num_rows, self.words), dtype=torch.int32, pin_memory=self.pinned)
        host = self._host[:num_rows]
        host.fill_(-1)
        fill_bitmasks(rows, host)
        self.copies += 1
        mask = host.to(self.device, non_blocking=True)
        if self.pinned:
            self._copied = torch.Event(device=self.device)
            self._copied.record()
        elif mask.data_ptr() == host.data_ptr():  # on the host already (the CPU): not the buffer the next step refills
            mask = mask.clone()
        return mask


@dataclass
class StepProcessing:
    """One step's inputs to the processing ops, on the device (None: that op does not run)."""

    allowed: torch.Tensor | None  # [B, ceil(V/32)] int32 bitmask
    grammar: torch.Tensor | None  # [B, ceil(V/32)] int32 bitmask of the grammars' next tokens (-1: a row without one)
    bias: tuple[torch.Tensor, ...] | None  # rows, tokens, values, prefixes, recent tokens (newest patched in at apply)
    newest: tuple[torch.Tensor, torch.Tensor] | None  # each row's last input row [B] and whether it generated a token [B]
    penalties: tuple[torch.Tensor, ...] | None  # slots (in the history), presence, frequency, repetition
    # rows whose history runs past their slot's (drafts before them): slots into tables of their own,
    # the output counts and prompt mask (PenaltyHistory.with_tokens); None: the history's tables
    tables: tuple[torch.Tensor, ...] | None = None


class LogitsProcessing:
    def __init__(self, ops, device: torch.device, vocab_size: int, max_num_seqs: int, pin_host_buffers: bool = False):
        """pin_host_buffers: the host buffers the device reads (grammar masks) are pinned (the device runs behind the host)."""
        self.ops, self.device, self.vocab_size, self.pin_host_buffers = ops, device, vocab_size, pin_host_buffers
        self.history = PenaltyHistory(max_num_seqs, vocab_size, device)
        self._everything_allowed: torch.Tensor | None = None  # [ceil(V/32)] int32 of -1, on the device
        self.grammar_masks = GrammarMasks(device, vocab_size, pin_host_buffers)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    def plan(self, samplers: list[Sequence], input_rows: list[int], drafts: list[list[int]] | None = None) -> StepProcessing | None:
        """This step's processing inputs (input_rows: each sampler's last input row); None when no
        sampler needs any. drafts (a speculative verification): sampler b brings 1 + len(drafts[b])
        logits rows, the input rows input_rows[b], input_rows[b] + 1, ..., and row i is processed as
        the step after b's tokens then drafts[b][:i] would be (its penalties, min_tokens and bad-word
        prefixes count those drafts)."""
        if not any(needs_processing(seq) for seq in samplers):
            return None
        if drafts is None:
            seqs, extra, rows = samplers, [[]] * len(samplers), input_rows
        else:  # a row per verified position: its sequence, the drafts before it, its input row
            seqs = [seq for seq, d in zip(samplers, drafts) for _ in range(len(d) + 1)]
            extra = [d[:i] for d in drafts for i in range(len(d) + 1)]
            rows = [row + i for row, d in zip(input_rows, drafts) for i in range(len(d) + 1)]
        bias = self._bias(seqs, extra)
        newest = None
        if bias is not None and bias[4].shape[1]:  # prefixes to match: the newest token comes from the input on the device
            generated = torch.tensor([seq.num_output_tokens + len(e) > 0 for seq, e in zip(seqs, extra)])
            newest = (self._to_device(torch.tensor(rows, dtype=torch.int64)), self._to_device(generated))
        penalties, tables = self._penalties(seqs, extra)
        grammar = self._grammar(samplers, drafts)
        return StepProcessing(allowed=self._allowed(seqs), grammar=grammar, bias=bias, newest=newest, penalties=penalties, tables=tables)

    def _allowed(self, samplers: list[Sequence]) -> torch.Tensor | None:
        masks = [seq.constraints.allowed if seq.constraints is not None else None for seq in samplers]
        if all(m is None for m in masks):
            return None
        if self._everything_allowed is None:
            self._everything_allowed = torch.full((-(-self.vocab_size // 32),), -1, dtype=torch.int32, device=self.device)
        rows = []
        for seq, mask in zip(samplers, masks):
            if mask is not None and mask.device != self.device:
                seq.constraints.allowed = mask = self._to_device(mask)  # moved once, kept on the device
            rows.append(self._everything_allowed if mask is None else mask)
        return torch.stack(rows)

    def _grammar(self, samplers: list[Sequence], drafts: list[list[int]] | None) -> torch.Tensor | None:
        """The grammar rows' masks, filled on the host into one bitmask and moved once (GrammarMasks);
        with drafts, sampler b's 1 + len(drafts[b]) rows, each the mask after the drafts before it.
        A sequence no longer running (overlap scheduling: it stopped, or its grammar failed, at the
        step before, after this step was launched) gets all ones: its matcher may be terminated,
        and its token is dropped."""
        drafts = drafts if drafts is not None else [[]] * len(samplers)
        rows, first = [], 0
        for seq, d in zip(samplers, drafts):
            if seq.grammar is not None and seq.status is SequenceStatus.RUNNING:
                rows.append((first, seq.grammar, d))
            first += 1 + len(d)
        if not rows:
            return None
        return self.grammar_masks.fill(first, rows)

    def _bias(self, samplers: list[Sequence], extra: list[list[int]]) -> tuple[torch.Tensor, ...] | None:
        per_row = [seq.constraints.entries(seq.num_output_tokens + len(e)) if seq.constraints is not None else None for seq, e in zip(samplers, extra)]
        counts = [0 if e is None else e[0].numel() for e in per_row]
        if not any(counts):
            return None
        width = max(seq.constraints.width for seq in samplers if seq.constraints is not None)
        kept = [e for e in per_row if e is not None and e[0].numel()]
        rows = torch.repeat_interleave(torch.arange(len(samplers)), torch.tensor(counts))
        tokens = torch.cat([e[0] for e in kept])
        values = torch.cat([e[1] for e in kept])
        prefixes = torch.cat([torch.nn.functional.pad(e[2], (width - e[2].shape[1], 0), value=-1) for e in kept])
        # Each row's last `width` generated tokens (its drafts included), oldest first, -1 where
        # fewer; the newest is taken from the step's input on the device when the row is processed.
        recent = torch.full((len(samplers), width), -1, dtype=torch.int64)
        if width:
            for b, (seq, e) in enumerate(zip(samplers, extra)):
                tail = (seq.output_token_ids[-width:] + e)[-width:]
                if tail:
                    recent[b, width - len(tail) :] = torch.tensor(tail)
        return tuple(self._to_device(t) for t in (rows, tokens, values, prefixes, recent))

    def _penalties(self, samplers: list[Sequence], extra: list[list[int]]) -> tuple[tuple[torch.Tensor, ...] | None, tuple[torch.Tensor, ...] | None]:
        """(penalties, tables): see StepProcessing. A sequence no longer running (overlap
        scheduling, as in `_grammar`) gets no slot: its dropped token is not counted, and a slot it
        gave up is never taken back."""
        if not any(seq.params.penalized for seq in samplers):
            return None, None
        slots = [self.history.slot(seq) if seq.params.penalized and seq.status is SequenceStatus.RUNNING else -1 for seq in samplers]
        params = [seq.params for seq in samplers]
        penalties = (
            self._to_device(torch.tensor(slots, dtype=torch.int64)),
            self._to_device(torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)),
            self._to_device(torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)),
            self._to_device(torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)),
        )
        drafted = any(e for slot, e in zip(slots, extra) if slot >= 0)
        return penalties, self.history.with_tokens(slots, extra) if drafted else None

    def apply(self, logits: torch.Tensor, step: StepProcessing, input_ids: torch.Tensor) -> torch.Tensor:
        """Run the step's processing on its samplers' float32 logits [B, V], in place (input_ids:
        the step's input tokens on the device)."""
        ops = self.ops
        if step.grammar is not None:
            ops.apply_token_bitmask(logits=logits, bitmask=step.grammar)
        if step.allowed is not None:
            ops.apply_token_bitmask(logits=logits, bitmask=step.allowed)
        if step.bias is not None:
            rows, tokens, values, prefixes, recent = step.bias
            if step.newest is not None:
                input_rows, generated = step.newest
                recent[:, -1] = torch.where(generated, input_ids.index_select(0, input_rows), -1)
            ops.apply_token_bias(logits=logits, rows=rows, tokens=tokens, values=values, prefixes=prefixes, recent_tokens=recent)
        if step.penalties is not None:
            slots, presence, frequency, repetition = step.penalties
            counts, prompt_mask = self.history.output_counts, self.history.prompt_mask
            if step.tables is not None:
                slots, counts, prompt_mask = step.tables
            ops.apply_penalties(
                logits=logits, slots=slots, output_counts=counts, prompt_mask=prompt_mask,
                presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
            )  # fmt: skip
        return logits

    def after_sampling(self, step: StepProcessing, tokens: torch.Tensor) -> None:
        """Count the step's sampled tokens into the penalized rows' history (on the device; a row
        without a token, -1, counts nothing)."""
        if step.penalties is not None:
            self.history.record(step.penalties[0], tokens)
