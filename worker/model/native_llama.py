"""Engine steps of a Llama model in one native call (worker/native/llama_step.cpp), where the CPU allows.

A torch step of a small model is hundreds of small operators; this runs the whole step (every layer,
the head) as one function over float32 activations, with int4 x int16 VNNI dot products for the linears
(AMX bfloat16 tiles for steps of AMX_FROM_ROWS rows or more where the CPU has them) and attention that
reads K/V straight from the paged pool. Every new token is a row: a decode is one
row, a prompt chunk one row per token, each attending to its sequence's keys up to its own position.
It owns a packed copy of the weights (the int4 blocks as the checkpoint stores them, the head in int8
per row) and serves the steps it can: a bfloat16 KV pool on the CPU, and fewer tokens than `max_rows`
(where the loader keeps packed bfloat16 copies for long prompts, oneDNN's GEMM is faster from there on).
The torch path writes the same pool, so a sequence moves between the two freely.

LlamaModel calls it through `takes(batch, kv)` / `forward(batch, kv)`; the loader attaches it with
`attach_native_steps(model, checkpoint, max_rows)` when the checkpoint is a plain Llama in int4 and the
library loads.
"""

from __future__ import annotations

import collections
import ctypes
import logging

import torch

from worker.batch import PagedKV, StepBatch
from worker.model.checkpoint import Checkpoint
from worker.model.families.llama import split_projections
from worker.model.native_pack import (
    BLOCK_N,
    NoNativeKernel,
    QuantMatrix,
    kernel_format,
    matrix,
    native_blocks,
    pack_parts,
)
from worker.model.quant_linear import DenseLinear, Int8Linear, TieredLinear
from worker.model.weights import INT4_GROUP
from worker.native import build

log = logging.getLogger(__name__)

# Steps of this many rows and more run their linears on AMX tiles where the CPU has them: a tile product
# costs about the same for 1 row as for 16, VNNI's grow with the rows: the crossover measured in
# docs/benchmarks.md ("The native step's linears, second pass").
AMX_FROM_ROWS = 6
PHASES = ("embedding, rope tables", "norms + quantizing x", "q/k/v", "rope + K/V write", "attention", "o_proj (+ quantizing)",
          "gate/up", "SiLU·mul (+ quantizing)", "down", "final norm + head")  # fmt: skip


class LayerWeights(ctypes.Structure):
    _fields_ = [("qkv", QuantMatrix), ("o", QuantMatrix), ("gate_up", QuantMatrix), ("down", QuantMatrix),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p)]  # fmt: skip


class ModelStruct(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab")] + [
        ("eps", ctypes.c_float), ("rope_factor", ctypes.c_float), ("inv_freq", ctypes.c_void_p), ("embed", ctypes.c_void_p),
        ("layer", ctypes.c_void_p), ("final_norm", ctypes.c_void_p), ("head", ctypes.c_void_p), ("head_scale", ctypes.c_void_p),
        ("amx_from_rows", ctypes.c_int64),
    ]  # fmt: skip


class StepStruct(ctypes.Structure):
    _fields_ = [("rows", ctypes.c_int64), ("ids", ctypes.c_void_p), ("positions", ctypes.c_void_p), ("slots", ctypes.c_void_p),
                ("contexts", ctypes.c_void_p), ("page_tables", ctypes.c_void_p), ("page_table_stride", ctypes.c_int64),
                ("k_pool", ctypes.c_void_p), ("v_pool", ctypes.c_void_p), ("layer_stride", ctypes.c_int64),
                ("page_size", ctypes.c_int64), ("logit_rows", ctypes.c_void_p), ("logit_count", ctypes.c_int64),
                ("logits", ctypes.c_void_p), ("phase_seconds", ctypes.c_void_p)]  # fmt: skip


def head_int8(head: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The output head as (int8 weights [N/16, K/2, 16, 2], per-row scales [N] float32), its rows padded to BLOCK_N."""
    small = head.small if isinstance(head, TieredLinear) else head
    if isinstance(small, DenseLinear):
        small = Int8Linear(small.weight, None, torch.float32)
    if not isinstance(small, Int8Linear):
        raise TypeError(f"no native form for a head of type {type(small).__name__}")
    pad = -small.qweight.shape[0] % BLOCK_N
    q = torch.nn.functional.pad(small.qweight, (0, 0, 0, pad))
    rows, k = q.shape
    packed = q.view(rows // BLOCK_N, BLOCK_N, k // 2, 2).transpose(1, 2).contiguous()
    return packed, torch.nn.functional.pad(small.scale.float(), (0, pad)).contiguous()


class NativeLlamaSteps:
    def __init__(
        self,
        library: ctypes.CDLL,
        model: torch.nn.Module,
        checkpoint: Checkpoint,
        max_rows: int | None = None,
        amx_from_rows: int = 0,
    ) -> None:
        config = model.config
        self.max_rows = max_rows
        self.library, self.vocab = library, config.vocab_size
        # Every step on all the worker's threads: the native step wakes them once, not once per operator, so
        # even one row gains from two (worker/step_threads.py's rule is for torch's many small operators).
        self.threads = torch.get_num_threads()
        self._keep: list = []  # every tensor and struct the structs point into
        self.formats: dict[str, str] = {}  # each linear's weights as the kernel reads them, e.g. "Q5_0 as int5/fp16/32"
        layers = [self._layer(model, checkpoint, index) for index in range(config.num_layers)]
        self._layers = (LayerWeights * len(layers))(*layers)
        if amx_from_rows and not all(f.endswith(" as int4/fp16/32") for f in self.formats.values()):
            log.info("AMX tiles off: they run int4 weights with fp16 scales only; every step on VNNI")
            amx_from_rows = 0
        head_q, head_scale = head_int8(model.lm_head)
        self.head_rows = head_q.shape[0] * BLOCK_N
        self.struct = ModelStruct(
            layers=config.num_layers, hidden=config.hidden_size, heads=config.num_heads, kv_heads=config.num_kv_heads,
            head_dim=config.head_dim, intermediate=config.intermediate_size, vocab=self.head_rows,
            eps=config.rms_norm_eps, rope_factor=model.rotary.attention_factor,
            inv_freq=self._pointer(model.rotary.inv_freq.float().contiguous()), embed=self._pointer(model.embed_tokens.data),
            layer=ctypes.addressof(self._layers), final_norm=self._pointer(model.norm.weight.float().contiguous()),
            head=self._pointer(head_q), head_scale=self._pointer(head_scale), amx_from_rows=amx_from_rows,
        )  # fmt: skip
        library.lmq_step.argtypes = [ctypes.POINTER(ModelStruct), ctypes.POINTER(StepStruct), ctypes.c_int]
        library.lmq_step.restype = ctypes.c_int
        if library.lmq_step_phases() != len(PHASES):
            raise RuntimeError("the native library and native_llama.py disagree on the step's phases")
        self.phase_seconds: torch.Tensor | None = (
            None  # float64 [len(PHASES)]: set it to have steps add their phases' times
        )

    def _pointer(self, tensor: torch.Tensor) -> int:
        self._keep.append(tensor)
        return tensor.data_ptr()

    def _matrix(self, checkpoint: Checkpoint, names: list[str]) -> QuantMatrix:
        blocks = [native_blocks(name, checkpoint.weights[name + ".weight"]) for name in names]
        for name, part in zip(names, blocks):
            self.formats[name] = kernel_format(part)
        return matrix(pack_parts(blocks), self._keep)

    def _layer(self, model: torch.nn.Module, checkpoint: Checkpoint, index: int) -> LayerWeights:
        qkv, gate_up = split_projections(index)
        prefix = f"model.layers.{index}."
        layer = model.layers[index]
        return LayerWeights(
            qkv=self._matrix(checkpoint, qkv), o=self._matrix(checkpoint, [prefix + "self_attn.o_proj"]),
            gate_up=self._matrix(checkpoint, gate_up), down=self._matrix(checkpoint, [prefix + "mlp.down_proj"]),
            input_norm=self._pointer(layer.input_norm.weight.float().contiguous()),
            post_norm=self._pointer(layer.post_attention_norm.weight.float().contiguous()),
        )  # fmt: skip

    def takes(self, batch: StepBatch, kv: PagedKV) -> bool:
        """Whether the native code runs this step: a bfloat16 CPU pool and fewer tokens than max_rows."""
        return (
            kv.k.dtype == torch.bfloat16 and kv.k.device.type == "cpu" and type(batch) is StepBatch
            and (self.max_rows is None or batch.input_ids.numel() < self.max_rows)
        )  # fmt: skip

    def forward(self, batch: StepBatch, kv: PagedKV) -> torch.Tensor:
        k, v = kv.k, kv.v
        if not (k.is_contiguous() and v.is_contiguous()):
            raise ValueError("the native step needs a contiguous KV pool")
        rows = batch.input_ids.numel()
        ids, positions, slots = (
            t.to(torch.int64).contiguous() for t in (batch.input_ids, batch.positions, batch.slots)
        )
        contexts = positions + 1
        sequence_of_row = torch.repeat_interleave(torch.arange(len(batch.query_lens)), torch.tensor(batch.query_lens))
        page_tables = batch.page_tables.to(torch.int64)[sequence_of_row].contiguous()
        logit_rows = batch.logits_indices.to(torch.int64).contiguous()
        logits = torch.empty(logit_rows.numel(), self.head_rows, dtype=torch.float32)
        step = StepStruct(
            rows=rows, ids=ids.data_ptr(), positions=positions.data_ptr(), slots=slots.data_ptr(),
            contexts=contexts.data_ptr(), page_tables=page_tables.data_ptr(), page_table_stride=page_tables.shape[1],
            k_pool=k.data_ptr(), v_pool=v.data_ptr(), layer_stride=k[0].numel(), page_size=k.shape[2],
            logit_rows=logit_rows.data_ptr(), logit_count=logit_rows.numel(), logits=logits.data_ptr(),
            phase_seconds=None if self.phase_seconds is None else self.phase_seconds.data_ptr(),
        )  # fmt: skip
        status = self.library.lmq_step(ctypes.byref(self.struct), ctypes.byref(step), self.threads)
        if status != 0:
            reason = {1: "shapes", 2: "weight formats", 3: "weight formats on AMX tiles"}.get(
                status, f"status {status}"
            )
            raise RuntimeError(f"the native step refused the model's {reason}")
        return logits[:, : self.vocab]


def amx_usable(library: ctypes.CDLL) -> bool:
    """Whether the linears can run on AMX tiles here: the CPU has them and the kernel grants their state."""
    return {"amx_tile", "amx_bf16"} <= build.cpu_flags() and library.lmq_amx_enable() == 1


def attach_native_steps(
    model: torch.nn.Module, checkpoint: Checkpoint, max_rows: int | None = None, invariant: bool = False
) -> bool:
    """Give a plain LlamaModel on the CPU its native steps; False (and the model unchanged) where they cannot run.

    invariant: every step native and on VNNI, whatever its size, so that a sequence's tokens do not depend
    on what it is batched with (max_rows and AMX tiles, which change the arithmetic of large steps, off).
    """
    from worker.model.llama import LlamaModel

    if type(model) is not LlamaModel or checkpoint.config.architecture != "llama":
        return False
    if model.embed_tokens.device.type != "cpu" or model.embed_tokens.dtype != torch.bfloat16:
        return False
    if any(name.endswith(".bias") for name in checkpoint.weights):
        log.info("native steps off: the checkpoint has biases, which the native step does not add")
        return False
    if not _shapes_fit(model.config):
        log.info("native steps off: the model's shapes do not fit the kernel")
        return False
    library = build.load()
    if library is None:
        return False
    amx_from_rows = 0 if invariant or not amx_usable(library) else AMX_FROM_ROWS
    try:
        native = NativeLlamaSteps(library, model, checkpoint, None if invariant else max_rows, amx_from_rows)
    except NoNativeKernel as error:
        log.info("native steps off: %s", error)
        return False
    model.native_steps = native
    limit = f" of fewer than {max_rows} tokens" if max_rows and not invariant else ""
    tiles = f", from {native.struct.amx_from_rows} rows on AMX tiles" if native.struct.amx_from_rows else ""
    kinds = collections.Counter(f.split(" as ")[0] for f in native.formats.values())
    weights = ", ".join(f"{count} {kind}" for kind, count in kinds.most_common())
    log.info("steps%s run natively (one call per step; linears %s x int16 on VNNI%s)", limit, weights, tiles)
    return True


def _shapes_fit(config) -> bool:
    q_size = config.num_heads * config.head_dim
    return (
        config.head_dim in (64, 128, 256) and config.num_heads % config.num_kv_heads == 0
        and config.num_heads // config.num_kv_heads <= 16 and config.hidden_size % 64 == 0
        and config.intermediate_size % 64 == 0 and q_size % 64 == 0 and INT4_GROUP == 32
        and (q_size + 2 * config.num_kv_heads * config.head_dim) % BLOCK_N == 0
    )  # fmt: skip
