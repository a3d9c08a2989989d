"""One engine step with speculative decoding.

Prefill step: the target's forward (with every token's hidden state), the first token sampled as
without speculation, then the draft source's pass over the step (MTP: its cache rows and draft 1).

Decode step, for B requests with c computed tokens each (the last token not yet computed):
  1. draft: up to cap_b drafts each (cap_b = k, fewer near max_tokens or the model's length, so a
     verification never emits past them; the scheduler gave positions c .. c + cap_b pages);
  2. choose: the policy decides how many drafts k_b each request verifies;
  3. verify: one target forward over [last token, k_b drafts] per request (a decode step whose
     requests bring different numbers of tokens; a device graph's replay where the backend has
     graphs, every request padded to the step's longest), then `rejection_sample` keeps the drafts the
     target agrees with and adds the token after them;
  4. re-draft: the draft source's pass over the kept positions (MTP: draft 1 for the next step).
The engine appends the emitted tokens one at a time (a stop condition inside the run discards the
rest) and counts the appended ones as computed.
"""

from __future__ import annotations

from typing import Callable

import torch

from deepinfer.engine.speculative.config import SpeculativeConfig
from deepinfer.engine.speculative.metrics import SpeculativeMetrics
from deepinfer.engine.speculative.policy import ConfidencePolicy, FixedPolicy


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig, model, runner, ops, final_length: Callable, drafter, cost_model=None):
        """final_length(seq): the most tokens seq may reach. drafter: the draft source
        (MTPDrafter, ControlledDraft). cost_model: the confidence policy's StepCostModel."""
        self.config = config
        self.model = model
        self.runner = runner
        self.ops = ops
        self.final_length = final_length
        self.drafter = drafter
        # with device graphs a verification step is padded to its longest request (ModelRunner.forward_rows)
        self.policy = ConfidencePolicy(cost_model, padded=runner.graphs is not None) if config.policy == "confidence" else FixedPolicy()
        self.metrics = SpeculativeMetrics()

    def lookahead(self, seq) -> int:
        """Drafts seq may verify next step: k, fewer when fewer tokens remain (a verification of
        n drafts emits up to n + 1 tokens)."""
        return max(0, min(self.config.num_drafts, self.final_length(seq) - seq.num_tokens - 1))

    @torch.inference_mode()
    def run(self, batch) -> tuple[list, list[list[int]]]:
        """The step's sequences that emit tokens, and their tokens (in order)."""
        return self._prefill(batch) if batch.is_prefill else self._decode(batch)

    def _prefill(self, batch):
        runner = self.runner
        forward_batch, samplers = runner.prepare(batch)
        logits, hidden = self.model.forward(forward_batch, runner.kv_caches, hidden_states=True)
        tokens = self.ops.sample(logits=logits.float(), **runner.sampling_tensors(samplers)).tolist() if samplers else []
        self.drafter.after_prefill(batch, forward_batch, hidden, samplers, tokens)
        return samplers, [[t] for t in tokens]

    def _decode(self, batch):
        runner, seqs = self.runner, batch.seqs
        caps = [self.lookahead(seq) for seq in seqs]
        drafts, confidences = self.drafter.propose(seqs, caps)
        verify = self.policy.choose([s.seq_id for s in seqs], confidences)
        starts = [s.num_computed_tokens for s in seqs]
        inputs = [[s.token_ids[-1]] + d[:k] for s, d, k in zip(seqs, drafts, verify)]
        logits, hidden = runner.forward_rows(seqs, starts, inputs)
        draft_rows = [t for d, k in zip(drafts, verify) for t in d[:k] + [-1]]
        cu = [0]
        for k in verify:
            cu.append(cu[-1] + k + 1)
        sampling = runner.sampling_tensors(seqs)
        out = self.ops.rejection_sample(
            logits.float(), runner.tensor(draft_rows, torch.int64), runner.tensor(cu, torch.int32), sampling["temperature"],
            sampling["top_k"], sampling["top_p"], sampling["min_p"], sampling["seeds"], sampling["positions"],
        ).tolist()  # fmt: skip
        emitted, kept_rows = [], []
        self.metrics.steps += 1
        for b, seq in enumerate(seqs):
            row = out[cu[b] : cu[b + 1]]
            tokens = [t for t in row if t >= 0]
            emitted.append(tokens)
            kept_rows.append(list(range(cu[b], cu[b] + len(tokens))))
            accepted = len(tokens) - 1
            self.policy.record(seq.seq_id, confidences[b][: verify[b]], accepted)
            self.metrics.record(len(drafts[b]), verify[b], accepted)
            seq.num_drafts_verified += verify[b]
            seq.num_drafts_accepted += accepted
        self.drafter.after_verify(seqs, starts, emitted, hidden, kept_rows)
        return seqs, emitted

    def forget(self, seq) -> None:
        """seq finished: drop its draft state and its acceptance record."""
        self.drafter.forget(seq.seq_id)
        self.policy.forget(seq.seq_id)
