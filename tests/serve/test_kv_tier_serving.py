"""`deepinfer serve --kv-offload-cpu-gib --kv-offload-dir`: a prompt whose blocks left a small device pool comes back
from the host tier (usage's cached_tokens, the same text), /metrics shows each tier, and a second server on the same
directory finds the first one's blocks on disk."""

from __future__ import annotations

import httpx2

from serve.server_process import ServerProcess
from waits import HANG_S

PROMPTS = [[(7 * i + j) % 900 + 1 for j in range(40)] for i in range(6)]  # token ids: two full 16-token blocks each


def complete(server, prompt: list[int]) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    answer = httpx2.post(f"{server.url}/v1/completions", json=body, timeout=HANG_S)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_tiers_serve_hits_and_show_in_metrics(cache, tmp_path):
    flags = ["--backend", "reference", "--num-kv-blocks", "12", "--max-num-seqs", "2", "--served-model-name", "tiny",
             "--kv-offload-cpu-gib", "0.01", "--kv-offload-dir", str(tmp_path / "kv")]  # fmt: skip
    server = ServerProcess(*flags, cache=cache)
    try:
        first = [complete(server, p) for p in PROMPTS]  # six prompts of three blocks: the pool keeps the last few
        again = complete(server, PROMPTS[0])
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        assert again["choices"][0]["text"] == first[0]["choices"][0]["text"]
        metrics = server.metrics()
        assert metrics['deepinfer_kv_tier_hit_blocks_total{tier="host"}'] >= 1  # what the device pool no longer held
        assert metrics['deepinfer_kv_tier_stores_total{tier="disk"}'] >= 12
        assert 'deepinfer_kv_tier_errors_total{tier="disk"}' in metrics
    finally:
        code, err = server.stop()
    assert code == 0, err
    second = ServerProcess(*flags, cache=cache)  # a restart on the same directory
    try:
        restarted = complete(second, PROMPTS[1])
        assert restarted["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        assert restarted["choices"][0]["text"] == first[1]["choices"][0]["text"]
        assert second.metrics()['deepinfer_kv_tier_hit_blocks_total{tier="disk"}'] == 2
    finally:
        code, err = second.stop()
    assert code == 0, err
