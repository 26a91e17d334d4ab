"""The torch path's linears are built only where a step runs on them (worker/model/lazy_linear.py).

On a CPU the native step packs its own copy of every linear from the checkpoint; where it serves every step,
the torch path's int4 weights (and dense copies) would be memory no step reads. The loader leaves them unbuilt,
worker/runtime/select.py builds them when the chosen backend runs torch steps, and a torch forward over a
model whose linears were left unbuilt (a reference beside an engine) builds each on first use, with exactly
the results of one built at load.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.paged_steps import Chunk, allocate_kv, make_batch
from worker.model.lazy_linear import unbuilt_linears
from worker.model.loader import load_model
from worker.native import build
from worker.runtime import select
from worker.runtime.cpu_torch import CpuTorchBackend

PAGE = 16

pytestmark = pytest.mark.slow  # the real default model


def _layer_tensor_bytes(model: torch.nn.Module) -> int:
    """What the decoder layers hold in tensors of two or more dimensions (the linears' weights; norms are 1-D)."""
    tensors = [*model.layers.parameters(), *model.layers.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if t.dim() >= 2)


def _logits(model: torch.nn.Module, config) -> torch.Tensor:
    prompt = [1, 504, 3458, 282, 4649, 314, 2367, 30, 198, 504, 3458]
    kv = allocate_kv(config, 2, PAGE, torch.bfloat16)
    with torch.inference_mode():
        return model(make_batch([Chunk(prompt, 0, [0, 1])], PAGE), kv)


@pytest.mark.skipif(build.missing_requirements() is not None, reason=f"native step: {build.missing_requirements()}")
def test_a_model_the_native_step_serves_at_every_step_keeps_no_torch_linears() -> None:
    loaded = load_model(device="cpu")
    backend = select.select_backend(loaded, max_threads=2)
    if backend.native.max_rows is not None:
        pytest.skip("long prompts run on torch's dense copies on this CPU (AMX tiles)")
    assert _layer_tensor_bytes(loaded.model) == 0
    assert unbuilt_linears(loaded.model)


def test_an_unbuilt_linear_builds_on_first_use_with_the_results_of_one_built_at_load() -> None:
    lazy = load_model(device="cpu")
    eager = load_model(device="cpu", cpu_steps="torch")  # no native step to serve it: built at load
    assert unbuilt_linears(lazy.model) and not unbuilt_linears(eager.model)
    assert torch.equal(_logits(lazy.model, lazy.config), _logits(eager.model, eager.config))
    assert not unbuilt_linears(lazy.model.layers)  # the head's dense tier serves 8 rows or more: this step had 1


@pytest.mark.skipif(build.missing_requirements() is not None, reason=f"native step: {build.missing_requirements()}")
def test_where_the_native_step_serves_every_step_no_torch_embedding_or_head_is_kept() -> None:
    """The native step reads the embedding from the file's Q8_0 blocks and packs its own head: the torch table
    stays unbuilt and the head's int8 tier (built to pack from) is let go; a torch forward builds both again."""
    loaded = load_model(device="cpu")
    backend = select.select_backend(loaded, max_threads=2)
    if backend.native.max_rows is not None:
        pytest.skip("long prompts run on torch's dense copies on this CPU (AMX tiles)")
    assert backend.native.embedding_format == "Q8_0 rows"
    assert not loaded.model.embed_tokens.built and unbuilt_linears(loaded.model.lm_head)
    eager = load_model(device="cpu", cpu_steps="torch")
    assert torch.equal(_logits(loaded.model, loaded.config), _logits(eager.model, eager.config))


def test_a_backend_that_runs_torch_steps_builds_every_linear_at_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = load_model(device="cpu")
    monkeypatch.setattr(select, "native_refusal", lambda loaded: "refused for this test")
    assert unbuilt_linears(loaded.model)
    assert isinstance(select.select_backend(loaded, max_threads=2), CpuTorchBackend)
    assert not unbuilt_linears(loaded.model) and _layer_tensor_bytes(loaded.model) > 0
    assert loaded.model.embed_tokens.built


def _mapped_rss_kib(path) -> int:
    """What this process holds resident of `path`'s mappings (/proc/self/smaps), in KiB."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if "-" in line.split(" ", 1)[0]:  # a mapping's header: "start-end perms offset dev inode path"
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_the_gguf_s_pages_leave_the_resident_set_once_the_backend_is_chosen() -> None:
    """Every step reads copies of the file's weights (packed, built or dequantized), so the mapped file's pages
    need not stay resident: packing reads all of it, and without the release they would (worker/runtime/freed_memory.py)."""
    loaded = load_model(device="cpu")
    before = _mapped_rss_kib(loaded.path)
    select.select_backend(loaded, max_threads=2)
    assert _mapped_rss_kib(loaded.path) < before
