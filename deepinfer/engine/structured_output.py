"""Structured output through llguidance: grammars compiled in worker threads, one matcher per
sequence, and each step's token masks.

- Compiling: `GrammarCompiler.submit` starts a request's grammar in a thread pool when the request
  is added, and caches it by StructuredOutputsParams.key() (kind, spec, options): requests with the
  same schema share one compilation. The cache keeps the `cache_size` most recently used grammars
  (EngineConfig.grammar_cache_size); a request holds its own grammar, evicted or not. What is compiled is an llguidance LLMatcher, kept unused as a
  template; each sequence (each of a request's n samples) gets its own deep copy. The llguidance
  tokenizer is built once, from the checkpoint's tokenizer.json, with the model's vocabulary size
  and the engine's EOS ids as llguidance's EOS (so the mask allows EOS exactly where the grammar
  may end). A compile error becomes a GrammarError with llguidance's message on one line.
- Each step: `fill_bitmasks` writes the constrained rows' masks into one host int32 bitmask
  [rows, ceil(V/32)] (deepinfer.engine.logits_processing moves it to the device once and applies it
  with `apply_token_bitmask`). A speculative verification brings a row per draft position: the
  matcher is advanced through the drafts for their masks and rolled back, so it only ever holds the
  tokens the verification keeps (each emitted token is then accepted as below).
- After sampling: `SequenceGrammar.accept` advances the sequence's matcher with its token; the
  request finishes when the matcher is stopped (the grammar is complete: on the token that
  completes it, or on EOS where the grammar could go on).

llguidance is imported on first use: the engine runs without it until a request asks for this.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from deepinfer.engine.sampling_params import InvalidRequestError
from deepinfer.engine.structured_params import StructuredOutputsParams

log = logging.getLogger(__name__)

COMPILE_THREADS = 2  # grammar compilations at a time (llguidance releases the GIL while it builds one)
# Threads of llguidance's executor for a step's masks. One: on the H200's 16-core host a 64-row step
# of the bench's JSON schema took 0.94 ms on one thread and no less on 2-6 (4.49 vs 5.7-6.6 ms at 256
# rows); the default (80% of the cores, 12 there) took 3.3 ms inside the engine
# (docs/measurements/2026-12-02/round2_h200/call1_mask_threads/). A mask costs ~15-50 us, too little to share out.
MASK_THREADS = 1
MESSAGE_LIMIT = 400  # characters of a compiler message kept in a request's error


class GrammarError(Exception):
    """A grammar that does not compile, or a matcher that failed while generating."""


def require_llguidance() -> None:
    """A one-line InvalidRequestError when llguidance is not installed."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        raise InvalidRequestError("structured_outputs needs llguidance: pip install 'deepinfer[structured]'") from None


def one_line(message: str) -> str:
    """llguidance's multi-line message as one line (its drawing of the grammar source with carets
    left out), cut to MESSAGE_LIMIT characters."""
    drawing = re.compile(r"^\s*(\^+|\d+ \|.*|\|.*)\s*$")
    text = " ".join(" ".join(line.split()) for line in message.splitlines() if line.strip() and not drawing.match(line))
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 3] + "..."


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for spec (ValueError for a schema llguidance cannot read)."""
    import llguidance

    kind = spec.kind
    if kind in ("json", "json_object"):
        return llguidance.LLMatcher.grammar_from_json_schema(spec.json_schema(), overrides=spec.json_options() or None)
    if kind == "choice":
        return llguidance.grammar_from("choice", list(spec.choice))
    if kind == "grammar":
        return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark
    return llguidance.LLMatcher.grammar_from_regex(spec.regex)


def check_compiles(spec: StructuredOutputsParams) -> None:
    """A GrammarError when spec's grammar does not compile (checked without a tokenizer: the CLI's
    flags, before the model loads)."""
    import llguidance

    try:
        grammar = grammar_text(spec)
    except ValueError as exc:
        raise GrammarError(f"{spec.kind} does not compile: {one_line(str(exc))}") from None
    problem = llguidance.LLMatcher.validate_grammar(grammar, None)
    if problem:
        raise GrammarError(f"{spec.kind} does not compile: {one_line(problem)}")


class GrammarCompiler:
    """Compiles grammars in a thread pool, each (kind, spec, options) once."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, cache_size: int = 256):
        if tokenizer is None:
            raise InvalidRequestError("structured_outputs needs the checkpoint's tokenizer.json, and this checkpoint has none")
        self._tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, sorted(eos_token_ids)
        self._ll_tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="deepinfer-grammar")
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()  # least recently used first

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """A future of spec's template matcher (raises GrammarError when it does not compile)."""
        key = spec.key()
        future = self._cache.get(key)
        if future is None:
            future = self._cache[key] = self._pool.submit(self._compile, spec)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return future

    def cached_keys(self) -> list[tuple[str, str]]:
        """The cached grammars' keys, least recently used first."""
        return list(self._cache)

    def ll_tokenizer(self):
        """The llguidance tokenizer (built once, about a second for a 128k vocabulary)."""
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                import llguidance

                self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer.backend_json(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
            return self._ll_tokenizer

    def _compile(self, spec: StructuredOutputsParams):
        import llguidance

        try:
            grammar = grammar_text(spec)
        except ValueError as exc:
            raise GrammarError(f"{spec.kind} does not compile: {one_line(str(exc))}") from None
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{spec.kind} does not compile: {one_line(matcher.get_error())}")
        return matcher

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class SequenceGrammar:
    """One sequence's matcher: it has consumed exactly the sequence's generated tokens."""

    def __init__(self, template):
        self.matcher = template.deep_copy()

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
    from llguidance.torch import fill_next_token_bitmask_par

    if _executor is None:
        _executor = llguidance.LLExecutor(MASK_THREADS)
    valid = [grammar.matcher.validate_tokens(drafts) if drafts else 0 for _, grammar, drafts in rows]  # drafts the grammar takes
    for i in range(max(valid, default=0) + 1):
        fill_next_token_bitmask_par(_executor, [(grammar.matcher, row + i) for (row, grammar, _), n in zip(rows, valid) if i <= n], bitmask)
        for (_, grammar, drafts), n in zip(rows, valid):
            if i < n and not grammar.matcher.consume_token(drafts[i]):
                raise GrammarError(f"the grammar matcher refused draft token {drafts[i]} it had validated")
    for (_, grammar, _), n in zip(rows, valid):
        if n and not grammar.matcher.rollback(n):
            raise GrammarError(f"the grammar matcher could not roll back {n} draft tokens: {one_line(grammar.matcher.get_error())}")
