"""`deepinfer run --ep N` and `bench e2e-ep --ep N` as a user starts them (the launcher starts
torchrun): whatever can be checked is checked once before any rank starts, with one line; a rank
that still fails (a broken checkpoint, a rank that dies) is reported in ONE line by the launcher,
torchrun's own report kept in a log folder; rank 0's progress reaches the user."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from waits import HANG_S

PROMPTS = [[0, 2182, 11, 1100, 6657, 344], [0, 671, 7664, 294], [0, 16, 223, 17, 223, 18], [0, 4117]]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    from deepinfer.model.embedded import ensure_embedded

    root = tmp_path_factory.mktemp("deepinfer_cache")
    ensure_embedded(root)
    return root


def env_for(cache: Path, tmp: Path, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(DEEPINFER_CACHE=str(cache), OMP_NUM_THREADS="1", TMPDIR=str(tmp), **extra)
    return env


def deepinfer(*args: str, env: dict[str, str], timeout: float = HANG_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer", *args], env=env, capture_output=True, text=True, timeout=timeout)


def in_process(argv: list[str], cache: Path, tmp: Path, monkeypatch, capsys) -> tuple[int, str]:
    """`deepinfer <argv>` in this process (a refusal before any rank starts needs no process of its
    own; the README's own command below still runs as a user runs it): exit code and stderr."""
    from deepinfer.cli.main import main

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DEEPINFER_CACHE", str(cache))
    monkeypatch.setenv("TMPDIR", str(tmp))
    capsys.readouterr()
    code = main(argv)
    return code, capsys.readouterr().err


def error_lines(stderr: str) -> list[str]:
    markers = ("deepinfer: error", "Traceback", "[rank", "ChildFailedError")
    return [line for line in stderr.splitlines() if any(m in line for m in markers)]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--ep", "3", "--prompt", "hi"], "do not divide over --ep 3"),
        (["--ep", "2", "--num-redundant-experts", "1", "--prompt", "hi"], "(e.g. 0)"),
        (["--ep", "2", "--backend", "cuda", "--prompt", "hi"], "not available"),
        (["--ep", "2", "-i", "missing.jsonl"], "not found"),
        (["--ep", "2", "--dist-timeout", "-1", "--prompt", "hi"], "--dist-timeout"),
        (["--ep", "2", "--temperature", "-1", "--prompt", "hi"], "--temperature"),
        (["--ep", "2", "--expert-load", "missing.json", "--prompt", "hi"], "expert load"),
        (["--ep", "2", "--model", "no/such/folder", "--prompt", "hi"], "does not exist"),
    ],
)
def test_run_ep_checks_once_before_starting_ranks(cache, tmp_path, argv, needle, monkeypatch, capsys):
    argv = [str(tmp_path / a) if a.startswith("missing") else a for a in argv]
    code, stderr = in_process(["run", "--no-progress", *argv], cache, tmp_path, monkeypatch, capsys)
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("deepinfer: error: ") and needle in lines[0], stderr
    assert "starting" not in stderr, "ranks were started"


def test_run_ep_with_everything_already_done_starts_no_rank(cache, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "x"}\n', encoding="utf-8")
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": 1, "error": {"message": "m", "type": "invalid_request_error"}}\n', encoding="utf-8")
    proc = deepinfer("run", "--ep", "2", "-i", str(src), "-o", str(out), "--resume", env=env_for(cache, tmp_path))
    assert proc.returncode == 0 and "nothing to do" in proc.stderr and "starting" not in proc.stderr, proc.stderr


def test_a_rank_failure_is_one_line_from_the_launcher(cache, tmp_path):
    """Every rank fails to load a truncated checkpoint (its config.json, checked before, is fine)."""
    import shutil

    from deepinfer.model.embedded import NAME

    model = tmp_path / "model"
    shutil.copytree(cache / NAME, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    proc = deepinfer("run", "--ep", "2", "--backend", "reference", "--model", str(model), "--prompt", "hi", env=env_for(cache, tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert "starting 2 ranks" in proc.stderr
    errors = error_lines(proc.stderr)
    assert len(errors) == 1, proc.stderr  # not one per rank, no torchrun report, no traceback
    assert errors[0].startswith("deepinfer: error: rank ") and "model.safetensors" in errors[0] and "(logs: " in errors[0], errors
    folder = Path(errors[0].rsplit("(logs: ", 1)[1].rstrip(")"))
    assert folder.parent == tmp_path and "FAILED" in (folder / "torchrun.log").read_text()  # torchrun's report, kept


def test_a_rank_that_dies_is_one_line_and_resume_completes_the_rows(cache, tmp_path):
    """Rank 1 dies (exit 7, no message) at its third step; rank 0 has written the first result."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    from deepinfer.engine.llm_engine import LLMEngine\n"
        "    def die(self):\n"
        "        if self.num_steps + 1 >= 3:\n"
        "            os._exit(7)\n"
        "    before_step = LLMEngine.before_step  # once per step on every rank\n"
        "    LLMEngine.before_step = lambda self: (die(self), before_step(self))[1]\n"
    )
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt_token_ids": p, "max_tokens": 1 if i == 0 else 30}) + "\n" for i, p in enumerate(PROMPTS[:3])))
    out = tmp_path / "out.jsonl"
    env = env_for(cache, tmp_path, PYTHONPATH=os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    args = ["--ep", "2", "--backend", "reference", "--dtype", "float32", "--no-progress", "--num-kv-blocks", "32", "--temperature", "0", "--ignore-eos"]
    proc = deepinfer("run", *args, "--dist-timeout", "30", "-i", str(src), "-o", str(out), env=env)
    assert proc.returncode != 0
    errors = error_lines(proc.stderr)
    assert len(errors) == 1 and "rank 1 exited with code 7" in errors[0], proc.stderr
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [0]
    # --resume (no fault now) completes the file: every row once, in input order.
    proc = deepinfer("run", *args, "-i", str(src), "-o", str(out), "--resume", env=env_for(cache, tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [0, 1, 2]


def test_run_ep_shows_rank0_progress_and_writes_in_input_order(cache, tmp_path):
    """Rows in input order, a bad line's error row among them (exit code 1, no error line); rank
    0's bar counts the tokens of both ranks."""
    lines = [{"id": f"r{i}", "prompt_token_ids": p, "max_tokens": 8 - 2 * i} for i, p in enumerate(PROMPTS)]
    lines.insert(2, {"id": "bad", "prompt": "x", "presence_penalty": 3})
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    run = ("run", "--ep", "2", "--backend", "reference", "--dtype", "float32", "--num-kv-blocks", "32", "-i", str(src), "-o", str(out))
    proc = deepinfer(*run, env=env_for(cache, tmp_path))
    assert proc.returncode == 1 and not error_lines(proc.stderr), proc.stderr
    assert "tok generated" in proc.stderr and "est. speed input" in proc.stderr
    assert "20 tok generated" in proc.stderr  # 8 + 6 + 4 + 2 tokens, counted on both ranks
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["id"] for row in rows] == [line["id"] for line in lines]
    assert "presence_penalty" in rows[2]["error"]["message"] and all("text" in row for i, row in enumerate(rows) if i != 2)
    assert not list(tmp_path.glob("deepinfer-run-*")), "a run that completes leaves no log folder"


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--ep", "2", "--layers", "61", "--dense-layers", "3", "--num-redundant-experts", "32"], "of RAM available"),
        (["--ep", "2", "--backend", "cuda"], "not available"),
        (["--ep", "2", "--dist-timeout", "0"], "--dist-timeout"),
    ],
)
def test_bench_e2e_ep_checks_before_starting_ranks(cache, tmp_path, argv, needle, monkeypatch, capsys):
    """The full-depth V3 shape needs hundreds of GiB per rank: refused on any CPU host, with the estimate."""
    code, stderr = in_process(["bench", "e2e-ep", *argv], cache, tmp_path, monkeypatch, capsys)
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("deepinfer: error: ") and needle in lines[0], stderr
    assert "starting" not in stderr and "Traceback" not in stderr


def test_the_readme_bench_e2e_ep_command_on_this_cpu_host(cache, tmp_path):
    """`deepinfer bench e2e-ep --ep 2 --num-redundant-experts 32` (docs/benchmarks.md's two-GPU line) on a CPU
    host that cannot hold two ranks of the model: one line, before any rank starts."""
    import torch

    from deepinfer.bench import e2e_ep
    from deepinfer.model.memory import host_available

    need = 2 * e2e_ep.rank_memory_bytes(e2e_ep.model_config(4, 1), 2, 32, torch.bfloat16, 256, 128, 32, 16)
    if torch.cuda.is_available() or (host_available() or 0) > need:
        pytest.skip("this host could run it")
    proc = deepinfer("bench", "e2e-ep", "--ep", "2", "--num-redundant-experts", "32", env=env_for(cache, tmp_path))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "GiB" in proc.stderr, proc.stderr


def test_ctrl_c_stops_every_rank_with_one_line(cache, tmp_path):
    """SIGINT to the whole process group (what a terminal's Ctrl-C sends) once rank 0 has its model."""
    import signal

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt_token_ids": p, "max_tokens": 500}) + "\n" for i, p in enumerate(PROMPTS)))
    args = ["run", "--ep", "2", "--backend", "reference", "--no-progress", "--ignore-eos", "-i", str(src), "-o", str(tmp_path / "out.jsonl")]
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer", *args], env=env_for(cache, tmp_path), stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "dummy weights" in line:  # rank 0 has loaded the model: the ranks are generating
            break
    os.killpg(proc.pid, signal.SIGINT)
    rest = proc.stderr.read()
    proc.wait(timeout=HANG_S)
    stderr = "".join(seen) + rest
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1].startswith("deepinfer: interrupted (logs: "), stderr
    assert not error_lines(stderr), stderr
