"""A tiny Llama-style model written as a Hugging Face directory, for fast tests.

Random weights (HF tensor names, safetensors), a small byte-level BPE tokenizer trained on text
written here, and a ChatML chat template with `<|im_end|>` as end of turn.
"""

from __future__ import annotations

import json
import pathlib

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is the capital.
Hello, world! Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 3.14159. Code: def f(x): return x ** 2
Unicode: Ünïcödé ✓ 日本語 🙂. The user asks, the assistant answers, and the system sets the rules.
A paged cache keeps keys and values; a batch mixes prefill chunks with decode steps.
"""

HIDDEN = 64
LAYERS = 3
HEADS = 4
KV_HEADS = 2
INTERMEDIATE = 128
VOCAB = 384


def _train_tokenizer(directory: pathlib.Path) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = directory / "corpus.txt"
    corpus.write_text(TRAINING_TEXT * 4, encoding="utf-8")
    tokenizer.train([str(corpus)], trainer)
    corpus.unlink()
    tokenizer.save(str(directory / "tokenizer.json"))
    return tokenizer


def _config(tied: bool) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": tied,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def _weights(tied: bool, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    def norm_weight() -> torch.Tensor:
        return 1.0 + normal(HIDDEN, std=0.05)

    head_dim = HIDDEN // HEADS
    weights = {"model.embed_tokens.weight": normal(VOCAB, HIDDEN, std=0.5), "model.norm.weight": norm_weight()}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        weights[prefix + "input_layernorm.weight"] = norm_weight()
        weights[prefix + "post_attention_layernorm.weight"] = norm_weight()
        weights[prefix + "self_attn.q_proj.weight"] = normal(HEADS * head_dim, HIDDEN, std=0.3)
        weights[prefix + "self_attn.k_proj.weight"] = normal(KV_HEADS * head_dim, HIDDEN, std=0.3)
        weights[prefix + "self_attn.v_proj.weight"] = normal(KV_HEADS * head_dim, HIDDEN)
        weights[prefix + "self_attn.o_proj.weight"] = normal(HIDDEN, HEADS * head_dim)
        weights[prefix + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        weights[prefix + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        weights[prefix + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE)
    if not tied:
        weights["lm_head.weight"] = normal(VOCAB, HIDDEN, std=0.5)
    return weights


def make_tiny_model(directory: pathlib.Path, *, tied: bool = True, seed: int = 0) -> pathlib.Path:
    """Write a tiny LlamaForCausalLM-style HF model directory into `directory` and return it."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _train_tokenizer(directory)
    (directory / "config.json").write_text(json.dumps(_config(tied), indent=2))
    save_file(_weights(tied, seed), str(directory / "model.safetensors"), metadata={"format": "pt"})
    tokenizer_config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHATML_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return directory
