"""`deepinfer run`'s structured-output flags: --json-schema FILE, --regex REGEX, --choice TEXT
(repeat for each choice), --grammar FILE (Lark, or GBNF/EBNF). At most one of them; it applies to
every request that has no "structured_outputs" or "response_format" field of its own (a line's
field wins, {"type": "text"} included: that line runs free). --disable-any-whitespace (vLLM's
option of that name) keeps --json-schema's JSON free of whitespace between its tokens.

The flag is read and its grammar checked by llguidance once, before the model loads (in a child
process: deepinfer.engine.grammar_sandbox): a file that cannot be read, a schema that is not JSON,
a grammar over --max-grammar-bytes, a regex, schema or grammar that does not compile or crashes
llguidance, or llguidance missing is one line naming the flag (exit 2), not an error row per request.
"""

from __future__ import annotations

import json
from pathlib import Path

from deepinfer.errors import UserError

FLAGS = ("json_schema", "regex", "choice", "grammar")

STRUCTURED_HELP = """structured output for every request without a structured_outputs or response_format field
At most one of --json-schema, --regex, --choice, --grammar (needs llguidance: pip install
'deepinfer[structured]'). A line's own field wins ({"type": "text"} included: that line runs free).
A file that cannot be read or a grammar that does not compile stops the run before it starts."""


def add_structured_flags(p) -> None:
    group = p.add_argument_group("structured", STRUCTURED_HELP)
    one = group.add_mutually_exclusive_group()
    one.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid under the JSON schema in FILE")
    one.add_argument("--regex", metavar="REGEX", help="the output matches REGEX (whole)")
    one.add_argument("--choice", action="append", metavar="TEXT", help="the output is one of the choices (repeat for each)")
    one.add_argument("--grammar", metavar="FILE", help="the output is a sentence of the Lark (or GBNF/EBNF) grammar in FILE")
    group.add_argument("--disable-any-whitespace", action="store_true",
                       help="with --json-schema: no whitespace between the JSON's tokens (vLLM's disable_any_whitespace)")
    p.set_defaults(structured_outputs=None)  # check_structured_flags: the flag's StructuredOutputsParams fields


def _read(flag: str, path: str) -> str:
    file = Path(path).expanduser()
    if file.is_dir():
        raise UserError(f"{flag} {path} is a folder; pass a file")
    try:
        return file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{flag} {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{flag} {path} cannot be read: {exc}") from None


def check_structured_flags(args) -> None:
    """args.structured_outputs: the flag's StructuredOutputsParams fields (None without one), its
    grammar checked; a UserError naming the flag otherwise."""
    given = [name for name in FLAGS if getattr(args, name) is not None]
    if args.disable_any_whitespace and given != ["json_schema"]:
        raise UserError("--disable-any-whitespace applies to --json-schema only")
    if not given:
        args.structured_outputs = None
        return
    flag = "--" + given[0].replace("_", "-")
    value = getattr(args, given[0])
    if given[0] == "json_schema":
        text = _read(flag, value)
        try:
            fields = {"json": json.loads(text), "disable_any_whitespace": args.disable_any_whitespace}
        except ValueError as exc:
            raise UserError(f"{flag} {value} is not valid JSON ({exc})") from None
    elif given[0] == "grammar":
        fields = {"grammar": _read(flag, value)}
    else:
        fields = {given[0]: value}
    from deepinfer.engine.grammar_sandbox import check_compiles
    from deepinfer.engine.grammar_source import GrammarError, require_llguidance
    from deepinfer.engine.structured_params import StructuredOutputsParams

    try:
        spec = StructuredOutputsParams(**fields)
        require_llguidance()
        if spec.size() > args.max_grammar_bytes:
            raise GrammarError(f"the {spec.kind} is {spec.size()} bytes, over --max-grammar-bytes {args.max_grammar_bytes}")
        check_compiles(spec)
    except (ValueError, GrammarError) as exc:
        raise UserError(f"{flag}: {str(exc).removeprefix('StructuredOutputsParams: ')}") from None
    args.structured_outputs = fields
