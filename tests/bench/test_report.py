"""The doc writer of `make bench`: section replacement, tables and target verdicts from reports."""

from __future__ import annotations

from bench.harness import report


def level(concurrency: int, tok_s: float, ttft_s: float) -> dict:
    return {
        "concurrency": concurrency, "completed": 4, "errors": 0, "ttft_median_s": ttft_s, "ttft_p95_s": ttft_s * 2,
        "tpot_median_s": 0.01, "stream_tok_s_median": 100.0, "output_tok_s": tok_s, "req_s": 1.0,
        "prompt_tokens": {"min": 52, "median": 55, "max": 58}, "cached_tokens": {"min": 0, "median": 25, "max": 25},
    }  # fmt: skip


def test_replace_section_keeps_the_rest_and_is_idempotent():
    document = f"# Benchmarks\n\nintro\n\n{report.BEGIN}\nold figures\n{report.END}\n\n## The engine alone\nkept\n"
    once = report.replace_section(document, "new figures")
    assert "old figures" not in once and "new figures" in once
    assert once.startswith("# Benchmarks\n\nintro") and once.endswith("## The engine alone\nkept\n")
    assert report.replace_section(once, "new figures") == once


def test_replace_section_appends_markers_when_absent():
    updated = report.replace_section("# Benchmarks\n", "figures")
    assert updated.endswith(f"{report.BEGIN}\nfigures\n{report.END}\n")


def test_targets_verdicts():
    met = {"levels": [level(1, 120.0, 0.050), level(16, 2 * 198.0 + 1, 1.0)]}
    missed = {"levels": [level(1, 120.0, 0.150), level(16, 300.0, 2.0)]}
    assert report.targets(met).count("— met") == 3
    assert report.targets(missed).count("— not met") == 3


def test_tables_hold_every_level_and_ratios():
    ours = {"levels": [level(1, 100.0, 0.1), level(4, 200.0, 0.2)]}
    peer = {"levels": [level(1, 50.0, 0.2), level(4, 100.0, 0.4)]}
    table = report.serve_table({"lmq": ours, "peer": peer})
    assert table.count("| lmq |") == 2 and table.count("| peer |") == 2
    ratios = report.ratio_table(ours, peer, "peer")
    assert "| 1 | 2.00× | 0.50× |" in ratios and "| 4 | 2.00× | 0.50× |" in ratios
    assert "| lmq, shared | 4 | 55 | 25 |" in report.prefix_table({"lmq, shared": ours})
