"""The docs a newcomer reads first must agree with the code: every command the README and docs/ show
parses with the real parser (the README's run as written, on the CPU), the example files are valid
input, the links lead somewhere, the counts and lists the docs quote are the code's, and the example
script shows every kind of prompt readably."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.errors import UserError

from waits import HANG_S

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# The pages a user runs commands from; docs/measurements/ keeps the commands of past runs as they were.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "backends").glob("*.md"))]
# The pages whose commands say which need a GPU (a CPU user reads which to skip).
USER_PAGES = [ROOT / name for name in ("README.md", "docs/usage.md", "docs/serving.md", "docs/benchmarks.md")]
README_MAX_LINES = 65  # one screen
SETUP = (
    "pip install torch==2.13.0 -e . && deepinfer run",
    "pip install torch==2.13.0 -e '.[test]' && python -m pytest -q -n 2 --dist loadfile",
)
PLACEHOLDER = re.compile(r"\.\.\.|[\[\]|<>]|(?:^|\s)-?-?[A-Z][A-Z0-9_=]*(?:\s|$)")  # a synopsis: `deepinfer run --ep N [--x]`


def fenced_commands(path: Path) -> list[tuple[str, str]]:
    """The `deepinfer ...` command lines of a page's code blocks (continuations joined), comments
    included, with where each starts; `torchrun ... -m deepinfer ...` counts too. A line that elides
    part of itself with "..." is not a command."""
    found, fenced, pending, where = [], False, "", ""
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.strip()
        if line.startswith("```"):
            fenced, pending = not fenced, ""
            continue
        if not fenced:
            continue
        if not pending:
            where = f"{path.relative_to(ROOT).as_posix()}:{number}"
        line = f"{pending} {line}" if pending else line
        if line.endswith("\\"):
            pending = line[:-1].strip()
            continue
        pending = ""
        command = command_text(line)
        if command.startswith("deepinfer ") and "..." not in command:
            found.append((where, line))
    return found


def command_text(line: str) -> str:
    """The command a code line runs, from `deepinfer` on, without its comment or prompt."""
    command = re.split(r"\s#\s", line, maxsplit=1)[0].strip().removeprefix("$ ")
    command = command.rsplit("&& ", 1)[-1]  # `pip install ... && deepinfer run`
    if " -m deepinfer " in f" {command}":
        command = "deepinfer " + command.split("-m deepinfer ", 1)[1]
    return command


def inline_commands(path: Path) -> list[tuple[str, str]]:
    """The `deepinfer ...` code spans of a page's prose that are whole command lines: at least one
    flag, no placeholder (N, FILE, ..., [optional], a|b)."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    spans = [" ".join(span.split()) for span in re.findall(r"`(deepinfer [^`]+)`", text)]
    return [(path.relative_to(ROOT).as_posix(), span) for span in spans if " -" in span and not PLACEHOLDER.search(span.split(" ", 1)[1])]


def doc_commands() -> list[tuple[str, str]]:
    return [item for page in PAGES for item in (*fenced_commands(page), *inline_commands(page))]


def words_of(line: str) -> list[str]:
    return shlex.split(command_text(line))[1:]


def needs_gpu(words: list[str]) -> bool:
    """A command that only runs on a GPU (or an NPU): a device backend outside the interpreter, a bench
    whose model only a GPU holds."""
    if "--interpret" in words:
        return False
    device_backend = any(a == "--backend" and b in ("cuda", "ascend") for a, b in zip(words, words[1:]))
    gpu_bench = words[:2] in (["bench", "e2e"], ["bench", "e2e-ep"], ["bench", "speculative"]) or "--model-shape" in words
    return device_backend or gpu_bench


@pytest.mark.parametrize(("where", "line"), doc_commands(), ids=lambda v: v if ":" in v or v.endswith(".md") else None)
def test_every_doc_command_parses(where, line, capsys):
    """A flag renamed or removed in the CLI must not leave a page behind: each command line the
    README and docs/ show parses with the real parser (`--help` ones print and exit 0). A code span
    in prose may name a command by a flag and leave out what it requires (`deepinfer conformance
    --deterministic`); a code block's line is whole."""
    from deepinfer.cli.main import build_parser, parse

    words = words_of(line)
    try:
        parse(build_parser(words), words)
    except UserError as exc:
        in_prose = ":" not in where
        if not (in_prose and str(exc).startswith("the following arguments are required")):
            pytest.fail(f"{where}: {line!r} does not parse: {exc}")
    except SystemExit as exc:
        assert exc.code == 0, f"{where}: {line!r} exits {exc.code}"
    capsys.readouterr()


def test_the_docs_show_commands_to_check():
    """The extraction itself finds the pages' commands (a broken pattern would check nothing)."""
    found = {where.split(":")[0] for where, _ in doc_commands()}
    assert {"README.md", "docs/usage.md", "docs/serving.md", "docs/benchmarks.md", "docs/distributed.md"} <= found


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: p.name)
def test_commands_that_need_a_gpu_say_so(page):
    """A command that only runs on a GPU says so in its comment; the README shows none."""
    for where, line in fenced_commands(page):
        if needs_gpu(words_of(line)):
            assert page.name != "README.md", f"{where}: the README shows a GPU command: {line}"
            comment = (re.split(r"\s#\s", line, maxsplit=1) + [""])[1]
            assert "GPU" in comment, f"{where}: {line!r} needs a GPU but its comment does not say so"


def test_readme_fits_one_screen_and_keeps_the_setup_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md is {len(text.splitlines())} lines; keep it to one screen"
    for command in SETUP:
        assert f"\n{command}\n" in text, f"README.md lost the set-up command {command!r}"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert SETUP[1].replace("pip install ", "pip install -q ", 1) in ci, ".ci/run no longer runs the README's test command"


def test_readme_links_every_doc_page():
    """A newcomer finds every page from the README."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    pages = [p.relative_to(ROOT).as_posix() for p in PAGES if p.name != "README.md"]
    missing = [page for page in pages if f"({page})" not in text]
    assert not missing, f"README.md does not link {missing}"


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lowercased, punctuation but - and _ dropped, spaces as -."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_and_example_files_exist(page):
    """Every relative link leads to a file (and a heading of it, for #anchors); every examples/ file named exists."""
    text = page.read_text(encoding="utf-8")
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file) if file else page
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(target)
    broken += [f for f in re.findall(r"\bexamples/[\w.-]+\.\w+", text) if not (ROOT / f).is_file()]
    assert not broken, f"{page.relative_to(ROOT)} points to missing files or headings: {sorted(set(broken))}"


def test_usage_describes_the_request_lines():
    text = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    for key in ('"prompt"', '"messages"', '"prompt_token_ids"', '"custom_id"', '"error"', "`id`", "`finish_reason`"):
        assert key in text, f"docs/usage.md does not describe the key {key}"


def test_usage_lists_the_run_flag_groups_as_the_parser_has_them():
    """docs/usage.md's table of `deepinfer run`'s flag groups: every group, each with its own flags."""
    import argparse

    from deepinfer.cli.flag_help import flag_groups
    from deepinfer.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    for name, group in flag_groups(sub.choices["run"]).items():
        row = re.search(rf"^\| {name} \| (.*?) \|", text, re.M)
        assert row, f"docs/usage.md's flag table has no row for the group {name}"
        listed = set(re.findall(r"`(--?[a-z][a-z-]*)`", row.group(1)))
        spellings = {s: a for a in group._group_actions for s in a.option_strings}
        assert listed <= set(spellings), f"group {name}: docs/usage.md lists {sorted(listed - set(spellings))}, not in the group"
        missing = [a.option_strings[-1] for a in group._group_actions if not listed & set(a.option_strings)]
        assert not missing, f"group {name}: docs/usage.md does not list {missing}"


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


def test_readme_commands_run_on_this_cpu(tmp_path, monkeypatch, capsys):
    """Every command the README shows runs as written on a CPU, from a checkout's root (the examples
    beside it), and so does its Python snippet."""
    from deepinfer.cli.main import main

    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    lines = [line for _, line in fenced_commands(ROOT / "README.md")]
    assert len(lines) >= 6, lines  # the set-up's `deepinfer run` and the quick start's five
    for line in lines:
        assert main(words_of(line)) == 0, f"{line}: {capsys.readouterr().err[-2000:]}"
    (snippet,) = python_blocks(ROOT / "README.md")
    exec(compile(snippet, "README.md", "exec"), {})
    assert "->" in capsys.readouterr().out


def test_usage_python_snippet_runs(capsys):
    (snippet,) = python_blocks(ROOT / "docs" / "usage.md")
    exec(compile(snippet, "docs/usage.md", "exec"), {})
    assert capsys.readouterr().out.strip()


def example(name: str) -> Path:
    return ROOT / "examples" / name


@pytest.mark.parametrize("name", ["prompts.jsonl", "structured.jsonl"])
def test_example_run_files_hold_runnable_lines(name):
    """Each line reads as `deepinfer run` reads it and makes a valid SamplingParams; each grammar compiles."""
    from deepinfer.cli.main import build_parser, parse
    from deepinfer.cli.run_requests import make_params, read_jsonl_requests
    from deepinfer.engine.grammar_sandbox import check_compiles
    from deepinfer.engine.structured_params import StructuredOutputsParams

    args = parse(build_parser(["run"]), ["run"])
    for request in read_jsonl_requests(str(example(name))):
        assert request.error is None, request.error
        params = make_params(args, request)
        assert params is not None, request.error
        spec = params.structured_outputs
        if spec is not None:
            check_compiles(spec if isinstance(spec, StructuredOutputsParams) else StructuredOutputsParams(**spec))


def test_example_prompts_show_every_kind_of_line():
    lines = [json.loads(line) for line in example("prompts.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
    for key in ("prompt", "messages", "prompt_token_ids", "custom_id", "logprobs"):
        assert any(key in line for line in lines), f"examples/prompts.jsonl has no line with {key!r}"


def test_example_batch_file_lines_validate():
    from deepinfer.cli.batch_requests import read_batch_requests, sampling_params
    from deepinfer.cli.request_fields import CHAT, COMPLETIONS

    requests = read_batch_requests(str(example("requests.jsonl")), ["tiny-v3"])
    for request in requests:
        assert request.failure is None, request.failure
        assert sampling_params(request, 0) is not None, request.failure
    assert {r.url for r in requests} == {CHAT, COMPLETIONS}


def test_example_schema_is_a_valid_json_schema_that_compiles():
    import jsonschema

    from deepinfer.engine.grammar_sandbox import check_compiles
    from deepinfer.engine.structured_params import StructuredOutputsParams

    schema = json.loads(example("person.json").read_text(encoding="utf-8"))
    jsonschema.validators.validator_for(schema).check_schema(schema)
    jsonschema.validate({"name": "Ada", "age": 36}, schema)
    check_compiles(StructuredOutputsParams(json=schema))


def test_docs_name_capabilities_not_issue_numbers():
    """Issue numbers mean nothing to a reader of the docs; the capability's name does."""
    for path in DOCS:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            assert not re.search(r"\bissue[ _-]?\d+", line, re.IGNORECASE), f"{path.name}:{number} refers to an issue number: {line.strip()}"


def test_architecture_lists_every_weight_format():
    from deepinfer.ops.gemm import FORMATS

    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = [fmt for fmt in FORMATS if f'"{fmt}"' not in text]
    assert not missing, f"docs/architecture.md does not list the weight formats {missing}"


def test_support_matrix_quotes_the_golden_set_size():
    manifest = json.loads((ROOT / "conformance" / "golden" / "manifest.json").read_text())
    text = (ROOT / "docs" / "support-matrix.md").read_text(encoding="utf-8")
    quoted = re.search(r"the set now has (\d+)", text)
    assert quoted, "docs/support-matrix.md does not say how many golden cases the set has"
    assert int(quoted.group(1)) == len(manifest["cases"])


def test_distributed_doc_does_not_deny_ep_graphs():
    """The engine replays EP > 1 decode steps as CUDA graphs; the doc must not say they never are."""
    text = (ROOT / "docs" / "distributed.md").read_text(encoding="utf-8")
    assert "are not\n  captured in CUDA graphs" not in text and "are not captured in CUDA graphs" not in text


def test_example_prints_token_id_prompts_readably(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "offline_inference.py"), "--backend", "reference"],
        capture_output=True, text=True, timeout=HANG_S, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "prompt: None" not in result.stdout
    assert "prompt: token ids [" in result.stdout
