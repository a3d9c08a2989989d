"""One engine step with speculative decoding.

Prefill step: the target's forward (with every token's hidden state), the first token sampled (and
prompt logprobs gathered) as without speculation, then the draft source's pass over the step (MTP:
its cache rows and draft 1).

Decode step, for B requests with c computed tokens each (the last token not yet computed):
  1. draft: up to cap_b drafts each (cap_b = k, fewer near max_tokens or the model's length, so a
     verification never emits past them; the scheduler gave positions c .. c + cap_b pages);
  2. choose: the policy decides how many drafts k_b each request verifies;
  3. verify: one target forward over [last token, k_b drafts] per request (a decode step whose
     requests bring different numbers of tokens; a device graph's replay where the backend has
     graphs, every request padded to the step's longest); each row's logits are processed as the
     step after the drafts before it would process them (penalties, bans, biases:
     ModelRunner.sample_rows), then `rejection_sample` keeps the drafts the target agrees with and
     adds the token after them; logprobs come from the kept rows' raw logits, as without speculation;
  4. re-draft: the draft source's pass over the kept positions (MTP: draft 1 for the next step).
The engine appends the emitted tokens one at a time (a stop condition inside the run discards the
rest) and counts the appended ones as computed.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from deepinfer.engine.model_runner import LaunchedStep
from deepinfer.engine.speculative.config import SpeculativeConfig
from deepinfer.engine.speculative.head_policy import HeadPolicy
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
        # with device graphs that hold verification rows, a verification step is padded to its longest request (ModelRunner.forward_rows)
        padded = runner.graphs is not None and runner.graphs.max_tokens_per_seq > 1
        policies = {"confidence": ConfidencePolicy, "head": HeadPolicy}
        self.policy = policies[config.policy](cost_model, padded=padded) if config.policy in policies else FixedPolicy()
        self.metrics = SpeculativeMetrics()

    def lookahead(self, seq) -> int:
        """Drafts seq may verify next step: k, fewer when fewer tokens remain (a verification of
        n drafts emits up to n + 1 tokens)."""
        return max(0, min(self.config.num_drafts, self.final_length(seq) - seq.num_tokens - 1))

    @torch.inference_mode()
    def run(self, batch) -> tuple[list, list[list[int]], list[list]]:
        """The step's sequences that emit tokens, their tokens (in order) and each token's
        TokenLogprobs record (None unless its request asked for logprobs)."""
        return self._prefill(batch) if batch.is_prefill else self._decode(batch)

    def _prefill(self, batch):
        runner = self.runner
        rows = runner.step_rows(batch)
        logits, hidden = self.model.forward(rows.forward_batch, runner.kv_caches, hidden_states=True)
        samplers, tokens, records = runner.collect(runner.sample_step(rows, logits.float()))
        forward_batch = rows.forward_batch
        if rows.prompt_select:  # the drafter reads the samplers' last input rows, not the prompt-logprob rows
            forward_batch = dataclasses.replace(forward_batch, logits_indices=runner.tensor(rows.input_rows, torch.int64))
        self.drafter.after_prefill(batch, forward_batch, hidden, samplers, tokens)
        return samplers, [[t] for t in tokens], [[r] for r in records]

    def _decode(self, batch):
        runner, seqs = self.runner, batch.seqs
        caps = [self.lookahead(seq) for seq in seqs]
        drafts, confidences = self.drafter.propose(seqs, caps)
        verify = self.policy.choose([s.seq_id for s in seqs], confidences)
        starts = [s.num_computed_tokens for s in seqs]
        verified = [d[:k] for d, k in zip(drafts, verify)]
        inputs = [[s.token_ids[-1]] + d for s, d in zip(seqs, verified)]
        logits, hidden = runner.forward_rows(seqs, starts, inputs)
        draft_rows = [t for d in verified for t in d + [-1]]
        cu = [0]
        for k in verify:
            cu.append(cu[-1] + k + 1)
        sampling = runner.sampling_tensors(seqs)

        def verify_rows(processed: torch.Tensor) -> torch.Tensor:
            return self.ops.rejection_sample(
                processed, runner.tensor(draft_rows, torch.int64), runner.tensor(cu, torch.int32), sampling["temperature"],
                sampling["top_k"], sampling["top_p"], sampling["min_p"], sampling["seeds"], sampling["positions"],
            )  # fmt: skip

        # row i of a request is processed (penalties, bans, biases) as if drafts[:i] were its tokens
        input_ids = runner.tensor([t for ids in inputs for t in ids], torch.int64)
        tokens, logprobs = runner.sample_rows(logits.float(), seqs, cu[:-1], input_ids, verify_rows, verified)
        _, out, row_records = runner.collect(LaunchedStep(seqs, tokens, logprobs))
        emitted, records, kept_rows = [], [], []
        self.metrics.steps += 1
        for b, seq in enumerate(seqs):
            row = out[cu[b] : cu[b + 1]]
            kept = [t for t in row if t >= 0]
            emitted.append(kept)
            records.append(row_records[cu[b] : cu[b] + len(kept)])
            kept_rows.append(list(range(cu[b], cu[b] + len(kept))))
            accepted = len(kept) - 1
            self.policy.record(seq.seq_id, confidences[b][: verify[b]], accepted)
            self.metrics.record(len(drafts[b]), verify[b], accepted)
            seq.num_drafts_verified += verify[b]
            seq.num_drafts_accepted += accepted
        self.drafter.after_verify(seqs, starts, emitted, hidden, kept_rows)
        return seqs, emitted, records

    def forget(self, seq) -> None:
        """seq finished: drop its draft state and its acceptance record."""
        self.drafter.forget(seq.seq_id)
        self.policy.forget(seq.seq_id)
