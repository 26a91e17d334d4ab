"""Running the engine in tests: requests that join at a given step or after another finishes."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from protocol import SamplingParams
from worker.engine import Engine, GenRequest, SeqOutput
from worker.model.loader import LoadedModel

# A run fails when the engine goes this long without finishing a step: a hang, not a slow machine.
# A whole run is not timed: on 2 loaded cores one tiny-model step can take a second, a real-model
# prefill many seconds, and how many steps a run takes depends on the workload (pytest-timeout
# still bounds the test).
STALL_TIMEOUT_S = 120.0


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_sequence: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finishes: int = 0
    error: str | None = None

    def add(self, output: SeqOutput) -> None:
        self.token_ids += output.token_ids
        self.text += output.text
        self.prompt_tokens, self.completion_tokens = output.prompt_tokens, output.completion_tokens
        self.cached_tokens = output.cached_tokens
        if output.finish_reason is not None:
            self.finishes += 1
            self.finish_reason, self.stop_sequence, self.error = (
                output.finish_reason,
                output.stop_sequence,
                output.error,
            )


def greedy(max_tokens: int = 12, **params) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)


def _idle(engine: Engine) -> bool:
    stats = engine.stats
    return stats.running == stats.waiting == 0


async def generate(
    model: LoadedModel,
    requests: list[GenRequest],
    *,
    joins: dict[str, int | str] | None = None,
    cancels: dict[str, int] | None = None,
    engine_out: list[Engine] | None = None,
    **engine_options,
) -> dict[str, Result]:
    """Run requests to completion on a fresh engine.

    joins: request id -> the step after which it is added (int; earlier if the engine would go idle),
    or the id of a request after whose finish it is added (str); others start at once. cancels: request id -> step after which it is cancelled.
    """
    joins, cancels = joins or {}, dict(cancels or {})
    results = {request.id: Result() for request in requests}
    by_step = sorted((step, r.id) for r in requests if isinstance(step := joins.get(r.id), int))
    after = {joins[r.id]: r for r in requests if isinstance(joins.get(r.id), str)}
    by_id = {r.id: r for r in requests}
    unadded = {r.id for r in requests if r.id in joins}
    steps = 0
    last_step = time.monotonic()

    def add(request_id: str) -> None:
        unadded.discard(request_id)
        engine.add(by_id[request_id])

    def on_step(outputs: list[SeqOutput]) -> None:
        nonlocal steps, last_step
        steps += 1
        last_step = time.monotonic()
        for output in outputs:
            results[output.id].add(output)
            if output.finish_reason is not None and output.id in after:
                add(after.pop(output.id).id)
        while by_step and (by_step[0][0] <= steps or _idle(engine)):
            add(by_step.pop(0)[1])
        for request_id, step in list(cancels.items()):
            if step <= steps:
                engine.cancel(request_id)
                del cancels[request_id]
        if not unadded:
            engine.stop()

    engine = Engine(model, on_step=on_step, **engine_options)
    if engine_out is not None:
        engine_out.append(engine)
    for request in requests:
        if request.id not in joins:
            engine.add(request)
    if _idle(engine) and by_step:
        add(by_step.pop(0)[1])
    if not unadded:
        engine.stop()
    run = asyncio.ensure_future(engine.run())
    try:
        while not run.done():
            await asyncio.wait([run], timeout=1.0)
            stalled = time.monotonic() - last_step
            if not run.done() and stalled > STALL_TIMEOUT_S:
                stats = engine.stats
                raise AssertionError(
                    f"the engine finished no step for {stalled:.0f} s (after step {steps}; "
                    f"running {stats.running}, waiting {stats.waiting}, not yet added {sorted(unadded)})"
                )
        run.result()
    finally:
        if not run.done():
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
    return results
