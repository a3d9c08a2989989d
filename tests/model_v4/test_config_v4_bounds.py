"""A DeepSeek-V4 config.json whose numbers would size a per-step table or a loop far beyond any
model's (issue 38, F6, F7, T8) is refused when it is read, in one line naming the field and the
allowed range: it used to take the machine's memory at the first step (index_topk 10**9), hang
(hc_sinkhorn_iters 10**9) or fail there with a RuntimeError (sliding_window 10**12)."""

from __future__ import annotations

import pytest

from deepinfer.bench.e2e_v4 import V4_FLASH
from deepinfer.errors import UserError
from deepinfer.model.deepseek_v4.config import V4Config
from deepinfer.model.embedded import V4_CONFIG
from deepinfer.model.errors import CheckpointError


def refused(change: dict) -> str:
    with pytest.raises(CheckpointError) as info:
        V4Config.from_dict({**V4_CONFIG, **change}, source="/m/config.json")
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, UserError) and info.value.exit_code == 2
    assert message.startswith("/m/config.json: "), message
    return message


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"index_topk": 10**9}, "index_topk is 1000000000, expected an integer in [1, 16384]"),
        ({"hc_sinkhorn_iters": 10**9}, "hc_sinkhorn_iters is 1000000000, expected an integer in [1, 256]"),
        ({"sliding_window": 10**12}, "sliding_window is 1000000000000, expected an integer in [1, 16384]"),
        ({"swiglu_limit": 1e300}, "swiglu_limit is 1e+300, expected a finite number in (0, 3.40282e+38]"),
        ({"num_nextn_predict_layers": 10**12}, "num_nextn_predict_layers=1000000000000 exceeds num_hidden_layers=4"),
        ({"compress_rates": {"compressed_sparse_attention": 3, "heavily_compressed_attention": 128}},
         "compress_rates.compressed_sparse_attention is 3, expected a power of two"),
        ({"compress_rate_hca": 96}, "compress_rates.heavily_compressed_attention is 96, expected a power of two"),
    ],
)  # fmt: skip
def test_a_size_no_model_uses_is_refused_naming_the_field_and_its_range(change, needle):
    assert needle in refused(change)


def test_the_bounds_admit_the_released_shapes_and_their_edges():
    flash = V4Config.from_dict(V4_FLASH)
    assert (flash.sliding_window, flash.index_topk, flash.hc_sinkhorn_iters) == (128, 512, 20)
    edge = V4Config.from_dict({**V4_CONFIG, "index_topk": 16384, "sliding_window": 16384, "hc_sinkhorn_iters": 256, "swiglu_limit": 3e38})
    assert (edge.index_topk, edge.sliding_window, edge.hc_sinkhorn_iters) == (16384, 16384, 256)


def test_the_cli_refuses_such_a_config_in_one_line_before_reading_weights(tmp_path):
    import json

    from cli_helpers import run_main

    (tmp_path / "config.json").write_text(json.dumps({**V4_CONFIG, "hc_sinkhorn_iters": 10**9}))
    run = run_main("run", "--model", str(tmp_path), "--backend", "reference", "--prompt", "hi", "--no-progress")
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        f"deepinfer: error: {tmp_path / 'config.json'}: hc_sinkhorn_iters is 1000000000, expected an integer in [1, 256]"
    ], run.stderr
