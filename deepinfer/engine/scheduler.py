"""Continuous batching: each step is either a prefill step or a decode step (nano-vllm's shape).

Prefill first: sequences part-way through their prompt continue, then waiting sequences are
admitted in request order while KV pages, `max_num_seqs` and the step's token budget
(`max_num_batched_tokens`) allow; a prompt longer than the remaining budget is cut into chunks
(chunked prefill) and continues in the next steps. When nothing can prefill, every running sequence
decodes one token. A decode that needs a new page when none is free preempts the newest running
sequence: its pages are freed and it waits to be recomputed (its prefix may still be cached).
The oldest request always progresses, so the engine cannot livelock.

When the block manager keeps state snapshots (a model whose per-sequence state a prefix hit must restore:
DeepSeek-V4.1), a prompt's chunks end on block boundaries where they can, vLLM's "align" mode: a chunk cut
by the budget ends at the last boundary inside it, and every prompt ends a chunk at its last full block
and at its hit limit's block (the bounded replay's tail start), so the states a later hit needs exist.

Deterministic mode admits a request only when the pages for its longest possible length (prompt +
max_tokens, capped by the model's length) fit beside what the running sequences may still take, so
no decode ever runs out of pages and nothing is preempted: a recomputed request would rebuild its
generated tokens' keys by prefill, whose arithmetic is not decode's.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

from deepinfer.engine.block_manager import BlockManager, blocks_for
from deepinfer.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    is_prefill: bool  # a prefill step (run on the prefill path), decode rows possibly mixed in
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence: tokens computed this step
    num_decodes: int = 0  # a mixed step: its first num_decodes sequences decode one token each

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens computed this step (a prefill step's tokens but its mixed-in decode rows)."""
        return self.num_tokens - self.num_decodes if self.is_prefill else 0


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 final_length: Callable[[Sequence], int] | None = None, lookahead: Callable[[Sequence], int] | None = None,
                 mixed_steps: bool = False):  # fmt: skip
        """final_length: a sequence's longest possible length; given, admission reserves pages up to
        it for every running sequence (deterministic mode: never preempt). lookahead: positions
        past its last token a decode step may write (speculative decoding's drafts; None: 0).
        mixed_steps: a prefill step also decodes one token of every running sequence that is past
        its prompt (those tokens first, the prompt chunks in the rest of the token budget), so a
        long prompt does not stall the requests already generating."""
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"need max_num_seqs >= 1 and max_num_batched_tokens >= 1, got {max_num_seqs} and {max_num_batched_tokens}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # by Sequence.order: preempted sequences go back in request order
        self.running: list[Sequence] = []  # by Sequence.order: the newest is preempted first
        self.num_preemptions = 0
        self.final_length = final_length
        self.mixed_steps = mixed_steps
        self.lookahead = lookahead or (lambda seq: 0)
        # the KV tiers (deepinfer.kv_tiers.tiered_cache): a waiting sequence whose prefix is being loaded from a tier is
        # not admissible yet (later ones go ahead: it waits on a copy, not on pages); told when one is admitted
        self.tiers = None

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.order)

    def remove_waiting(self, seqs: list[Sequence]) -> None:
        """Take seqs (those of them that are queued) out of the waiting queue, in one pass over it:
        aborting a request of n samples costs one pass, not n."""
        if seqs and self.waiting:
            gone = {id(seq) for seq in seqs}
            self.waiting[:] = [seq for seq in self.waiting if id(seq) not in gone]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledBatch | None:
        decodes = self._decodes_to_mix()
        budget = self.max_num_batched_tokens - len(decodes)
        seqs, chunks = [], []
        for seq in self.running:  # part-way through their prompt
            if seq.is_prefilling and budget > 0:
                chunk = self._chunk(seq, budget)
                seqs.append(seq), chunks.append(chunk)
                budget -= chunk
        at = reserved = 0
        while at < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[at]
            if self.tiers is not None and not self.tiers.admissible(seq):
                reserved += self.tiers.reserved_blocks(seq)
                at += 1  # its prefix is on its way from a KV tier: later requests go ahead, leaving the blocks its copy waits for
                continue
            if not self._fits_now(seq, reserved):
                break  # in order: a later, smaller request does not overtake
            self.waiting.pop(at)
            self.block_manager.allocate(seq)
            if self.tiers is not None:
                self.tiers.admitted(seq)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = seq.num_cached_kv
            seq.prefill_target = seq.num_tokens
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.order)
            chunk = self._chunk(seq, budget)
            seqs.append(seq), chunks.append(chunk)
            budget -= chunk
        if not seqs:
            return None
        return ScheduledBatch(True, decodes + seqs, [1] * len(decodes) + chunks, num_decodes=len(decodes))

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """seq's next prompt chunk within `budget` tokens: all it can take, ended on a block boundary when the block
        manager keeps snapshots (module docstring) and the chunk reaches past one."""
        start, target = seq.num_computed_tokens, seq.prefill_target
        end = min(target, start + budget)
        bm = self.block_manager
        if bm.snapshots is None:
            return end - start
        bs = bm.block_size
        stops = [target // bs * bs] + ([bm.hit_limit(seq) // bs * bs] if bm.hit_limit is not None else [])
        for stop in sorted(stops):
            if start < stop < end:
                return stop - start
        if end < target and end // bs * bs > start:  # cut by the budget: back to the last boundary
            end = end // bs * bs
        return end - start

    def _decodes_to_mix(self) -> list[Sequence]:
        """The running sequences past their prompt, each with its slot for one more token, when a
        mixed step may take them: all of them fit the pages without preempting and leave part of
        the token budget to prompts. Else none (a prefill step alone, as without mixing)."""
        if not self.mixed_steps:
            return []
        decodes = [seq for seq in self.running if not seq.is_prefilling]
        if not decodes or len(decodes) >= self.max_num_batched_tokens or not self._prefill_due():
            return []  # (no prompt to prefill: a decode step, with its own checks, follows)
        return decodes if self._slots_for_all(decodes) else []

    def _slots_for_all(self, seqs: list[Sequence]) -> bool:
        """Give every one of seqs its slot for one more token when the free pages go round without
        preempting (True); else change nothing (False)."""
        bm = self.block_manager
        if sum(bm.new_blocks_needed(seq) for seq in seqs) > bm.num_free_blocks:
            return False
        for seq in seqs:
            bm.append_slot(seq)
        return True

    def schedule_decode_ahead(self, leaving: set[int]) -> ScheduledBatch | None:
        """The next decode step, scheduled while the step before it still runs (overlap scheduling):
        every running sequence but those `leaving` (seq ids that the step in flight ends by length).
        None when the step should wait for the one in flight instead: a prefill is due (its first
        token is not pending), nothing is left, or the pages would not go round without preempting."""
        if self._prefill_due():
            return None
        seqs = [seq for seq in self.running if seq.seq_id not in leaving]
        if not seqs or not self._slots_for_all(seqs):
            return None
        return ScheduledBatch(False, seqs, [1] * len(seqs))

    def _prefill_due(self) -> bool:
        """Whether `schedule` would prefill now: a running prompt not finished, or an admissible waiting one."""
        return any(seq.is_prefilling for seq in self.running) or self.has_admissible()

    def has_admissible(self) -> bool:
        """Whether the first waiting request would be admitted now."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return False
        reserved = 0
        for seq in self.waiting:
            if self.tiers is not None and not self.tiers.admissible(seq):
                reserved += self.tiers.reserved_blocks(seq)  # (as _schedule_prefill)
                continue
            return self._fits_now(seq, reserved)
        return False

    def _fits_now(self, seq: Sequence, reserved: int) -> bool:
        """Whether seq's pages fit now, leaving free the `reserved` blocks earlier requests' tier loads wait for (unless
        seq holds loaded blocks itself: admitting it frees the pool sooner), and, with a final length, to its end."""
        keep_free = 0 if self.tiers is None or self.tiers.holds_loaded(seq) else reserved
        return self.block_manager.can_allocate(seq, keep_free) and (self.final_length is None or self._fits_to_the_end(seq))

    def _fits_to_the_end(self, seq: Sequence) -> bool:
        """seq's pages up to its final length fit beside the pages the running sequences may still take."""
        bm = self.block_manager
        owed = sum(max(0, blocks_for(self.final_length(s), bm.block_size) - len(s.block_table)) for s in self.running)
        hits = bm.cached_prefix(seq)
        revived = sum(1 for b in hits if bm.blocks[b].ref_count == 0)  # cached but free: they leave the free queue
        need = blocks_for(self.final_length(seq), bm.block_size) - len(hits) + revived
        return need + owed <= bm.num_free_blocks

    def _schedule_decode(self) -> ScheduledBatch:
        scheduled = []
        queue = list(self.running)
        while queue:
            seq = queue.pop(0)
            ahead = self.lookahead(seq)
            while not self.block_manager.can_append(seq, ahead):
                if self.tiers is not None and self.tiers.release_loads(look_again=True):
                    continue  # blocks held for waiting requests' tier loads go first: they stay cached
                victim = queue.pop() if queue else seq
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.append_slot(seq, ahead)
                scheduled.append(seq)
        # Requests are checked to fit the cache alone, so the oldest one always gets its page (the waiting ones may all
        # be loading their prefix from a KV tier: an empty step, LLMEngine.step waits for the tiers instead).
        assert scheduled or not self.running and (not self.waiting or self.tiers is not None), "scheduler made no progress"
        return ScheduledBatch(False, scheduled, [1] * len(scheduled))

    def preempt(self, seq: Sequence) -> None:
        """Free seq's pages; it goes back to waiting and is recomputed later (preemption by recompute)."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.prefill_target = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def commit(self, batch: ScheduledBatch) -> None:
        """After the forward pass: the scheduled tokens' KV is in the cache."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            old = seq.num_computed_tokens
            seq.num_computed_tokens += n
            self.block_manager.commit(seq, old)

    def commit_tokens(self, seq: Sequence, computed: int) -> None:
        """After a speculative decode step: `computed` more of seq's tokens have their KV in the
        cache (the positions whose tokens were kept; rejected drafts' rows are overwritten later)."""
        old = seq.num_computed_tokens
        seq.num_computed_tokens += computed
        self.block_manager.commit(seq, old)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
