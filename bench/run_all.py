"""`make bench`: measure lmq and its peer, then rewrite docs/benchmarks.md's measured section and plots.

    python bench/run_all.py            # the full run (about half an hour on 2 cores)
    python bench/run_all.py --quick    # a smoke run: few requests, small levels

Steps: `lmq serve` on a free port (default model, 2 threads) → bench/serve.py at each level, then the
long-system-prompt workload shared vs unique → the same against llama.cpp's server
(bench/peer_llamacpp.py) → bench/queue_overhead.py → JSON under bench/results/, plots and the doc → bench/engine.py
(the engine alone next to HF transformers; it writes its own section of the doc).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import processes, report
from bench.plot import plot_throughput, plot_ttft
from lmq.redis_server import free_tcp_port

ROOT = processes.ROOT
PEER_LABEL = "llama.cpp (PyPI wheel)"
PREFIX_QUESTIONS = 1000  # question index of the prefix workload: none of the main run's


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: levels 1,4, few requests, small prefix")
    parser.add_argument("--levels", default="1,4,16,64")
    parser.add_argument("--requests", type=int, default=32, help="requests per level")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prefix-tokens", type=int, default=1000, help="length of the long system prompt")
    parser.add_argument("--prefix-levels", default="1,4,16")
    parser.add_argument("--prefix-requests", type=int, default=16)
    parser.add_argument("--overhead-streams", default="64,256")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of lmq's worker and of the peer")
    parser.add_argument("--peer-slots", type=int, default=64, help="llama.cpp parallel sequences")
    parser.add_argument("--peer-python", default=sys.executable, help="a Python with the xllamacpp wheel")
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--skip-engine", action="store_true", help="no bench/engine.py run")
    parser.add_argument("--results", type=Path, default=ROOT / "bench/results")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs/benchmarks.md")
    parser.add_argument("--plots", type=Path, default=ROOT / "docs", help="folder of bench-throughput.png and bench-ttft.png")
    return parser


def apply_quick(args: argparse.Namespace) -> None:
    args.levels, args.requests, args.max_tokens = "1,4", 4, 32
    args.prefix_tokens, args.prefix_levels, args.prefix_requests = 200, "1,4", 4
    args.overhead_streams, args.peer_slots = "8,32", 8


def shown(command: list[str]) -> str:
    """The command as a user would type it from the repository root."""
    parts = [os.path.relpath(part, ROOT) if part.startswith(str(ROOT)) else part for part in command]
    if command[0] == sys.executable:
        parts[0] = ".venv/bin/python" if sys.executable.startswith(str(ROOT)) else "python"
    return shlex.join(parts)


class Runner:
    """Runs the benchmark commands, keeps what each printed and the exact command lines."""

    def __init__(self, results: Path):
        self.results = results
        self.commands: list[str] = []

    def run_json(self, command: list[str], out_name: str) -> dict:
        out = self.results / out_name
        command = [*command, "--json", str(out)]
        self.commands.append(shown(command))
        print(f"\n$ {self.commands[-1]}", flush=True)
        subprocess.run(command, cwd=ROOT, check=True)
        return json.loads(out.read_text())

    def serve_bench(self, url: str, label: str, out_name: str, args: argparse.Namespace, *extra: str) -> dict:
        command = processes.python_command(
            "bench/serve.py", "--url", url, "--label", label, "--max-tokens", str(args.max_tokens), "--ignore-eos", *extra
        )
        return self.run_json(command, out_name)


@contextlib.contextmanager
def lmq_service(args: argparse.Namespace, logs: Path):
    """`lmq serve` on a free port, from a scratch directory (its embedded Redis keeps data there)."""
    port = free_tcp_port()
    with tempfile.TemporaryDirectory(prefix="lmq-bench-") as scratch:
        command = processes.python_command("-m", "lmq", "serve", "--port", str(port), "--threads", str(args.threads))
        process = processes.start(command, logs.resolve() / "lmq-serve.log", cwd=Path(scratch))
        try:
            processes.wait_http_ok(f"http://127.0.0.1:{port}/ready", [process], timeout_s=600)
            yield f"http://127.0.0.1:{port}/v1", shown(command)
        finally:
            processes.stop(process)


@contextlib.contextmanager
def peer_service(args: argparse.Namespace, logs: Path):
    port = free_tcp_port()
    command = [args.peer_python, "bench/peer_llamacpp.py", "--port", str(port), "--slots", str(args.peer_slots),
               "--threads", str(args.threads)]  # fmt: skip
    process = processes.start(command, logs / "peer.log")
    try:
        processes.wait_http_ok(f"http://127.0.0.1:{port}/health", [process], timeout_s=300)
        yield f"http://127.0.0.1:{port}/v1", shown(command)
    finally:
        processes.stop(process)


def measure_server(runner: Runner, url: str, name: str, slug: str, args: argparse.Namespace) -> tuple[dict, dict[str, dict]]:
    """The main levels, then the long-system-prompt workload shared (cacheable) and unique; JSON files named by `slug`."""
    main = runner.serve_bench(url, name, f"{slug}.json", args, "--concurrency", args.levels, "--requests", str(args.requests))
    prefix = {}
    for mode in ("shared", "unique"):
        prefix[f"{name}, {mode}"] = runner.serve_bench(
            url, f"{name}, {mode} prefix", f"{slug}-prefix-{mode}.json", args,
            "--concurrency", args.prefix_levels, "--requests", str(args.prefix_requests),
            "--shared-prefix-tokens", str(args.prefix_tokens), "--prefix-mode", mode,
            "--prompt-offset", str(PREFIX_QUESTIONS),
        )  # fmt: skip
    return main, prefix


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())  # fmt: skip
    import torch

    return f"{cpu}, {os.cpu_count()} cores; {platform.platform()}; Python {platform.python_version()}, torch {torch.__version__}"


def render(args: argparse.Namespace, runs: dict[str, dict], prefix: dict[str, dict], overhead: dict | None,
           commands: list[str], servers: list[str]) -> str:  # fmt: skip
    today = datetime.date.today().isoformat()
    ours = runs["lmq"]
    parts = [
        f"_Measured by `make bench` on {today}{' (quick smoke run)' if args.quick else ''}. Machine: {machine()}; "
        f"load average when the run began: {args.load_before:.2f} (other work on the cores skews every figure). "
        "Raw JSON: `bench/results/` (not committed)._",
        "",
        "### The whole service on the default model",
        "",
        f"SmolLM2-135M-Instruct (Q4_1 GGUF), CPU, {args.threads} threads; streaming chat completions, distinct prompts "
        f"of {report._num((ours['levels'][0].get('prompt_tokens') or {}).get('min'), 0)}–"
        f"{report._num((ours['levels'][0].get('prompt_tokens') or {}).get('max'), 0)} tokens after the chat template "
        f"(counted by each server), {args.max_tokens} output tokens with `ignore_eos`, greedy; "
        f"{args.requests} requests per level (at least one per stream), closed loop, after a warm-up.",
        "",
        report.serve_table(runs),
        "",
    ]
    if PEER_LABEL in runs:
        parts += [report.ratio_table(ours, runs[PEER_LABEL], PEER_LABEL), ""]
    parts += [
        f"Targets (against the quoted reference of {report.REFERENCE_DATE}, below):",
        "",
        report.targets(ours),
        "",
        "![throughput](bench-throughput.png) ![first token](bench-ttft.png)",
        "",
        "### Prefix caching seen from outside",
        "",
        f"The same kind of questions behind a system prompt of about {args.prefix_tokens} tokens: **shared** (one "
        "system prompt for every request, so a server can reuse its KV) vs **unique** (each system prompt starts "
        "with its own ticket number, so nothing can be reused).",
        "",
        report.prefix_table(prefix),
        "",
    ]
    if overhead:
        parts += ["### The queue's own cost (stub model)", "", report.overhead_section(overhead), ""]
    parts += ["### Commands", "", "Servers:", "", "```", *servers, "```", "", "Measurements:", "", "```", *commands, "```"]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        apply_quick(args)
    args.load_before = os.getloadavg()[0]
    logs = args.results / "logs"
    runner = Runner(args.results)
    runs: dict[str, dict] = {}
    prefix: dict[str, dict] = {}
    servers: list[str] = []
    with lmq_service(args, logs) as (url, command):
        servers.append(command)
        runs["lmq"], found = measure_server(runner, url, "lmq", "lmq", args)
        prefix.update(found)
    if not args.skip_peer:
        with peer_service(args, logs) as (url, command):
            servers.append(command)
            runs[PEER_LABEL], found = measure_server(runner, url, PEER_LABEL, "llamacpp", args)
            prefix.update(found)
    overhead = None
    if not args.skip_overhead:
        command = processes.python_command("bench/queue_overhead.py", "--streams", args.overhead_streams,
                                           "--max-tokens", str(args.max_tokens))  # fmt: skip
        overhead = runner.run_json(command, "queue_overhead.json")

    plot_throughput(runs, args.plots / "bench-throughput.png", report.REFERENCE_TOK_S)
    plot_ttft(runs, args.plots / "bench-ttft.png", report.REFERENCE_TTFT_S)
    section = render(args, runs, prefix, overhead, runner.commands, servers)
    document = args.doc.read_text() if args.doc.exists() else "# Benchmarks\n"
    args.doc.write_text(report.replace_section(document, section))
    print(f"\nwrote {args.doc} and the plots in {args.plots}")
    if not args.skip_engine:
        command = processes.python_command("-m", "bench.engine", "--threads", str(args.threads), "--doc", str(args.doc),
                                           *(["--quick"] if args.quick else []))  # fmt: skip
        runner.run_json(command, "engine.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
