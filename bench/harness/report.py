"""The measured section of docs/benchmarks.md, rendered from the JSON reports of one run."""

from __future__ import annotations

import re

BEGIN = "<!-- measured:begin (bench/service/run_all.py rewrites this section) -->"
END = "<!-- measured:end -->"

# Quoted from issue 8: llama.cpp's server (Q4_1, 16 slots) on this machine kind, measured 2026-11-29.
REFERENCE_DATE = "2026-11-29"
REFERENCE_TOK_S = {1: 110.0, 4: 150.0, 16: 198.0}
REFERENCE_TTFT_S = {1: 0.095, 4: 0.40, 16: 1.47}


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:.0f}"


def _num(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _level(report: dict | None, concurrency: int) -> dict | None:
    if not report:
        return None
    return next((lv for lv in report["levels"] if lv["concurrency"] == concurrency), None)


def serve_table(reports: dict[str, dict]) -> str:
    """One row per (server, concurrency)."""
    rows = [
        "| server | streams | TTFT p50 ms | TTFT p95 ms | TPOT p50 ms | tok/s per stream | tok/s total | req/s | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, report in reports.items():
        for lv in report["levels"]:
            rows.append(
                f"| {label} | {lv['concurrency']} | {_ms(lv['ttft_median_s'])} | {_ms(lv['ttft_p95_s'])} | "
                f"{_ms(lv['tpot_median_s'])} | {_num(lv['stream_tok_s_median'])} | {_num(lv['output_tok_s'])} | "
                f"{_num(lv['req_s'], 2)} | {lv['errors']} |"
            )
    return "\n".join(rows)


def ratio_table(ours: dict, peer: dict, peer_label: str) -> str:
    rows = [f"| streams | total tok/s, lmq ÷ {peer_label} | TTFT p50, lmq ÷ {peer_label} |", "|---:|---:|---:|"]
    for lv in ours["levels"]:
        other = _level(peer, lv["concurrency"])
        if not other or not other["output_tok_s"] or not other["ttft_median_s"] or lv["ttft_median_s"] is None:
            continue
        rows.append(
            f"| {lv['concurrency']} | {lv['output_tok_s'] / other['output_tok_s']:.2f}× | "
            f"{lv['ttft_median_s'] / other['ttft_median_s']:.2f}× |"
        )
    return "\n".join(rows)


def targets(ours: dict) -> str:
    """The issue's targets against the quoted llama.cpp reference, met or not."""
    lines = []
    at16, at1 = _level(ours, 16), _level(ours, 1)
    if at16:
        goal = 2 * REFERENCE_TOK_S[16]
        met = at16["output_tok_s"] >= goal
        lines.append(
            f"- 16 streams, aggregate ≥ {goal:.0f} tok/s (2× the reference): {at16['output_tok_s']:.0f} — {'met' if met else 'not met'}"
        )
        ttft = at16["ttft_median_s"]
        met = ttft is not None and ttft < REFERENCE_TTFT_S[16]
        lines.append(
            f"- 16 streams, median first token < {REFERENCE_TTFT_S[16] * 1000:.0f} ms: {_ms(ttft)} ms — {'met' if met else 'not met'}"
        )
    if at1:
        ttft = at1["ttft_median_s"]
        met = ttft is not None and ttft < 0.100
        lines.append(f"- 1 stream, median first token < 100 ms: {_ms(ttft)} ms — {'met' if met else 'not met'}")
    return "\n".join(lines)


def prefix_table(runs: dict[str, dict]) -> str:
    rows = [
        "| server, system prompt | streams | prompt tokens p50 | cached tokens p50 | TTFT p50 ms | TTFT p95 ms | tok/s total |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, report in runs.items():
        for lv in report["levels"]:
            prompt = (lv.get("prompt_tokens") or {}).get("median")
            cached = (lv.get("cached_tokens") or {}).get("median")
            rows.append(
                f"| {label} | {lv['concurrency']} | {_num(prompt, 0)} | {_num(cached, 0)} | {_ms(lv['ttft_median_s'])} | "
                f"{_ms(lv['ttft_p95_s'])} | {_num(lv['output_tok_s'])} |"
            )
    return "\n".join(rows)


def overhead_section(report: dict) -> str:
    ttft = report["ttft"]
    lines = [
        "| streams | streamed tok/s | ok | errors | gateway CPU s | worker CPU s | Redis CPU s | client CPU s | tok per gateway CPU s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lv in report["levels"]:
        cpu = lv["cpu_s"]
        lines.append(
            f"| {lv['concurrency']} | {lv['output_tok_s']:.0f} | {lv['completed']} | {lv['errors']} | {cpu['gateway']:.1f} | "
            f"{cpu['worker']:.1f} | {cpu['redis']:.1f} | {cpu['client']:.1f} | {lv['tokens_per_gateway_cpu_s']:.0f} |"
        )
    lines += [
        "",
        f"First token, one request at a time (median of {ttft['requests']}): stub engine called in-process "
        f"{_num(ttft['engine_in_process_median_ms'], 2)} ms; through HTTP, gateway, Redis and worker "
        f"{_num(ttft['through_queue_median_ms'], 2)} ms; added by the hop: **{_num(ttft['added_median_ms'], 2)} ms** "
        "(target ≤ 2 ms).",
    ]
    return "\n".join(lines)


def replace_section(document: str, section: str, begin: str = BEGIN, end: str = END) -> str:
    """`document` with the text between the markers replaced (markers appended if absent)."""
    block = f"{begin}\n{section.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.DOTALL)
    if pattern.search(document):
        return pattern.sub(lambda _: block, document)
    return document.rstrip() + "\n\n" + block + "\n"
