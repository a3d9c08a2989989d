"""Backends that ship inside the core distribution. Only `reference` lives here; the cuda and ascend
backends are their own packages (backends/cuda, backends/ascend) and register through the same
entry-point group, exactly as a third-party backend would."""
