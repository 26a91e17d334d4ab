"""The requests a worker holds, and the events their engine outputs become: the one owner of a running request.

A request starts here (`start`) and ends here, once, in `_close`, whatever ends it:

- its model finished it (the engine's `stop` or `length`), or the engine failed its step (`error`):
  its final event is a `done` or an `internal` error;
- `end(request_id, reason)`, the one way to end it before that, with an `Ending`: its producer
  cancelled it (`cancel`, remembered in `early_cancels` when it comes before the request starts), its
  deadline passed (`time_out_overdue`), another worker took its entry over or its reply could not be
  written (`refused`).

Ending a request stops it in the engine, which frees its pages at its next step boundary. While its
entry is ours, its final event goes out with the entry's acknowledgement (which deletes its progress
and holder keys too); once it is not, nothing more is written for it.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass

from protocol import Cancel, Reply, Request, delta_event, done_event, error_event, started_event
from worker.cancel_memory import CancelMemory
from worker.claims import EntryRef
from worker.engine import SeqOutput
from worker.publisher import Publisher
from worker.reasoning_budget import Thinking
from worker.request_spans import RequestSpans

log = logging.getLogger(__name__)

# Rejections that are answers to a well-formed request, not poison: no dead letter for them.
ORDINARY_REJECTIONS = ("timeout", "prompt_too_long")


class Ending(enum.Enum):
    """Why a request ends before its model finishes it, and so what it is told."""

    CANCELLED = "cancelled"  # its producer cancelled it: a `done` with finish_reason "cancelled"
    TIMEOUT = "timeout"  # its deadline passed while it ran: a `timeout` error
    TAKEN_OVER = "lost"  # another worker claimed its entry: that worker answers it
    REFUSED = "refused"  # its reply could not be written (`denied`, `too_large`): the publisher finished its entry

    @property
    def entry_is_ours(self) -> bool:
        return self in (Ending.CANCELLED, Ending.TIMEOUT)


@dataclass
class Running:
    request: Request
    entry: EntryRef
    next_seq: int
    streamed: int  # completion tokens sent so far, by this worker or a dead one before it
    spans: RequestSpans
    ending: Ending | None = None  # set by `end`, until the engine confirms the stop

    def take_seq(self) -> int:
        self.next_seq += 1
        return self.next_seq - 1


LogprobMaps = Callable[[list], list[dict]]


class RequestTable:
    def __init__(
        self,
        publisher: Publisher,
        stop: Callable[[str], None],
        count_outcome: Callable[[str], None],
        logprob_maps: LogprobMaps = lambda logprobs: [],
    ):
        self.publisher = publisher
        self.stop = stop  # the engine's cancel: the request's pages are freed at its next step boundary
        self.count_outcome = count_outcome  # called with a finish reason or an error code
        self.logprob_maps = logprob_maps  # an output's TokenLogprobs as the protocol's maps (worker/logprob_events.py)
        self.running: dict[str, Running] = {}
        self.early_cancels = CancelMemory()  # (request id, token digest) of cancels for requests not started yet
        # entry -> the spans of an ended request, until its last write is done
        self._publishing: dict[EntryRef, RequestSpans] = {}

    def start(
        self,
        request: Request,
        entry: EntryRef,
        already_streamed: int,
        prompt_tokens: int,
        thinking: Thinking | None = None,
    ) -> None:
        """A request that asks to be announced gets `started` (seq 0) from its first run, saying how its
        answer thinks, if it does. A dead worker sent that and at most one delta per streamed token, so
        a re-run's seq numbers start above them."""
        spans = RequestSpans(request, entry.entry_id, self.publisher.consumer, already_streamed)
        first_seq = already_streamed + 1 if request.announce else already_streamed
        self.running[request.id] = Running(request, entry, next_seq=first_seq, streamed=already_streamed, spans=spans)
        if request.announce and not already_streamed:
            reasoning = thinking.event_field() if thinking is not None else None
            self.publisher.send(entry, request.reply, started_event(request.id, 0, prompt_tokens, reasoning))
        if self.early_cancels.take((request.id, request.cancel_digest)):
            self.end(request.id, Ending.CANCELLED)

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
                continue  # ended here already: the engine's answer to the stop of a request whose entry was lost
            self._send_delta(running, output)
            if output.finish_reason is not None:
                event = self._final_event(running, output)
                self._close(running, event, event.get("finish_reason") or event["code"])

    # ------------------------------------------------------------ ending a request early

    def cancel(self, cancel: Cancel) -> None:
        """End the request a producer's cancel names (its id and its token's digest); a cancel naming
        no request running here is remembered: perhaps it was read but has not started yet."""
        running = self.running.get(cancel.id)
        if running is not None and running.request.cancel_digest == cancel.digest:
            self.end(cancel.id, Ending.CANCELLED)
        else:
            self.early_cancels.remember((cancel.id, cancel.digest))

    def time_out_overdue(self, now: float) -> None:
        """End the requests whose deadline (a wall-clock time) is before `now`."""
        for running in list(self.running.values()):
            if running.request.deadline < now:
                self.end(running.request.id, Ending.TIMEOUT)

    def refused(self, entry: EntryRef, status: str) -> None:
        """The publisher or the keep loop found an entry this worker may no longer answer: `lost`
        (another worker owns it), `denied` or `too_large` (its reply could not be written)."""
        running = next((running for running in self.running.values() if running.entry == entry), None)
        if running is not None:
            self.end(running.request.id, Ending.TAKEN_OVER if status == "lost" else Ending.REFUSED)

    def end(self, request_id: str, reason: Ending) -> None:
        """End a running request before its model finishes it; a request ends once.

        The engine stops it and frees its pages at its next step boundary, then answers with a
        "cancelled" output (after those of a step in flight). While the entry is ours (CANCELLED,
        TIMEOUT), that answer brings its final event (`_final_event`). Once the entry is not ours
        (TAKEN_OVER, REFUSED), the request is closed now, with nothing more written: its claim stays
        with whoever holds it. A second reason is ignored, except that losing the entry overrides a
        cancel or timeout still waiting for the engine: there is no one left to tell.
        """
        running = self.running.get(request_id)
        if running is None or (running.ending is not None and reason.entry_is_ours):
            return
        if running.ending is None:
            self.stop(request_id)
        running.ending = reason
        if not reason.entry_is_ours:
            self._close(running, None, "dropped")

    # ------------------------------------------------------------ writes

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

    def _final_event(self, running: Running, output: SeqOutput) -> dict:
        """The last event of a request whose entry is ours, when the engine reports it finished."""
        request = running.request
        seq = running.take_seq()
        if output.finish_reason == "error":
            return error_event(request.id, seq, "internal", output.error or "the engine failed")
        if output.finish_reason == "cancelled" and running.ending is Ending.TIMEOUT:
            return error_event(request.id, seq, "timeout", "the request's deadline passed while it ran")
        return done_event(
            request.id,
            seq,
            output.finish_reason,
            output.prompt_tokens,
            output.completion_tokens,
            output.cached_tokens,
            output.stop_sequence,
        )

    def _close(self, running: Running, event: dict | None, outcome: str) -> None:
        """Where every request this table started ends, once: it is forgotten and its outcome counted.
        With an `event` (its entry is ours), that is its last write, sent with the entry's acknowledgement."""
        del self.running[running.request.id]
        self.count_outcome(outcome)
        if event is None:
            running.spans.dropped("the entry was taken over or its reply refused")
            return
        self.publisher.send(running.entry, running.request.reply, event)
        self.publisher.finish(running.entry, running.request.id)
        running.spans.ended(outcome)
        self._publishing[running.entry] = running.spans
