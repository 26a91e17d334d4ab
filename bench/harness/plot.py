"""PNG plots of serve.py reports: aggregate throughput and first-token latency against concurrency."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def _series(report: dict, key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    points = [(lv["concurrency"], lv[key] * scale) for lv in report["levels"] if lv.get(key) is not None]
    return [c for c, _ in points], [v for _, v in points]


def _axes(title: str, ylabel: str):
    figure, axes = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("concurrent streams")
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    return figure, axes


def _finish(figure, axes, reports: dict[str, dict], path: Path, reference: dict[int, float] | None) -> None:
    levels = sorted(
        {lv["concurrency"] for report in reports.values() for lv in report["levels"]} | set(reference or {})
    )
    axes.set_xticks(levels, [str(c) for c in levels])
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)


def plot_throughput(reports: dict[str, dict], path: Path, reference: dict[int, float] | None = None) -> None:
    figure, axes = _axes("Aggregate output throughput", "output tokens/s")
    for label, report in reports.items():
        axes.plot(*_series(report, "output_tok_s"), marker="o", label=label)
    if reference:
        axes.plot(
            list(reference),
            list(reference.values()),
            linestyle="--",
            marker="x",
            color="gray",
            label="llama.cpp reference (quoted)",
        )
    _finish(figure, axes, reports, path, reference)


def plot_ttft(reports: dict[str, dict], path: Path, reference: dict[int, float] | None = None) -> None:
    figure, axes = _axes("Time to first token (median)", "milliseconds")
    axes.set_yscale("log")
    for label, report in reports.items():
        axes.plot(*_series(report, "ttft_median_s", 1000.0), marker="o", label=label)
    if reference:
        axes.plot(list(reference), [s * 1000 for s in reference.values()], linestyle="--", marker="x", color="gray",
                  label="llama.cpp reference (quoted)")  # fmt: skip
    _finish(figure, axes, reports, path, reference)
