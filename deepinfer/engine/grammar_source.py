"""What llguidance is handed for a request's structured_outputs: the grammar text of a
StructuredOutputsParams, checked by llguidance without a tokenizer, and its messages as one line.

Kept free of torch and of the engine: deepinfer.engine.grammar_sandbox runs `translate` in a child
process of its own, where a grammar that crashes llguidance takes only that process down.
"""

from __future__ import annotations

import re

from deepinfer.engine.sampling_params import InvalidRequestError

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
    """llguidance's multi-line message as one line (its drawing of the grammar source with carets,
    its parser's state dump and a Rust panic's backtrace left out), cut to MESSAGE_LIMIT characters."""
    message = re.split(r"<backtrace>|stack backtrace:|<state>", message, maxsplit=1)[0]
    drawing = re.compile(r"^\s*(\^+|\d+ \|.*|\|.*)\s*$")
    text = " ".join(" ".join(line.split()) for line in message.splitlines() if line.strip() and not drawing.match(line))
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 3] + "..."


def compiler_failed(kind: str, exc: BaseException) -> GrammarError:
    """llguidance's own failure (a Rust panic, say) on a grammar, as that grammar's error."""
    return GrammarError(f"{kind} is too big or too complex for the grammar compiler: {one_line(str(exc)) or type(exc).__name__}")


def grammar_text(spec) -> str:
    """The llguidance grammar for spec, a StructuredOutputsParams (ValueError for a schema or a
    grammar llguidance cannot read)."""
    import llguidance

    kind = spec.kind
    if kind in ("json", "json_object"):
        return llguidance.LLMatcher.grammar_from_json_schema(spec.json_schema(), overrides=spec.json_options() or None)
    if kind == "choice":
        return llguidance.grammar_from("choice", list(spec.choice))
    if kind == "grammar":
        return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to Lark
    return llguidance.LLMatcher.grammar_from_regex(spec.regex)


def translate(spec) -> str:
    """spec's grammar text, validated by llguidance (no tokenizer); GrammarError when it does not compile."""
    import llguidance

    try:
        grammar = grammar_text(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    except ValueError as exc:
        raise GrammarError(f"{spec.kind} does not compile: {one_line(str(exc))}") from None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # a Rust panic (pyo3's PanicException is a BaseException), a RecursionError of the GBNF converter
        raise compiler_failed(spec.kind, exc) from None
    if is_error:
        raise GrammarError(f"{spec.kind} does not compile: {one_line(messages[0] if messages else 'llguidance refused it')}")
    return grammar
