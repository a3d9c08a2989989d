"""Structured outputs a hostile client sent (issue 38), built here for the engine's and the server's
tests. Sizes: each fits the default --max-grammar-bytes (256 KiB) unless its name says otherwise."""

from __future__ import annotations


def _name(i: int) -> str:
    """A short rule name: a, b, ..., z, ba, bb, ... (so many chained rules stay under the byte limit)."""
    text = ""
    while True:
        text = "abcdefghijklmnopqrstuvwxyz"[i % 26] + text
        i //= 26
        if not i:
            return text


def lark_chain(rules: int) -> str:
    """A Lark grammar of `rules` rules, each only the next one: its only sentence is "x"."""
    return "start: ra\n" + "\n".join(f"r{_name(i)}: r{_name(i + 1)}" for i in range(rules)) + f'\nr{_name(rules)}: "x"'


def ref_chain(refs: int) -> dict:
    """A JSON schema whose $defs chain `refs` $refs, each through an object's property."""
    defs = {f"d{i}": {"properties": {"n": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(refs)}
    defs[f"d{refs}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def nested_schema(levels: int) -> dict:
    """An object schema nested `levels` objects deep (each level is two JSON objects)."""
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


# Took llguidance down (a stack overflow, a segmentation fault of the whole process) before issue 38:
CRASHED_BEFORE = {"lark_3000": lark_chain(3000), "refs_1000": ref_chain(1000)}
# Deep enough to crash llguidance's checking child (32 MiB stack): refused, the engine running on.
CRASHES_THE_CHECK = {"lark_20000": lark_chain(20_000), "refs_4000": ref_chain(4000)}
# Nothing matches them.
UNSATISFIABLE = [{"regex": r"[^\s\S]"}, {"json": {"$ref": "#"}}, {"grammar": "start: start"}]
