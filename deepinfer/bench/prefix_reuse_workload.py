"""The workload of `bench prefix-reuse`: long multi-turn conversations whose prompts grow by appending to the
previous turn, interleaved so that their working set outgrows the device's KV pool (DeepSeek's production shape:
most of a prompt was computed before, by the same conversation's previous turn).

C conversations of T turns. Turn 1's prompt is `prompt_len` random token ids; each next turn's prompt is the previous
prompt, the previous turn's output (`output_len` greedy tokens, EOS ignored, so every length is known up front) and
`turn_tokens` new random ids. Requests go in round-robin order: turn 1 of every conversation, then turn 2 of every
one, and so on; between two turns of one conversation every other conversation's context passes through the pool.

Everything random comes from one seed, drawn in a fixed order, so that two runs (two processes too) of the same
workload send the same prompts, as long as the model answers the same (the outputs are the model's).

Reuse, what the workload offers a cache (`reuse_rate`: the tokens of each prompt that its conversation's previous
request held, over all prompt tokens) and what a paged prefix cache can take of it (`reusable_rate`: only full
blocks whose KV the previous request computed, its last output token's not among them, and never a prompt's last
token, whose step yields the logits). A pool that never evicts reaches `reusable_rate`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass(frozen=True)
class Workload:
    conversations: int
    turns: int
    prompt_len: int  # turn 1's prompt tokens
    turn_tokens: int  # new tokens each later turn appends after the previous output
    output_len: int  # greedy tokens generated per request
    vocab_size: int
    seed: int = 0

    # -- lengths (known up front: every request generates exactly output_len tokens) --------

    def prompt_tokens(self, turn: int) -> int:
        """Prompt tokens of a conversation's turn `turn` (0-based)."""
        return self.prompt_len + turn * (self.output_len + self.turn_tokens)

    @property
    def longest(self) -> int:
        """The longest request's tokens, prompt and output: the last turn's."""
        return self.prompt_tokens(self.turns - 1) + self.output_len

    @property
    def num_requests(self) -> int:
        return self.conversations * self.turns

    @property
    def total_prompt_tokens(self) -> int:
        return self.conversations * sum(self.prompt_tokens(t) for t in range(self.turns))

    def working_set_blocks(self, block_size: int) -> int:
        """KV blocks of every conversation's whole context (its last turn, prompt and output): what a pool must
        hold so that no conversation's prefix is ever evicted."""
        return self.conversations * blocks_for(self.longest, block_size)

    def reuse_rate(self) -> float:
        """Prompt tokens its conversation's previous request held (its prompt and output), over all prompt tokens."""
        reused = self.conversations * sum(self.prompt_tokens(t - 1) + self.output_len for t in range(1, self.turns))
        return reused / self.total_prompt_tokens

    def reusable_tokens(self, turn: int, block_size: int, previous_run: bool = False) -> int:
        """Prompt tokens of turn `turn` a prefix cache can serve: the full blocks the previous request computed (all
        but its last output token), at most the prompt's full blocks before its last token. previous_run: the same
        workload ran before over the same cache (a restart on the disk tier): every turn's prompt, the first too, was
        computed by that run."""
        prompt = self.prompt_tokens(turn)
        most = (prompt - 1) // block_size
        if previous_run:
            computed = prompt + self.output_len - 1  # this turn's own request, in the run before
        elif turn == 0:
            return 0
        else:
            computed = self.prompt_tokens(turn - 1) + self.output_len - 1
        return min(computed // block_size, most) * block_size

    def reusable_rate(self, block_size: int, previous_run: bool = False) -> float:
        """`reusable_tokens` over all prompt tokens (module docstring)."""
        tokens = self.conversations * sum(self.reusable_tokens(t, block_size, previous_run) for t in range(self.turns))
        return tokens / self.total_prompt_tokens

    def describe(self, block_size: int) -> dict:
        """The workload's settings and the figures it implies, for the JSON."""
        return {
            **asdict(self),
            "requests": self.num_requests,
            "prompt_tokens": self.total_prompt_tokens,
            "longest_request_tokens": self.longest,
            "reuse_rate": self.reuse_rate(),
            "reusable_rate": self.reusable_rate(block_size),
            "reusable_rate_after_a_run": self.reusable_rate(block_size, previous_run=True),
            "working_set_blocks": self.working_set_blocks(block_size),
        }

    # -- the requests --------------------------------------------------------------------------

    def order(self) -> list[tuple[int, int]]:
        """(turn, conversation) of every request in submission order: round-robin over the conversations."""
        return [(turn, conv) for turn in range(self.turns) for conv in range(self.conversations)]

    def conversations_state(self) -> "Conversations":
        return Conversations(self)


class Conversations:
    """The conversations' contexts as a run goes: each turn's prompt, from the previous turn's prompt and output."""

    def __init__(self, workload: Workload):
        import torch

        self.workload = w = workload
        gen = torch.Generator().manual_seed(w.seed)
        self.first = [torch.randint(0, w.vocab_size, (w.prompt_len,), generator=gen).tolist() for _ in range(w.conversations)]
        # appended[conv][turn - 1]: the new tokens of turn `turn` (1..T-1)
        self.appended = [[torch.randint(0, w.vocab_size, (w.turn_tokens,), generator=gen).tolist() for _ in range(w.turns - 1)]
                         for _ in range(w.conversations)]  # fmt: skip
        self.prompts: dict[tuple[int, int], list[int]] = {}
        self.outputs: dict[tuple[int, int], list[int]] = {}

    def prompt(self, turn: int, conv: int) -> list[int]:
        """The prompt of conversation `conv`'s turn `turn` (0-based); needs the previous turn's output recorded."""
        if turn == 0:
            prompt = list(self.first[conv])
        else:
            previous = (turn - 1, conv)
            if previous not in self.outputs:
                raise RuntimeError(f"conversation {conv}'s turn {turn + 1} was asked for before turn {turn} finished")
            prompt = self.prompts[previous] + self.outputs[previous] + self.appended[conv][turn - 1]
        self.prompts[(turn, conv)] = prompt
        return prompt

    def record(self, turn: int, conv: int, output: list[int]) -> None:
        self.outputs[(turn, conv)] = list(output)

    def finished(self, turn: int, conv: int) -> bool:
        return (turn, conv) in self.outputs
