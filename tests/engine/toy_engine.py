"""A toy model with the real model's interface, for engine tests that need no checkpoint.

Its "attention" reads every earlier token back from the paged KV cache, with weights that depend on
distance, so a wrong page, slot, cached prefix or recompute changes its logits. `reference_logits`
computes the same function straight from the token list, with no cache at all: the oracle.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from deepinfer.engine.llm import LLM
from deepinfer.engine.llm_engine import EngineConfig, LLMEngine
from deepinfer.runtime import open_runtime


class ToyTokenizer:
    """One token per character; id 0 is BOS, id 1 is EOS."""

    ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:\n!?"
    bos_token_id, eos_token_id = 0, 1
    vocab_size = 2 + len(ALPHABET)
    max_token_chars = 5  # "<eos>": a text of C characters is at least C / 5 tokens (Tokenizer.max_token_chars)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        return ([self.bos_token_id] if add_bos else []) + [2 + self.ALPHABET.index(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        special = {0: "<bos>", 1: "<eos>"}
        return "".join(("" if skip_special_tokens else special[i]) if i < 2 else self.ALPHABET[i - 2] for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant:" if add_generation_prompt else "")


class ToyModel:
    def __init__(self, vocab_size: int, dim: int = 16, num_layers: int = 2, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.dim, self.num_layers, self.vocab_size = dim, num_layers, vocab_size
        self.embed = torch.randn(vocab_size, dim, generator=gen)
        self.freqs = torch.rand(dim, generator=gen)
        self.unembed = torch.randn(num_layers * dim, vocab_size, generator=gen, dtype=torch.float64) * 2

    def kv_cache_shape(self, num_blocks: int, block_size: int, dtype=None) -> tuple[int, ...]:
        return (num_blocks, block_size, self.dim)

    def rows(self, token_ids: torch.Tensor, positions: torch.Tensor, layer: int) -> torch.Tensor:
        """What a token writes into layer `layer`'s cache: float32 [T, dim]."""
        return self.embed[token_ids] * (layer + 1) + torch.cos(positions[:, None].float() * self.freqs * (layer + 1))

    def logits_from_rows(self, rows_per_layer: list[torch.Tensor]) -> torch.Tensor:
        """Logits of the last of n tokens from their cached rows (float32 [n, dim] per layer)."""
        n = rows_per_layer[0].shape[0]
        weights = 1.0 / (1.0 + torch.arange(n - 1, -1, -1, dtype=torch.float64))  # the newest weighs most
        pooled = [(weights[:, None] * rows.double()).sum(0) / weights.sum() for rows in rows_per_layer]
        return (torch.tanh(torch.cat(pooled)) @ self.unembed).float()

    def forward(self, batch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        block_size = kv_caches[0].shape[1]
        slots = batch.slot_mapping
        for layer, cache in enumerate(kv_caches):
            cache[slots // block_size, slots % block_size] = self.rows(batch.input_ids, batch.positions, layer)
        out = []
        for row in batch.logits_indices.tolist():
            seq = int(torch.searchsorted(batch.cu_seqlens_q, row, right=True)) - 1
            n = int(batch.positions[row]) + 1  # tokens visible to the last token, itself included
            pages = batch.block_tables[seq, : -(-n // block_size)].long()
            out.append(self.logits_from_rows([cache[pages].flatten(0, 1)[:n] for cache in kv_caches]))
        return torch.stack(out) if out else torch.empty(0, self.vocab_size)

    def reference_logits(self, token_ids: list[int]) -> torch.Tensor:
        """The same function with no cache: straight from the token list."""
        ids, positions = torch.tensor(token_ids), torch.arange(len(token_ids))
        return self.logits_from_rows([self.rows(ids, positions, layer) for layer in range(self.num_layers)])


def greedy_reference(model: ToyModel, prompt: list[int], max_tokens: int, eos: int | None = ToyTokenizer.eos_token_id) -> list[int]:
    """Greedy decoding by recomputing everything each token: what the engine must reproduce."""
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        token = int(model.reference_logits(tokens).argmax())
        tokens.append(token)
        out.append(token)
        if token == eos:
            break
    return out


_RUNTIME = None


def reference_runtime(block_size: int):
    """The reference backend's ops, with the block size under test."""
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = open_runtime("reference", dtype=torch.float32)
    return dataclasses.replace(_RUNTIME, backend=dataclasses.replace(_RUNTIME.backend, kv_block_size=block_size))


def toy_llm(block_size: int = 4, max_position_embeddings: int = 256, seed: int = 0, model_seed: int = 0, **engine_options) -> LLM:
    tokenizer = ToyTokenizer()
    model = ToyModel(tokenizer.vocab_size, seed=model_seed)
    config = SimpleNamespace(vocab_size=tokenizer.vocab_size, max_position_embeddings=max_position_embeddings, eos_token_ids=(tokenizer.eos_token_id,))
    loaded = SimpleNamespace(model=model, config=config, tokenizer=tokenizer, path="toy", dummy_weights=True)
    engine_options.setdefault("num_kv_blocks", 64)
    engine = LLMEngine(loaded, reference_runtime(block_size), torch.float32, EngineConfig(seed=seed, **engine_options))
    return LLM.from_engine(engine)
