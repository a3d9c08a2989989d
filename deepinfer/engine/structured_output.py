"""Structured output through llguidance: one matcher per sequence, and each step's token masks.
(Grammars are compiled off the engine thread by deepinfer.engine.grammar_compiler.)

- Each sequence (each of a request's n samples) gets its own deep copy of the compiled template.
- Each step: `fill_bitmasks` writes the constrained rows' masks into one host int32 bitmask
  [rows, ceil(V/32)] (deepinfer.engine.logits_processing moves it to the device once and applies it
  with `apply_token_bitmask`). A speculative verification brings a row per draft position: the
  matcher is advanced through the drafts for their masks and rolled back, so it only ever holds the
  tokens the verification keeps (each emitted token is then accepted as below). The masks are
  written by llguidance's executor straight into the tensor's memory: llguidance.torch, its torch
  helpers, is not imported (it decorates a function with torch.compile at import: seconds of the
  engine thread on the first structured step, docs/performance.md).
- After sampling: `SequenceGrammar.accept` advances the sequence's matcher with its token; the
  request finishes when the matcher is stopped (the grammar is complete: on the token that
  completes it, or on EOS where the grammar could go on).

llguidance is imported on first use: the engine runs without it until a request asks for this.
"""

from __future__ import annotations

import torch

from deepinfer.engine.grammar_source import GrammarError, one_line

# Threads of llguidance's executor for a step's masks. One: on the H200's 16-core host a 64-row step
# of the bench's JSON schema took 0.94 ms on one thread and no less on 2-6 (4.49 vs 5.7-6.6 ms at 256
# rows); the default (80% of the cores, 12 there) took 3.3 ms inside the engine
# (docs/measurements/2026-12-02/round2_h200/call1_mask_threads/). A mask costs ~15-50 us, too little to share out.
MASK_THREADS = 1

class SequenceGrammar:
    """One sequence's matcher: it has consumed exactly the sequence's generated tokens."""

    def __init__(self, template):
        self.template = template
        self.matcher = template.deep_copy()

    def allows(self, tokens: list[int], token: int) -> bool:
        """Whether the grammar lets `token` follow `tokens` (from a fresh matcher: for explaining a
        failure, never on the way of a step)."""
        fresh = self.template.deep_copy()
        if tokens and not fresh.consume_tokens(tokens):
            return False
        mask = fresh.compute_bitmask()
        return bool(mask[token // 8] >> (token % 8) & 1)

    def accept(self, token: int) -> bool:
        """Advance with the sampled token; True when the grammar is now complete (the sequence ends).
        Raises GrammarError when the matcher refuses the token or failed (it cannot go on)."""
        if not self.matcher.consume_token(token) or self.matcher.is_error():
            raise GrammarError(f"the grammar matcher failed: {one_line(self.matcher.get_error() or f'token {token} refused')}")
        return self.matcher.is_stopped()


_executor = None


def fill_bitmasks(rows: list[tuple[int, SequenceGrammar, list[int]]], bitmask: torch.Tensor) -> None:
    """For each (row, grammar, drafts), write the grammar's allowed next tokens into bitmask[row]
    and, with drafts (a speculative verification), the tokens allowed after drafts[:i] into
    bitmask[row + i] for i = 1 .. len(drafts) (bitmask: a host int32 [R, ceil(V/32)] tensor,
    contiguous). The grammars' matchers are advanced through their drafts and rolled back: they
    end as they began. Rows after a draft the grammar refuses are left as they are: that draft is
    banned by the row before it, so verification never reaches them. Each position's rows are
    filled by llguidance's executor (MASK_THREADS), the GIL released."""
    global _executor
    import llguidance

    if _executor is None:
        _executor = llguidance.LLExecutor(MASK_THREADS)
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2 or not bitmask.is_contiguous():
        raise ValueError(f"fill_bitmasks needs a contiguous 2-D int32 host tensor, got {bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}")
    rows_total, words = bitmask.shape
    valid = [grammar.matcher.validate_tokens(drafts) if drafts else 0 for _, grammar, drafts in rows]  # drafts the grammar takes
    for i in range(max(valid, default=0) + 1):
        matchers = [(grammar.matcher, row + i) for (row, grammar, _), n in zip(rows, valid) if i <= n]
        _executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), words * 4, rows_total)
        for (_, grammar, drafts), n in zip(rows, valid):
            if i < n and not grammar.matcher.consume_token(drafts[i]):
                raise GrammarError(f"the grammar matcher refused draft token {drafts[i]} it had validated")
    for (_, grammar, _), n in zip(rows, valid):
        if n and not grammar.matcher.rollback(n):
            raise GrammarError(f"the grammar matcher could not roll back {n} draft tokens: {one_line(grammar.matcher.get_error())}")
