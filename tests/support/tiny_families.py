"""Tiny random-weight models of each supported family, made with transformers' own config and model
classes and saved with save_pretrained, and the same models written as GGUF the way llama.cpp's
convert_hf_to_gguf.py writes them (gguf's own tensor-name map, q/k row permutation for llama-arch,
Gemma's norm + 1, experts stacked per layer, rope_freqs / rope_factors tensors).

A spec with `gguf_arch=None` exercises a setting llama.cpp files cannot express (they are compared
with transformers only). `legacy_config` rewrites config.json into the transformers-4 layout
(rope_theta + rope_scaling, num_experts, rope_local_base_freq) that most checkpoints on the Hub use.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np
import sentencepiece
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import AddedToken, Tokenizer, processors

from tests.support.tiny_model import CHATML_TEMPLATE, _train_tokenizer

COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


@dataclass(frozen=True)
class TinyFamily:
    name: str
    model_class: str  # transformers class; its config_class makes the config
    config: dict[str, Any] = field(default_factory=dict)
    gguf_arch: gguf.MODEL_ARCH | None = None
    legacy_config: bool = False
    min_compared_length: int = 0  # long-rope: transformers switches factors by length, lmq by served context

    def __str__(self) -> str:
        return self.name


def _longrope_factors(seed: int) -> list[float]:
    generator = torch.Generator().manual_seed(seed)
    return [round(float(x), 4) for x in 1 + 3 * torch.rand(8, generator=generator)]


A = gguf.MODEL_ARCH
FAMILIES = [
    TinyFamily(
        "llama3-rope",
        "LlamaForCausalLM",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        ),
        A.LLAMA,
        legacy_config=True,
    ),
    TinyFamily("mistral", "MistralForCausalLM", dict(sliding_window=None), A.LLAMA),
    TinyFamily(
        "mistral-window", "MistralForCausalLM", dict(sliding_window=6)
    ),  # llama.cpp keeps no window for llama-arch
    TinyFamily("qwen2", "Qwen2ForCausalLM", dict(tie_word_embeddings=True), A.QWEN2),
    TinyFamily(
        "qwen2-yarn",
        "Qwen2ForCausalLM",
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        ),
        A.QWEN2,
        legacy_config=True,
    ),
    TinyFamily(
        "qwen2-window", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)
    ),
    TinyFamily("qwen3", "Qwen3ForCausalLM", dict(head_dim=32), A.QWEN3),
    TinyFamily(
        "qwen3-moe",
        "Qwen3MoeForCausalLM",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, head_dim=16),
        A.QWEN3MOE,
        legacy_config=True,
    ),
    TinyFamily(
        "qwen3-moe-dense-layer",
        "Qwen3MoeForCausalLM",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            mlp_only_layers=[0],
            head_dim=16,
        ),
    ),
    TinyFamily(
        "gemma2",
        "Gemma2ForCausalLM",
        dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=6,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            tie_word_embeddings=True,
        ),
        A.GEMMA2,
    ),
    TinyFamily(
        "gemma2-query-scalar",
        "Gemma2ForCausalLM",
        dict(
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=6,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            tie_word_embeddings=True,
        ),
    ),
    TinyFamily(
        "gemma3",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=6,
            num_hidden_layers=6,
            hidden_size=32,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        ),
        A.GEMMA3,
        legacy_config=True,
    ),
    TinyFamily("phi3", "Phi3ForCausalLM", dict(sliding_window=7, pad_token_id=None), A.PHI3),
    TinyFamily(
        "phi3-longrope",
        "Phi3ForCausalLM",
        dict(
            pad_token_id=None,
            original_max_position_embeddings=16,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": _longrope_factors(1),
                "long_factor": _longrope_factors(2),
            },
        ),
        A.PHI3,
        min_compared_length=17,
    ),
    TinyFamily("phi3-partial-rotary", "Phi3ForCausalLM", dict(pad_token_id=None, partial_rotary_factor=0.5), A.PHI3),
    TinyFamily("mixtral", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2), A.LLAMA),
]
FAMILY_BY_NAME = {spec.name: spec for spec in FAMILIES}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights big enough that every piece (norm offsets, biases, soft-caps, routing) changes the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if parameter.ndim == 1:
                base = 0.0 if parameter.abs().sum() == 0 else 1.0  # Gemma norms hold w in x * (1 + w)
                parameter.copy_(base + 0.1 * noise)
            elif "embed" in name or "lm_head" in name:
                parameter.copy_(0.5 * noise)
            else:
                router = name.endswith(".gate.weight")  # a decisive router: top-k choices far from ties
                parameter.copy_(noise / math.sqrt(parameter.shape[-1]) * (3.0 if router else 0.6))


def _legacy(raw: dict[str, Any]) -> dict[str, Any]:
    rope = raw.pop("rope_parameters", None) or {}
    if "full_attention" in rope:
        full, local = rope["full_attention"], rope["sliding_attention"]
        raw["rope_theta"], raw["rope_local_base_freq"] = full.pop("rope_theta"), local["rope_theta"]
        raw["rope_scaling"] = full if full.get("rope_type") != "default" else None
        raw.pop("layer_types", None)
        raw["sliding_window_pattern"] = 6
    elif rope:
        raw["rope_theta"] = rope.pop("rope_theta")
        raw["rope_scaling"] = rope if rope.get("rope_type") != "default" else None
    if raw.get("model_type") == "qwen3_moe" and "num_local_experts" in raw:
        raw["num_experts"] = raw.pop("num_local_experts")
    return raw


GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
SENTENCEPIECE_TEXT = """The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is the capital.
Café déjà vu, naïve façade, über Straße. 日本語のテキストと中文文本。 Emoji: 🙂🚀 and ✓.
Numbers: 0 1 2 3 42 12345 3.14159 and code: def f(x): return x ** 2
The user asks, the model answers, and the system sets the rules.
"""


def gemma_sentencepiece_tokenizer(directory: pathlib.Path, vocab_size: int = 600) -> Tokenizer:
    """A SentencePiece BPE model trained like Gemma's (no dummy prefix, byte fallback, digits split),
    saved as tokenizer.model, and the tokenizer.json transformers' own converter makes of it."""
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    model_file = directory / "tokenizer.model"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SENTENCEPIECE_TEXT.splitlines() * 20),
        model_prefix=str(model_file.with_suffix("")),
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        character_coverage=0.98,
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
        control_symbols=GEMMA_SPECIALS[4:],
        minloglevel=2,
    )
    proto = import_protobuf().ModelProto()
    proto.ParseFromString(model_file.read_bytes())
    vocab = {piece.piece: index for index, piece in enumerate(proto.pieces)}
    tokenizer = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in GEMMA_SPECIALS])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    return tokenizer


def make_family_model(
    spec: TinyFamily,
    directory: pathlib.Path,
    seed: int = 0,
    *,
    chat_template: str = CHATML_TEMPLATE,
    sentencepiece_vocab: bool = False,
) -> pathlib.Path:
    """sentencepiece_vocab: a Gemma-style SentencePiece vocabulary (bos <bos>, eos <eos>) instead of the byte-level BPE one."""
    directory.mkdir(parents=True, exist_ok=True)
    if sentencepiece_vocab:
        tokenizer = gemma_sentencepiece_tokenizer(directory)
        bos, eos = "<bos>", "<eos>"
    else:
        tokenizer = _train_tokenizer(directory)
        bos, eos = "<|im_start|>", "<|im_end|>"
    model_class = getattr(transformers, spec.model_class)
    settings = {**COMMON, **spec.config}
    config = model_class.config_class(
        **settings,
        vocab_size=tokenizer.get_vocab_size(),
        bos_token_id=tokenizer.token_to_id(bos),
        eos_token_id=tokenizer.token_to_id(eos),
    )
    torch.manual_seed(seed)
    model = model_class(config)
    _randomize(model, seed)
    model.save_pretrained(str(directory))
    if spec.legacy_config:
        path = directory / "config.json"
        path.write_text(json.dumps(_legacy(json.loads(path.read_text())), indent=2))
    tokenizer_config = {
        "bos_token": bos,
        "eos_token": eos,
        "chat_template": chat_template,
        "add_bos_token": sentencepiece_vocab,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


def reference_model(directory: pathlib.Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager"
    ).eval()


@torch.no_grad()
def reference_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits at the last position of the whole sequence, no cache."""
    return model(input_ids=torch.tensor([token_ids])).logits[0, -1].float()


# --- GGUF, as convert_hf_to_gguf.py writes it ----------------------------------------------------


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: interleave each head's rotary halves."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def _rope(raw: dict[str, Any]) -> dict[str, Any]:
    rope = dict(raw.get("rope_parameters") or {})
    rope = rope.get("full_attention", rope)
    return {
        **(raw.get("rope_scaling") or {}),
        **rope,
        "rope_theta": rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
    }


def _llama3_rope_factors(raw: dict[str, Any], rope: dict[str, Any]) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: rope_freqs = the divisor of each frequency."""
    dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _hparams(writer: gguf.GGUFWriter, arch: gguf.MODEL_ARCH, raw: dict[str, Any]) -> None:
    rope = _rope(raw)
    writer.add_block_count(raw["num_hidden_layers"])
    writer.add_context_length(raw["max_position_embeddings"])
    writer.add_embedding_length(raw["hidden_size"])
    writer.add_feed_forward_length(raw["intermediate_size"])
    writer.add_head_count(raw["num_attention_heads"])
    writer.add_head_count_kv(raw["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(raw["rms_norm_eps"])
    writer.add_rope_freq_base(rope["rope_theta"])
    if raw.get("head_dim"):
        writer.add_key_length(raw["head_dim"])
        writer.add_value_length(raw["head_dim"])
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif kind == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(raw, rope))
    experts = raw.get("num_local_experts") or raw.get("num_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(raw["num_experts_per_tok"])
    if arch == A.QWEN3MOE:
        writer.add_expert_feed_forward_length(raw["moe_intermediate_size"])
    if arch == A.GEMMA2:
        writer.add_attn_logit_softcapping(raw["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(raw["final_logit_softcapping"])
        writer.add_sliding_window(raw["sliding_window"])
    if arch == A.GEMMA3:
        writer.add_sliding_window(raw["sliding_window"])
        local = raw.get("rope_local_base_freq") or raw["rope_parameters"]["sliding_attention"]["rope_theta"]
        writer.add_rope_freq_base_swa(local)
    if arch == A.PHI3:
        _phi3_hparams(writer, raw, rope)


def _phi3_hparams(writer: gguf.GGUFWriter, raw: dict[str, Any], rope: dict[str, Any]) -> None:
    """Phi3MiniModel.set_gguf_parameters / generate_extra_tensors."""
    heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
    partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) or 1.0
    original = raw.get("original_max_position_embeddings") or raw["max_position_embeddings"]
    writer.add_rope_dimension_count(int(partial * hidden) // heads)
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_sliding_window(raw.get("sliding_window") or 0)
    if rope.get("long_factor"):
        scale = raw["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def _sentencepiece_vocab(writer: gguf.GGUFWriter, directory: pathlib.Path) -> None:
    """Gemma2Model/Gemma3Model.set_vocab: _set_vocab_sentencepiece (tokens, scores, types), no space prefix,
    and SpecialVocab's ids, add_bos_token and chat template from tokenizer_config.json."""
    sp = sentencepiece.SentencePieceProcessor(model_file=str(directory / "tokenizer.model"))
    tokens, scores, types = [], [], []
    for index in range(sp.vocab_size()):
        kind = 1
        if sp.IsUnknown(index):
            kind = 2
        elif sp.IsControl(index):
            kind = 3
        elif sp.IsUnused(index):
            kind = 5
        elif sp.IsByte(index):
            kind = 6
        tokens.append(sp.IdToPiece(index))
        scores.append(sp.GetScore(index))
        types.append(kind)
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(False)
    writer.add_bos_token_id(sp.piece_to_id(tokenizer_config["bos_token"]))
    writer.add_eos_token_id(sp.piece_to_id(tokenizer_config["eos_token"]))
    writer.add_unk_token_id(sp.unk_id())
    writer.add_pad_token_id(sp.piece_to_id("<pad>"))
    writer.add_add_bos_token(tokenizer_config.get("add_bos_token", True))
    writer.add_add_eos_token(False)
    writer.add_chat_template(tokenizer_config["chat_template"])


def _tokenizer(writer: gguf.GGUFWriter, directory: pathlib.Path) -> None:
    if (directory / "tokenizer.model").exists():
        _sentencepiece_vocab(writer, directory)
        return
    model = json.loads((directory / "tokenizer.json").read_text())
    vocab = model["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    specials = {added["content"] for added in model["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # llama.cpp's name for GPT-2's regex
    writer.add_token_list(tokens)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["model"]["merges"]])
    writer.add_token_types([3 if token in specials else 1 for token in tokens])
    writer.add_bos_token_id(vocab["<|im_start|>"])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_chat_template(json.loads((directory / "tokenizer_config.json").read_text())["chat_template"])


def _tensors(arch: gguf.MODEL_ARCH, raw: dict[str, Any], directory: pathlib.Path) -> dict[str, np.ndarray]:
    names = gguf.get_tensor_name_map(arch, raw["num_hidden_layers"])
    heads, kv_heads = raw["num_attention_heads"], raw["num_key_value_heads"]
    tensors: dict[str, np.ndarray] = {}
    experts: dict[str, list[tuple[int, np.ndarray]]] = {}
    for name, tensor in load_file(str(directory / "model.safetensors")).items():
        array = tensor.float().numpy()
        if arch in (A.GEMMA2, A.GEMMA3) and name == "lm_head.weight":
            continue  # tied; the converter skips it
        if arch in (A.GEMMA2, A.GEMMA3) and name.endswith("norm.weight"):
            array = array + 1  # Gemma's RMSNorm scales by 1 + w: llama.cpp stores 1 + w
        if arch == A.LLAMA and name.endswith(("q_proj.weight", "k_proj.weight")):
            array = llama_cpp_permute(array, heads if "q_proj" in name else kv_heads)
        parts = name.split(".")
        if "experts" in parts:  # model.layers.N.<moe>.experts.E.<w>.weight -> stacked under ....experts.<w>.weight
            index = parts.index("experts")
            merged = ".".join(parts[: index + 1] + parts[index + 2 :])
            experts.setdefault(merged, []).append((int(parts[index + 1]), array))
            continue
        tensors[names.get_name(name, try_suffixes=(".weight", ".bias"))] = array
    for merged, items in experts.items():
        stacked = np.stack([array for _, array in sorted(items, key=lambda item: item[0])])
        tensors[names.get_name(merged, try_suffixes=(".weight",))] = stacked
    return tensors


def write_family_gguf(
    spec: TinyFamily,
    directory: pathlib.Path,
    path: pathlib.Path,
    blocks: Callable[[str, np.ndarray], tuple[np.ndarray, gguf.GGMLQuantizationType] | None] | None = None,
) -> pathlib.Path:
    """blocks(gguf name, float32 array): a tensor's (raw bytes, type) to store instead of the float32 array, or None."""
    raw = json.loads((directory / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[spec.gguf_arch])
    _hparams(writer, spec.gguf_arch, raw)
    _tokenizer(writer, directory)
    for name, array in _tensors(spec.gguf_arch, raw, directory).items():
        stored = blocks(name, array) if blocks else None
        if stored is None:
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, stored[0], raw_dtype=stored[1])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
