"""A usage error (a bad flag value, a missing input, an output that cannot be written, a model or
backend that does not exist) is answered before torch is imported (issue 38: each took 2-5 s,
torch's import, before its one line). Checked in a fresh interpreter, which imports torch only if
a command does: the test process itself has imported it long ago."""

from __future__ import annotations

import json
import subprocess
import sys

# (arguments, a part of the one-line error); {tmp} is a folder of the test's own
CASES = [
    (["run", "--prompt", "hi", "--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
    (["run", "--prompt", "hi", "--cpu-threads", "0"], "--cpu-threads must lie in [1, 1024], got 0"),
    (["run", "--prompt", "hi", "--dist-timeout", "-1"], "--dist-timeout must be a number of seconds"),
    (["run", "--prompt", "hi", "--temperature", "-1"], "--temperature: temperature must be a finite number >= 0"),
    (["run", "--prompt", "hi", "--speculative", "bogus"], "--speculative: method must be one of mtp"),
    (["run", "--prompt", "hi", "--model", "tiny-v2"], "model path tiny-v2 does not exist; pass an HF checkpoint folder, or an embedded model: tiny-v3, tiny-v4, tiny-v41"),  # noqa: E501
    (["run", "--prompt", "hi", "--tokenizer", "{tmp}/none"], "tokenizer path {tmp}/none does not exist"),
    (["run", "--prompt", "hi", "--backend", "nope"], "unknown backend 'nope'; installed backends:"),
    (["run", "--prompt", "hi", "--chat-template", "{tmp}/none.jinja"], "--chat-template {tmp}/none.jinja: no such file"),
    (["run", "-i", "{tmp}/none.jsonl"], "input file {tmp}/none.jsonl not found"),
    (["run", "--prompt", "hi", "-o", "{tmp}"], "output {tmp} is a directory"),
    (["run", "--prompt", "hi", "-o", "{tmp}/none/out.jsonl"], "output folder {tmp}/none does not exist"),
    (["run-batch", "-i", "{tmp}/none.jsonl", "-o", "{tmp}/out.jsonl"], "input file {tmp}/none.jsonl not found"),
    (["serve", "--port", "99999"], "--port must lie in [0, 65535], got 99999"),
    (["serve", "--model", "tiny-v2"], "an embedded model: tiny-v3, tiny-v4, tiny-v41"),
]

PROBE = """
import contextlib, io, json, sys
from deepinfer.cli.main import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    results.append([code, err.getvalue()])
print(json.dumps({"results": results, "torch": "torch" in sys.modules}))
"""


def test_usage_errors_are_answered_before_torch_is_imported(tmp_path):
    cases = [([a.format(tmp=tmp_path) for a in argv], needle.format(tmp=tmp_path)) for argv, needle in CASES]
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps([argv for argv, _ in cases])], capture_output=True, text=True, check=True)
    report = json.loads(done.stdout)
    for (argv, needle), (code, err) in zip(cases, report["results"]):
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("deepinfer: error: ") and needle in lines[0], (argv, code, err)
    assert not report["torch"], "a usage error imported torch before it was answered"
