"""Per-request measurements and the summary of one concurrency level."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass
class RequestResult:
    """One streamed request, timed with time.perf_counter()."""

    start: float
    end: float = 0.0
    first_token: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token is not None

    @property
    def ttft(self) -> float:
        return self.first_token - self.start

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for a single-token answer."""
        if self.output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between ranks, as numpy's default."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _distribution(values: list[int]) -> dict[str, float] | None:
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summarize(concurrency: int, results: list[RequestResult], wall_s: float) -> dict:
    """The figures of one level. Aggregate rates divide by the level's wall time, ramp-down included."""
    ok = [r for r in results if r.ok]
    errors = [r.error or "no token received" for r in results if not r.ok]
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "completed": len(ok),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:5],
        "wall_s": wall_s,
        "ttft_median_s": _median([r.ttft for r in ok]),
        "ttft_p95_s": percentile([r.ttft for r in ok], 95),
        "tpot_median_s": _median(tpots),
        "stream_tok_s_median": _median([1.0 / t for t in tpots if t > 0]),
        "output_tok_s": output_tokens / wall_s if wall_s > 0 else 0.0,
        "req_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "output_tokens": output_tokens,
        "prompt_tokens": _distribution([r.prompt_tokens for r in ok if r.prompt_tokens is not None]),
        "cached_tokens": _distribution([r.cached_tokens for r in ok if r.cached_tokens is not None]),
    }


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(levels: list[dict]) -> str:
    """A short fixed-width table of the levels' main figures."""
    header = f"{'conc':>5} {'ok':>5} {'err':>4} {'TTFT p50':>9} {'TTFT p95':>9} {'TPOT p50':>9} {'stream':>8} {'total':>8} {'req/s':>6}"
    units = f"{'':>5} {'':>5} {'':>4} {'ms':>9} {'ms':>9} {'ms':>9} {'tok/s':>8} {'tok/s':>8} {'':>6}"
    rows = [
        f"{lv['concurrency']:>5} {lv['completed']:>5} {lv['errors']:>4} {_ms(lv['ttft_median_s']):>9} "
        f"{_ms(lv['ttft_p95_s']):>9} {_ms(lv['tpot_median_s']):>9} {_num(lv['stream_tok_s_median']):>8} "
        f"{_num(lv['output_tok_s']):>8} {_num(lv['req_s'], 2):>6}"
        for lv in levels
    ]
    return "\n".join([header, units, *rows])
