"""The residual streams of a hyper-connected model (DeepSeek-V4 and V4.1) at its first layer."""

from __future__ import annotations

import torch


def embedded_streams(embed: torch.Tensor, token_ids: torch.Tensor, streams: int) -> torch.Tensor:
    """[T, streams, hidden]: each token's embedding row in every one of its streams, gathered in one indexing kernel
    (an index of [T, streams] ids) rather than a gather and then a copy of the broadcast."""
    return embed[token_ids[:, None].expand(-1, streams)]
