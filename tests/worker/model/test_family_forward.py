"""Each family's tiny model: lmq's logits equal transformers' (float32) through prefill, chunked prefill
and paged decode, alone and batched; the same model written as GGUF gives lmq the same logits.

Tolerance: |lmq - transformers| <= 5e-5 + 1e-5 * |transformers| per logit (float32 throughout;
the two differ only in summation order: fused projections, SDPA vs eager attention, expert grouping).
GGUF vs safetensors: 1e-5, the same arithmetic on weights that went through a float32 file.
"""

from __future__ import annotations

import pathlib
import random

import pytest
import torch

from tests.support.paged_steps import Chunk, allocate_kv, make_batch
from tests.support.tiny_families import (
    FAMILIES,
    TinyFamily,
    make_family_model,
    reference_logits,
    reference_model,
    write_family_gguf,
)
from worker.model.loader import LoadedModel, load_model

PAGE_SIZE = 4
# (sequence, new tokens) per step; sequences end with 25, 12 and 23 tokens. Windows in the tiny
# models are 6-7 keys, so every windowed layer drops keys; long-rope compares prefixes > 16 only.
SCHEDULE = [
    [(0, 18), (1, 8)],  # two prefills from empty caches
    [(0, 4), (1, 1), (2, 13)],  # a chunk continuing a cache, a decode, a fresh prefill
    [(0, 1), (1, 1), (2, 8)],  # decodes with a chunk
    [(0, 1), (1, 1), (2, 1)],  # decodes only
    [(2, 1), (0, 1)],  # decodes, sequences in another order
    [(1, 1)],  # one decode alone
]
LENGTHS = (25, 12, 23)
TOLERANCE = dict(atol=5e-5, rtol=1e-5)


@pytest.fixture(scope="module", params=FAMILIES, ids=str)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[TinyFamily, pathlib.Path]:
    spec: TinyFamily = request.param
    return spec, make_family_model(spec, tmp_path_factory.mktemp(spec.name))


def run_schedule(loaded: LoadedModel, sequences: list[list[int]]):
    """Yields (sequence, tokens so far, lmq logits of its last token) for every sequence of every step."""
    pages = list(range(1, 24))
    random.Random(1).shuffle(pages)
    page_tables = [pages[0:7], pages[7:10], pages[10:16]]
    kv = allocate_kv(loaded.config, num_pages=24, page_size=PAGE_SIZE, dtype=torch.float32)
    done = [0, 0, 0]
    for step in SCHEDULE:
        chunks = [Chunk(sequences[s][done[s] : done[s] + n], done[s], page_tables[s]) for s, n in step]
        logits = loaded.model(make_batch(chunks, PAGE_SIZE), kv)
        assert logits.dtype == torch.float32 and logits.shape == (len(step), loaded.config.vocab_size)
        for row, (s, n) in enumerate(step):
            done[s] += n
            yield s, done[s], logits[row]


def random_sequences(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(n)] for n in LENGTHS]


def test_paged_forward_matches_transformers(family: tuple[TinyFamily, pathlib.Path]) -> None:
    spec, directory = family
    loaded = load_model(str(directory), dtype="float32", quant="none", device="cpu")
    reference = reference_model(directory)
    sequences = random_sequences(loaded.config.vocab_size)
    compared = 0
    for s, length, logits in run_schedule(loaded, sequences):
        if length < spec.min_compared_length:
            continue
        expected = reference_logits(reference, sequences[s][:length])
        torch.testing.assert_close(
            logits, expected, **TOLERANCE, msg=lambda m: f"{spec} sequence {s} at {length} tokens: {m}"
        )
        compared += 1
    assert compared >= 6


def test_gguf_gives_the_same_logits_as_safetensors(
    family: tuple[TinyFamily, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    spec, directory = family
    if spec.gguf_arch is None:
        pytest.skip(f"{spec}: a setting llama.cpp's GGUF cannot express (compared with transformers only)")
    from_hf = load_model(str(directory), dtype="float32", quant="none", device="cpu")
    from_gguf = load_model(
        str(write_family_gguf(spec, directory, tmp_path / f"{spec.name}.gguf")),
        dtype="float32",
        quant="none",
        device="cpu",
    )
    assert from_gguf.config.architecture == (
        "llama" if spec.name.startswith("mistral") else from_hf.config.architecture
    )
    assert (from_gguf.config.num_layers, from_gguf.config.num_kv_heads, from_gguf.config.head_dim) == (
        from_hf.config.num_layers,
        from_hf.config.num_kv_heads,
        from_hf.config.head_dim,
    )
    assert from_gguf.config.layer_windows == from_hf.config.layer_windows
    assert from_gguf.config.options == from_hf.config.options
    sequences = random_sequences(from_hf.config.vocab_size)
    for (s, length, expected), (_, _, logits) in zip(
        run_schedule(from_hf, sequences), run_schedule(from_gguf, sequences)
    ):
        torch.testing.assert_close(
            logits, expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"{spec} sequence {s} at {length} tokens: {m}"
        )
