"""Typed checks of the JSON a checkpoint folder holds: a table of `Field`s per object, checked in one pass.

A field names its kind (integer, number, boolean, string, one of a set, object, list), its range,
and its default (used when the key is absent or null; `REQUIRED` for none). `check_fields` returns
the values with defaults filled in, or raises one CheckpointError naming the file, the field, the
value and what was expected. JSON integers only count as integers (64.7 is not truncated, true is
not 1); numbers must be finite (json reads NaN and Infinity). No dependency beyond the standard
library: the GPU machines have no pydantic.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from deepinfer.model.errors import CheckpointError

SHOWN_CHARS = 60  # a value longer than this is cut in the message


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


@dataclass(frozen=True)
class Kind:
    """What a field accepts: `accepts(value)`, described as `expected` ("an integer >= 1")."""

    expected: str
    accepts: Callable[[Any], bool]
    choices: tuple[str, ...] = ()  # set for `one_of`: a wrong value is "not supported"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def integer(min: int | None = None, max: int | None = None) -> Kind:
    """A JSON integer; `max`: the most a sane model uses of a size that nothing in the checkpoint
    bounds (a loop count, a per-step table), so a hostile value fails here, not as an OOM or a hang."""
    if max is not None:
        return Kind(f"an integer in [{min}, {max}]", lambda v: _is_int(v) and min <= v <= max)
    return Kind(f"an integer >= {min}" if min is not None else "an integer", lambda v: _is_int(v) and (min is None or v >= min))


def number(above: float | None = None, min: float | None = None, max: float | None = None) -> Kind:
    """A finite JSON number (an integer counts); `above`: exclusive lower bound, `min`: inclusive; `max`: inclusive upper bound."""
    if max is not None:
        low = f"({above:g}" if above is not None else f"[{min:g}"
        return Kind(f"a finite number in {low}, {max:g}]", lambda v: _is_number(v) and (v > above if above is not None else v >= min) and v <= max)
    if above is not None:
        return Kind(f"a finite number > {above:g}", lambda v: _is_number(v) and v > above)
    if min is not None:
        return Kind(f"a finite number >= {min:g}", lambda v: _is_number(v) and v >= min)
    return Kind("a finite number", _is_number)


BOOLEAN = Kind("true or false", lambda v: isinstance(v, bool))
STRING = Kind("a string", lambda v: isinstance(v, str))
OBJECT = Kind("an object", lambda v: isinstance(v, dict))


def one_of(*choices: str) -> Kind:
    return Kind(f"one of {', '.join(choices)}", lambda v: isinstance(v, str) and v in choices, choices)


def integers(min: int | None = None) -> Kind:
    """An integer, or a list of them (e.g. eos_token_id)."""
    one = integer(min)
    return Kind(f"{one.expected} or a list of them", lambda v: one.accepts(v) or (isinstance(v, list) and all(one.accepts(x) for x in v)))


def any_of(*kinds: Kind) -> Kind:
    return Kind(" or ".join(k.expected for k in kinds), lambda v: any(k.accepts(v) for k in kinds))


@dataclass(frozen=True)
class Field:
    name: str
    kind: Kind
    default: Any = None  # absent or null gives this; REQUIRED: the field must be there


def shown(value: Any) -> str:
    """A value as JSON, cut to one short line (ASCII, so a lone surrogate prints too)."""
    try:
        text = json.dumps(value, ensure_ascii=True, allow_nan=True)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def check_fields(data: Mapping[str, Any], fields: Iterable[Field], source: str, where: str = "") -> dict[str, Any]:
    """Each field's value (its default when absent or null), checked against its kind.

    `where` prefixes field names in messages ("rope_scaling." for a nested object). Fields not in
    the table are left alone (configs carry many that do not matter here).
    """
    values = {}
    for field in fields:
        value = data.get(field.name)
        if value is None:
            if field.default is REQUIRED:
                raise CheckpointError(f"{source}: required field {where}{field.name} is missing", "add it")
            values[field.name] = field.default
        elif field.kind.accepts(value):
            values[field.name] = value
        else:
            raise field_error(source, f"{where}{field.name}", value, field.kind)
    return values


def field_error(source: str, name: str, value: Any, kind: Kind) -> CheckpointError:
    if kind.choices and isinstance(value, str):
        return CheckpointError(f"{source}: {name} {value!r} is not supported; supported: {', '.join(kind.choices)}")
    return CheckpointError(f"{source}: {name} is {shown(value)}, expected {kind.expected}")


def check_object(data: Any, name: str, source: str) -> Mapping[str, Any] | None:
    """A nested object field: its dict, None when absent, null or empty; CheckpointError for any other type."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise field_error(source, name, data, OBJECT)
    return data or None
