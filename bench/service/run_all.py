"""`make bench`: lmq beside llama.cpp's server, alternated level by level, then docs/benchmarks.md's measured section.

    python bench/service/run_all.py            # the full run (about 40 minutes on 2 cores)
    python bench/service/run_all.py --quick    # a smoke run: few requests, small levels

Steps: `lmq serve` (default model, 2 threads), llama.cpp's llama-server compiled for this machine
(bench/harness/build_llama_server.sh, cached under .bench/) and the `xllamacpp` wheel's server, all up at once
→ bench/service/serve.py at each level, the servers in turn, two rounds, best round of each (bench/harness/alternate.py)
→ a 1,000-token system prompt, shared (cacheable) and unique, the same way → bench/service/queue_overhead.py →
JSON under bench/results/, plots and the doc → bench/engine/speed.py (the engine alone next to HF transformers;
it writes its own section of the doc).
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
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness import processes, report
from bench.harness.alternate import Alternation, Workload

# Every server's OpenMP threads wait as lmq's worker's do (worker/config.py), llama.cpp's too (built with
# OpenMP): a short spin, then sleep. Spinning without end collapses both 10-20x when anything else takes the
# cores; sleeping at once cost llama.cpp 3x on a quiet host (one stream: 30 against 100 tokens/s).
os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")  # with GOMP_SPINCOUNT, bounded: worker/config.py says why
os.environ.setdefault("GOMP_SPINCOUNT", "3000")
from bench.harness.plot import plot_throughput, plot_ttft
from lmq.redis_server import free_tcp_port

ROOT = processes.ROOT
PEER_LABEL = "llama.cpp (PyPI wheel)"
BUILT_PEER_LABEL = "llama.cpp (built here)"
# The issue's targets (15), each a same-run ratio against the strongest peer.
TARGET_TOK_S_1, TARGET_TOK_S_16, TARGET_SHARED_16, TARGET_UNIQUE_TTFT = 1.5, 2.5, 2.0, 0.5


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: levels 1,4, few requests, small prefix")
    parser.add_argument("--levels", default="1,4,16")
    parser.add_argument(
        "--requests", type=int, default=8, help="requests per level: this many, or 2 per stream if more"
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each level per server; the best one counts")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prefix-tokens", type=int, default=1000, help="length of the long system prompt")
    parser.add_argument("--prefix-shared-levels", default="4,16", help="levels of the shared system prompt")
    parser.add_argument("--prefix-unique-levels", default="1,4", help="levels of the unique system prompts")
    parser.add_argument("--overhead-streams", default="64,256")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of lmq's worker and of the peer")
    parser.add_argument("--peer-slots", type=int, default=64, help="llama.cpp parallel sequences")
    parser.add_argument("--peer-python", default=sys.executable, help="a Python with the xllamacpp wheel")
    parser.add_argument(
        "--peers", default="built,wheel", help="built (llama-server compiled here), wheel (xllamacpp), or both"
    )
    parser.add_argument("--peer-poll", type=int, default=0, help="llama.cpp's --poll (busy-wait level of its threads)")
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--skip-engine", action="store_true", help="no bench/engine/speed.py run")
    parser.add_argument("--results", type=Path, default=ROOT / "bench/results")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs/benchmarks.md")
    parser.add_argument(
        "--plots", type=Path, default=ROOT / "docs", help="folder of bench-throughput.png and bench-ttft.png"
    )
    return parser


def apply_quick(args: argparse.Namespace) -> None:
    args.levels, args.requests, args.max_tokens, args.rounds = "1,4", 2, 32, 1
    args.prefix_tokens, args.prefix_shared_levels, args.prefix_unique_levels = 200, "4", "1"
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
def peer_service(args: argparse.Namespace, logs: Path, binary: str = ""):
    """llama.cpp's server: the xllamacpp wheel's, or the compiled `binary`."""
    port = free_tcp_port()
    command = [args.peer_python, "bench/harness/peer_llamacpp.py", "--port", str(port), "--slots", str(args.peer_slots),
               "--threads", str(args.threads), "--poll", str(args.peer_poll)]  # fmt: skip
    if binary:
        command += ["--binary", binary]
    process = processes.start(command, logs / ("peer-built.log" if binary else "peer.log"))
    try:
        processes.wait_http_ok(f"http://127.0.0.1:{port}/health", [process], timeout_s=300)
        yield f"http://127.0.0.1:{port}/v1", shown(command)
    finally:
        processes.stop(process)


def built_server(logs: Path) -> str:
    """The compiled llama-server's path (built once, ~10 minutes on 2 cores), or "" when it cannot be built."""
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "build-llama-server.log", "wb") as log:
        done = subprocess.run(
            ["bash", "bench/harness/build_llama_server.sh"], cwd=ROOT, stdout=subprocess.PIPE, stderr=log
        )
    path = done.stdout.decode().strip().splitlines()[-1:] if done.returncode == 0 else []
    return str(ROOT / path[0]) if path else ""


def workloads(args: argparse.Namespace) -> dict[str, Workload]:
    def per_level(level: int) -> int:
        return max(args.requests, 2 * level)

    prefix = ["--shared-prefix-tokens", str(args.prefix_tokens)]
    return {
        "main": Workload("main", [], _levels(args.levels), per_level),
        "shared": Workload("prefix-shared", [*prefix, "--prefix-mode", "shared"], _levels(args.prefix_shared_levels), per_level),
        "unique": Workload("prefix-unique", [*prefix, "--prefix-mode", "unique"], _levels(args.prefix_unique_levels),
                           lambda level: max(2, args.requests // 2, level)),
    }  # fmt: skip


def _levels(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())  # fmt: skip
    import torch

    return f"{cpu}, {os.cpu_count()} cores; {platform.platform()}; Python {platform.python_version()}, torch {torch.__version__}"


def _level(run: dict | None, concurrency: int) -> dict | None:
    return next((lv for lv in (run or {}).get("levels", []) if lv["concurrency"] == concurrency), None)


def issue_targets(runs: dict[str, dict], prefix: dict[str, dict], peer: str) -> str:
    """Issue 15's targets as same-run ratios against `peer`; met or not, and by how much."""
    lines = []

    def ratio_line(text: str, ours: float | None, theirs: float | None, goal: float, higher: bool) -> None:
        if not ours or not theirs:
            return
        ratio = ours / theirs
        met = ratio >= goal if higher else ratio <= goal
        lines.append(
            f"- {text}: {ratio:.2f}× (target {'≥' if higher else '≤'} {goal}×) — {'met' if met else 'not met'}"
        )

    def get(run: dict | None, level: int, key: str) -> float | None:
        found = _level(run, level)
        return None if found is None else found[key]

    ours, theirs = runs.get("lmq"), runs.get(peer)
    ratio_line("1 stream, tokens/s", get(ours, 1, "output_tok_s"), get(theirs, 1, "output_tok_s"), TARGET_TOK_S_1, True)
    ratio_line("1 stream, TTFT p50", get(ours, 1, "ttft_median_s"), get(theirs, 1, "ttft_median_s"), 1.0, False)
    ratio_line(
        "16 streams, tokens/s", get(ours, 16, "output_tok_s"), get(theirs, 16, "output_tok_s"), TARGET_TOK_S_16, True
    )
    ratio_line("16 streams, TTFT p50", get(ours, 16, "ttft_median_s"), get(theirs, 16, "ttft_median_s"), 1.0, False)
    shared_ours, shared_theirs = prefix.get("lmq, shared"), prefix.get(f"{peer}, shared")
    ratio_line("1,000-token shared system prompt, 16 streams, tokens/s", get(shared_ours, 16, "output_tok_s"),
               get(shared_theirs, 16, "output_tok_s"), TARGET_SHARED_16, True)  # fmt: skip
    ratio_line("the same, lmq's 16 streams ÷ its own 4 streams", get(shared_ours, 16, "output_tok_s"),
               get(shared_ours, 4, "output_tok_s"), 1.0, True)  # fmt: skip
    unique_ours, unique_theirs = prefix.get("lmq, unique"), prefix.get(f"{peer}, unique")
    for level in (1, 4):
        ratio_line(f"unique 1,000-token prompts, {level} stream{'s' if level > 1 else ''}, TTFT p50",
                   get(unique_ours, level, "ttft_median_s"), get(unique_theirs, level, "ttft_median_s"), TARGET_UNIQUE_TTFT, False)  # fmt: skip
    return "\n".join(lines)


def render(args: argparse.Namespace, runs: dict[str, dict], prefix: dict[str, dict], overhead: dict | None,
           commands: list[str], servers: list[str]) -> str:  # fmt: skip
    today = datetime.date.today().isoformat()
    ours = runs["lmq"]
    prompt = ours["levels"][0].get("prompt_tokens") or {}
    peers = [label for label in runs if label != "lmq"]
    parts = [
        f"_Measured by `make bench` on {today}{' (quick smoke run)' if args.quick else ''}. Machine: {machine()}; "
        f"load average when the run began: {args.load_before:.2f} (other work on the cores skews every figure). "
        "Raw JSON: `bench/results/` (not committed)._",
        "",
        "### The whole service on the default model",
        "",
        f"SmolLM2-135M-Instruct (Q4_1 GGUF), CPU, {args.threads} threads each; streaming chat completions, distinct "
        f"prompts of {report._num(prompt.get('min'), 0)}–{report._num(prompt.get('max'), 0)} tokens after the chat "
        f"template (counted by each server), {args.max_tokens} output tokens with `ignore_eos`, greedy; per level "
        f"max({args.requests}, 2 × streams) requests, closed loop, after a warm-up. All servers up at once; each level "
        f"runs on each server in turn ({', '.join(runs)}), {args.rounds} rounds, and each server's best round counts "
        "(bench/harness/alternate.py).",
        "",
        report.serve_table(runs),
        "",
    ]
    for peer in peers:
        parts += [report.ratio_table(ours, runs[peer], peer), ""]
    if peers:
        strongest = BUILT_PEER_LABEL if BUILT_PEER_LABEL in runs else peers[0]
        parts += [
            f"Targets of issue 15, same-run ratios against {strongest}:",
            "",
            issue_targets(runs, prefix, strongest),
            "",
        ]
    parts += [
        "![throughput](bench-throughput.png) ![first token](bench-ttft.png)",
        "",
        "### Prefix caching seen from outside",
        "",
        f"The same kind of questions behind a system prompt of about {args.prefix_tokens} tokens: **shared** (one "
        "system prompt for every request, so a server can reuse its KV) vs **unique** (each system prompt starts "
        "with its own ticket number, so nothing can be reused). Alternated like the table above.",
        "",
        report.prefix_table(prefix),
        "",
    ]
    if overhead:
        parts += ["### The queue's own cost (stub model)", "", report.overhead_section(overhead), ""]
    parts += [
        "### Commands",
        "",
        "Servers:",
        "",
        "```",
        *servers,
        "```",
        "",
        "Measurements:",
        "",
        "```",
        *commands,
        "```",
    ]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        apply_quick(args)
    args.load_before = os.getloadavg()[0]
    logs = args.results / "logs"
    runner = Runner(args.results)
    wanted = set() if args.skip_peer else {part.strip() for part in args.peers.split(",")}
    binary = built_server(logs) if "built" in wanted else ""
    if "built" in wanted and not binary:
        print(
            f"llama-server could not be built (see {logs / 'build-llama-server.log'}): measuring without it", flush=True
        )
    servers: list[str] = []
    with contextlib.ExitStack() as stack:
        urls = {}
        url, command = stack.enter_context(lmq_service(args, logs))
        urls["lmq"] = url
        servers.append(command)
        if binary:
            url, command = stack.enter_context(peer_service(args, logs, binary))
            urls[BUILT_PEER_LABEL] = url
            servers.append(command)
        if "wheel" in wanted:
            url, command = stack.enter_context(peer_service(args, logs))
            urls[PEER_LABEL] = url
            servers.append(command)
        alternation = Alternation(urls, args.max_tokens, args.results, rounds=args.rounds, shown=shown)
        work = workloads(args)
        runs = alternation.measure(work["main"])
        prefix_servers = [
            label for label in urls if label != PEER_LABEL or not binary
        ]  # the wheel only without a built peer
        prefix = {}
        for mode in ("shared", "unique"):
            found = alternation.measure(work[mode], only=prefix_servers)
            prefix.update({f"{label}, {mode}": found[label] for label in found})
    runner.commands += alternation.commands
    overhead = None
    if not args.skip_overhead:
        command = processes.python_command("bench/service/queue_overhead.py", "--streams", args.overhead_streams,
                                           "--max-tokens", str(args.max_tokens))  # fmt: skip
        overhead = runner.run_json(command, "queue_overhead.json")

    plot_throughput(runs, args.plots / "bench-throughput.png", report.REFERENCE_TOK_S)
    plot_ttft(runs, args.plots / "bench-ttft.png", report.REFERENCE_TTFT_S)
    section = render(args, runs, prefix, overhead, runner.commands, servers)
    (args.results / "run_all.json").write_text(json.dumps({"runs": runs, "prefix": prefix}, indent=2))
    document = args.doc.read_text() if args.doc.exists() else "# Benchmarks\n"
    args.doc.write_text(report.replace_section(document, section))
    print(f"\nwrote {args.doc} and the plots in {args.plots}")
    if not args.skip_engine:
        command = processes.python_command("-m", "bench.engine.speed", "--threads", str(args.threads), "--doc", str(args.doc),
                                           *(["--quick"] if args.quick else []))  # fmt: skip
        runner.run_json(command, "engine.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
