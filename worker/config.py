"""Worker settings. Each field is also a CLI flag (`--kv-memory`) and an env var (`LMQ_KV_MEMORY`)."""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field

# OpenMP threads that wait for work by spinning (libgomp's default) turn every parallel kernel into a
# wait for a descheduled partner thread as soon as anything else wants the cores: on 2 shared cores a
# decode step of the default model took 1,000 ms with 2 spinning threads and 45 ms with 2 sleeping ones
# (docs/dev/measurements.md, "Targets, and where the time goes", its levers). So a waiting thread spins
# briefly, then sleeps: the native step has ~300 barriers (one OpenMP team per step,
# worker/native/decoder_step.cpp), and a thread that slept at each turned the default model's step at
# batch 1 into 15 ms on 2 threads against 5 on one; 3,000 spins first (tens of microseconds) gave 2.7 ms.
# The policy is ACTIVE, not PASSIVE, for libgomp's other count: where a process holds more OpenMP threads
# than cores (each thread that starts parallel work keeps a team), libgomp spins its "throttled" count
# instead, which PASSIVE leaves at 0 and ACTIVE sets to 1,000 (never above GOMP_SPINCOUNT). The engine
# benchmarks' processes were such: under PASSIVE every barrier slept there (Gemma 3 270M's step at batch
# 1, 9.4 ms against 7.2); `lmq serve`'s worker measured alike under both (docs/benchmarks.md, "OpenMP's
# throttled spin"). With GOMP_SPINCOUNT set, ACTIVE never spins longer than that count. libgomp reads
# both when torch loads, and `lmq serve` / `lmq worker` import this module first; a value the user set
# is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "3000")

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTS = ("auto", "none", "int8", "int4")
CPU_STEPS = ("native", "invariant", "torch")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass
class WorkerConfig:
    redis_url: str = field(
        default="redis://localhost:6379/0", metadata={"help": "Redis to read requests from", "env": "REDIS_URL"}
    )
    model: str = field(
        default="",
        metadata={"help": "GGUF file or Hugging Face model directory; empty = the default SmolLM2-135M-Instruct"},
    )
    model_name: str = field(
        default="", metadata={"help": "name clients use in `model`; empty = derived from the model file"}
    )
    dtype: str = field(default="auto", metadata={"help": "compute dtype: auto, float32, bfloat16, float16"})
    quant: str = field(default="auto", metadata={"help": "weight mode: auto, none, int8, int4"})
    device: str = field(default="auto", metadata={"help": "torch device: auto (cuda when present), cpu, cuda, cuda:N"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads; 0 = torch's default"})
    cpu_steps: str = field(
        default="native",
        metadata={
            "help": "an int4 Llama model's steps on a CPU: native (one C++ call per step where the CPU has AVX-512 VNNI), invariant (native, and a request's tokens independent of its batch) or torch"
        },
    )
    kv_memory: str = field(
        default="auto", metadata={"help": "KV cache budget, e.g. 512MiB or 4GiB; auto = a default per device"}
    )
    page_size: int = field(default=16, metadata={"help": "tokens per KV page"})
    max_seqs: int = field(default=64, metadata={"help": "most sequences running at once"})
    step_tokens: int = field(
        default=512, metadata={"help": "token budget of one engine step (decodes + prefill chunks)"}
    )
    worker_id: str = field(default_factory=_default_worker_id, metadata={"help": "unique consumer name in the group"})
    claim_idle_ms: int = field(
        default=15000, metadata={"help": "idle time after which a dead worker's requests are claimed"}
    )
    max_attempts: int = field(
        default=3, metadata={"help": "runs of one request before it goes to the dead-letter stream"}
    )
    grace_seconds: float = field(default=30.0, metadata={"help": "on SIGTERM, time to finish running requests"})
    metrics_port: int = field(default=0, metadata={"help": "port for Prometheus /metrics; 0 = off"})
    log_level: str = field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING or ERROR"})
    log_format: str = field(default="text", metadata={"help": "text, or json: one JSON object a line"})
    otlp_endpoint: str = field(
        default="",
        metadata={"help": "OTLP/HTTP traces URL (e.g. http://collector:4318/v1/traces); empty = tracing off"},
    )


def parse_kv_memory(text: str) -> int | None:
    """'auto' → None (the engine picks); '512MiB', '4GiB', '1.5G', '1048576' → bytes."""
    if text.strip().lower() == "auto":
        return None
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"not a memory size: {text!r} (try 512MiB or 4GiB)")
    unit = (match.group(2) or "").upper()[:1]
    return int(float(match.group(1)) * _UNITS[unit])
