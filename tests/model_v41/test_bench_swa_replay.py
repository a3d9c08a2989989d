"""`deepinfer bench swa-replay` on the embedded tiny-v41: the table and the JSON; a model that is not V4.1 is one line."""

from __future__ import annotations

import json
import os

from cli_helpers import run_cli


def test_swa_replay_bench_reports_on_against_off(tmp_path):
    env = {**os.environ, "DEEPINFER_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "swa.json"
    done = run_cli("bench", "swa-replay", "--prompt-lens", "150", "--output-tokens", "2", "--repeat", "1", "--json", str(out), env=env)
    assert done.returncode == 0, done.stderr
    assert "decoder layers 4 of 10 on the prompt's last 133 tokens" in done.stdout
    saved = json.loads(out.read_text())
    row = saved["results"][0]
    assert saved["machine"]["backend"] == "reference" and saved["settings"]["model"] == "tiny-v41"
    assert row["decoder_from"] == 150 - 133 and row["decoder_rows_on"] == 4 * 133 and row["decoder_rows_off"] == 4 * 150
    assert row["rows_on"] == 6 * 150 + 4 * 133 and 0 < row["max_logit_diff"] < row["max_abs_logit"]


def test_a_model_that_is_not_v41_is_one_line():
    done = run_cli("bench", "swa-replay", "--model", "tiny-v4")
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0
    assert "the decoder SWA bounded replay is DeepSeek-V4.1's" in done.stderr
