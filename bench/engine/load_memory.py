"""A worker's load of one model: seconds, and peak and steady memory, beside llama-server's on the same file.

    .venv/bin/python -m bench.engine.load_memory --model .bench/shapes/llama-3.2-1b-random.Q4_0.gguf
    .venv/bin/python -m bench.engine.load_memory --model FILE --baseline 8921863 \
        --peer .bench/llama.cpp/build-avx512-1/bin/llama-server

Each figure is a fresh process. lmq's loads the model as a worker does (load_model, select_backend) and
allocates a KV pool for SLOTS sequences of CONTEXT tokens; `--baseline` runs the same in a git worktree of that
revision (its native library built before the clock starts). `--peer` starts llama-server on the file with
SLOTS slots of CONTEXT tokens each and reads it once /health answers. Memory is /proc's: the peak (VmHWM), and
at the end the resident set split into anonymous memory and file pages (the GGUF's mapped pages: the kernel can
drop those under pressure and read them again, so RssAnon is what the load costs the machine).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

from bench.harness import processes
from bench.service.revisions import worktree
from lmq.redis_server import free_tcp_port

SLOTS, CONTEXT = 4, 2048
FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile")

# Run in the tree measured (this one or a baseline's worktree): only APIs both have.
CHILD = f"""
import json, pathlib, sys, time
from worker.native import build
build.load()
start = time.perf_counter()
from worker.model.loader import load_model
from worker.runtime.select import select_backend
loaded = load_model(sys.argv[1])
backend = select_backend(loaded, max_threads=2)
kv = backend.make_kv(backend.kv_page_bytes(16) * {SLOTS * CONTEXT // 16}, 16, {SLOTS})
print(json.dumps({{"seconds": time.perf_counter() - start, "status": pathlib.Path("/proc/self/status").read_text()}}))
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a GGUF file")
    parser.add_argument("--baseline", help="a git revision to load the same model with")
    parser.add_argument("--peer", help="a llama-server binary to start on the same file")
    return parser


def lmq(tree: pathlib.Path, model: pathlib.Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(model)], cwd=tree, capture_output=True, text=True, check=True
    )
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    return {"seconds": answer["seconds"], **memory(answer["status"])}


def memory(status: str) -> dict[str, int]:
    """FIELDS in MiB from a /proc/<pid>/status text."""
    lines = dict(line.split(":", 1) for line in status.splitlines())
    return {k: int(lines[k].split()[0]) // 1024 for k in FIELDS}


def llama_server(binary: str, model: pathlib.Path, logs: pathlib.Path) -> dict:
    port = free_tcp_port()
    command = [binary, "--model", str(model), "--port", str(port), "--parallel", str(SLOTS),
               "--ctx-size", str(SLOTS * CONTEXT), "--threads", "2", "--no-webui"]  # fmt: skip
    start = time.perf_counter()
    server = processes.start(command, logs / "llama-server.log")
    try:
        processes.wait_http_ok(f"http://127.0.0.1:{port}/health", [server], timeout_s=300)
        seconds = time.perf_counter() - start
        status = pathlib.Path(f"/proc/{server.pid}/status").read_text()
    finally:
        processes.stop(server)
    return {"seconds": seconds, **memory(status)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model = pathlib.Path(args.model).resolve()
    rows = {"lmq (this tree)": lmq(processes.ROOT, model)}
    if args.baseline:
        with worktree(args.baseline) as tree:
            rows[f"lmq at {args.baseline}"] = lmq(tree, model)
    if args.peer:
        logs = pathlib.Path("/tmp/lmq-load-memory")
        logs.mkdir(exist_ok=True)
        rows["llama-server"] = llama_server(args.peer, model, logs)
    print(f"{model.name} ({model.stat().st_size / 2**20:.0f} MiB), {SLOTS} sequences of {CONTEXT} tokens' KV")
    print(f"{'':24} {'load s':>7} {'peak MiB':>9} {'RSS MiB':>8} {'anon MiB':>9} {'file MiB':>9}")
    for label, row in rows.items():
        figures = (row["VmHWM"], row["VmRSS"], row["RssAnon"], row["RssFile"])
        print(f"{label:24} {row['seconds']:7.1f} " + " ".join(f"{f:>{w}}" for f, w in zip(figures, (9, 8, 9, 9))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
