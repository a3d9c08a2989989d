"""A request as the scheduler sees it: its tokens, its KV pages and how far it has been computed."""

from __future__ import annotations

import hashlib
from enum import Enum

from deepinfer.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"  # no KV pages: not admitted yet, or preempted
    RUNNING = "running"  # holds KV pages: prefilling or decoding
    FINISHED = "finished"


def chain_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """The hash of a full KV block: its tokens and, through `parent`, every token before them.

    blake2b is keyed by nothing random, so hashes (and prefix-cache hits) repeat from run to run.
    """
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(b"".join(t.to_bytes(8, "little", signed=True) for t in token_ids))
    return digest.digest()


ROOT_HASH = b"deepinfer-prefix-cache-v1"


class Sequence:
    """token_ids = prompt + generated tokens. The KV of the first `num_computed_tokens` of them is in
    the cache, in the pages `block_table` lists. A sequence prefills until `num_computed_tokens`
    reaches `prefill_target` (its length when it was admitted); afterwards each decode step computes
    its last token and samples the next.

    A request with SamplingParams.n > 1 is n sequences (deepinfer.engine.parallel_samples): sample 0
    is the request (its seq_id is the request index, as with n=1), `samples` lists all n, and
    `held_back` the ones that start once its prompt is in the cache; each sample's `head` is sample 0.
    """

    def __init__(self, seq_id: int, prompt_token_ids: list[int], params: SamplingParams, seed: int, prompt: str | None = None,
                 request_index: int | None = None, sample_index: int = 0):  # fmt: skip
        self.seq_id = seq_id
        self.request_index = seq_id if request_index is None else request_index
        self.sample_index = sample_index
        self.head = self  # sample 0 of the request
        self.samples: list[Sequence] = [self]  # on sample 0: the request's samples, by sample_index
        self.held_back: list[Sequence] = []  # on sample 0: samples not queued until its prompt is computed
        self.prompt = prompt
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.seed = seed
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_kv = 0  # positions below this had their KV in the cache when admitted (a prefix hit); replayed tokens do not rewrite it
        self.state_slot = -1  # the model's per-sequence state slot while running (-1: none, or the model keeps none)
        self.prefill_target = 0
        self.num_cached_tokens: int | None = None  # prefix-cache hit at the first admission
        self.num_preemptions = 0
        self.num_drafts_verified = 0  # speculative decoding: drafts this request verified, and accepted
        self.num_drafts_accepted = 0
        self.finish_reason: str | None = None  # "stop" | "length" | "error" | "abort"
        self.error: str | None = None  # with finish_reason "error": what failed (its grammar)
        self.grammar = None  # its SequenceGrammar (structured output), once its request's grammar compiled
        self.stop_reason: int | str | None = None  # the stop token id or stop string, None for EOS/length
        self.constraints = None  # its TokenConstraints (deepinfer.engine.token_constraints), None without token options
        # Logprobs (when params ask for them): a TokenLogprobs record per generated token and their
        # logprobs' sum; per prompt token, the first None (nothing predicts it).
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self._block_hashes: list[bytes] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def order(self) -> tuple[int, int]:
        """The scheduler's order: by request, a request's samples together (n=1: the seq_id's order)."""
        return self.request_index, self.sample_index

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether admission may skip computing a cached prefix: not when the request wants its
        prompt's logprobs, which need the logits of every prompt position (vLLM's rule)."""
        return self.params.prompt_logprobs is None

    def add_logprobs(self, record) -> None:
        """The TokenLogprobs record of the token just appended."""
        self.logprobs.append(record)
        self.cumulative_logprob += record[1]

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.prefill_target

    def block_hash(self, index: int, block_size: int) -> bytes:
        """Chained hash of full block `index` (tokens [index*bs, (index+1)*bs) must exist).

        Tokens are only ever appended, so a full block's hash never changes: computed once, kept
        across preemptions."""
        while len(self._block_hashes) <= index:
            i = len(self._block_hashes)
            parent = self._block_hashes[i - 1] if i else ROOT_HASH
            block = self.token_ids[i * block_size : (i + 1) * block_size]
            if len(block) < block_size:
                raise ValueError(f"block {i} of sequence {self.seq_id} is not full ({len(block)} of {block_size} tokens)")
            self._block_hashes.append(chain_hash(parent, block))
        return self._block_hashes[index]

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={self.block_table}, status={self.status.value})"
        )
