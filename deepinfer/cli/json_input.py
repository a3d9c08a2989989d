"""Reading one request's JSON (a line of `deepinfer run` / `run-batch`, a body `deepinfer serve`
receives) so that a hostile one fails alone, with a message, instead of taking the process down.

- Parsing: Python's json raises RecursionError for a value nested deeper than its parser goes
  (about 1,000 levels: a line of 100,000 `[`) and ValueError for an integer of more than 4,300
  digits; both are "not valid JSON" here, as a syntax error is (`parse`).
- Nesting: a value that parses may still be nested too deeply for the code that walks it (the
  Unicode check, the messages that quote it, the chat template, the grammar compiler), so a request
  nested deeper than MAX_DEPTH levels fails, naming the limit (`too_deep`). A request body is a few
  levels deep (messages and their parts: 5); the rest of the budget is for JSON schemas.
- Size: `deepinfer serve` refuses a body over --max-request-bytes (MAX_REQUEST_BYTES by default)
  before reading it whole; every command refuses a text too long for the model whatever its
  tokens before tokenizing it (deepinfer.engine.llm.check_text_length).
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 100  # levels of objects and arrays one request may nest (the body itself is level 1)
MAX_REQUEST_BYTES = 8 << 20  # `deepinfer serve --max-request-bytes`' default: 8 MiB (a prompt of a million token ids, written as JSON)


class NotJson(ValueError):
    """Text that deepinfer cannot read as JSON; the message says why (without saying where)."""


def parse(text: str | bytes) -> Any:
    """The JSON value of `text`; NotJson for a syntax error, nesting the parser cannot follow, an
    integer too long to convert, or bytes that are not UTF-8."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise NotJson(f"{exc.msg} at line {exc.lineno} column {exc.colno}" if exc.lineno > 1 else f"{exc.msg} at column {exc.colno}") from None
    except RecursionError:
        raise NotJson(f"nested too deeply to read; deepinfer reads at most {MAX_DEPTH} levels of objects and arrays") from None
    except UnicodeDecodeError as exc:
        raise NotJson(f"not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start})") from None
    except ValueError as exc:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise NotJson(str(exc).split(";")[0]) from None


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether `value` nests objects and arrays more than `limit` levels deep (walked without recursion)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item) if isinstance(child, (dict, list)))
    return False


def depth_problem() -> str:
    return f"nests objects and arrays more than {MAX_DEPTH} levels deep; deepinfer reads at most {MAX_DEPTH}"
