"""The requests a worker holds, and the events their engine outputs become."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from protocol import Reply, Request, delta_event, done_event, error_event, started_event
from worker.claims import EntryRef
from worker.engine import SeqOutput
from worker.publisher import Publisher
from worker.request_spans import RequestSpans

log = logging.getLogger(__name__)

# Rejections that are answers to a well-formed request, not poison: no dead letter for them.
ORDINARY_REJECTIONS = ("timeout", "prompt_too_long")


@dataclass
class Running:
    request: Request
    entry: EntryRef
    next_seq: int
    streamed: int  # completion tokens sent so far, by this worker or a dead one before it
    spans: RequestSpans
    timed_out: bool = False

    def take_seq(self) -> int:
        self.next_seq += 1
        return self.next_seq - 1


LogprobMaps = Callable[[list], list[dict]]


class RequestTable:
    def __init__(
        self,
        publisher: Publisher,
        count_outcome: Callable[[str], None],
        logprob_maps: LogprobMaps = lambda logprobs: [],
    ):
        self.publisher = publisher
        self.count_outcome = count_outcome  # called with a finish reason or an error code
        self.logprob_maps = logprob_maps  # an output's TokenLogprobs as the protocol's maps (worker/logprob_events.py)
        self.running: dict[str, Running] = {}
        self._publishing: dict[
            EntryRef, RequestSpans
        ] = {}  # entry -> spans of an ended request until its write is done

    def start(self, request: Request, entry: EntryRef, already_streamed: int, prompt_tokens: int) -> None:
        """A request that asks to be announced gets `started` (seq 0) from its first run. A dead worker
        sent that and at most one delta per streamed token, so a re-run's seq numbers start above them."""
        spans = RequestSpans(request, entry.entry_id, self.publisher.consumer, already_streamed)
        first_seq = already_streamed + 1 if request.announce else already_streamed
        self.running[request.id] = Running(request, entry, next_seq=first_seq, streamed=already_streamed, spans=spans)
        if request.announce and not already_streamed:
            self.publisher.send(entry, request.reply, started_event(request.id, 0, prompt_tokens))

    def answer(self, entry: EntryRef, request: Request, event: dict) -> None:
        """A request answered at once with one event (a tokenize task): sent, and its entry finished."""
        self.count_outcome(event.get("finish_reason") or event.get("code", "done"))
        self.publisher.send(entry, request.reply, event)
        self.publisher.finish(entry, None)

    def on_step(self, outputs: list[SeqOutput]) -> None:
        """Turn one engine step's outputs into writes."""
        for output in outputs:
            running = self.running.get(output.id)
            if running is None:
                continue
            self._send_delta(running, output)
            if output.finish_reason is not None:
                self._send_end(running, output)
                del self.running[output.id]

    def reject(
        self,
        entry: EntryRef,
        raw: bytes,
        code: str,
        message: str,
        *,
        request_id: str | None,
        reply: Reply | None,
        seq: int = 0,
        forget: bool = False,
    ) -> None:
        """Answer a request that will not run: an error event where possible, a dead letter unless ordinary.
        `forget`: also delete the request id's progress and holder keys."""
        log.info("rejected entry %s (%s): %s", entry, code, message)
        self.count_outcome(code)
        if reply is not None:
            self.publisher.send(entry, reply, error_event(request_id, seq, code, message))
        if code not in ORDINARY_REJECTIONS:
            self.publisher.dead_letter(entry, raw, code, message)
        self.publisher.finish(entry, request_id if forget else None)

    def drop(self, entry: EntryRef) -> str | None:
        """Forget the request of an entry this worker may no longer answer; its id, to cancel in the engine."""
        for request_id, running in self.running.items():
            if running.entry == entry:
                del self.running[request_id]
                running.spans.dropped("the entry was taken over or its reply refused")
                self.count_outcome("dropped")
                return request_id
        return None

    def written(self, entries: list[EntryRef]) -> None:
        """The publisher wrote these entries' events: the requests that ended there are done."""
        for entry in entries:
            spans = self._publishing.pop(entry, None)
            if spans is not None:
                spans.written()

    def _send_delta(self, running: Running, output: SeqOutput) -> None:
        if not output.token_ids and not output.text:
            return
        request = running.request
        logprobs = self.logprob_maps(output.logprobs) if output.logprobs is not None else None
        event = delta_event(request.id, running.take_seq(), output.text, output.token_ids, running.streamed, logprobs)
        self.publisher.send(running.entry, request.reply, event)
        if output.token_ids:
            running.spans.tokens_streamed()
        if output.finish_reason is None:
            self.publisher.record_progress(running.entry, request.id, running.streamed, output.token_ids)
        running.streamed += len(output.token_ids)

    def _send_end(self, running: Running, output: SeqOutput) -> None:
        request = running.request
        seq = running.take_seq()
        if output.finish_reason == "error":
            event = error_event(request.id, seq, "internal", output.error or "the engine failed")
        elif output.finish_reason == "cancelled" and running.timed_out:
            event = error_event(request.id, seq, "timeout", "the request's deadline passed while it ran")
        else:
            event = done_event(
                request.id,
                seq,
                output.finish_reason,
                output.prompt_tokens,
                output.completion_tokens,
                output.cached_tokens,
                output.stop_sequence,
            )
        self.publisher.send(running.entry, request.reply, event)
        self.publisher.finish(running.entry, request.id)
        outcome = event.get("finish_reason") or event["code"]
        self.count_outcome(outcome)
        running.spans.ended(outcome)
        self._publishing[running.entry] = running.spans
