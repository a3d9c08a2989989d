"""A backend declared through the plugin hooks, as an out-of-tree package would: for the tests of
what the core asks a backend for (its options, a forced kernel that cannot run, the capabilities a
registration declares, device graphs). Its kernels are the reference's; rms_norm has three more,
chosen by its options, that record their calls.

    plugins = Plugins(load_entry_points=False, extra_plugins=(FakeBackend(),))
"""

from __future__ import annotations

import torch

from deepinfer.options import BackendOption
from deepinfer.plugins import Availability, BackendSpec, hookimpl
from deepinfer.registry import OPS, all_ops

NAME = "fake"
FLAVOUR = BackendOption("norm_flavour", ("plain", "fancy"), "plain", "which rms_norm kernel serves", env="DEEPINFER_FAKE_NORM_FLAVOUR")
EXOTIC = BackendOption("exotic", ("off", "on"), "off", "on: an rms_norm kernel that cannot run on this machine")
UNUSABLE = "the exotic unit is not installed (exotic=off uses the other kernels)"


def capturable(ranks: int, bound: int, top_k: int) -> bool:
    return ranks * bound * top_k <= 64


class ReplayByRunning:
    """A 'graph' that replays by running the captured function again into its outputs."""

    def __init__(self, fn, out, api):
        self.fn, self.out, self.api = fn, out, api

    def replay(self) -> None:
        fresh = self.fn()
        for out, new in zip(*((t if isinstance(t, tuple) else (t,)) for t in (self.out, fresh))):
            out.copy_(new)
        self.api.replays += 1


class RecordingGraphs:
    """A GraphCapture for the CPU that records how the engine used it."""

    def __init__(self):
        self.pools = 0
        self.captured: list[torch.Tensor] = []
        self.warmups = 0
        self.replays = 0

    def new_pool(self, device):
        self.pools += 1
        return ("pool", self.pools)

    def capture(self, fn, *, device, pool, warmups):
        for _ in range(warmups):
            fn()
        self.warmups += warmups
        out = fn()
        self.captured.append(out)
        return ReplayByRunning(fn, out, self), out


class FakeBackend:
    """without: ops it registers no kernel for (a backend that lacks a model's ops, as cuda and
    ascend lack DeepSeek-V4's)."""

    def __init__(self, graphs: RecordingGraphs | None = None, memory_info=None, without: tuple[str, ...] = ()):
        self.graphs, self.memory_info, self.without = graphs, memory_info, frozenset(without)
        self.calls: list[str] = []

    @hookimpl
    def deepinfer_add_backends(self, register):
        register(
            BackendSpec(
                name=NAME,
                device_type="cpu",
                probe=lambda interpret=False: Availability(True, "always here"),
                kv_block_size=16,
                options=(FLAVOUR, EXOTIC),
                graph_capture=self.graphs,
                memory_info=self.memory_info,
            )
        )

    @hookimpl
    def deepinfer_register_kernels(self, backend, registry, interpret, options):
        if backend.name != NAME:
            return
        for name, spec in all_ops().items():
            if name not in self.without:
                registry.register_kernel(NAME, name, spec.reference, note="reference")
        for flavour in FLAVOUR.choices:
            registry.register_kernel(NAME, "rms_norm", self._norm(flavour), when=lambda ctx, f=flavour: FLAVOUR.value(ctx) == f, priority=1, note=flavour)
        registry.register_kernel(
            NAME, "rms_norm", self._norm("exotic"), when=lambda ctx: EXOTIC.value(ctx) == "on", unusable=lambda ctx: UNUSABLE, priority=2, note="exotic"
        )
        for op in ("dispatch", "combine"):
            registry.register_kernel(NAME, op, OPS[op].reference, capturable_with_token_bound=capturable, priority=1, note="capturable")

    def _norm(self, flavour: str):
        def rms_norm(x, weight, *, eps=1e-6, residual=None):
            self.calls.append(flavour)
            return OPS["rms_norm"].reference(x, weight, eps=eps, residual=residual)

        return rms_norm


def recording_graphs_llm(model: str, cache_dir, **config):
    """`model` loaded on the fake backend with recording graphs (the reference kernels), prefix caching off unless
    `config` turns it on: the graph tests' shared engine, over which each test builds engines of its own."""
    import pytest

    import deepinfer.plugins as plugins_mod
    from deepinfer import LLM
    from deepinfer.backends import reference
    from deepinfer.plugins import Plugins

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE", str(cache_dir))
        mp.setattr(plugins_mod, "load_plugins", lambda: Plugins(load_entry_points=False, extra_plugins=(FakeBackend(graphs=RecordingGraphs()), reference)))
        return LLM(model=model, backend="fake", dtype="float32", announce=False, **{"enable_prefix_caching": False, **config})


def random_prompts(lens, low: int, high: int, seed: int = 1) -> list[dict]:
    """Token-id prompts of the given lengths, ids drawn in [low, high)."""
    gen = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(low, high, (n,), generator=gen).tolist()} for n in lens]
