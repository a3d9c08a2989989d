"""The progress bar moves while one long request decodes (tokens generated, input and output
tok/s), and rates keep three significant digits: a slow backend never shows "0.0 tok/s". Written to a
file or a pipe it draws no frames (issue 38: they spliced into the completions and repeated the 100%
line): one plain line at the end instead."""

from __future__ import annotations

import math
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
    monkeypatch.setattr(progress, "draws_live", lambda: True)  # as on a terminal (capsys is not one)
    llm = LLM(backend="reference", announce=False, num_kv_blocks=16)
    capsys.readouterr()
    llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=True)
    err = capsys.readouterr().err
    frames = [frame for frame in re.split(r"[\r\n]", err) if "Processed prompts" in frame]
    # While the request is unfinished (0/1) the count of generated tokens rises, with both rates.
    unfinished = [frame for frame in frames if " 0/1 " in frame and "tok generated" in frame]
    counts = [int(re.search(r"(\d+) tok generated", frame).group(1)) for frame in unfinished]
    assert counts == sorted(counts) and len(set(counts)) >= 3, frames
    assert all(re.search(r"est. speed input [\d.]+ tok/s, output [\d.]+ tok/s", frame) for frame in unfinished), unfinished
    assert not any("0.0 tok/s" in frame for frame in frames), frames
    assert any(" 1/1 " in frame and "5 tok generated" in frame for frame in frames), frames


def test_output_that_is_no_terminal_gets_one_plain_line_and_no_frames(tmp_path, monkeypatch, capsys):
    """`deepinfer run ... 2>&1 | cat`: completions on stdout stay whole lines, stderr holds no
    carriage-return frames and the final count once."""
    from deepinfer.cli.main import main

    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path))
    monkeypatch.setattr(progress, "LOG_EVERY_S", math.inf)  # the final line only, however slow the machine
    assert main(["run", "--backend", "reference", "--num-kv-blocks", "16", "--max-tokens", "3", "--prompt", "a", "--prompt", "b", "--prompt", "c"]) == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.err and "\x1b" not in captured.err and "\r" not in captured.out, captured.err
    lines = [line for line in captured.err.splitlines() if line.startswith("Processed prompts")]
    final = r"Processed prompts: 3/3 requests in [\d.]+ s, 9 tok generated, est\. speed input [\d.]+ tok/s, output [\d.]+ tok/s"
    assert len(lines) == 1 and re.fullmatch(final, lines[0]), lines
    assert [line for line in captured.out.splitlines() if line.startswith("[")] == ["[1] prompt: 'a'", "[2] prompt: 'b'", "[3] prompt: 'c'"]


def test_the_summary_names_its_throughput_over_the_wall_time(tmp_path, monkeypatch, capsys):
    """"prompt tok/s" read as a prefill rate but was prompt tokens over the whole run: the summary
    gives vLLM's offline figures instead (requests/s, total tok/s, generated tok/s)."""
    from deepinfer.cli.main import main

    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path))
    assert main(["run", "--backend", "reference", "--num-kv-blocks", "16", "--max-tokens", "3", "--no-progress", "--prompt", "a", "--prompt", "b"]) == 0
    err = capsys.readouterr().err
    assert "prompt tok/s" not in err
    assert re.search(r"\n  throughput +[\d.]+ requests/s, [\d.]+ total tok/s \(prompt \+ generated\), [\d.]+ generated tok/s\n", err), err
