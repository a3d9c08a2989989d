"""Device graphs as a backend capability: how a backend records a sequence of kernel launches once
and replays it (CUDA graphs; Ascend's aclgraph through torch_npu's NPUGraph has the same shape).

A backend that can capture declares a `GraphCapture` on its BackendSpec (`graph_capture`); the
engine's decode-graph runner (engine/decode_graphs.py) asks the opened runtime for it and never
names a device API itself. A backend without one runs every step eagerly.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import torch  # imported when a graph is captured: backends declare a capture while plugins load

T = TypeVar("T")


class Graph(Protocol):
    def replay(self) -> None: ...


class GraphCapture(Protocol):
    """What the decode-graph runner needs from a backend."""

    def new_pool(self, device: torch.device) -> Any:
        """A memory pool every graph of one runner shares (its graphs never run concurrently)."""

    def capture(self, fn: Callable[[], T], *, device: torch.device, pool: Any, warmups: int) -> tuple[Graph, T]:
        """Run `fn` `warmups` times eagerly (compilers and allocators settle), then once under capture;
        return the graph and `fn`'s outputs, which every replay rewrites in place."""


class TorchGraphCapture:
    """Capture through a torch device module with torch.cuda's graph API: `torch.cuda` (CUDA graphs),
    or `torch.npu` once torch_npu is imported (NPUGraph). The warm-up runs on a side stream, as
    torch's graph documentation requires."""

    def __init__(self, module: str, graph_class: str, *, import_first: str | None = None):
        self.module, self.graph_class, self.import_first = module, graph_class, import_first

    def _api(self):
        import torch

        if self.import_first:
            importlib.import_module(self.import_first)  # e.g. torch_npu, which adds torch.npu
        return getattr(torch, self.module)

    def new_pool(self, device: torch.device) -> Any:
        return self._api().graph_pool_handle()

    def capture(self, fn: Callable[[], T], *, device: torch.device, pool: Any, warmups: int) -> tuple[Graph, T]:
        api = self._api()
        stream = api.Stream(device)
        stream.wait_stream(api.current_stream(device))
        with api.stream(stream):
            for _ in range(warmups):
                fn()
        api.current_stream(device).wait_stream(stream)
        graph = getattr(api, self.graph_class)()
        with api.graph(graph, pool=pool):
            out = fn()
        return graph, out
