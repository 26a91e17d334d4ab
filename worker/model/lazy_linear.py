"""LazyLinear: a linear whose weights are built the first time something needs them.

Why: on a CPU the native step (worker/runtime/native_step.py) packs its own copy of every linear from the
checkpoint, and reads only the model's structure off the torch model (its norms, rotary tables, the MLP's
activation, a sparse MLP's routing). Where it serves every step, the torch path's int4 weights and dense copies
are memory no step reads, and building them is most of the load: on the Llama-3.2-1B shape (Q4_0), leaving them
unbuilt took the load from 30 to 16 s, its peak from 6.3 to 3.9 GB and the worker from 2.36 to 1.78 GB
(docs/benchmarks.md, "a worker's memory and load time"). So the loader builds the linears
as LazyLinears where the native step may serve the model, and worker/runtime/select.py builds them all
(`build_linears`) when the backend it picks runs torch steps. A torch forward over linears left unbuilt (a
test's reference beside an engine) builds each on first use: the same module the loader would have built, so
the same results.

A build runs where the forward runs (the engine's compute thread); nothing else calls it concurrently.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class LazyLinear(torch.nn.Module):
    def __init__(self, build: Callable[[], torch.nn.Module]) -> None:
        super().__init__()
        self._build = build
        self.built: torch.nn.Module | None = None

    def materialize(self) -> torch.nn.Module:
        if self.built is None:
            self.built = self._build().train(self.training)
        return self.built

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.materialize()(x)

    def release(self) -> None:
        """Let the built module go (built again on next use)."""
        self.built = None


def unbuilt_linears(model: torch.nn.Module) -> list[LazyLinear]:
    return [module for module in model.modules() if isinstance(module, LazyLinear) and module.built is None]


def release_linears(model: torch.nn.Module) -> int:
    """Let every built LazyLinear of `model` go (the native step built the head's int8 tier to pack its own copy);
    returns how many were."""
    built = [module for module in model.modules() if isinstance(module, LazyLinear) and module.built is not None]
    for module in built:
        module.release()
    return len(built)


def build_linears(model: torch.nn.Module) -> int:
    """Build every LazyLinear of `model` not built yet; returns how many were built."""
    unbuilt = unbuilt_linears(model)
    for module in unbuilt:
        module.materialize()
    return len(unbuilt)
