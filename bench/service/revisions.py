"""This tree's whole service beside another git revision's, on one model: the check for a change to the engine.

    python bench/service/revisions.py --baseline main~1                       # the default model, 1 and 16 streams
    python bench/service/revisions.py --baseline 4bde6d8 --model .bench/shapes/llama-3.2-1b-random.Q4_0.gguf --levels 1 --rounds 3

A step alone (bench/engine/native_step_ab.py) runs on cores it has to itself. Through the service it shares
them with the event loop, Valkey, the gateway and the client, and a change can win alone and lose there, or
the reverse (the native step's claimed work shares: docs/benchmarks.md). Here two `lmq serve`, each with its
own embedded Valkey, run at once: one from a temporary git worktree of `--baseline` (its own sources, native
library included, built on first start), one from this tree. Every level runs once per server per round,
alternated (bench/harness/alternate.py); each round's aggregate tokens/s is printed, so the drift of the
host shows beside the difference.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness import processes
from bench.harness.alternate import Alternation, Workload
from lmq.redis_server import free_tcp_port

ROOT = processes.ROOT
DEFAULT_MODEL = "default"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="a git revision to compare this tree with")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a GGUF file; 'default' = lmq serve's own")
    parser.add_argument("--levels", default="1,16")
    parser.add_argument("--requests", type=int, default=8, help="requests per level: this many, or 3 per stream")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--results", type=Path, default=Path(tempfile.gettempdir()) / "lmq-revisions")
    return parser


@contextlib.contextmanager
def worktree(revision: str):
    """A detached checkout of `revision` in a temporary directory, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="lmq-baseline-") as scratch:
        path = Path(scratch) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(path), revision], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        try:
            yield path
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, check=False)


@contextlib.contextmanager
def servers(trees: dict[str, Path], model: str, logs: Path):
    """`lmq serve` from each tree (label -> its root), all up at once: label -> base URL."""
    with contextlib.ExitStack() as stack:
        ports = {}
        for label, tree in trees.items():
            ports[label] = free_tcp_port()
            command = processes.python_command("-m", "lmq", "serve", "--port", str(ports[label]))
            if model != DEFAULT_MODEL:
                command += ["--model", str(Path(model).resolve())]
            server = processes.start(command, logs / f"{label}.log", cwd=tree)  # `-m lmq` imports the tree's own
            stack.callback(processes.stop, server)
            processes.wait_http_ok(f"http://127.0.0.1:{ports[label]}/ready", [server], timeout_s=900)
        yield {label: f"http://127.0.0.1:{port}/v1" for label, port in ports.items()}


def round_figures(results: Path, labels: list[str], level: int) -> dict[str, list[float]]:
    """label -> aggregate tokens/s of each round at `level`, from the runs' JSON files."""
    figures = {}
    for label in labels:
        runs = sorted(results.glob(f"revisions-{label}-c{level}-r*.json"), key=lambda p: int(p.stem.rsplit("-r", 1)[1]))
        figures[label] = [json.loads(run.read_text())["levels"][0]["output_tok_s"] for run in runs]
    return figures


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    levels = [int(level) for level in args.levels.split(",")]
    args.results.mkdir(parents=True, exist_ok=True)
    for old in args.results.glob("revisions-*.json"):
        old.unlink()
    baseline = "baseline"
    with worktree(args.baseline) as tree, servers({baseline: tree, "this": ROOT}, args.model, args.results) as urls:
        alternation = Alternation(servers=urls, max_tokens=args.max_tokens, results=args.results, rounds=args.rounds)
        workload = Workload("revisions", [], levels, lambda level: max(args.requests, 3 * level))
        alternation.measure(workload)
    print(f"\n{args.model}: tokens/s each round, {args.baseline} against this tree")
    for level in levels:
        figures = round_figures(args.results, [baseline, "this"], level)
        shown = {label: " / ".join(f"{value:.1f}" for value in values) for label, values in figures.items()}
        print(f"  {level:>3} streams   {args.baseline}: {shown[baseline]}   this tree: {shown['this']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
