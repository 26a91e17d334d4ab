"""Compile the native step (decoder_step.cpp) once per machine and load it with ctypes.

The library is plain C++ with AVX-512 and VNNI intrinsics and OpenMP: no torch headers, so g++ builds
it in a few seconds. It is cached by the hash of its source and flags under $XDG_CACHE_HOME/lmq (default
~/.cache/lmq), written to a temporary name and renamed, so workers starting together never load a
half-written file. Where the CPU lacks the instructions, or no compiler is installed, `load()` returns
None with the reason logged once, and the model runs its torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import time

log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).with_name("decoder_step.cpp")
HEADERS = (
    SOURCE.with_name("quant_linear.h"),
    SOURCE.with_name("amx_linear.h"),
    SOURCE.with_name("int8_linear.h"),
    SOURCE.with_name("prompt_attention.h"),
    SOURCE.with_name("prompt_attention_bf16.h"),
    SOURCE.with_name("expert_mlp.h"),
    SOURCE.with_name("gguf_rows.h"),
)  # included by SOURCE: part of the cache key
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
         "-mavx512vnni", "-mfma", "-mf16c", "-mamx-tile", "-mamx-bf16")  # fmt: skip
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma", "f16c")


def cpu_flags() -> set[str]:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def missing_requirements() -> str | None:
    """Why the native step cannot run here, or None."""
    missing = [flag for flag in CPU_FLAGS if flag not in cpu_flags()]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    if not library_path().exists() and shutil.which(compiler()) is None:
        return f"no C++ compiler ({compiler()}) on PATH and no library built in {cache_dir()}"
    return None


def compiler() -> str:
    return os.environ.get("CXX", "g++")


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "lmq" / "native"


def library_path() -> pathlib.Path:
    sources = b"".join(path.read_bytes() for path in (SOURCE, *HEADERS))
    key = hashlib.sha256(sources + " ".join(FLAGS).encode()).hexdigest()[:16]
    return cache_dir() / f"decoder_step_{key}.so"


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled library (built now if needed), or None when this machine cannot run it."""
    reason = missing_requirements()
    if reason:
        log.info("native steps off: %s; steps run on torch", reason)
        return None
    library = library_path()
    if not library.exists():
        try:
            compile_library(library)
        except (OSError, subprocess.CalledProcessError) as error:
            detail = getattr(error, "stderr", "") or error
            log.warning("native steps off: compiling %s failed: %s", SOURCE.name, str(detail)[-2000:])
            return None
    return ctypes.CDLL(str(library))


def compile_library(library: pathlib.Path) -> None:
    library.parent.mkdir(parents=True, exist_ok=True)
    partial = library.with_suffix(f".{os.getpid()}.tmp")
    started = time.perf_counter()
    log.info("compiling the native step (%s, once per machine)", SOURCE.name)
    subprocess.run([compiler(), *FLAGS, str(SOURCE), "-o", str(partial)], check=True, capture_output=True, text=True)
    os.replace(partial, library)
    log.info("compiled %s in %.1f s", library, time.perf_counter() - started)


if __name__ == "__main__":  # an image build: compile into the cache, whatever CPU builds the image
    logging.basicConfig(level=logging.INFO)
    compile_library(library_path())
