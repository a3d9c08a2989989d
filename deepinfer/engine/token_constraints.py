"""What a request's token options become once, when it is queued: its logit-bias entries, the bans
its bad words make (with the tokens that must precede each), the tokens min_tokens holds back, and
its allowed-token bitmask. Each step only picks these up per row (deepinfer.engine.logits_processing);
nothing here is recomputed while the request runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.engine.sampling_params import InvalidRequestError, SamplingParams

NEG_INF = float("-inf")


@dataclass
class TokenConstraints:
    """One request's entries for `apply_token_bias` and its allowed bitmask, as host tensors."""

    tokens: torch.Tensor  # [n] int64: logit_bias tokens, then bad words' last tokens
    values: torch.Tensor  # [n] float32: the biases, -inf for the bans
    prefixes: torch.Tensor  # [n, width] int64: tokens that must precede (right-aligned, -1 = any)
    stop_tokens: torch.Tensor  # [m] int64: banned while fewer than min_tokens were generated
    min_tokens: int
    allowed: torch.Tensor | None  # [ceil(V/32)] int32 bitmask of allowed_token_ids, or None
    # The same rules on the host, for `drew_banned`: allowed_token_ids, min_tokens' stop tokens, and
    # per token the bad words' preceding tokens that ban it (() bans it always).
    allowed_ids: frozenset[int] | None = None
    stop_ids: frozenset[int] = frozenset()
    bans: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)

    @property
    def width(self) -> int:
        """The longest prefix an entry needs: how many recent tokens the request's rows must bring."""
        return self.prefixes.shape[1]

    def drew_banned(self, token: int, generated: int, recent: list[int]) -> bool:
        """Whether `token`, drawn after `generated` tokens (the last `width` of them: `recent`), was
        one these options ban. `sample` never draws a -inf token from a row that holds a finite one,
        so such a token means every token was banned: the request cannot go on (the engine fails it)."""
        if self.allowed_ids is not None and token not in self.allowed_ids:
            return True
        if generated < self.min_tokens and token in self.stop_ids:
            return True
        return any(len(recent) >= len(before) and tuple(recent[len(recent) - len(before) :]) == before for before in self.bans.get(token, ()))

    def entries(self, generated: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, values, prefixes) for a row that has generated `generated` tokens so far."""
        if generated >= self.min_tokens or not self.stop_tokens.numel():
            return self.tokens, self.values, self.prefixes
        held = self.stop_tokens.numel()
        return (
            torch.cat([self.tokens, self.stop_tokens]),
            torch.cat([self.values, torch.full((held,), NEG_INF)]),
            torch.cat([self.prefixes, torch.full((held, self.width), -1, dtype=torch.int64)]),
        )


def bad_word_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's tokenization of bad words: each word as given (leading spaces stripped) and, when that
    gives a different first token and as many tokens, with one leading space."""
    sequences = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_bos=False)
        sequences.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_bos=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences


def check_token_options(params: SamplingParams, tokenizer, vocab_size: int, what: str, max_model_len: int | None = None) -> None:
    """One-line InvalidRequestErrors for token options this model cannot take. max_model_len: a bad
    word longer than any text of that many tokens is refused before it is tokenized."""
    for name, ids in (("logit_bias", list(params.logit_bias)), ("allowed_token_ids", params.allowed_token_ids or [])):
        outside = next((t for t in ids if t >= vocab_size), None)
        if outside is not None:
            raise InvalidRequestError(f"{what}: {name} has token id {outside}, outside the vocabulary [0, {vocab_size})", name)
    if params.bad_words:
        if tokenizer is None:
            raise InvalidRequestError(f"{what}: bad_words need a tokenizer, and this checkpoint has no tokenizer.json; use logit_bias with -100 instead",
                                      "bad_words")
        if max_model_len is not None:
            longest = max(params.bad_words, key=len)
            if len(longest) > max_model_len * tokenizer.max_token_chars:
                raise InvalidRequestError(f"{what}: a bad word of {len(longest)} characters is longer than any text of the model's maximum length "
                                          f"({max_model_len} tokens) could be", "bad_words")  # fmt: skip
        for word, ids in zip(params.bad_words, bad_word_token_ids(tokenizer, params.bad_words)):
            if not ids or max(ids) >= vocab_size:
                raise InvalidRequestError(f"{what}: bad word {word!r} tokenizes to {ids}, not to token ids of the vocabulary [0, {vocab_size})", "bad_words")


def token_constraints(params: SamplingParams, tokenizer, vocab_size: int, eos_token_ids) -> TokenConstraints | None:
    """The request's constraints (None when it has no token option). Checked by check_token_options first."""
    stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    min_tokens = params.min_tokens if stop else 0
    if not (params.logit_bias or params.bad_words or params.allowed_token_ids is not None or min_tokens):
        return None
    words = bad_word_token_ids(tokenizer, params.bad_words) if params.bad_words else []
    width = max((len(w) - 1 for w in words), default=0)
    tokens = list(params.logit_bias) + [w[-1] for w in words]
    values = list(params.logit_bias.values()) + [NEG_INF] * len(words)
    prefixes = [[-1] * width for _ in params.logit_bias] + [[-1] * (width - len(w) + 1) + w[:-1] for w in words]
    bans: dict[int, list[tuple[int, ...]]] = {}
    for w in words:
        bans.setdefault(w[-1], []).append(tuple(w[:-1]))
    allowed = None
    if params.allowed_token_ids is not None:
        bits = torch.zeros(-(-vocab_size // 32) * 32, dtype=torch.int64)
        bits[torch.tensor(params.allowed_token_ids, dtype=torch.int64)] = 1
        words32 = (bits.view(-1, 32) << torch.arange(32)).sum(dim=1)
        allowed = torch.where(words32 >= 2**31, words32 - 2**32, words32).to(torch.int32)
    return TokenConstraints(
        tokens=torch.tensor(tokens, dtype=torch.int64),
        values=torch.tensor(values, dtype=torch.float32),
        prefixes=torch.tensor(prefixes, dtype=torch.int64).reshape(len(tokens), width),
        stop_tokens=torch.tensor(sorted(stop), dtype=torch.int64),
        min_tokens=min_tokens,
        allowed=allowed,
        allowed_ids=frozenset(params.allowed_token_ids) if params.allowed_token_ids is not None else None,
        stop_ids=frozenset(stop),
        bans=bans,
    )
