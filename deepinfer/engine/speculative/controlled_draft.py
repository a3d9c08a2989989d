"""A draft source with a chosen acceptance profile, to measure the verification policy itself.

Random weights accept almost no MTP draft, so benchmarks and tests also draft from a known
continuation: the tokens each request is known to produce (recorded by a run without speculation;
a greedy request, or a sampled one with its seed, repeats them). Draft i of a step agrees with the
continuation with probability profile[i] (per request scaled by a factor drawn once, so requests
differ in how predictable they are) and is otherwise a token that differs from it. Each draft's
confidence is its agreement probability: a calibrated confidence head. Whether a draft agrees is a
fixed hash of (prompt, position, draft index), so runs repeat: a second run of the same prompts
takes the same steps (a benchmark's warm-up captures the graphs of its timed run). Once a request's output leaves
its recorded continuation (a near-tie resolved differently), its drafts stop agreeing.
"""

from __future__ import annotations

import hashlib


def geometric_profile(first: float, decay: float, length: int) -> list[float]:
    """first, first * decay, first * decay^2, ... (e.g. 0.9 decaying by 0.85)."""
    return [first * decay**i for i in range(length)]


def _uniform(*key) -> float:
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0**-53


class ControlledDraft:
    def __init__(self, continuations: dict[tuple[int, ...], list[int]], profile: list[float], vocab_size: int, spread: float = 0.0, seed: int = 0):
        """continuations: prompt token ids -> the output tokens the request is known to produce.
        profile[i]: probability that draft i + 1 agrees, for a request whose factor is 1; each
        request's factor is drawn uniformly from [1 - spread, 1] (spread in [0, 1))."""
        self.continuations = continuations
        self.profile = list(profile)
        self.vocab_size = vocab_size
        self.spread = spread
        self.seed = seed
        self.prompt_index = {prompt: i for i, prompt in enumerate(continuations)}  # a request's key, whatever its seq_id

    def propose(self, seqs, caps: list[int]) -> tuple[list[list[int]], list[list[float]]]:
        drafts, confidences = [], []
        for seq, cap in zip(seqs, caps):
            prompt = tuple(seq.token_ids[: seq.num_prompt_tokens])
            known = self.continuations.get(prompt, [])
            key = self.prompt_index.get(prompt, -1)
            done = seq.num_output_tokens
            on_track = known[:done] == seq.output_token_ids
            factor = 1.0 - self.spread * _uniform(self.seed, "request", key)
            tokens, confs = [], []
            for i in range(cap):
                p = min(1.0, self.profile[min(i, len(self.profile) - 1)] * factor)
                true = known[done + i] if on_track and done + i < len(known) else None
                agrees = true is not None and _uniform(self.seed, key, seq.num_tokens, i) < p
                if agrees:
                    tokens.append(true)
                else:  # a token the continuation does not have here
                    tokens.append(((true if true is not None else 0) + 1 + i) % self.vocab_size)
                confs.append(p if true is not None else 0.0)
            drafts.append(tokens)
            confidences.append(confs)
        return drafts, confidences

    def after_prefill(self, batch, forward_batch, target_hidden, samplers, sampled) -> None:
        """Nothing to compute: the drafts come from the recorded continuations, not from a model."""

    def after_verify(self, seqs, starts, emitted, target_hidden, rows) -> None:
        """Nothing to compute (as after_prefill)."""

    def forget(self, seq_id: int) -> None:
        """No per-request state is kept."""
