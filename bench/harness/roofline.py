"""The ceilings a figure is judged by: tokens/s the machine's read bandwidth and integer peak allow for a GGUF file.

    python -m bench.harness.roofline [--threads 2] [--model FILE]    # the machine's ceilings (and one file's)

One stream's decode step reads every weight once per token, so its ceiling is the weight bytes read per
token over the measured read bandwidth. At 16 streams a step reads the weights once for 16 tokens and
the multiply-adds bound it instead: 2 ops per weight per token over the measured peak of the kernel's
instruction (vpdpwssd: lmq's int4 x int16 linears; vpdpbusd: llama.cpp's Q4_0/Q4_K x Q8 dot products;
AMX tdpbusd where the CPU has it). The measurements come from roofline.cpp, compiled once (g++, like
worker/native/build.py) into .bench/roofline/ and run in a fresh process.

Counted per token: every tensor of the file, except that an embedding not shared with the output head
reads one row (a head tied to it reads it whole), and a mixture of experts' stacked experts (ffn_*_exps)
count the share a token's router picks (expert_used_count of expert_count). Attention's reads of the KV cache are left out: at
the benchmark's few hundred tokens of context they are small beside the weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("roofline.cpp")
ROOT = Path(__file__).resolve().parents[2]
FLAGS = ("-O3", "-std=c++17", "-fopenmp", "-mavx2", "-mfma", "-mamx-tile", "-mamx-int8")
EMBEDDING, HEAD = "token_embd.weight", "output.weight"


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]  # (rows, columns) as numpy reads a GGUF matrix; (experts, rows, columns) for stacked experts
    nbytes: int
    read: float = 1.0  # the share of it one token reads: experts used of experts for stacked experts


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """The machine's measured rates (bytes/s, ops/s); a None is an instruction the CPU lacks."""

    threads: int
    read_bytes_s_1_thread: float
    read_bytes_s_all_threads: float
    vpdpbusd_ops_s_all_threads: float | None = None
    vpdpwssd_ops_s_all_threads: float | None = None
    amx_tdpbusd_ops_s_all_threads: float | None = None
    vpdpbusd_ops_s_1_thread: float | None = None
    vpdpwssd_ops_s_1_thread: float | None = None
    amx_tdpbusd_ops_s_1_thread: float | None = None

    @classmethod
    def from_json(cls, raw: dict) -> Ceilings:
        return cls(**{field.name: raw.get(field.name) for field in dataclasses.fields(cls)})

    def describe(self) -> str:
        def g(value: float | None, unit: str) -> str:
            return "absent" if value is None else f"{value / 1e9:.0f} G{unit}"

        return (
            f"read bandwidth {g(self.read_bytes_s_1_thread, 'B/s')} (1 thread), "
            f"{g(self.read_bytes_s_all_threads, 'B/s')} ({self.threads} threads); peak int ops on "
            f"{self.threads} threads: vpdpwssd {g(self.vpdpwssd_ops_s_all_threads, 'op/s')}, "
            f"vpdpbusd {g(self.vpdpbusd_ops_s_all_threads, 'op/s')}, AMX {g(self.amx_tdpbusd_ops_s_all_threads, 'op/s')}"
        )


def weight_bytes_per_token(tensors: list[Tensor]) -> int:
    """Bytes of weights one token's step reads: all of them, an untied embedding one row only."""
    names = {tensor.name for tensor in tensors}
    total = 0
    for tensor in tensors:
        if tensor.name == EMBEDDING and HEAD in names:
            total += tensor.nbytes // tensor.shape[0]
        else:
            total += round(tensor.nbytes * tensor.read)
    return total


def macs_per_token(tensors: list[Tensor]) -> int:
    """Multiply-adds of one token through the matrices (the head included; an untied embedding is a lookup)."""
    names = {tensor.name for tensor in tensors}
    return sum(
        round(math.prod(tensor.shape) * tensor.read)
        for tensor in tensors
        if len(tensor.shape) >= 2 and not (tensor.name == EMBEDDING and HEAD in names)
    )


def bandwidth_tok_s(bytes_per_token: int, read_bytes_s: float) -> float:
    """One stream's ceiling: tokens/s when every step reads the weights once."""
    return read_bytes_s / bytes_per_token


def compute_tok_s(macs: int, ops_s: float) -> float:
    """Many streams' ceiling: tokens/s when the multiply-adds (2 ops each) are the bound."""
    return ops_s / (2 * macs)


def share(measured: float, ceiling: float | None) -> str:
    """ "85% of 41.2", or "—" without a ceiling."""
    return "—" if not ceiling else f"{measured / ceiling:.0%} of {ceiling:.1f}"


def gguf_tensors(path: Path) -> list[Tensor]:
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    experts = reader.fields.get(f"{arch}.expert_count")
    used = reader.fields.get(f"{arch}.expert_used_count")
    picked = used.contents() / experts.contents() if experts and used else 1.0
    return [
        Tensor(t.name, tuple(int(d) for d in reversed(t.shape)), int(t.n_bytes), picked if "_exps." in t.name else 1.0)
        for t in reader.tensors
        if t.name not in ("rope_freqs.weight",)
    ]


def binary(cache: Path = ROOT / ".bench/roofline") -> Path:
    """roofline.cpp compiled, cached by the hash of its source and flags."""
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    path = cache / f"roofline-{key}"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        if not (cache / ".gitignore").exists():
            (cache / ".gitignore").write_text("*\n")
        partial = path.with_name(path.name + ".partial")
        compiler = os.environ.get("CXX", "g++")
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(partial)], check=True)
        partial.rename(path)
    return path


def measure(threads: int, mib: int = 1024) -> Ceilings:
    """The machine's ceilings on `threads` threads (a few seconds: a mib-MiB array summed, peak loops)."""
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run([str(binary()), str(mib)], check=True, capture_output=True, text=True, env=env)
    return Ceilings.from_json(json.loads(done.stdout))


def file_ceilings(path: Path, ceilings: Ceilings) -> dict:
    """One file's ceilings on this machine: one stream from bandwidth, many from each instruction's peak."""
    tensors = gguf_tensors(path)
    per_token, macs = weight_bytes_per_token(tensors), macs_per_token(tensors)
    out = {
        "weight_bytes_per_token": per_token,
        "macs_per_token": macs,
        "one_stream_tok_s_1_thread": bandwidth_tok_s(per_token, ceilings.read_bytes_s_1_thread),
        "one_stream_tok_s": bandwidth_tok_s(per_token, ceilings.read_bytes_s_all_threads),
    }
    for kind in ("vpdpwssd", "vpdpbusd", "amx_tdpbusd"):
        ops_s = getattr(ceilings, f"{kind}_ops_s_all_threads")
        out[f"compute_tok_s_{kind}"] = None if ops_s is None else compute_tok_s(macs, ops_s)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mib", type=int, default=1024, help="size of the summed array")
    parser.add_argument("--model", type=Path, action="append", default=[], help="a GGUF file (repeatable)")
    args = parser.parse_args(argv)
    ceilings = measure(args.threads, args.mib)
    print(ceilings.describe())
    for path in args.model:
        print(path.name, json.dumps(file_ceilings(path, ceilings)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
