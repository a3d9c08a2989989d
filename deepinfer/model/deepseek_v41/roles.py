"""Each layer's role in DeepSeek-V4.1's cross-layer KV sharing, derived from config.json and cross-checked.

V4.1 computes compressed KV on a few layers and lets the others borrow it (docs/models/deepseek_v41.md):
- Full (a KV source): runs the compressor, owns the index keys, selects its own top-k;
- Reindex (an index source that is not a KV source): its own indexer queries over the index keys of the
  latest KV source, a new top-k; inside the candidate source's candidate blocks when that is its KV source;
- Reuse (compressed, neither): the compressed KV and top-k of the latest sources before it;
- SWA (compress ratio 0): the sliding window only. The DSpark draft blocks are SWA.
`kv_source(l)` = the largest KV source <= l; `topk_owner(l)` = the largest index source <= l.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

SWA, FULL, REINDEX, REUSE = "swa", "full", "reindex", "reuse"


@dataclass(frozen=True)
class LayerRole:
    layer: int
    ratio: int  # compress ratio: tokens per compressed entry (0: sliding window only)
    kind: str  # SWA / FULL / REINDEX / REUSE
    kv_source: int | None  # the layer whose compressed KV (and index keys) it reads; None for SWA
    topk_owner: int | None  # the layer whose top-k selection it attends with; None for SWA
    candidate_filtered: bool  # a Reindex layer that selects inside the candidate source's blocks
    engram: int | None  # which Engram table it owns (index into engram_layer_ids), None for none

    @property
    def has_compressor(self) -> bool:
        return self.kind == FULL

    @property
    def has_indexer(self) -> bool:
        return self.kind in (FULL, REINDEX)


def _latest(sources: Sequence[int], layer: int) -> int | None:
    earlier = [s for s in sources if s <= layer]
    return earlier[-1] if earlier else None


def layer_roles(
    num_layers: int, ratios: Sequence[int], kv_sources: Sequence[int], index_sources: Sequence[int], candidate_source: int,
    engram_layers: Sequence[int], bad: Callable[[str], None],
) -> tuple[LayerRole, ...]:  # fmt: skip
    """The roles of the backbone layers 0..num_layers-1. `bad(message)` raises for a config whose
    sources contradict each other (each message names the keys and the values)."""
    for name, ids in (("kv_source_layer_ids", kv_sources), ("index_source_layer_ids", index_sources), ("engram_layer_ids", engram_layers)):
        outside = [i for i in ids if not 0 <= i < num_layers]
        if outside:
            bad(f"{name} holds layer {outside[0]}, outside [0, num_hidden_layers={num_layers})")
        if list(ids) != sorted(set(ids)):
            bad(f"{name} is {list(ids)}, expected layer ids in increasing order without repeats")
    for name, ids in (("kv_source_layer_ids", kv_sources), ("index_source_layer_ids", index_sources)):
        for layer in ids:
            if ratios[layer] == 0:
                bad(f"{name} holds layer {layer}, whose compress_ratio is 0: a sliding-window-only layer has nothing to compress or index")
    for layer in kv_sources:
        if layer not in index_sources:
            bad(f"kv_source_layer_ids holds layer {layer}, which is not in index_source_layer_ids: a KV source owns the index keys, so it indexes too")
    if candidate_source != -1 and candidate_source not in kv_sources:
        bad(f"candidate_source_layer_id is {candidate_source}, expected -1 (off) or one of kv_source_layer_ids {list(kv_sources)}")
    roles = []
    for layer in range(num_layers):
        ratio = ratios[layer]
        engram = engram_layers.index(layer) if layer in engram_layers else None
        if ratio == 0:
            roles.append(LayerRole(layer, 0, SWA, None, None, False, engram))
            continue
        source = _latest(kv_sources, layer)
        if source is None:
            bad(f"layer {layer} has compress_ratio {ratio} but no KV source at or before it (kv_source_layer_ids {list(kv_sources)})")
        if ratios[source] != ratio:
            bad(f"layer {layer} has compress_ratio {ratio} but reads the compressed KV of layer {source}, whose compress_ratio is {ratios[source]}")
        kind = FULL if layer == source else REINDEX if layer in index_sources else REUSE
        filtered = kind == REINDEX and source == candidate_source
        roles.append(LayerRole(layer, ratio, kind, source, _latest(index_sources, layer), filtered, engram))
    return tuple(roles)


__all__ = ["LayerRole", "layer_roles", "SWA", "FULL", "REINDEX", "REUSE"]
