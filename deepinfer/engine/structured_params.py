"""StructuredOutputsParams: what a request's output must match (vLLM's shape), checked when it is made.

Exactly one kind per request: json (a JSON schema, as a str or a dict), regex, choice (a list of
strings), grammar (Lark, or GBNF/EBNF, which llguidance converts to Lark) or json_object (any JSON
object). Options honoured: disable_any_whitespace and whitespace_pattern (JSON whitespace between
tokens), disable_additional_properties (objects of the schema that do not say otherwise take no
other keys), disable_fallback (there is no fallback: always honoured), backend (None, "auto",
"guidance" or "llguidance": llguidance is the one grammar engine). structural_tag is refused.
The grammar itself is compiled later, off the engine thread (deepinfer.engine.grammar_compiler): a
schema or a regex that does not compile fails its request alone, with the compiler's message.

Bounds: a schema nests at most MAX_SCHEMA_DEPTH objects and arrays inside each other (checked here:
llguidance's JSON reader stops at about 124 anyway, and the Python walks over a schema must not
recurse without end); the engine bounds the spec's bytes (`size`, EngineConfig.max_grammar_bytes).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

from deepinfer.engine.sampling_params import InvalidRequestError, short_repr

KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_SCHEMA_DEPTH = 120
BACKENDS = (None, "auto", "guidance", "llguidance")


def _bad(message: str) -> InvalidRequestError:
    return InvalidRequestError(f"StructuredOutputsParams: {message}")


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    backend: str | None = None

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise _bad(f"give exactly one of {', '.join(KINDS)}; got {', '.join(given) if given else 'none'}")
        if self.structural_tag is not None:
            raise _bad("structural_tag is not supported; use json, regex, choice or grammar")
        if self.backend not in BACKENDS:
            raise _bad(f"backend must be 'guidance' (llguidance, the only one) or unset, got {short_repr(self.backend)}")
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(f"{name} must be True or False, got {short_repr(getattr(self, name))}")
        if self.whitespace_pattern is not None and (not isinstance(self.whitespace_pattern, str) or not self.whitespace_pattern):
            raise _bad(f"whitespace_pattern must be a non-empty regex string, got {short_repr(self.whitespace_pattern)}")
        if self.json_object not in (None, True, False):
            raise _bad(f"json_object must be True, False or None, got {short_repr(self.json_object)}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise _bad(f"{name} must be a non-empty string, got {short_repr(value)}")
        choice = self.choice
        if choice is not None and (not isinstance(choice, (list, tuple)) or not choice or not all(isinstance(c, str) and c for c in choice)):
            raise _bad(f"choice must be a non-empty list of non-empty strings, got {short_repr(self.choice)}")
        if self.json is not None:
            self.json = self._schema(self.json)

    @staticmethod
    def _schema(schema) -> dict | bool:
        """The schema as a JSON value (a str is parsed): an object, or true / false."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise _bad(f"json is not valid JSON ({exc})") from None
            except RecursionError:
                raise _too_deep() from None
        if not isinstance(schema, (dict, bool)):
            raise _bad(f"json must be a JSON schema (an object), got {short_repr(schema)}")
        if _deeper_than(schema, MAX_SCHEMA_DEPTH):
            raise _too_deep()
        try:
            json.dumps(schema)
        except (TypeError, ValueError) as exc:
            raise _bad(f"json schema is not JSON-serializable ({exc})") from None
        return schema

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical spec text with the options that change the grammar): the compile cache's key."""
        kind = self.kind
        if kind in ("json", "json_object"):
            return "json", json.dumps([self.json_schema(), self.json_options()], sort_keys=True)
        if kind == "choice":
            return kind, json.dumps(list(self.choice))
        return kind, getattr(self, kind)

    def size(self) -> int:
        """The spec's bytes as the grammar compiler gets them (its key's text): what
        EngineConfig.max_grammar_bytes bounds."""
        return len(self.key()[1].encode())

    def json_schema(self) -> dict | bool:
        """The JSON schema to compile (json_object: any object), with disable_additional_properties applied."""
        schema = {"type": "object"} if self.kind == "json_object" else self.json
        if self.disable_additional_properties:
            schema = copy.deepcopy(schema)
            _close_objects(schema)
        return schema

    def json_options(self) -> dict:
        """llguidance's JSON compile options for the whitespace settings."""
        options = {}
        if self.disable_any_whitespace:
            options["whitespace_flexible"] = False
        if self.whitespace_pattern is not None:
            options["whitespace_pattern"] = self.whitespace_pattern
        return options


def _too_deep() -> InvalidRequestError:
    return _bad(f"the json schema nests objects and arrays more than {MAX_SCHEMA_DEPTH} deep; llguidance reads no deeper, flatten it (with $defs)")


def _deeper_than(value, limit: int) -> bool:
    """Whether objects and arrays nest in value more than `limit` deep (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _close_objects(node) -> None:
    """additionalProperties: false on every object schema (one with properties, or type object) that
    does not set it, recursively (vLLM's disable_additional_properties)."""
    if isinstance(node, list):
        for item in node:
            _close_objects(item)
        return
    if not isinstance(node, dict):
        return
    if ("properties" in node or node.get("type") == "object") and "additionalProperties" not in node:
        node["additionalProperties"] = False
    for value in node.values():
        _close_objects(value)
