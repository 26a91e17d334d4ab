"""How many CPU threads an engine step runs on: one for steps too small to share, all for the rest.

torch runs every operator of a step on its OpenMP threads. A small step (a few decodes of a small
model) is hundreds of operators of a few microseconds each, and waking the other threads for each
one (they sleep between operators after a short spin: worker/config.py bounds it, since spinning
threads stall everything on shared cores) costs more than they save. The default model's decode
step on the Intel machine, 2 threads against 1 (median ms, 2026-11-30, docs/benchmarks.md):

    rows      1     2     4     8    16    32
    1 thread 28    25-33 38    56-60 83    83-89
    2        39    39-42 51    59-65 70-73 73-77

The work of a step grows with its tokens times the model's parameters, and the cost of waking
threads does not, so the rule is written in that product: fewer than `SINGLE_THREAD_WORK`
token-parameters (up to 7 rows of the default model) run on one thread. A model ten times larger never
does, where one thread could not keep up with memory anyway. Only small decode steps are
affected; a prompt's first step (tens of tokens or more) keeps every thread.

We tried learning the crossover from the steps' own times instead, per size class with trials and
exploration: in the whole service, where the gateway and Redis share the cores, it chose worse than
this rule (16 streams 6-10% slower, first tokens later), so it stays a rule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SINGLE_THREAD_WORK = 1e9  # tokens × parameters: up to 7 rows of the default model (135M)


class StepThreads:
    """One owner: the engine's torch thread calls `choose` before each step."""

    def __init__(
        self, max_threads: int, parameter_count: int, set_threads: Callable[[int], None] = torch.set_num_threads
    ) -> None:
        self.max_threads = max_threads
        self.parameter_count = parameter_count
        self._set_threads = set_threads
        self._current = max_threads

    def choose(self, tokens: int) -> int:
        """Set the thread count for a step feeding `tokens` tokens; returns it."""
        threads = 1 if tokens * self.parameter_count < SINGLE_THREAD_WORK else self.max_threads
        if threads != self._current:
            self._set_threads(threads)
            self._current = threads
        return threads
