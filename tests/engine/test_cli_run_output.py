"""`deepinfer run -o`: the output file is never the input, never written by two runs at once, never
half-replaced; rows come in input order, so kills at any point and a disk that fills up end, after
--resume, in exactly the file an uninterrupted run writes."""

from __future__ import annotations

import fcntl
import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest

from deepinfer.cli.main import main

from cli_helpers import write_lines
from waits import HANG_S

FAST = ["--backend", "reference", "--no-progress", "--num-kv-blocks", "64"]
# Sampled (seeds follow the lines, so a resumed run repeats), two sequences a step: later requests
# with short budgets finish before earlier long ones.
SAMPLING = ["--temperature", "1.0", "--seed", "7", "--max-num-seqs", "2"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    from deepinfer.model.embedded import ensure_embedded

    root = tmp_path_factory.mktemp("deepinfer_cache")
    ensure_embedded(root)
    return root


@pytest.fixture(autouse=True)
def model_cache(cache, monkeypatch):
    monkeypatch.setenv("DEEPINFER_CACHE", str(cache))


def prompts_file(tmp_path, n: int = 10):
    # Budgets that make completion order differ from input order.
    return write_lines(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": f"Story {i}:", "max_tokens": 24 if i % 3 == 0 else 3} for i in range(n)])


def cli(*args, env=None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "deepinfer", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def child_env(cache) -> dict:
    return {**os.environ, "DEEPINFER_CACHE": str(cache), "OMP_NUM_THREADS": "1"}


def rows_in(path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def one_line_error(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    *before, last = err.splitlines()
    assert last.startswith("deepinfer: error: ") and all(line.startswith("deepinfer: model ") for line in before), err
    for needle in needles:
        assert needle in last, last
    return last


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cache):
    """The output of an uninterrupted run over prompts_file()."""
    tmp = tmp_path_factory.mktemp("full")
    src = prompts_file(tmp)
    out = tmp / "full.jsonl"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE", str(cache))
        assert main(["run", *FAST, *SAMPLING, "-i", str(src), "-o", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    assert [json.loads(line)["id"] for line in text.splitlines()] == [f"r{i}" for i in range(10)], "rows in input order"
    return src, text


def test_kill_9_at_several_points_then_resume_gives_the_uninterrupted_file(tmp_path, cache, uninterrupted, monkeypatch):
    src, full = uninterrupted
    out = tmp_path / "out.jsonl"
    argv = ["run", *FAST, *SAMPLING, "-i", str(src), "-o", str(out)]
    for kill_after in (1, 5):  # rows in the file when the run is killed (the second run resumes the first)
        proc = cli(*argv, *(["--resume"] if out.exists() else []), env=child_env(cache))
        while rows_in(out) < kill_after and proc.poll() is None:
            time.sleep(0.02)
        proc.kill()
        proc.communicate()
        assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    monkeypatch.setenv("DEEPINFER_CACHE", str(cache))
    assert main([*argv, "--resume"]) == 0  # the last resume in this process
    assert out.read_text(encoding="utf-8") == full  # every row once, in input order, identical


def test_a_full_disk_keeps_the_rows_before_and_resume_completes(tmp_path, cache, uninterrupted):
    """The file size limit makes a write fail part-way (EFBIG, as ENOSPC would): one line, the
    whole rows before it kept, the torn one dropped by --resume."""
    src, full = uninterrupted
    out = tmp_path / "out.jsonl"
    limit = len("".join(full.splitlines(keepends=True)[:3]).encode()) + 10  # three rows and a bit of the fourth

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process

    proc = cli("run", *FAST, *SAMPLING, "-i", str(src), "-o", str(out), env=child_env(cache), preexec_fn=small_files)
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 2, err
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert f"cannot write {out}" in errors[0] and "the 3 rows written before are kept" in errors[0], errors[0]
    assert out.read_text(encoding="utf-8").startswith("".join(full.splitlines(keepends=True)[:3]))
    assert main(["run", *FAST, *SAMPLING, "-i", str(src), "-o", str(out), "--resume"]) == 0
    assert out.read_text(encoding="utf-8") == full


def test_dev_full_is_one_line(tmp_path, cache):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    proc = cli("run", *FAST, "--prompt", "hi", "--max-tokens", "2", "-o", "/dev/full", env=child_env(cache))
    _, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 2
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("deepinfer: error: cannot write /dev/full: No space left on device (the disk is full)"), err
    assert err.count("deepinfer: error:") == 1


@pytest.mark.parametrize("how", ["same", "hard link", "symlink"])
@pytest.mark.parametrize("mode", ["--resume", "--overwrite"])
def test_the_output_may_not_be_the_input(tmp_path, capsys, how, mode):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "a"}\n{"id": 2, "prompt": "b"}', encoding="utf-8")  # no newline at the end
    before = src.read_bytes()
    out = {"same": src, "hard link": tmp_path / "link.jsonl", "symlink": tmp_path / "sym.jsonl"}[how]
    if how == "hard link":
        os.link(src, out)
    elif how == "symlink":
        out.symlink_to(src)
    one_line_error(capsys, ["run", *FAST, "-i", str(src), "-o", str(out), mode], "is the input file")
    assert src.read_bytes() == before


@pytest.mark.parametrize(
    "content, needles",
    [
        ('{"id": 1, "text": "a"}\n{"foo": 1', ["line 2", "not a deepinfer result or error row, nor the start of one"]),
        ('{"id": 1, "text": "a"}\n{"id": 3, "prompt": "an input line"}', ["line 2", "nor the start of one"]),
        ('{"id": 1, "prompt": "x"}\n{"id": 2, "text": "b"}\n', ["line 1", "not a deepinfer result or error row"]),
        ('{"id": 1, "text": "a"}\nnot json\n', ["line 2", "not valid JSON"]),
    ],
)
def test_resume_refuses_what_is_not_a_row_and_changes_nothing(tmp_path, capsys, content, needles):
    src = write_lines(tmp_path / "in.jsonl", [{"id": i, "prompt": "x"} for i in range(1, 4)])
    out = tmp_path / "out.jsonl"
    out.write_text(content, encoding="utf-8")
    one_line_error(capsys, ["run", *FAST, "-i", str(src), "-o", str(out), "--resume"], str(out), *needles)
    assert out.read_text(encoding="utf-8") == content


def test_resume_drops_a_torn_row_and_completes_a_whole_one(tmp_path, capsys):
    src = write_lines(tmp_path / "in.jsonl", [{"id": i, "prompt": "x"} for i in range(1, 4)])
    out = tmp_path / "out.jsonl"
    whole = '{"id": 1, "prompt": "x", "text": "a", "token_ids": [], "finish_reason": "length", "prompt_tokens": 1, "completion_tokens": 0}'
    out.write_text(whole + '\n{"id": 2, "error": {"message": "m", "type": "invalid_request_error"}}\n{"id": 3, "prompt": "x", "te', encoding="utf-8")
    assert main(["run", *FAST, "--max-tokens", "2", "-i", str(src), "-o", str(out), "--resume"]) == 0
    assert "unfinished last line" in capsys.readouterr().err
    assert [json.loads(line)["id"] for line in out.read_text(encoding="utf-8").splitlines()] == [1, 2, 3]


def test_a_second_run_on_a_locked_output_fails_at_once(tmp_path, capsys):
    src = write_lines(tmp_path / "in.jsonl", [{"id": 1, "prompt": "x"}])
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": 0, "text": "kept"}\n', encoding="utf-8")
    with open(out, "rb") as other:  # what a running deepinfer holds
        fcntl.flock(other.fileno(), fcntl.LOCK_EX)
        one_line_error(capsys, ["run", *FAST, "-i", str(src), "-o", str(out), "--resume"], "in use by another deepinfer run")
        one_line_error(capsys, ["run", *FAST, "-i", str(src), "-o", str(out), "--overwrite"], "in use by another deepinfer run")
    assert out.read_text(encoding="utf-8") == '{"id": 0, "text": "kept"}\n'


def test_a_run_that_fails_before_generating_keeps_the_old_file_and_leaves_no_new_one(tmp_path, capsys):
    old = tmp_path / "old.jsonl"
    old.write_text('{"id": 0, "text": "precious"}\n', encoding="utf-8")
    one_line_error(capsys, ["run", *FAST, "--prompt", "hi", "--model", str(tmp_path / "missing"), "-o", str(old), "--overwrite"], "does not exist")
    assert old.read_text(encoding="utf-8") == '{"id": 0, "text": "precious"}\n'
    new = tmp_path / "new.jsonl"
    one_line_error(capsys, ["run", *FAST, "--prompt", "hi", "--model", str(tmp_path / "missing"), "-o", str(new)], "does not exist")
    assert not new.exists()
