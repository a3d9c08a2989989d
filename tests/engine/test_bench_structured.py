"""`deepinfer bench structured` on the reference backend and the embedded tiny model (cheap settings):
the JSON holds a mask-fill time per batch size asked and a throughput run per constrained share,
every request of which ran to its length; the plot is written; bad flags are one line."""

from __future__ import annotations

import json

import pytest

from deepinfer.bench import structured
from deepinfer.cli.main import main

pytestmark = pytest.mark.usefixtures("model_cache")  # tests/engine/conftest.py


def test_bench_writes_its_json_and_plot(tmp_path, capsys):
    out = tmp_path / "structured.json"
    argv = ["bench", "structured", "--backend", "reference", "--batch", "4", "--input-len", "6", "--output-len", "6",
            "--mask-batches", "1,3", "--mask-steps", "3", "--json", str(out), "--plot", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "mask fill per step" in printed and "out tok/s" in printed
    data = json.loads(out.read_text())
    assert data["kind"] == "structured" and data["machine"]["backend"] == "reference" and data["machine"]["model"] == "tiny-v3"
    assert [m["batch"] for m in data["mask_fill"]] == [1, 3] and all(m["ms_per_step"] > 0 for m in data["mask_fill"])
    runs = data["throughput"]
    assert [(r["constrained"], r["batch"]) for r in runs] == [(0, 4), (2, 4), (4, 4)]
    assert all(r["output_tokens"] == 4 * 6 and r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / r["wall_s"]) for r in runs)
    assert set(data["overhead"]) == {"50%", "100%"}
    assert (tmp_path / "structured.png").stat().st_size > 0


def test_the_schema_never_ends_before_the_output_length():
    """The throughput runs compare equal lengths: a document of the schema has at least output_len / 4
    items, and no item is shorter than 4 tokens (DeepSeek's tokenizer: 9 for the shortest)."""
    from deepinfer import LLM

    assert structured.schema(structured.min_items(64))["minItems"] == 16 and structured.min_items(65) == 17
    tokenizer = LLM(model="tiny-v3", backend="reference", announce=False).engine.tokenizer
    assert len(tokenizer.encode('{"id":0,"tag":"beta"}', add_bos=False)) >= 4
    json.loads(structured.DOCUMENT)  # the mask-fill matchers walk a valid document


@pytest.mark.parametrize(
    "flags, needle",
    [(["--mask-batches", "1,x"], "--mask-batches must be integers"), (["--batch", "0"], "--batch must be at least 1"),
     (["--layers", "2"], "--layers cuts a --model-shape model"), (["--model", "tiny-v3", "--model-shape", "v2-lite"], "not both")],
)  # fmt: skip
def test_bad_flags_are_one_line(capsys, flags, needle):
    assert main(["bench", "structured", "--backend", "reference", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err, err
