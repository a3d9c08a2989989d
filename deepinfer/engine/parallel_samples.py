"""Parallel samples (SamplingParams.n > 1): n sequences of one prompt that share its KV blocks.

Sample 0 is the request as with n=1 (its seq_id is the request index, its seed the request's). The
other n-1 are made with it but held back, out of the scheduler's queue, until sample 0's prompt
prefill has run: its full prompt blocks are then committed to the prefix cache, so each extra
sample is admitted with them as prefix hits (the same pages, one more reference each) and computes
only the prompt's last block (the partial one, or the last full one when the prompt fills its blocks:
a step must compute at least one token to sample from). Held back rather than queued behind a
"waits for" link, a sample never stands in the queue blocking the unrelated requests behind it; once
queued it is ordered right after its request (Sequence.order), ahead of later requests.

With prefix caching off nothing is shared: each extra sample prefills the whole prompt itself (still
correct, only slower). A request's RequestOutput is reported once, when its last sample finishes.
"""

from __future__ import annotations

from deepinfer.engine.sequence import Sequence, SequenceStatus


def add_samples(head: Sequence, first_id: int) -> list[Sequence]:
    """Samples 1..n-1 of `head`'s request, held back on it; their seq ids count down from `first_id`
    (negative: request indices, the ids of samples 0, are >= 0). Sample j's seed derives from the
    request's seed and j, so runs repeat."""
    from deepinfer.engine.llm_engine import derive_seed

    prompt_ids = head.token_ids[: head.num_prompt_tokens]
    for j in range(1, head.params.n):
        sample = Sequence(first_id - (j - 1), prompt_ids, head.params, derive_seed(head.seed, j), head.prompt,
                          request_index=head.request_index, sample_index=j)  # fmt: skip
        sample.head = head
        head.samples.append(sample)
    head.held_back = head.samples[1:]
    return head.held_back


def release_held_back(scheduler, seqs: list[Sequence]) -> None:
    """Queue the samples held back on any of `seqs` whose prompt prefill is now computed (after the
    step's commit: its full blocks are in the prefix cache)."""
    for seq in seqs:
        if seq.held_back and not seq.is_prefilling and seq.num_computed_tokens >= seq.num_prompt_tokens:
            for sample in seq.held_back:
                scheduler.add(sample)
            seq.held_back = []


def finished_requests(finished: list[Sequence]) -> list[Sequence]:
    """The heads (samples 0) of the requests whose every sample has now finished, once each, from
    the sequences that finished this step."""
    heads = []
    for seq in finished:
        head = seq.head
        if head not in heads and all(s.status is SequenceStatus.FINISHED for s in head.samples):
            heads.append(head)
    return heads
