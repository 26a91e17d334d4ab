"""GGUF: the tiny model written with gguf.GGUFWriter loads to the same model as its HF directory."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from tests.support.paged_steps import Chunk, allocate_kv, make_batch
from tests.support.tiny_model import make_tiny_model
from worker.model.gguf_blocks import gguf_int4_blocks
from worker.model.gguf_loader import GLOBAL_NAMES, LAYER_NAMES
from worker.model.loader import LoadedModel, load_model


def gguf_name(hf: str) -> str:
    """Inverse of the loader's name mapping."""
    global_names = {value: key for key, value in GLOBAL_NAMES.items()}
    if hf in global_names:
        return global_names[hf]
    _, _, layer, *part, kind = hf.split(".")
    layer_names = {value: key for key, value in LAYER_NAMES.items()}
    return f"blk.{layer}.{layer_names['.'.join(part)]}.{kind}"


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q_proj/k_proj rows of llama models."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _tokenizer_metadata(writer: gguf.GGUFWriter, directory: pathlib.Path) -> None:
    model = json.loads((directory / "tokenizer.json").read_text())
    vocab = model["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    specials = {added["content"] for added in model["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if token in specials else 1 for token in tokens])
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_chat_template(json.loads((directory / "tokenizer_config.json").read_text())["chat_template"])


def write_gguf(directory: pathlib.Path, path: pathlib.Path, linear_type: QType = QType.F32) -> pathlib.Path:
    config = json.loads((directory / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    _tokenizer_metadata(writer, directory)
    for name, tensor in load_file(str(directory / "model.safetensors")).items():
        array = tensor.numpy()
        if name.endswith("q_proj.weight") or name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, heads if "q_proj" in name else kv_heads)
        if array.ndim == 2 and "embed" not in name and linear_type != QType.F32:
            writer.add_tensor(gguf_name(name), quantize(array, linear_type), raw_dtype=linear_type)
        else:
            writer.add_tensor(gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def step_logits(loaded: LoadedModel, token_ids: list[int]) -> torch.Tensor:
    kv = allocate_kv(loaded.config, num_pages=8, page_size=8, dtype=loaded.dtype)
    pages = [3, 1, 5, 7, 2]
    prefill = loaded.model(make_batch([Chunk(token_ids[:-1], 0, pages)], 8), kv)
    decode = loaded.model(make_batch([Chunk(token_ids[-1:], len(token_ids) - 1, pages)], 8), kv)
    return torch.cat((prefill, decode))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), tied=False, seed=1)


def test_gguf_round_trip_gives_same_model(tiny_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    from_hf = load_model(str(tiny_dir), dtype="float32", quant="none", device="cpu")
    from_gguf = load_model(
        str(write_gguf(tiny_dir, tmp_path / "tiny-model.F32.gguf")), dtype="float32", quant="none", device="cpu"
    )
    assert from_gguf.name == "tiny-model"
    assert from_gguf.config.rms_norm_eps == pytest.approx(from_hf.config.rms_norm_eps)  # GGUF stores float32
    assert dataclasses.replace(from_gguf.config, rms_norm_eps=from_hf.config.rms_norm_eps) == from_hf.config
    messages = [{"role": "user", "content": "What is the capital of France? 42 ✓"}]
    text = from_gguf.chat_template.render(messages)
    assert text == from_hf.chat_template.render(messages)
    ids = from_gguf.tokenizer.encode(text, add_special_tokens=False).ids
    assert ids == from_hf.tokenizer.encode(text, add_special_tokens=False).ids
    assert from_gguf.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert from_gguf.stop_token_ids == from_hf.stop_token_ids
    assert from_gguf.bos_token_id == from_hf.bos_token_id
    torch.testing.assert_close(step_logits(from_gguf, ids), step_logits(from_hf, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1])
def test_quantized_gguf_int4_mode_matches_dequantized_weights(
    tiny_dir: pathlib.Path, tmp_path: pathlib.Path, qtype: QType
) -> None:
    path = write_gguf(tiny_dir, tmp_path / f"tiny.{qtype.name}.gguf", qtype)
    dequantized = load_model(str(path), dtype="float32", quant="none", device="cpu")
    int4 = load_model(str(path), dtype="float32", quant="int4", device="cpu")
    ids = list(range(10, 30))
    # int4 mode runs on the file's own 4-bit blocks: the same weights, another kernel
    torch.testing.assert_close(step_logits(int4, ids), step_logits(dequantized, ids), atol=2e-3, rtol=2e-3)


def _random_blocks(
    rng: np.random.Generator, block_bytes: int, scale_offsets: tuple[int, ...], count: int
) -> np.ndarray:
    blocks = rng.integers(0, 256, size=(count, block_bytes), dtype=np.uint8)
    for offset in scale_offsets:  # finite, modest fp16 scales
        blocks[:, offset : offset + 2] = (
            rng.uniform(-0.1, 0.1, count).astype(np.float16).view(np.uint8).reshape(count, 2)
        )
    return blocks


@pytest.mark.parametrize(
    "qtype, block_bytes, block_values, scale_offsets",
    [(QType.Q4_0, 18, 32, (0,)), (QType.Q4_1, 20, 32, (0, 2)), (QType.Q4_K, 144, 256, (0, 2))],
)
def test_gguf_4bit_blocks_unpack_like_gguf_dequantize(
    qtype: QType, block_bytes: int, block_values: int, scale_offsets: tuple[int, ...]
) -> None:
    rows, columns = 16, 512
    raw = _random_blocks(np.random.default_rng(0), block_bytes, scale_offsets, rows * columns // block_values)
    raw = raw.reshape(rows, -1)
    blocks = gguf_int4_blocks(raw, qtype, rows, columns)
    expected = torch.from_numpy(dequantize(raw, qtype).reshape(rows, columns).astype(np.float32))
    torch.testing.assert_close(blocks.dequantize(), expected, atol=1e-5, rtol=1e-4)
