"""Writes tests/model_v41/fixtures/oracle_v41_dspark.safetensors: NVIDIA NeMo Automodel 0.7.0's DSpark draft
(`DeepseekV41DSparkModel`, its `dspark.py`) on the tiny oracle checkpoint's `mtp.0..2`, as the oracle for
deepinfer's DSpark drafter (deepinfer/model/deepseek_v41/dspark.py).

NeMo's target model (make_oracle_fixtures.nemo_model) runs each fixture prompt's tokens; the target features are
captured where NeMo's DSpark trainer captures them (the inputs of the target layers' attention hyper-connections,
`get_dspark_target_feature_modules`) and averaged over the streams (`HFDSparkTargetModel._collapse_hc_streams`).
Its draft backbone then runs one block at anchor a (the token at a, noise after it) over the context a - window
.. a - 1, with NeMo's own position ids and attention mask (`build_position_ids`, `build_attention_mask`). The
slots are drafted greedily in order, each through NeMo's Markov head on the token drafted before it, as serving
drafts them. Per anchor: the drafted tokens, each slot's logits (head(norm h) + markov), and the confidence
head's logits on NeMo's input (the normed h) and on the release's (the pre-norm h, by NeMo's head module).

    /work/venvs/nemo/bin/python tests/model_v41/make_dspark_fixtures.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model_v41.make_oracle_fixtures import FIXTURE as TARGET_FIXTURE  # noqa: E402
from model_v41.make_oracle_fixtures import SEED, nemo_model  # noqa: E402
from model_v41.tiny_v41 import write_oracle_checkpoint  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "oracle_v41_dspark.safetensors"
ANCHORS = ((0, 40), (1, 43), (2, 12))  # (fixture prompt, anchor position): past the window, late, before the window fills


def nemo_draft(folder: Path, target):
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkModel

    config = target.config.text_config if hasattr(target.config, "text_config") else target.config
    backend = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch")
    draft = DeepseekV41DSparkModel(config, backend, num_anchors=1, enable_confidence_head=True).float().eval()
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    state = draft.state_dict_adapter.from_hf(tensors)
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith(("embed_tokens", "lm_head"))]
    if missing or unexpected:
        raise SystemExit(f"NeMo DSpark state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    draft.initialize_embeddings_and_head(embed_tokens=target.get_input_embeddings(), lm_head=target.get_output_embeddings())
    return draft, config


@torch.no_grad()
def target_features(target, config, ids: list[int]) -> torch.Tensor:
    captured = {}
    modules = target.get_dspark_target_feature_modules(list(config.dspark_target_layer_ids))
    handles = [m.register_forward_pre_hook(lambda _m, inputs, key=i: captured.__setitem__(key, inputs[0])) for i, m in enumerate(modules)]
    try:
        target(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return torch.cat([captured[i].mean(dim=2) for i in range(len(modules))], dim=-1)[0]  # [T, targets * hidden]


@torch.no_grad()
def draft_block(draft, config, features: torch.Tensor, anchor_token: int, anchor: int):
    k = config.dspark_block_size
    ids = torch.full((1, k), config.dspark_noise_token_id)
    ids[0, 0] = anchor_token
    noise = draft.embed_tokens(ids)
    anchors = torch.tensor([[anchor]])
    keep = torch.ones(1, 1, dtype=torch.bool)
    positions = draft.build_position_ids(anchors, anchor)
    mask = draft.build_attention_mask(anchors, keep, anchor, noise.dtype)
    context = features[None, :anchor]
    # the backbone's streams before its final norm: run the stages as DeepseekV41DSparkBackbone.forward does
    streams = noise.unsqueeze(2).expand(-1, -1, config.hc_mult, -1)
    pre = torch.zeros(1, k, config.hc_mult)
    pre[..., 0] = 1
    for layer in draft.mtp:
        out = layer(streams, pre, context, position_ids=positions, attention_mask=mask, previous_token_ids=None)
        streams, pre, context = out.streams, out.pre_mix, out.target_hidden_states
    from nemo_automodel.components.models.deepseek_v41.layers import DeepseekV41HyperConnection

    h = DeepseekV41HyperConnection.collapse(streams, pre)[0]  # [k, hidden]
    last = draft.mtp[-1]
    normed = last.norm(h)
    base = draft.compute_logits(normed[None])[0]
    previous, tokens, logits, conf_normed, conf_residual = anchor_token, [], [], [], []
    for slot in range(k):
        transition, embedding = last.markov_head(torch.tensor([previous]))
        row = base[slot] + transition[0].float()
        conf_normed.append(last.confidence_head(normed[slot : slot + 1], embedding)[0])
        conf_residual.append(last.confidence_head(h[slot : slot + 1], embedding)[0])
        previous = int(row.argmax())
        tokens.append(previous)
        logits.append(row)
    # the same block through NeMo's whole backbone (teacher tokens = the drafted ones) must agree with the stage loop
    whole = super(type(draft), draft).forward(noise, features[None, :anchor], position_ids=positions, attention_mask=mask,
                                             previous_token_ids=torch.tensor([[anchor_token] + tokens[:-1]]))  # fmt: skip
    assert torch.allclose(whole.normalized_hidden_states[0], normed) and torch.allclose(whole.confidence_pred[0], torch.stack(conf_normed))
    return torch.tensor(tokens), torch.stack(logits), torch.stack(conf_normed), torch.stack(conf_residual)


def main() -> int:
    torch.set_num_threads(2)
    prompts = load_file(str(TARGET_FIXTURE))
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_oracle_checkpoint(Path(tmp) / "oracle", seed=SEED)
        target = nemo_model(folder)
        draft, config = nemo_draft(folder, target)
        for i, (prompt, anchor) in enumerate(ANCHORS):
            ids = prompts[f"p{prompt}.ids"].tolist()
            features = target_features(target, config, ids[:anchor])
            tokens, logits, conf_normed, conf_residual = draft_block(draft, config, features, ids[anchor], anchor)
            top2 = logits.topk(2, dim=-1).values
            print(f"anchor {i}: prompt {prompt} at {anchor}, drafts {tokens.tolist()}, smallest margin {float((top2[:, 0] - top2[:, 1]).min()):.3f}")
            out[f"a{i}.ids"] = torch.tensor(ids[: anchor + 1])  # the context's tokens, then the anchor's
            out[f"a{i}.tokens"] = tokens
            out[f"a{i}.logits"] = logits.contiguous()
            out[f"a{i}.confidence_normed"] = conf_normed.contiguous()
            out[f"a{i}.confidence_residual"] = conf_residual.contiguous()
    save_file(out, str(FIXTURE), metadata={"seed": str(SEED), "source": "nemo_automodel 0.7.0 dspark.py, eager, float32"})
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
