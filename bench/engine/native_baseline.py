"""Another revision's native step, compiled beside this tree's, so that a benchmark can run both in one process, alternated."""

from __future__ import annotations

import ctypes
import pathlib
import subprocess

import torch

from worker.native import build
from worker.runtime.native_step import ModelStruct, StepStruct


def baseline_library(revision: str, directory: pathlib.Path) -> ctypes.CDLL:
    """The library of `revision`'s worker/native sources (git show), compiled into `directory` with build.FLAGS.

    It is handed this tree's structs, so `revision` must lay them out alike: QuantMatrix (inside every LayerWeights)
    gained `values` at 95ba94f, and a revision from before it reads every layer's matrices askew."""
    root = pathlib.Path(build.__file__).resolve().parents[2]
    for source in (build.SOURCE, *build.HEADERS):
        relative = source.resolve().relative_to(root).as_posix()
        shown = subprocess.run(["git", "show", f"{revision}:{relative}"], cwd=root, capture_output=True)
        if shown.returncode == 0:  # a header the revision does not have is one it does not include
            (directory / source.name).write_bytes(shown.stdout)
    library = directory / "baseline.so"
    subprocess.run([build.compiler(), *build.FLAGS, str(directory / build.SOURCE.name), "-o", str(library)], check=True)
    loaded = ctypes.CDLL(str(library))
    loaded.lmq_step.argtypes = [ctypes.POINTER(ModelStruct), ctypes.POINTER(StepStruct), ctypes.c_int]
    loaded.lmq_step.restype = ctypes.c_int
    loaded.lmq_linear.restype = ctypes.c_int
    return loaded


def embedding_table_for_baselines(native, model: torch.nn.Module) -> torch.Tensor:
    """Point the step's `embed` at the model's bfloat16 embedding table too, and return it (the caller keeps it alive):
    a revision from before the step read the embedding from its file's blocks (worker/native/gguf_rows.h) reads
    only the table, and this tree's library reads the blocks where it has them."""
    table = model.embed_tokens.weight
    native.struct.embed = table.data_ptr()
    return table


def bit_difference(ours: torch.Tensor, theirs: torch.Tensor) -> str:
    """How two libraries' outputs of the same step compare: "bit-identical", or their largest difference."""
    if torch.equal(ours, theirs):
        return "bit-identical"
    return f"max |diff| {(ours.float() - theirs.float()).abs().max():.3g}"
