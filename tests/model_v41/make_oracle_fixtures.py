"""Writes tests/model_v41/fixtures/oracle_v41.safetensors: NVIDIA NeMo Automodel 0.7.0's V4.1 forward on the tiny
oracle checkpoint (tiny_v41.ORACLE_V41, tiny_v41.oracle_tensors), as the test oracle for deepinfer's V4.1 model.

Run by hand in a venv that has `nemo_automodel==0.7.0` (installed with --no-deps, plus pillow); CI never imports
NeMo, it reads the fixture. NeMo runs in float32 on its eager torch path (BackendConfig(attn="eager")) from the
released-layout checkpoint, decoded by its own state-dict adapter (FP8 32x32, FP4 experts, FP8 Engram rows).

Per prompt: greedy continuation by full forwards (NeMo keeps no KV cache), each step's last-row logits, and the
full forward's logits of the last rows. A prompt is kept only when it is robust to float noise (v41.md section
12): every step's last-row logits equal the next full forward's logits at that row within 1e-3 (a realization
of the row-count-dependent BLAS noise that can cross an FP8/FP4/top-k boundary), and every greedy margin is
at least 0.03.

    /work/venvs/nemo/bin/python tests/model_v41/make_oracle_fixtures.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model_v41.tiny_v41 import write_oracle_checkpoint  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "oracle_v41.safetensors"
SEED = 0
PROMPT_LEN = 40
NEW_TOKENS = 6
KEPT_ROWS = 8  # full-forward logits rows stored per prompt (the last ones)
PROMPTS = 3


def nemo_model(folder: Path):
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import DeepseekV41StateDictAdapter
    from transformers import PreTrainedTokenizerFast

    raw = json.loads((folder / "config.json").read_text())
    raw["text_config"] = {**raw["text_config"], "dtype": "float32"}
    raw["vision_config"] = {**raw["vision_config"], "num_hidden_layers": 0}  # text only, as deepinfer serves it
    raw.pop("quantization_config")
    config = DeepseekV41Config(**{**raw, "dtype": "float32"})
    backend = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    model = DeepseekV41ForCausalLM(config, backend=backend, tokenizer=tokenizer).float().eval()
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    tensors = {k: v for k, v in tensors.items() if not k.startswith(("vision.", "aligner.", "image_"))}
    adapter = DeepseekV41StateDictAdapter(config, model.moe_config, backend, dtype=torch.float32)
    state = {k: v.float() if v.is_floating_point() else v for k, v in adapter.from_hf(tensors).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith(("token_map", "primes", "offsets", "multipliers"))]
    if missing or unexpected:
        raise SystemExit(f"NeMo state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model


@torch.no_grad()
def logits_of(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()


def main() -> int:
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_oracle_checkpoint(Path(tmp) / "oracle", seed=SEED)
        model = nemo_model(folder)
        gen = torch.Generator().manual_seed(1234)
        out, kept, tried = {}, 0, 0
        while kept < PROMPTS and tried < 20:
            tried += 1
            prompt = torch.randint(3, 256, (PROMPT_LEN,), generator=gen).tolist()
            ids, steps, margins, drift = list(prompt), [], [], 0.0
            for _ in range(NEW_TOKENS):
                logits = logits_of(model, ids)
                if steps:
                    drift = max(drift, float((logits[len(ids) - 2] - steps[-1]).abs().max()))
                last = logits[-1]
                top2 = last.topk(2).values
                margins.append(float(top2[0] - top2[1]))
                steps.append(last)
                ids.append(int(last.argmax()))
            full = logits_of(model, ids)
            drift = max(drift, float((full[len(ids) - 2] - steps[-1]).abs().max()))
            print(f"prompt {tried}: drift {drift:.2e}, smallest greedy margin {min(margins):.3f}", flush=True)
            if drift > 1e-3 or min(margins) < 0.03:
                continue
            out[f"p{kept}.ids"] = torch.tensor(ids, dtype=torch.int64)  # prompt then the greedy continuation
            out[f"p{kept}.step_logits"] = torch.stack(steps)  # [NEW_TOKENS, vocab]: the last row of each step
            out[f"p{kept}.full_logits"] = full[-KEPT_ROWS:].contiguous()
            kept += 1
    if kept < PROMPTS:
        raise SystemExit(f"only {kept} of {tried} prompts were robust")
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, str(FIXTURE), metadata={"seed": str(SEED), "prompt_len": str(PROMPT_LEN), "source": "nemo_automodel 0.7.0, eager, float32"})
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
