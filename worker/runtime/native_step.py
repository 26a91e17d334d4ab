"""Engine steps of a decoder in one native call (worker/native/decoder_step.cpp), where the CPU allows.

A torch step of a small model is hundreds of small operators; this runs the whole step (every layer,
the head) as one function over float32 activations, with integer x int16 VNNI dot products for the
linears (AMX bfloat16 tiles for int4 weights in steps of AMX_FROM_ROWS rows or more, where the CPU has
them) and attention that reads K/V straight from the paged pool. Every new token is a row: a decode is
one row, a prompt chunk one row per token, each attending to its sequence's keys up to its own position.
It owns a packed copy of the weights (each linear in its file's own GGUF block type, float weights as
lmq's int4: worker/model/native_pack.py; the head in its file's blocks or int8 per row; the token embedding
in its file's blocks, dequantized a row a token: `embedding_form`) and serves the steps it can: on a
CPU with AMX, fewer tokens than `max_rows` (where the loader keeps packed bfloat16 copies for long
prompts, oneDNN's GEMM is faster from there on), elsewhere every step. The torch path writes the same
pool, so a sequence moves between the two freely. A step that ends a long prompt runs as two
(worker/runtime/long_prompts.py), so that only the row giving the answer's first token stays on int16 x.

Every family runs on the one step: `model_form` reads what sets a model apart from Llama off the
torch model the loader built (its norms, their +1 already folded in for Gemma, q/k norms, windows,
rotary tables, the attention's scale and soft cap, the MLP's activation, a sparse MLP's routing, the
embedding scale, the final soft cap) and the checkpoint (the linears' blocks, q/k/v biases, a sparse
layer's router and experts), so the two paths cannot disagree on a family's arithmetic. `unsupported(model, checkpoint)` says why a model cannot run here (None when
it can); whether it does is worker/runtime/select.py's decision, and worker/runtime/cpu_native.py the
backend that calls it.
"""

from __future__ import annotations

import collections
import ctypes
import logging
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from tqdm import tqdm

from worker.batch import PagedKV, StepBatch
from worker.model.checkpoint import Checkpoint
from worker.model.decoder import Block, DecoderModel, GatedMLP
from worker.model.families.base import tied_head
from worker.model.gguf_blocks import gguf_blocks
from worker.model.lazy_linear import LazyLinear
from worker.model.llama import DecoderLayer, LlamaModel
from worker.model.moe import SparseMoE
from worker.model.native_pack import (
    BLOCK_N,
    NATIVE_TYPES,
    PackedMatrix,
    QuantMatrix,
    kernel_format,
    kernel_refusal,
    matrix,
    native_blocks,
    pack_by_rows,
    pack_parts,
)
from worker.model.norm import RMSNorm
from worker.model.paged_attention import paged_attention
from worker.model.quant_linear import DenseLinear, Int8Linear, TieredLinear
from worker.model.weights import INT4_GROUP, QuantBlocks, TensorSource
from worker.native import build
from worker.runtime.freed_memory import return_freed_memory
from worker.runtime.long_prompts import merge_logits, split_long_prompts

log = logging.getLogger(__name__)

# Steps of this many rows and more run their linears on AMX tiles where the CPU has them (and the model's formats
# allow): a tile product costs about the same for 1 row as for 16, VNNI's grow with the rows. Below it a step on
# int8 x (vpdpbusd, from INT8_FROM_ROWS) is faster: ms a decode step, tiles / int8 x, Intel Xeon with AMX,
# 2026-12-04 (docs/benchmarks.md, "Intel Xeon with AMX"): default model 8 rows 6.97 / 5.67, 12 rows 8.29 / 8.18,
# 16 rows 9.52 / 10.70; Llama-3.2-1B shape Q4_0 8 rows 53.7 / 40.1, 12 rows 53.9 / 50.5, 14 rows 58.4 / 60.2;
# Qwen3-0.6B shape Q4_0 12 rows 32.9 / 30.1, 16 rows 38.2 / 39.1. (Against int16 x the tiles paid from 6 rows:
# a step below 14 rows that samples a prompt's last row, which int8 x never computes, stays on int16.)
AMX_FROM_ROWS = 14
# Steps of this many rows or more take x in int8 on vpdpbusd where no AMX tiles serve the step and the step
# samples no prompt's last row: batched decodes, a long prompt's earlier rows (worker/native/int8_linear.h,
# worker/runtime/long_prompts.py). Measured crossover for decodes (Qwen3-0.6B shape, AMD EPYC Zen 4, ms a step, int8 /
# int16): 3 rows 18.7 / 17.9, 4 rows 19.1 / 20.7, 6 rows 24.2 / 32.5 (docs/benchmarks.md, "int8 activations
# for batched decodes"); steps of up to 4 rows also skip a barrier per linear on int16 (kOwnEncodeRows).
INT8_FROM_ROWS = 5
PHASES = ("embedding, rope tables", "norms + quantizing x", "q/k/v", "rope + K/V write", "attention", "o_proj (+ quantizing)",
          "gate/up", "activation (+ quantizing)", "down", "final norm + head")  # fmt: skip
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1}  # the .cpp's Model::activation


class LayerWeights(ctypes.Structure):
    _fields_ = [("qkv", QuantMatrix), ("o", QuantMatrix), ("gate_up", QuantMatrix), ("down", QuantMatrix)] + [
        (name, ctypes.c_void_p)
        for name in ("input_norm", "post_norm", "qkv_bias", "q_norm", "k_norm", "attention_out_norm", "mlp_out_norm")
    ] + [(name, ctypes.c_int64) for name in ("window", "rotary", "experts", "top_k", "normalize_top_k", "expert_intermediate")] + [
        ("router", ctypes.c_void_p), ("expert_gate_up", ctypes.c_void_p), ("expert_down", ctypes.c_void_p),
    ]  # fmt: skip


class ModelStruct(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab")] + [
        ("eps", ctypes.c_float), ("rotary_dim", ctypes.c_int64), ("rotaries", ctypes.c_int64),
        ("inv_freq", ctypes.c_void_p), ("rope_factor", ctypes.c_void_p), ("embed_scale", ctypes.c_float),
        ("attention_scale", ctypes.c_float), ("attention_softcap", ctypes.c_float), ("activation", ctypes.c_int64),
        ("embed", ctypes.c_void_p), ("layer", ctypes.c_void_p), ("final_norm", ctypes.c_void_p), ("head", ctypes.c_void_p),
        ("head_scale", ctypes.c_void_p), ("amx_from_rows", ctypes.c_int64), ("head_blocks", ctypes.c_void_p),
        ("int8_from_rows", ctypes.c_int64), ("embed_blocks", ctypes.c_void_p), ("embed_type", ctypes.c_int64),
        ("embed_row_bytes", ctypes.c_int64), ("embed_from_head", ctypes.c_int64), ("bf16_attention", ctypes.c_int64),
    ]  # fmt: skip


class StepStruct(ctypes.Structure):
    _fields_ = [("rows", ctypes.c_int64), ("ids", ctypes.c_void_p), ("positions", ctypes.c_void_p), ("slots", ctypes.c_void_p),
                ("contexts", ctypes.c_void_p), ("page_tables", ctypes.c_void_p), ("page_table_stride", ctypes.c_int64),
                ("k_pool", ctypes.c_void_p), ("v_pool", ctypes.c_void_p), ("layer_stride", ctypes.c_int64),
                ("page_size", ctypes.c_int64), ("logit_rows", ctypes.c_void_p), ("logit_count", ctypes.c_int64),
                ("logits", ctypes.c_void_p), ("phase_seconds", ctypes.c_void_p),
                ("one_row_per_sequence", ctypes.c_int64), ("sampled_prompt_rows", ctypes.c_int64)]  # fmt: skip


def head_int8(head: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The output head as (int8 weights [N/16, K/2, 16, 2], per-row scales [N] float32), its rows padded to BLOCK_N.
    A lazy int8 tier built here only to be packed is let go at once (Gemma 3's: 160 MiB), before the load's next
    large copy."""
    small = head.small if isinstance(head, TieredLinear) else head
    lazy = small if isinstance(small, LazyLinear) and small.built is None else None
    if isinstance(small, LazyLinear):
        small = small.materialize()
    if isinstance(small, DenseLinear):
        small = Int8Linear(small.weight, None, torch.float32)
    if not isinstance(small, Int8Linear):
        raise TypeError(f"no native form for a head of type {type(small).__name__}")
    pad = -small.qweight.shape[0] % BLOCK_N
    q = torch.nn.functional.pad(small.qweight, (0, 0, 0, pad)) if pad else small.qweight
    rows, k = q.shape
    packed = q.view(rows // BLOCK_N, BLOCK_N, k // 2, 2).transpose(1, 2).contiguous()
    scale = torch.nn.functional.pad(small.scale.float(), (0, pad)).contiguous()
    if lazy is not None:
        lazy.release()
    return packed, scale


def head_in_blocks(checkpoint: Checkpoint, config) -> TensorSource | None:
    """The output head's tensor where its file keeps it in fewer bits than int8 (Q4_*, Q5_*, Q6_K: the native
    kernels read them as they are, fewer bytes a token than int8 per row and no second rounding); None for an
    int8-class or float head (Q8_0, F16: int8 per row, as always) or rows not in blocks of 16."""
    tied = tied_head(config, checkpoint.weights)
    source = checkpoint.weights.get("model.embed_tokens.weight" if tied else "lm_head.weight")
    if source is None or source.qtype not in NATIVE_TYPES or source.qtype == "Q8_0":
        return None  # Q8_0: no fewer bits than int8
    if source.file_rows() is None or source.shape[0] % BLOCK_N or source.shape[1:] != (config.hidden_size,):
        return None
    return None if source.qtype.endswith("_K") and config.hidden_size % 256 else source  # the kernel's K-quant rule


def head_packed(source: TensorSource) -> tuple[PackedMatrix, str]:
    """The head's file blocks packed a slice of rows at a time (never its whole int16 decoding: Qwen3's 151,936 x
    1,024 Q6_K head's is 311 MB), and their format for the log."""
    raw, qtype, (rows, columns) = source.file_rows(), QType[source.qtype], source.shape

    def blocks_of(start: int, stop: int) -> QuantBlocks:
        return gguf_blocks(raw[start:stop], qtype, stop - start, columns)

    return pack_by_rows(blocks_of, rows), kernel_format(blocks_of(0, BLOCK_N))


@dataclass(frozen=True)
class EmbeddingForm:
    """Where the native step reads a token's embedding row, each time the file's values rounded to bfloat16 as the
    loader's table would hold them (so the same logits as from that table): the tied head's own packed blocks
    (quant_linear.h's matrix_row: no second copy), a copy of the file's blocks [vocab, bytes a row] of a GGML type
    (gguf_rows.h), or, neither set, the model's bfloat16 table (a float file's, rows the loader reorders)."""

    label: str
    from_head: bool = False
    rows: torch.Tensor | None = None
    ggml_type: int = 0


def embedding_form(checkpoint: Checkpoint, config, head: TensorSource | None) -> EmbeddingForm:
    """head: the output head's tensor where the step reads it in its file's blocks (`head_in_blocks`)."""
    if head is not None and tied_head(config, checkpoint.weights):
        return EmbeddingForm(f"the head's {head.qtype} blocks", from_head=True)
    source = checkpoint.weights.get("model.embed_tokens.weight")
    if source is None or source.qtype not in NATIVE_TYPES or source.shape != (config.vocab_size, config.hidden_size):
        return EmbeddingForm("bfloat16")
    rows = source.file_rows()
    if rows is None:
        return EmbeddingForm("bfloat16")
    return EmbeddingForm(
        f"{source.qtype} rows", rows=torch.from_numpy(np.array(rows)), ggml_type=int(QType[source.qtype])
    )


@dataclass(frozen=True)
class LayerForm:
    """What one layer is, as the native step reads it; None: the option is off (Llama's case)."""

    input_norm: RMSNorm
    mlp_norm: RMSNorm
    activation: str
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None
    attention_out_norm: RMSNorm | None = None
    mlp_out_norm: RMSNorm | None = None
    scale: float | None = None  # the factor on q.k; None: 1 / sqrt(head_dim)
    softcap: float | None = None
    moe: SparseMoE | None = None  # a sparse MLP (its routing: top_k, normalize_top_k); None: a dense one


@dataclass(frozen=True)
class ModelForm:
    layers: list[LayerForm]
    rotaries: list[torch.nn.Module]  # worker/model/rope.Rotary
    layer_rotary: list[int]
    windows: list[int]
    embed_scale: float | None
    final_softcap: float | None


def layer_form(layer: torch.nn.Module) -> LayerForm | str:
    """The layer's native form, or why it has none."""
    if isinstance(layer, DecoderLayer):
        return LayerForm(layer.input_norm, layer.post_attention_norm, "silu")
    if not isinstance(layer, Block):
        return f"layers of type {type(layer).__name__} have no native form"
    mlp = layer.mlp
    moe = mlp if isinstance(mlp, SparseMoE) else None
    if moe is not None:
        if layer.post_mlp_norm is not None:
            return "a mixture of experts with a norm on its output has no native form"
        if not all(isinstance(expert, GatedMLP) for expert in moe.experts):
            return "experts other than gated MLPs have no native form"
        if len({expert.activation for expert in moe.experts}) > 1:
            return "experts with different activations have no native form"
        mlp = moe.experts[0]
    elif not isinstance(mlp, GatedMLP):
        return f"a {type(mlp).__name__} MLP has no native form"
    attention = layer.attention
    attend = attention.attend
    if getattr(attend, "func", attend) is not paged_attention or getattr(attend, "args", ()):
        return "the layer's attention is not paged_attention with keywords"
    keywords = dict(getattr(attend, "keywords", {}))
    if set(keywords) - {"scale", "softcap"}:
        return f"attention options {sorted(set(keywords) - {'scale', 'softcap'})} have no native form"
    if mlp.activation not in ACTIVATIONS:
        return f"the MLP activation {mlp.activation!r} has no native form"
    form = LayerForm(
        input_norm=layer.input_norm,
        mlp_norm=layer.mlp_norm,
        activation=mlp.activation,
        q_norm=attention.q_norm,
        k_norm=attention.k_norm,
        attention_out_norm=layer.post_attention_norm,
        mlp_out_norm=layer.post_mlp_norm,
        scale=keywords.get("scale"),
        softcap=keywords.get("softcap"),
        moe=moe,
    )
    norms = (form.input_norm, form.mlp_norm, form.q_norm, form.k_norm, form.attention_out_norm, form.mlp_out_norm)
    if any(norm is not None and not isinstance(norm, RMSNorm) for norm in norms):
        return "a norm other than RMSNorm has no native form"
    return form


def model_form(model: torch.nn.Module) -> ModelForm | str:
    """The model's native form, or why it has none."""
    if type(model) is LlamaModel:
        count = len(model.layers)
        rotaries, layer_rotary, windows = [model.rotary], [0] * count, [0] * count
        embed_scale = final_softcap = None
    elif type(model) is DecoderModel:
        rotaries, layer_rotary, windows = list(model.rotaries), list(model.layer_rotary), list(model.layer_windows)
        embed_scale, final_softcap = model.embed_scale, model.final_softcap
    else:
        return f"a {type(model).__name__} has no native form"
    layers = []
    for index, layer in enumerate(model.layers):
        form = layer_form(layer)
        if isinstance(form, str):
            return f"layer {index}: {form}"
        layers.append(form)
    if len({(f.scale, f.softcap) for f in layers}) > 1:
        return "layers with different attention scales or soft caps have no native form"
    if len({f.activation for f in layers}) > 1:
        return "layers with different MLP activations have no native form"
    return ModelForm(layers, rotaries, layer_rotary, windows, embed_scale, final_softcap)


def projection_names(checkpoint: Checkpoint, index: int) -> tuple[list[str], str, list[str], str]:
    """The modules of layer `index`'s qkv, o, gate_up and down projections (Phi-3 stores qkv and gate_up fused)."""
    attn, mlp = f"model.layers.{index}.self_attn.", f"model.layers.{index}.mlp."
    fused_qkv = attn + "qkv_proj.weight" in checkpoint.weights
    qkv = [attn + "qkv_proj"] if fused_qkv else [attn + "q_proj", attn + "k_proj", attn + "v_proj"]
    gate_up = (
        [mlp + "gate_up_proj"]
        if mlp + "gate_up_proj.weight" in checkpoint.weights
        else [mlp + "gate_proj", mlp + "up_proj"]
    )
    return qkv, attn + "o_proj", gate_up, mlp + "down_proj"


def expert_names(checkpoint: Checkpoint, index: int, experts: int) -> tuple[str, list[tuple[str, str, str]]]:
    """Layer `index`'s router weight and each expert's (gate, up, down) modules: Qwen3-MoE's names or Mixtral's."""
    prefix = f"model.layers.{index}."
    if prefix + "mlp.gate.weight" in checkpoint.weights:
        moe = prefix + "mlp."
        return moe + "gate.weight", [
            (f"{moe}experts.{e}.gate_proj", f"{moe}experts.{e}.up_proj", f"{moe}experts.{e}.down_proj")
            for e in range(experts)
        ]
    moe = prefix + "block_sparse_moe."
    return moe + "gate.weight", [
        (f"{moe}experts.{e}.w1", f"{moe}experts.{e}.w3", f"{moe}experts.{e}.w2") for e in range(experts)
    ]


def linear_names(checkpoint: Checkpoint, form: ModelForm, index: int) -> list[str]:
    """Every linear module of layer `index` that the native step packs."""
    qkv, o, gate_up, down = projection_names(checkpoint, index)
    moe = form.layers[index].moe
    if moe is None:
        return [*qkv, o, *gate_up, down]
    return [*qkv, o, *(name for expert in expert_names(checkpoint, index, len(moe.experts))[1] for name in expert)]


def unsupported(model: torch.nn.Module, checkpoint: Checkpoint) -> str | None:
    """Why the native step cannot run this model on this machine; None when it can."""
    form = model_form(model)
    if isinstance(form, str):
        return form
    config = model.config
    if not _shapes_fit(config):
        return (
            "the kernel takes head_dim 64, 128 or 256 and widths that are multiples of 64 (this model: head_dim "
            f"{config.head_dim}, hidden {config.hidden_size}, intermediate {config.intermediate_size}, "
            f"{config.num_heads} heads, {config.num_kv_heads} KV heads)"
        )
    qkv_biases = {
        name + ".bias" for index in range(config.num_layers) for name in projection_names(checkpoint, index)[0]
    }
    others = sorted(name for name in checkpoint.weights if name.endswith(".bias") and name not in qkv_biases)
    if others:
        return f"the checkpoint has biases the native step does not add ({others[0]})"
    widths = {expert.intermediate_size for f in form.layers if f.moe is not None for expert in f.moe.experts}
    if any(width % 64 for width in widths):
        return f"the kernel takes experts whose width is a multiple of 64 (this model: {sorted(widths)})"
    for index in range(config.num_layers):
        for name in linear_names(checkpoint, form, index):
            refusal = kernel_refusal(name, checkpoint.weights[name + ".weight"])
            if refusal:
                return refusal
    missing = build.missing_requirements()
    if missing:
        return missing
    if build.load() is None:
        return f"the native library did not build (see the log) from {build.SOURCE.name}"
    return None


def _shapes_fit(config) -> bool:
    q_size = config.num_heads * config.head_dim
    return (
        config.head_dim in (64, 128, 256) and config.num_heads % config.num_kv_heads == 0
        and config.num_heads // config.num_kv_heads <= 16 and config.hidden_size % 64 == 0
        and config.intermediate_size % 64 == 0 and q_size % 64 == 0 and INT4_GROUP == 32
        and (q_size + 2 * config.num_kv_heads * config.head_dim) % BLOCK_N == 0
        and config.rotary_dim % 2 == 0 and config.rotary_dim <= config.head_dim
    )  # fmt: skip


def amx_usable(library: ctypes.CDLL) -> bool:
    """Whether the linears can run on AMX tiles here: the CPU has them and the kernel grants their state."""
    return {"amx_tile", "amx_bf16"} <= build.cpu_flags() and library.lmq_amx_enable() == 1


class NativeSteps:
    """The packed model and its step. Build it with `NativeSteps.build` once `unsupported` said None."""

    def __init__(
        self,
        library: ctypes.CDLL,
        model: torch.nn.Module,
        checkpoint: Checkpoint,
        threads: int,
        max_rows: int | None = None,
        amx_from_rows: int = 0,
        int8_from_rows: int = 0,
    ) -> None:
        form = model_form(model)
        if isinstance(form, str):
            raise ValueError(f"no native step for this model: {form}")
        config = model.config
        self.max_rows = max_rows
        self.library, self.vocab = library, config.vocab_size
        # Every step on all the worker's threads: the native step wakes them once, not once per operator, so
        # even one row gains from two (worker/step_threads.py's rule is for torch's many small operators).
        self.threads = threads
        self.final_softcap = form.final_softcap
        self._keep: list = []  # every tensor and struct the structs point into
        self.formats: dict[str, str] = {}  # each linear's weights as the kernel reads them, e.g. "Q5_0 as int5/fp16/32"
        layers = []
        # disable=None: a progress bar only on a terminal, never `\r` lines in a log file
        for index in tqdm(range(config.num_layers), desc="packing for the native step", unit="layer", disable=None):
            layers.append(self._layer(checkpoint, form, index))
            return_freed_memory()  # the layer's temporaries, before the next one's: the load's peak memory
            checkpoint.release_file_pages()  # and the file's pages it read: packed, they are not read again
        self._layers = (LayerWeights * len(layers))(*layers)
        if amx_from_rows and not all(f.endswith(" as int4/fp16/32") for f in self.formats.values()):
            log.info("AMX tiles off: they run int4 weights with fp16 scales only; every step on VNNI")
            amx_from_rows = 0
        if amx_from_rows and any(layer.moe is not None for layer in form.layers):
            log.info("AMX tiles off: a mixture of experts runs on VNNI; every step on VNNI")
            amx_from_rows = 0
        head_source = head_in_blocks(checkpoint, config)
        if head_source is None:
            head_q, head_scale = head_int8(model.lm_head)
            self.head_format, self.head_rows, head_matrix = "int8 per row", head_q.shape[0] * BLOCK_N, None
        else:
            head_q = head_scale = None
            packed, self.head_format = head_packed(head_source)
            self.head_rows, head_matrix = packed.n, matrix([packed], self._keep)
        embedding = embedding_form(checkpoint, config, head_source)
        self.embedding_format = embedding.label
        checkpoint.release_file_pages()  # the head's and embedding's, copied
        table = not embedding.from_head and embedding.rows is None
        inv_freq = torch.stack([rotary.inv_freq.float() for rotary in form.rotaries]).contiguous()
        rope_factor = torch.tensor([float(rotary.attention_factor) for rotary in form.rotaries], dtype=torch.float32)
        first = form.layers[0]
        self.struct = ModelStruct(
            layers=config.num_layers, hidden=config.hidden_size, heads=config.num_heads, kv_heads=config.num_kv_heads,
            head_dim=config.head_dim, intermediate=config.intermediate_size, vocab=self.head_rows,
            eps=config.rms_norm_eps, rotary_dim=inv_freq.shape[1] * 2, rotaries=len(form.rotaries),
            inv_freq=self._pointer(inv_freq), rope_factor=self._pointer(rope_factor),
            embed_scale=1.0 if form.embed_scale is None else _in_dtype(form.embed_scale, model.embed_tokens.dtype),
            embed=self._pointer(model.embed_tokens.weight) if table else None, embed_type=embedding.ggml_type,
            embed_blocks=self._optional_pointer(embedding.rows), embed_from_head=int(embedding.from_head),
            bf16_attention=int("avx512_bf16" in build.cpu_flags()),
            embed_row_bytes=0 if embedding.rows is None else embedding.rows.shape[1],
            attention_scale=config.head_dim**-0.5 if first.scale is None else first.scale,
            attention_softcap=first.softcap or 0.0, activation=ACTIVATIONS[first.activation],
            layer=ctypes.addressof(self._layers),
            final_norm=self._pointer(model.norm.weight.float().contiguous()),
            head=self._optional_pointer(head_q), head_scale=self._optional_pointer(head_scale),
            amx_from_rows=amx_from_rows,
            head_blocks=None if head_matrix is None else ctypes.addressof(head_matrix), int8_from_rows=int8_from_rows,
        )  # fmt: skip
        library.lmq_step.argtypes = [ctypes.POINTER(ModelStruct), ctypes.POINTER(StepStruct), ctypes.c_int]
        library.lmq_step.restype = ctypes.c_int
        if library.lmq_step_phases() != len(PHASES):
            raise RuntimeError("the native library and native_step.py disagree on the step's phases")
        self.phase_seconds: torch.Tensor | None = (
            None  # float64 [len(PHASES)]: set it to have steps add their phases' times
        )

    @classmethod
    def build(
        cls, model: torch.nn.Module, checkpoint: Checkpoint, threads: int, max_rows: int | None, invariant: bool
    ) -> NativeSteps:
        """invariant: every step native and on VNNI with int16 x, whatever its size, so that a sequence's tokens do
        not depend on what it is batched with (max_rows, AMX tiles and int8 x change the arithmetic of large steps)."""
        library = build.load()
        if library is None:
            raise RuntimeError("the native library is not available")
        tiles_here = not invariant and amx_usable(library)
        int8_from_rows = 0 if invariant else INT8_FROM_ROWS
        # Long prompts: oneDNN's bfloat16 GEMM on the loader's dense copies beats the native step on a CPU with
        # AMX; elsewhere int8 x (worker/runtime/long_prompts.py) runs them in ~0.8x its time (docs/benchmarks.md,
        # "Long prompts on int8 activations"), so there the native step takes every step.
        max_rows = max_rows if tiles_here else None
        steps = cls(library, model, checkpoint, threads, max_rows, AMX_FROM_ROWS if tiles_here else 0, int8_from_rows)
        limit = f" of fewer than {max_rows} tokens" if max_rows else ""
        tiles = f", from {steps.struct.amx_from_rows} rows on AMX tiles" if steps.struct.amx_from_rows else ""
        if steps.struct.int8_from_rows:
            below = " (below the tiles)" if steps.struct.amx_from_rows else ""
            tiles += f", steps of {steps.struct.int8_from_rows} rows or more{below} int8 x on vpdpbusd but a prompt's sampled row"
            if steps.struct.bf16_attention:
                tiles += ", their prompt rows attending in bfloat16 products"
        kinds = collections.Counter(f.split(" as ")[0] for f in steps.formats.values())
        weights = ", ".join(f"{count} {kind}" for kind, count in kinds.most_common())
        log.info(
            "steps%s run natively (one call per step; linears %s x int16 on VNNI%s; head %s; embedding %s)",
            limit, weights, tiles, steps.head_format, steps.embedding_format,
        )  # fmt: skip
        return steps

    def _pointer(self, tensor: torch.Tensor) -> int:
        self._keep.append(tensor)
        return tensor.data_ptr()

    def _optional_pointer(self, tensor: torch.Tensor | None) -> int | None:
        return None if tensor is None else self._pointer(tensor)

    def _optional(self, norm: RMSNorm | None) -> int | None:
        return None if norm is None else self._pointer(norm.weight.float().contiguous())

    def _matrix(self, checkpoint: Checkpoint, names: list[str]) -> QuantMatrix:
        blocks = [native_blocks(name, checkpoint.weights[name + ".weight"]) for name in names]
        for name, part in zip(names, blocks):
            self.formats[name] = kernel_format(part)
        return matrix(pack_parts(blocks), self._keep)

    def _bias(self, checkpoint: Checkpoint, names: list[str]) -> int | None:
        present = [name + ".bias" in checkpoint.weights for name in names]
        if not any(present):
            return None
        if not all(present):
            raise ValueError(f"biases on some of {names} only")
        return self._pointer(
            torch.cat([checkpoint.weights[name + ".bias"].load().float() for name in names]).contiguous()
        )

    def _layer(self, checkpoint: Checkpoint, form: ModelForm, index: int) -> LayerWeights:
        qkv, o, gate_up, down = projection_names(checkpoint, index)
        layer = form.layers[index]
        weights = LayerWeights(
            qkv=self._matrix(checkpoint, qkv), o=self._matrix(checkpoint, [o]),
            input_norm=self._optional(layer.input_norm), post_norm=self._optional(layer.mlp_norm),
            qkv_bias=self._bias(checkpoint, qkv), q_norm=self._optional(layer.q_norm), k_norm=self._optional(layer.k_norm),
            attention_out_norm=self._optional(layer.attention_out_norm), mlp_out_norm=self._optional(layer.mlp_out_norm),
            window=form.windows[index], rotary=form.layer_rotary[index],
        )  # fmt: skip
        if layer.moe is None:
            weights.gate_up, weights.down = self._matrix(checkpoint, gate_up), self._matrix(checkpoint, [down])
        else:
            self._experts(checkpoint, layer.moe, index, weights)
        return weights

    def _experts(self, checkpoint: Checkpoint, moe: SparseMoE, index: int, weights: LayerWeights) -> None:
        """A sparse layer's router (float32, as the file holds it) and its experts' matrices, into `weights`."""
        router, experts = expert_names(checkpoint, index, len(moe.experts))
        gate_up = (QuantMatrix * len(experts))(*(self._matrix(checkpoint, [gate, up]) for gate, up, _ in experts))
        return_freed_memory()  # a layer's experts are most of a large MoE's layer: their temporaries, then its pages
        checkpoint.release_file_pages()
        down = (QuantMatrix * len(experts))(*(self._matrix(checkpoint, [down]) for _, _, down in experts))
        self._keep += [gate_up, down]
        weights.experts, weights.top_k, weights.normalize_top_k = len(experts), moe.top_k, int(moe.normalize_top_k)
        weights.expert_intermediate = moe.experts[0].intermediate_size
        weights.router = self._pointer(checkpoint.weights[router].load().float().contiguous())
        weights.expert_gate_up, weights.expert_down = ctypes.addressof(gate_up), ctypes.addressof(down)

    def takes(self, batch: StepBatch, kv: PagedKV) -> bool:
        """Whether the native code runs this step: a bfloat16 CPU pool and fewer tokens than max_rows."""
        return (
            kv.k.dtype == torch.bfloat16 and kv.k.device.type == "cpu" and type(batch) is StepBatch
            and (self.max_rows is None or batch.input_ids.numel() < self.max_rows)
        )  # fmt: skip

    def forward(self, batch: StepBatch, kv: PagedKV) -> torch.Tensor:
        split = split_long_prompts(batch) if self.struct.int8_from_rows else None
        if split is None:
            return self._step(batch, kv)
        earlier = self._step(split.earlier, kv)  # first: the last rows attend to the keys it writes
        return merge_logits(split, earlier, self._step(split.last, kv))

    def _step(self, batch: StepBatch, kv: PagedKV) -> torch.Tensor:
        k, v = kv.k, kv.v
        if not (k.is_contiguous() and v.is_contiguous()):
            raise ValueError("the native step needs a contiguous KV pool")
        rows = batch.input_ids.numel()
        ids, positions, slots = (
            t.to(torch.int64).contiguous() for t in (batch.input_ids, batch.positions, batch.slots)
        )
        contexts = positions + 1
        page_tables = batch.page_tables.to(torch.int64)
        if not batch.is_decode_only:  # a row per sequence needs no gather of its table
            page_tables = page_tables[
                torch.repeat_interleave(torch.arange(len(batch.query_lens)), torch.tensor(batch.query_lens))
            ]
        page_tables = page_tables.contiguous()
        logit_rows = batch.logits_indices.to(torch.int64).contiguous()
        logits = torch.empty(logit_rows.numel(), self.head_rows, dtype=torch.float32)
        step = StepStruct(
            rows=rows, ids=ids.data_ptr(), positions=positions.data_ptr(), slots=slots.data_ptr(),
            contexts=contexts.data_ptr(), page_tables=page_tables.data_ptr(), page_table_stride=page_tables.shape[1],
            k_pool=k.data_ptr(), v_pool=v.data_ptr(), layer_stride=k[0].numel(), page_size=k.shape[2],
            logit_rows=logit_rows.data_ptr(), logit_count=logit_rows.numel(), logits=logits.data_ptr(),
            phase_seconds=None if self.phase_seconds is None else self.phase_seconds.data_ptr(),
            one_row_per_sequence=int(batch.is_decode_only),
            sampled_prompt_rows=logit_rows.numel() if batch.prompt_ends is None else sum(batch.prompt_ends),
        )  # fmt: skip
        status = self.library.lmq_step(ctypes.byref(self.struct), ctypes.byref(step), self.threads)
        if status != 0:
            reason = {1: "shapes", 2: "weight formats", 3: "weight formats on AMX tiles"}.get(
                status, f"status {status}"
            )
            raise RuntimeError(f"the native step refused the model's {reason}")
        logits = logits[:, : self.vocab]
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


def _in_dtype(value: float, dtype: torch.dtype) -> float:
    """value rounded to dtype, as the torch path multiplies by it (Gemma's sqrt(hidden) in bfloat16, as HF does)."""
    return float(torch.tensor(value, dtype=dtype))
