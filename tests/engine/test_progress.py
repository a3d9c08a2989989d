"""The progress bar moves while one long request decodes (tokens generated, prompt and generation
tok/s), and rates keep three significant digits: a slow backend never shows "0.0 tok/s"."""

from __future__ import annotations

import re

import pytest

from deepinfer import SamplingParams
from deepinfer.engine import progress
from deepinfer.engine.llm import LLM


@pytest.mark.parametrize(
    "value, shown",
    [(0.0, "0"), (0.0123456, "0.0123"), (0.04, "0.04"), (0.26, "0.26"), (1.23456, "1.23"),
     (45.678, "45.7"), (99.4, "99.4"), (1234.5, "1234"), (56789.1, "56789")],
)
def test_rates_keep_three_significant_digits(value, shown):
    assert progress.rate(value) == shown


def test_the_bar_counts_generated_tokens_before_the_only_request_finishes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path))
    monkeypatch.setattr(progress, "REFRESH_S", 0.0)  # redraw after every step
    llm = LLM(backend="reference", announce=False, num_kv_blocks=16)
    capsys.readouterr()
    llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=True)
    err = capsys.readouterr().err
    frames = [frame for frame in re.split(r"[\r\n]", err) if "Processed prompts" in frame]
    # While the request is unfinished (0/1) the count of generated tokens rises, with both rates.
    unfinished = [frame for frame in frames if " 0/1 " in frame and "tok generated" in frame]
    counts = [int(re.search(r"(\d+) tok generated", frame).group(1)) for frame in unfinished]
    assert counts == sorted(counts) and len(set(counts)) >= 3, frames
    assert all(re.search(r"prompt [\d.]+ tok/s, generation [\d.]+ tok/s", frame) for frame in unfinished), unfinished
    assert not any("0.0 tok/s" in frame for frame in frames), frames
    assert any(" 1/1 " in frame and "5 tok generated" in frame for frame in frames), frames
