"""Deterministic mode on one GPU (run by tools/gpu/deterministic_check.sh; the repo root on sys.path).

1. Bit-identity on the cuda backend, V2-Lite-shaped random model (bf16, eager steps so the probe's
   logits can be recorded): a probe alone, among 3, 17 and 64 other requests, prefilled in chunks,
   after a prefix hit; then 200 seeded temperature-1 completions over differently composed batches,
   with CUDA graphs (tokens only).
2. Cross-backend: the float32 logits of one prompt on cuda (this GPU) and on the ascend kernels
   (Triton interpreter, in a subprocess), small-vocabulary tiny V3, their largest difference.
Prints one table; `--json FILE` writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from engine.determinism import ProbeLogits, differing_steps, neighbour_prompts, run_probe, write_small_checkpoint  # noqa: E402


def v2_lite_llm(layers: int, **kwargs):
    """An LLM over the random V2-Lite-shaped model of `deepinfer bench e2e` (cut to `layers`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from deepinfer.bench.e2e import V2_LITE, hf_to_deepinfer_tensors
    from deepinfer.engine.llm import LLM
    from deepinfer.engine.llm_engine import EngineConfig, LLMEngine
    from deepinfer.model.config import ModelConfig
    from deepinfer.model.deepseek import DeepseekForCausalLM
    from deepinfer.model.loader import LoadedModel
    from deepinfer.model.weights import WeightStore
    from deepinfer.runtime import open_runtime

    cfg = dict(V2_LITE, num_hidden_layers=layers)
    runtime = open_runtime("cuda", dtype=torch.bfloat16, deterministic=kwargs.get("deterministic", False))
    torch.manual_seed(0)
    hf_config = AutoConfig.for_model("deepseek_v2", **cfg)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16).eval()
    config = ModelConfig.from_dict({**hf_config.to_dict(), **cfg, "model_type": "deepseek_v2"}, source="V2-Lite-shaped random model")
    model = DeepseekForCausalLM(config, runtime.ops, runtime.device, torch.bfloat16)
    model.load_weights(WeightStore(hf_to_deepinfer_tensors(hf.state_dict(), cfg)))
    del hf
    loaded = LoadedModel(model=model, config=config, tokenizer=None, path="V2-Lite-shaped random model", dummy_weights=True)
    engine = LLMEngine(loaded, runtime, torch.bfloat16, EngineConfig(max_num_seqs=256, kv_cache_memory_gib=8, **kwargs))
    return LLM.from_engine(engine), cfg["vocab_size"]


class Rows(list):
    """The table's rows, each printed as it comes (a run cut short keeps what it measured)."""

    def append(self, row):
        print(f"{row[0]}: {row[1]}", flush=True)
        super().append(row)


def bit_identity(layers: int) -> list[tuple[str, str]]:
    from deepinfer import SamplingParams

    rows = Rows()
    probe = list(range(1000, 1300))  # 300 tokens: several 64-token pages for the prefix cache
    llm, vocab = v2_lite_llm(layers, deterministic=True, enable_prefix_caching=False, enforce_eager=True)
    rec = ProbeLogits(llm)
    alone, tokens, _ = run_probe(llm, rec, probe, [], 8)
    for n in (3, 17, 64):
        got = run_probe(llm, rec, probe, neighbour_prompts(n, vocab, seed=n, lengths=(2, 600)), 8)
        rows.append((f"{n} neighbours", f"differing steps {differing_steps(alone, got[0])}, tokens equal {got[1] == tokens}"))
    chunked, _ = v2_lite_llm(layers, deterministic=True, enforce_eager=True, max_num_batched_tokens=96)
    rec = ProbeLogits(chunked)
    got = run_probe(chunked, rec, probe, neighbour_prompts(17, vocab, seed=5, lengths=(2, 600)), 8)
    rows.append(("chunked prefill (96)", f"differing steps {differing_steps(alone, got[0])}, tokens equal {got[1] == tokens}"))
    got = run_probe(chunked, rec, probe, neighbour_prompts(3, vocab, seed=6), 8)
    rows.append((f"prefix hit ({got[2]} cached)", f"differing steps {differing_steps(alone, got[0])}, tokens equal {got[1] == tokens}"))
    default, _ = v2_lite_llm(layers, enable_prefix_caching=False, enforce_eager=True)
    rec = ProbeLogits(default)
    want = run_probe(default, rec, probe, [], 8)[0]
    moved = differing_steps(want, run_probe(default, rec, probe, neighbour_prompts(64, vocab, seed=64, lengths=(2, 600)), 8)[0])
    rows.append(("default mode, 64 neighbours (control)", f"differing steps {len(moved)} of 8, largest {max((d for _, d in moved), default=0):.3g}"))
    graphs, _ = v2_lite_llm(layers, deterministic=True)
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    completions = []
    for i, (probes, others) in enumerate([(1, 0), (3, 5), (16, 20), (60, 4), (120, 100)]):
        prompts = [{"prompt_token_ids": probe}] * probes + neighbour_prompts(others, vocab, seed=100 + i, lengths=(2, 600))
        outs = graphs.generate(prompts, [params] * probes + [greedy] * others, use_tqdm=False)
        completions += [tuple(o.outputs[0].token_ids) for o in outs[:probes]]
    rows.append(("200 completions, T=1, CUDA graphs", f"{len(set(completions))} distinct of {len(completions)}"))
    return rows


CROSS = """
import json, sys, torch
sys.path.insert(0, "tests")
from engine.determinism import ProbeLogits, run_probe
from deepinfer import LLM
llm = LLM(model=sys.argv[1], backend=sys.argv[2], dtype="float32", announce=False, interpret=sys.argv[2] == "ascend", deterministic=True,
          enforce_eager=True)
steps, tokens, _ = run_probe(llm, ProbeLogits(llm), list(range(5, 45)), [], 4)
torch.save({"steps": steps, "tokens": tokens}, sys.argv[3])
"""


def cross_backend(backends=("cuda", "ascend"), keep: Path | None = None) -> list[tuple[str, str]]:
    """keep: a folder to save each backend's logits in (the other side can then run elsewhere: the
    ascend interpreter on a CPU machine, `--compare-with`)."""
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_small_checkpoint(Path(tmp) / "tiny-v3-small-vocab")
        got = {}
        for backend in backends:
            env = dict(os.environ, TRITON_INTERPRET="1") if backend == "ascend" else {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            out = Path(tmp) / f"{backend}.pt"
            subprocess.run([sys.executable, "-c", CROSS, str(ckpt), backend, str(out)], check=True, env=env, timeout=900)
            got[backend] = torch.load(out)
            if keep is not None:
                torch.save(got[backend], keep / f"{backend}_logits.pt")
    return compared(got) if len(got) == 2 else []


def compared(got: dict) -> list[tuple[str, str]]:
    """The cross-backend row from both backends' probe logits."""
    diff = max(float((got["cuda"]["steps"][p] - got["ascend"]["steps"][p]).abs().max()) for p in got["cuda"]["steps"])
    same = got["cuda"]["tokens"] == got["ascend"]["tokens"]
    return [("float32 logits, cuda (GPU) vs ascend (interpreter)", f"max |diff| {diff:.3g} over {len(got['cuda']['steps'])} steps, tokens equal {same}")]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--only", choices=("cuda", "ascend"), help="only this backend's cross-backend logits, saved into --keep")
    parser.add_argument("--keep", type=Path, help="folder for the cross-backend logits")
    parser.add_argument("--compare", type=Path, help="a folder holding both backends' kept logits: print their difference")
    args = parser.parse_args()
    if args.compare:
        print(*compared({b: torch.load(args.compare / f"{b}_logits.pt") for b in ("cuda", "ascend")})[0], sep="  ")
        return 0
    if args.only:
        cross_backend((args.only,), args.keep)
        return 0
    rows = bit_identity(args.layers)
    try:
        rows += cross_backend()
    except Exception as exc:  # keep the identity rows
        rows.append(("float32 logits, cuda (GPU) vs ascend (interpreter)", f"failed: {exc}"))
    width = max(len(r[0]) for r in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))
    if args.json:
        args.json.write_text(json.dumps(dict(rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
