"""Threads per engine step (worker/step_threads.py): one for small steps of a small model, all for the
rest; and the engine's answers do not depend on it."""

from __future__ import annotations

import asyncio
import sys

import torch

from protocol import SamplingParams
from worker import compute_thread
from worker.engine import Engine, GenRequest
from worker.step_threads import SINGLE_THREAD_WORK, StepThreads


def test_small_steps_of_a_small_model_run_on_one_thread_and_the_rest_on_all():
    calls: list[int] = []
    chooser = StepThreads(4, 135_000_000, set_threads=calls.append)
    assert [chooser.choose(tokens) for tokens in (1, 7, 8, 52, 3)] == [1, 1, 4, 4, 1]
    assert calls == [1, 4, 1]  # set only when it changes
    assert SINGLE_THREAD_WORK // 135_000_000 == 7


def test_a_large_model_always_runs_on_all_threads():
    calls: list[int] = []
    chooser = StepThreads(4, 7_000_000_000, set_threads=calls.append)
    assert {chooser.choose(tokens) for tokens in (1, 2, 300)} == {4} and calls == []


def test_greedy_answers_are_the_same_on_one_thread_and_on_two(tiny):
    """A sequence's steps run on one thread or on all as the batch around it changes: torch's CPU
    kernels split work by outputs, so the tokens must not change with the thread count."""

    def answers(threads: int) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

        def on_step(outputs) -> None:
            for output in outputs:
                out.setdefault(output.id, []).extend(output.token_ids)

        async def run() -> None:
            engine = Engine(tiny, max_seqs=8, on_step=on_step)
            engine.backend.step_threads = None
            for index in range(6):
                engine.add(GenRequest(f"r{index}", list(range(3 + index, 40 + 5 * index)), params))
            engine.stop()
            await engine.run()

        before = compute_thread.run(torch.get_num_threads)
        compute_thread.run(torch.set_num_threads, threads)
        try:
            asyncio.run(run())
        finally:
            compute_thread.run(torch.set_num_threads, before)
        return out

    one, two = answers(1), answers(2)
    assert len(one) == 6 and all(len(tokens) == 24 for tokens in one.values())
    assert one == two


def test_the_compute_thread_waits_at_most_the_switch_interval_for_the_gil():
    """The Python around a native step needs the GIL back from the event loop: CPython's 5 ms default is longer
    than the default model's step (worker/compute_thread.py)."""
    compute_thread.executor()
    assert sys.getswitchinterval() == compute_thread.SWITCH_INTERVAL_S < 0.005
