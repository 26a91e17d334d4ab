"""The soak's ledger: one line per request, judged against its reference answer.

Verdicts:

- `exact`: the whole answer, the same as the reference (text, tool calls, finish of every choice),
  with its end marker and nothing after it;
- `error`: an error the client could see (a status, an error event, a dropped connection) after
  nothing but a prefix of the reference's text;
- `lost`: nothing, neither answer nor error, within the client's limit (a hang);
- `wrong`: anything else: a different answer, text with a hole or a duplicate, a 200 that ended
  without its end marker. `lost` and `wrong` fail the soak;
- `left`: a client that hung up on purpose (not judged).

A reference is the answer that (kind, prompt) got in the run before any fault (float32 greedy: one
answer whatever the batch). Each line also names the faults whose window it overlapped, so visible
errors are counted per fault kind, and time to first token is reported under faults and outside them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from bench.soak.answers import Answer

FAULT_TAIL_S = 10.0  # a request that ends this long after a fault ended may still feel it
FAILING = ("lost", "wrong")


@dataclass
class Fault:
    kind: str
    started: float
    ended: float = 0.0
    detail: str = ""

    def overlaps(self, start: float, end: float) -> bool:
        return start <= (self.ended or self.started) + FAULT_TAIL_S and end >= self.started


@dataclass
class Line:
    kind: str
    prompt: int
    started: float
    ended: float
    verdict: str
    detail: str
    ttft: float | None
    faults: list[str] = field(default_factory=list)


def verdict(answer: Answer, reference: Answer | None) -> tuple[str, str]:
    """(verdict, why) of one answer against its reference (None: a hang-up, not judged)."""
    if reference is None:
        return "left", ""
    if answer.hung:
        return "lost", "no answer and no error within the client's limit"
    if answer.error is not None:
        for index, choice in answer.choices.items():
            expected = reference.choices.get(index)
            if expected is None or not expected.text.startswith(choice.text):
                return "wrong", f"text before the error is no prefix of the reference: {answer.describe()}"
        return "error", answer.error
    if not answer.complete or answer.extra_after_end:
        return "wrong", f"no end marker, or events after it: {answer.describe()}"
    if answer.signature() != reference.signature():
        return "wrong", f"got {answer.describe()} expected {reference.describe()}"
    return "exact", ""


class Ledger:
    def __init__(self) -> None:
        self.lines: list[Line] = []
        self.faults: list[Fault] = []

    def record(
        self, kind: str, prompt: int, started: float, ended: float, answer: Answer, reference: Answer | None
    ) -> Line:
        judged, why = verdict(answer, reference)
        line = Line(kind, prompt, started, ended, judged, why, answer.ttft)
        self.lines.append(line)
        return line

    def attribute(self) -> None:
        """Name on each line the faults it overlapped (call once the run is over)."""
        for line in self.lines:
            line.faults = [fault.kind for fault in self.faults if fault.overlaps(line.started, line.ended)]

    def failures(self) -> list[Line]:
        return [line for line in self.lines if line.verdict in FAILING]

    def summary(self) -> dict:
        self.attribute()
        verdicts = Counter(line.verdict for line in self.lines)
        by_kind: dict[str, Counter] = {}
        for line in self.lines:
            by_kind.setdefault(line.kind, Counter())[line.verdict] += 1
        errors_by_fault = Counter(
            fault for line in self.lines if line.verdict == "error" for fault in (line.faults or ["none"])
        )
        under = [line.ttft for line in self.lines if line.ttft is not None and line.faults]
        calm = [line.ttft for line in self.lines if line.ttft is not None and not line.faults]
        return {
            "requests": len(self.lines),
            "verdicts": dict(verdicts),
            "by_kind": {kind: dict(counts) for kind, counts in sorted(by_kind.items())},
            "faults": dict(Counter(fault.kind for fault in self.faults)),
            "fault_log": [vars(fault) for fault in self.faults],
            "visible_errors_by_fault": dict(errors_by_fault),
            "error_samples": _samples(self.lines, "error"),
            "failures": [vars(line) for line in self.failures()][:20],
            "ttft_s": {"under_faults": percentiles(under), "no_fault": percentiles(calm)},
        }


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {"n": len(ordered), "p50": at(0.5), "p99": at(0.99), "max": round(ordered[-1], 3)}


def _samples(lines: list[Line], verdict_name: str, per_fault: int = 2) -> dict[str, list[str]]:
    """A few visible errors per fault kind, to read what clients saw."""
    samples: dict[str, list[str]] = {}
    for line in lines:
        if line.verdict == verdict_name:
            for fault in line.faults or ["none"]:
                kept = samples.setdefault(fault, [])
                if len(kept) < per_fault:
                    kept.append(f"{line.kind}: {line.detail[:200]}")
    return samples
