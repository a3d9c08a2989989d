"""`deepinfer run-batch --ep N` runs on `deepinfer run`'s ranks: the launcher restarts the same
command (its flags, --served-model-name's several names included) on N ranks, rank 0 writes the
rows in input order, and the results are the ones one process writes, "n" samples included (a
request's samples run on its rank)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from waits import HANG_S

HI = [{"role": "user", "content": "Say hi"}]
LINES = [
    {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hello, my name is", "max_tokens": 6, "seed": 1}},
    {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "alias", "messages": HI, "max_tokens": 3}},
    {"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "echo": True}},
    {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": [[0, 671, 7664], [0, 16, 223, 17]], "max_tokens": 4}},
    {"custom_id": "d", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": HI, "max_completion_tokens": 2, "temperature": 0}},
    {"custom_id": "n", "method": "POST", "url": "/v1/completions", "body": {"prompt": ["The sky", "One two"], "n": 3, "max_tokens": 4, "seed": 7}},
    {"custom_id": "n-chat", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": HI, "n": 2, "max_tokens": 3}},
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    from deepinfer.model.embedded import ensure_embedded

    root = tmp_path_factory.mktemp("deepinfer_cache")
    ensure_embedded(root)
    return root


def deepinfer(*args: str, cache: Path, tmp: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(DEEPINFER_CACHE=str(cache), OMP_NUM_THREADS="1", TMPDIR=str(tmp))
    return subprocess.run([sys.executable, "-m", "deepinfer", *args], env=env, capture_output=True, text=True, timeout=HANG_S)


def content(row: dict) -> dict:
    body = row["response"]["body"]
    if body is None:
        return {"custom_id": row["custom_id"], "error": row["error"]}
    return {"custom_id": row["custom_id"], "choices": body["choices"], "usage": body["usage"], "model": body["model"]}


def test_run_batch_ep_writes_what_one_process_writes(cache, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in LINES), encoding="utf-8")
    common = ["--backend", "reference", "--dtype", "float32", "--num-kv-blocks", "32", "--no-progress", "--served-model-name", "deepseek", "alias"]
    alone, ranks = tmp_path / "alone.jsonl", tmp_path / "ranks.jsonl"
    proc = deepinfer("run-batch", *common, "-i", str(src), "-o", str(alone), cache=cache, tmp=tmp_path)
    assert proc.returncode == 1, proc.stderr
    proc = deepinfer("run-batch", "--ep", "2", *common, "-i", str(src), "-o", str(ranks), cache=cache, tmp=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "starting 2 ranks" in proc.stderr and "deepinfer: error" not in proc.stderr, proc.stderr
    rows = [json.loads(line) for line in ranks.read_text(encoding="utf-8").splitlines()]
    assert [row["custom_id"] for row in rows] == [line["custom_id"] for line in LINES]
    for row in rows:
        if row["error"] is None:
            body = row["response"]["body"]
            (Completion if body["object"] == "text_completion" else ChatCompletion).model_validate(body)
            assert body["model"] == "deepseek"
    assert rows[2]["error"]["param"] == "echo"
    samples = rows[5]["response"]["body"]["choices"]
    assert len(samples) == 6 and len({c["text"] for c in samples[:3]}) == 3  # prompt 0's three samples differ
    assert len(rows[6]["response"]["body"]["choices"]) == 2
    assert [content(row) for row in rows] == [content(json.loads(line)) for line in alone.read_text(encoding="utf-8").splitlines()]
    # Everything done: no rank is started.
    proc = deepinfer("run-batch", "--ep", "2", *common, "-i", str(src), "-o", str(ranks), "--resume", cache=cache, tmp=tmp_path)
    assert proc.returncode == 0 and "nothing to do" in proc.stderr and "starting" not in proc.stderr, proc.stderr
