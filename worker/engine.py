"""The engine: an asyncio loop of continuous batching over the paged KV cache.

One task (`run`) owns all state. Requests and cancellations arrive through `add` and `cancel`
and take effect between steps. Each step: schedule → model forward and sampling on the one
torch thread (worker/compute_thread.py, so the event loop keeps doing Redis I/O) → detokenize, check stops → report
every sequence's output through `on_step`.

A request may carry a constraint (worker/grammar.py): it is compiled when the request is added, so
a bad one is refused before it is queued; its matcher masks the sampler's logits every step and
finishes the sequence ("stop") when the grammar is complete. A request may ask for logprobs: each
output then carries one `TokenLogprob` per token (worker/sampler.py says how they are computed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from protocol import SamplingParams
from protocol.messages import MAX_LOGPROBS
from worker import compute_thread
from worker.detok import IncrementalDetokenizer, StopStrings, text_state
from worker.grammar import GrammarCompiler
from worker.model.loader import LoadedModel
from worker.prompt import PromptTooLong
from worker.reasoning_budget import Thinking, budget_for
from worker.runtime.backend import StepBackend
from worker.runtime.select import select_backend
from worker.sampler import Sampled, SamplingState, TokenLogprob, sample
from worker.scheduler import Scheduled, Scheduler, Sequence, StepPlan

log = logging.getLogger(__name__)

__all__ = ["Engine", "EngineStats", "GenRequest", "PromptTooLong", "SeqOutput", "TokenLogprob"]


@dataclass
class GenRequest:
    id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    # Tokens an earlier (dead) worker already streamed: generation continues after them; they
    # count toward max_tokens and stop checks but are not emitted again.
    generated_ids: list[int] = field(default_factory=list)
    # The output's grammar (worker/grammar.py: json_object, json_schema, regex or lark), or None.
    constraint: dict | None = None
    # How many alternatives to report with each token's logprob (0..20); None: no logprobs.
    logprobs: int | None = None
    priority: str = "interactive"  # or "batch": scheduled on spare capacity (worker/scheduler.py)
    # A thinking prompt (worker/reasoning_budget.py) and the most tokens its thinking may take (None: no limit).
    thinking: Thinking | None = None
    reasoning_budget: int | None = None


@dataclass
class SeqOutput:
    """What one sequence produced in one step (or how it finished)."""

    id: str
    token_ids: list[int]
    text: str  # never ends inside a UTF-8 character; stop strings trimmed
    finish_reason: str | None  # None while running; "stop" | "length" | "cancelled" | "error"
    stop_sequence: str | None
    prompt_tokens: int
    completion_tokens: int  # total so far, generated_ids of an earlier run included
    cached_tokens: int  # prompt tokens served from the prefix cache
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry when the request asked


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_pages_used: int
    kv_pages_free: int
    kv_pages_total: int
    prefix_hit_tokens: int
    prefix_lookup_tokens: int
    tokens_generated: int
    preemptions: int
    steps: int
    last_step_seconds: float


@dataclass(eq=False)
class _Active:
    """Engine-side state of one request next to its scheduler Sequence."""

    request: GenRequest
    seq: Sequence
    sampling: SamplingState
    detok: IncrementalDetokenizer
    stops: StopStrings
    stop_token_ids: frozenset[int]

    @property
    def completion_tokens(self) -> int:
        return len(self.seq.token_ids) - self.seq.num_prompt_tokens

    def output(
        self,
        token_ids: list[int],
        text: str,
        finish_reason: str | None = None,
        stop_sequence: str | None = None,
        error: str | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> SeqOutput:
        return SeqOutput(
            id=self.request.id,
            token_ids=token_ids,
            text=text,
            finish_reason=finish_reason,
            stop_sequence=stop_sequence,
            prompt_tokens=self.seq.num_prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.seq.cached_prompt_tokens or 0,
            error=error,
            logprobs=None if self.request.logprobs is None else (logprobs or []),
        )


class Engine:
    def __init__(
        self,
        model: LoadedModel,
        *,
        kv_memory_bytes: int | None = None,
        page_size: int = 16,
        max_seqs: int = 64,
        step_tokens: int = 512,
        on_step: Callable[[list[SeqOutput]], None],
        on_step_seconds: Callable[[float], None] | None = None,
        backend: StepBackend | None = None,
    ) -> None:
        self.model = model
        self.max_context = model.config.max_context
        # Where the steps run (worker/runtime/): the KV pool, the batch, the forward, the thread and batch-token rules.
        self.backend = backend or compute_thread.run(lambda: select_backend(model, max_threads=torch.get_num_threads()))
        self.kv = compute_thread.run(self.backend.make_kv, kv_memory_bytes, page_size, max_seqs)
        compute_thread.run(self.backend.prepare, self.kv, max_seqs)
        beside = self.backend.batch_tokens_beside_interactive
        self.scheduler = Scheduler(
            self.kv, max_seqs=max_seqs, step_tokens=step_tokens, max_context=self.max_context,
            batch_tokens_beside_interactive=step_tokens if beside is None else beside,
        )  # fmt: skip
        self._on_step = on_step
        self._on_step_seconds = on_step_seconds  # each step's duration (the metrics' histogram)
        self._wake = asyncio.Event()
        self._incoming: list[GenRequest] = []
        self._cancels: list[str] = []
        self._active: dict[str, _Active] = {}
        self._stopping = False
        self._tokens_generated = 0
        self._steps = 0
        self._last_step_seconds = 0.0
        self._grammars: GrammarCompiler | None = None  # built with the first constrained request

    # ------------------------------------------------------------ public API

    def add(self, request: GenRequest) -> None:
        """Queue a request; raises PromptTooLong if it can never fit, ValueError on bad input."""
        if self._stopping:
            raise RuntimeError("the engine is stopping")
        if not request.prompt_ids:
            raise ValueError("the prompt is empty")
        if request.id in self._active or any(r.id == request.id for r in self._incoming):
            raise ValueError(f"request {request.id} is already running")
        self._check_fits(request)
        if request.logprobs is not None and not (
            type(request.logprobs) is int and 0 <= request.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"logprobs must be an integer from 0 to {MAX_LOGPROBS}, not {request.logprobs!r}")
        if request.constraint is not None:
            self.grammars.check(request.constraint)
        self._incoming.append(request)
        self._wake.set()

    def cancel(self, request_id: str) -> None:
        """Finish the request with "cancelled" (at the next step boundary) and free its pages."""
        self._cancels.append(request_id)
        self._wake.set()

    def free_slots(self) -> int:
        """How many more requests to hand over now: none while some wait for pages."""
        if self._stopping or self.scheduler.waiting:
            return 0
        return max(0, self.scheduler.max_seqs - len(self._active) - len(self._incoming))

    def stop(self) -> None:
        """Accept nothing more; `run` returns once every running request has finished."""
        self._stopping = True
        self._wake.set()

    @property
    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting) + len(self._incoming),
            kv_pages_used=self.kv.num_used,
            kv_pages_free=self.kv.num_free,
            kv_pages_total=self.kv.num_pages,
            prefix_hit_tokens=self.scheduler.prefix.hit_tokens,
            prefix_lookup_tokens=self.scheduler.prefix.lookup_tokens,
            tokens_generated=self._tokens_generated,
            preemptions=self.scheduler.preemptions,
            steps=self._steps,
            last_step_seconds=self._last_step_seconds,
        )

    async def run(self) -> None:
        while True:
            outputs = self._take_incoming() + self._take_cancels()
            if self.scheduler.has_work():
                plan = self.scheduler.schedule()
                if plan.scheduled:
                    outputs += await self._step(plan)
            if outputs:
                self._on_step(outputs)
            if self.scheduler.has_work() or self._incoming or self._cancels:
                continue
            if self._stopping:
                return
            self._wake.clear()
            await self._wake.wait()

    # ------------------------------------------------------------ between steps

    def _check_fits(self, request: GenRequest) -> None:
        tokens = len(request.prompt_ids) + len(request.generated_ids)
        if tokens >= self.max_context:
            raise PromptTooLong(
                f"the prompt has {tokens} tokens; the model's context holds {self.max_context} "
                "including at least one generated token"
            )
        longest = min(len(request.prompt_ids) + request.sampling.max_tokens, self.max_context)
        pages = -(-longest // self.kv.page_size)
        if pages > self.kv.num_pages:
            raise PromptTooLong(
                f"prompt and max_tokens need up to {longest} tokens ({pages} KV pages); "
                f"the KV cache holds {self.kv.num_pages} pages of {self.kv.page_size} tokens"
            )

    @property
    def grammars(self) -> GrammarCompiler:
        """The model's grammar compiler, built on first use (its vocabulary takes a fraction of a second)."""
        if self._grammars is None:
            model = self.model
            self._grammars = GrammarCompiler(
                model.tokenizer, vocab_size=model.config.vocab_size, stop_token_ids=model.stop_token_ids
            )
        return self._grammars

    def _take_incoming(self) -> list[SeqOutput]:
        outputs = []
        for request in self._incoming:
            active = self._activate(request)
            grammar = active.sampling.grammar
            finished = self._already_finished(active)
            if grammar is not None and grammar.error is not None:
                error = f"the tokens already generated do not follow the constraint: {grammar.error}"
                outputs.append(active.output([], "", "error", error=error))
            elif finished is not None:
                outputs.append(active.output([], "", finished))
            else:
                self._active[request.id] = active
                self.scheduler.add(active.seq)
        self._incoming = []
        return outputs

    def _activate(self, request: GenRequest) -> _Active:
        params = request.sampling
        seq = Sequence(
            id=request.id,
            token_ids=[*request.prompt_ids, *request.generated_ids],
            num_prompt_tokens=len(request.prompt_ids),
            priority=request.priority,
        )
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.model.stop_token_ids
        grammar = None
        if request.constraint is not None:  # replayed: a takeover continues where the grammar was
            grammar = self.grammars.matcher(request.constraint, request.generated_ids)
        sampling = SamplingState(
            params,
            prompt_ids=request.prompt_ids,
            generated_ids=request.generated_ids,
            vocab_size=self.model.config.vocab_size,
            device=self.backend.device,
            grammar=grammar,
            logprobs=request.logprobs,
            budget=budget_for(self.model, request.thinking, request.reasoning_budget, request.generated_ids),
        )
        detok, stops = text_state(self.model.tokenizer, request.prompt_ids, request.generated_ids, params.stop)
        return _Active(request, seq, sampling, detok, stops, stop_ids)

    def _already_finished(self, active: _Active) -> str | None:
        """A request resumed from an earlier run may have nothing left to generate."""
        generated = active.request.generated_ids
        if generated and generated[-1] in active.stop_token_ids:
            return "stop"
        grammar = active.sampling.grammar
        if generated and grammar is not None and grammar.finished:
            return "stop"
        if active.completion_tokens >= active.request.sampling.max_tokens:
            return "length"
        return None

    def _take_cancels(self) -> list[SeqOutput]:
        outputs = []
        for request_id in self._cancels:
            active = self._active.pop(request_id, None)
            if active is not None:
                self.scheduler.remove(active.seq)
                outputs.append(active.output([], "", "cancelled"))
        self._cancels = []
        return outputs

    # ------------------------------------------------------------ one step

    async def _step(self, plan: StepPlan) -> list[SeqOutput]:
        samplers = [item for item in plan.scheduled if item.samples]
        states = [self._active[item.seq.id].sampling for item in samplers]
        started = time.perf_counter()
        try:
            sampled = await compute_thread.run_async(self._compute, plan.scheduled, states)
        except Exception as error:  # a failed step fails its sequences, never the worker
            log.exception("engine step failed")
            return self._fail(plan, error)
        finally:
            self._last_step_seconds = time.perf_counter() - started
            self._steps += 1
            if self._on_step_seconds is not None:
                self._on_step_seconds(self._last_step_seconds)
        self.scheduler.complete(plan)
        self._tokens_generated += len(sampled.tokens)
        return [
            self._append(self._active[item.seq.id], token, logprob)
            for item, token, logprob in zip(samplers, sampled.tokens, sampled.logprobs)
        ]

    def _compute(self, scheduled: list[Scheduled], states: list[SamplingState]) -> Sampled:
        """In the executor thread: the model forward over the step, then sampling."""
        batch = self.backend.build_batch(scheduled, self.kv.page_size)
        with torch.inference_mode():
            logits = self.backend.forward(batch, self.kv.kv)  # the sampling rows only
            sampled = sample(logits, states)
        for state, token in zip(states, sampled.tokens):
            state.record(token)
        return sampled

    def _append(self, active: _Active, token: int, logprob: TokenLogprob | None) -> SeqOutput:
        seq = active.seq
        grammar = active.sampling.grammar
        if grammar is not None and grammar.error is not None:  # should not happen: the mask allows only valid tokens
            return self._finish(active, [], "", "error", None, error=f"constrained decoding failed: {grammar.error}")
        seq.token_ids.append(token)
        logprobs = None if logprob is None else [logprob]
        if token in active.stop_token_ids:
            text, stop = self._final_text(active, active.detok.flush())
            return self._finish(active, [token], text, "stop", stop, logprobs)
        text, stop = active.stops.push(active.detok.add(token))
        if stop is not None:
            return self._finish(active, [token], text, "stop", stop, logprobs)
        if grammar is not None and grammar.finished:
            tail, stop = self._final_text(active, active.detok.flush())
            return self._finish(active, [token], text + tail, "stop", stop, logprobs)
        if active.completion_tokens >= active.request.sampling.max_tokens or len(seq.token_ids) >= self.max_context:
            tail, stop = self._final_text(active, active.detok.flush())
            return self._finish(active, [token], text + tail, "stop" if stop else "length", stop, logprobs)
        return active.output([token], text, logprobs=logprobs)

    @staticmethod
    def _final_text(active: _Active, text: str) -> tuple[str, str | None]:
        """The last text of a sequence: stop strings still apply, held-back text is released."""
        text, stop = active.stops.push(text)
        if stop is None:
            text += active.stops.flush()
        return text, stop

    def _finish(
        self,
        active: _Active,
        token_ids: list[int],
        text: str,
        reason: str,
        stop: str | None,
        logprobs: list[TokenLogprob] | None = None,
        error: str | None = None,
    ) -> SeqOutput:
        self.scheduler.remove(active.seq)
        del self._active[active.request.id]
        return active.output(token_ids, text, reason, stop_sequence=stop, error=error, logprobs=logprobs)

    def _fail(self, plan: StepPlan, error: Exception) -> list[SeqOutput]:
        outputs = []
        for item in plan.scheduled:
            active = self._active.pop(item.seq.id)
            self.scheduler.remove(item.seq)
            outputs.append(active.output([], "", "error", error=f"{type(error).__name__}: {error}"))
        return outputs
