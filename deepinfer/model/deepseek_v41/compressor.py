"""V4.1's compressor (KV-source layers only): one compressed KV entry and one index key per group of `ratio` tokens.

Ratio 2: per channel, a softmax of the gate logits over the group's two tokens weighs their values (`compress_kv`
without overlap and without a positional bias; projections in float32), cast to the model dtype and normed. Ratio
1: the normed projection of each token (no gate). The entry is the latent rotated at the group's first position
and stored in NVFP4; the index key is `k_norm(indexer.wk latent)` rotated likewise and stored in MXFP4, from the
unrotated, unrounded latent. Only complete groups make entries; an open group's tokens wait in the sequence's state.
Entries live in the sequence's token blocks (caches.py); groups inside a cached prefix's blocks are not written again
(another sequence may be reading them), as DeepSeek-V4 leaves a hit's paged rows alone.
"""

from __future__ import annotations

import torch

from deepinfer.model.deepseek_v41.caches import ENTRY_FORMAT, INDEX_KEY_FORMAT, RAW_DTYPE, LayerState, history_rows
from deepinfer.model.deepseek_v41.decode_plan import RatioDecode
from deepinfer.model.deepseek_v41.spans import Span, rotate_tail
from deepinfer.model.linear import LinearWeight


class V41Compressor:
    def __init__(self, weights, prefix: str, *, ratio: int, eps: float, rope_dim: int):
        self.ratio, self.eps, self.rope_dim = ratio, eps, rope_dim
        self.wkv = LinearWeight(weights.tensor(f"{prefix}compressor.wkv.weight").to(RAW_DTYPE))
        self.wgate = LinearWeight(weights.tensor(f"{prefix}compressor.wgate.weight").to(RAW_DTYPE)) if ratio > 1 else None
        self.norm = weights.tensor(f"{prefix}compressor.norm.weight")
        self.wk = LinearWeight(weights.tensor(f"{prefix}indexer.wk.weight"))
        self.k_norm = weights.tensor(f"{prefix}indexer.k_norm.weight")

    def projections(self, ops, x: torch.Tensor) -> torch.Tensor:
        """[T, 2D] float32 (value, then gate logits) for ratio > 1; the normed latent [T, D] in x's dtype for ratio 1."""
        if self.ratio == 1:
            # the release projects in the activation dtype here (its float32 weight cast down)
            return ops.rms_norm(ops.linear(x, self.wkv.weight.to(x.dtype), fmt="dense"), self.norm, eps=self.eps)[0]
        xf = x.to(RAW_DTYPE)
        return torch.cat((self.wkv(ops, xf), self.wgate(ops, xf)), dim=-1)

    def __call__(self, ops, projected: torch.Tensor, span: Span, state: LayerState, cos_sin: torch.Tensor, dtype: torch.dtype) -> int:
        """Emit the entries of the groups that complete in this span into `state` (entries and index keys, in the
        span's blocks), but those of a cached prefix's blocks; keep the open group's tokens. Returns the number of
        entries the sequence now has."""
        r = self.ratio
        done = span.end // r  # groups complete at the span's end
        first = max(span.start // r, span.cached // r)  # the first group to emit: open at the start, past the shared blocks
        if done > first:
            if r == 1:
                latent = projected[span.offset + first - span.start : span.offset + done - span.start]
            else:
                latent = self._pool(ops, projected[span.rows], span, state, first, done).to(dtype)
                latent, _ = ops.rms_norm(latent, self.norm, eps=self.eps)
            positions = torch.arange(first, done, device=latent.device) * r  # each group's first token
            self._write(ops, latent, positions, history_rows(span.pages, first, done, state.entries.shape[1]), state, cos_sin)
        if r > 1:
            # the span's last tokens, for the step that completes their group; every one of the last `rows`, not
            # only the open group's: a verification's rejected drafts may leave an earlier group open (caches.py)
            rows = state.pending.shape[1]
            for p in range(max(span.start, span.end - rows), span.end):
                state.pending[span.slot, p % rows] = projected[span.offset + p - span.start]
        return done

    def decode(self, ops, projected: torch.Tensor, plan: RatioDecode, state: LayerState, cos_sin: torch.Tensor, dtype: torch.dtype) -> None:
        """A decode step's (decode_plan.py): each token's projections into the pending ring, and the entry of the group
        it closes into its row of the paged history; a token that closes none writes its entry to the scratch block."""
        r = self.ratio
        if r == 1:
            latent = projected
        else:
            width = projected.shape[1] // 2
            pending = state.pending.view(-1, 2 * width)
            # torch glue: each token's group laid out [B * ratio] (its earlier tokens gathered from the ring, then its own),
            # and an index_put of one row per token (padding rows: the scratch slot's)
            rows = torch.cat((pending[plan.pending_reads], projected[:, None]), dim=1).flatten(0, 1)
            pending[plan.pending_write] = projected
            no_bias = torch.zeros(r, width, dtype=rows.dtype, device=rows.device)  # V4.1's compressor has no positional bias
            none = torch.full_like(plan.pool_starts, -1)  # no overlap: no previous window
            latent = ops.compress_kv(rows[:, :width], rows[:, width:], no_bias, plan.pool_starts, none, ratio=r, overlap=False).to(dtype)
            latent, _ = ops.rms_norm(latent, self.norm, eps=self.eps)
        self._write(ops, latent, plan.group_first, plan.write_rows, state, cos_sin)

    def _write(self, ops, latent: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, state: LayerState, cos_sin: torch.Tensor) -> None:
        """Entries [n, D] of groups starting at `positions`, and their index keys, stored into flat history rows `rows`."""
        entry = rotate_tail(ops, latent[:, None, :], self.rope_dim, positions, cos_sin)[:, 0]
        state.entries.view(-1, state.entries.shape[-1])[rows] = ops.cache_pack(entry, fmt=ENTRY_FORMAT)  # torch glue: index_put
        key, _ = ops.rms_norm(self.wk(ops, latent), self.k_norm, eps=self.eps)
        key = rotate_tail(ops, key[:, None, :], self.rope_dim, positions, cos_sin)[:, 0]
        state.index_keys.view(-1, state.index_keys.shape[-1])[rows] = ops.cache_pack(key, fmt=INDEX_KEY_FORMAT)

    def _pool(self, ops, new: torch.Tensor, span: Span, state: LayerState, first: int, done: int) -> torch.Tensor:
        """compress_kv over the tokens of groups first .. done - 1: those before the span from the state, then the span's."""
        r, width = self.ratio, new.shape[1] // 2
        waiting = max(0, span.start - first * r)  # the first group's tokens that arrived in earlier steps
        earlier = state.pending[span.slot, [(first * r + i) % state.pending.shape[1] for i in range(waiting)]] if waiting else new[:0]
        rows = torch.cat((earlier, new[max(0, first * r - span.start) : done * r - span.start]))
        starts = torch.arange(done - first, device=new.device) * r
        no_bias = torch.zeros(r, width, dtype=rows.dtype, device=rows.device)  # V4.1's compressor has no positional bias
        return ops.compress_kv(rows[:, :width], rows[:, width:], no_bias, starts, torch.full_like(starts, -1), ratio=r, overlap=False)
