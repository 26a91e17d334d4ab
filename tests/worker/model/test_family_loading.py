"""Loading the families: refusals before any weight is read, end-of-turn tokens, a SentencePiece GGUF
end to end, weight modes, the mixture-of-experts grouping, and the engine against transformers' generate."""

from __future__ import annotations

import json
import pathlib
import re

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import worker.model.loader as loader_module
from tests.support.engine_runs import generate, greedy
from tests.support.paged_steps import Chunk, allocate_kv, make_batch
from tests.support.tiny_families import FAMILY_BY_NAME, make_family_model, reference_model, write_family_gguf
from tests.support.tiny_model import make_tiny_model
from worker.engine import GenRequest
from worker.model.chat_template import ChatTemplate
from worker.model.families import UnsupportedModel
from worker.model.gguf_tokenizer import UnsupportedTokenizer
from worker.model.loader import END_OF_TURN_TOKENS, load_model
from worker.model.moe import SparseMoE

TEMPLATE_DIR = pathlib.Path(__file__).parent / "chat_templates"


@pytest.fixture
def no_weights_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal must come before the model is built (before any weight is read or memory allocated)."""

    def build_model(*args, **kwargs):
        raise AssertionError("build_model was called for a checkpoint that should have been refused")

    monkeypatch.setattr(loader_module, "build_model", build_model)


def _edit_config(directory: pathlib.Path, **changes) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"model_type": "mamba", "architectures": ["MambaForCausalLM"]},
            "model_type 'mamba' (MambaForCausalLM) is not supported (supported: llama, mistral, qwen2",
        ),
        (
            {"quantization_config": {"quant_method": "gptq", "bits": 4}},
            "quantized checkpoints (gptq) are not supported",
        ),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic' is not supported"),
    ],
)
def test_unsupported_hf_checkpoints_are_refused_by_name(
    tmp_path: pathlib.Path, no_weights_read: None, changes: dict, message: str
) -> None:
    directory = make_tiny_model(tmp_path / "model")
    _edit_config(directory, **changes)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_model(str(directory), dtype="float32", quant="none", device="cpu")


def test_non_float_safetensors_are_refused_by_tensor_and_dtype(tmp_path: pathlib.Path, no_weights_read: None) -> None:
    directory = make_tiny_model(tmp_path / "model")
    save_file(
        {"model.layers.0.self_attn.q_proj.qweight": torch.zeros(4, 4, dtype=torch.int32)},
        str(directory / "model-extra.safetensors"),
    )
    with pytest.raises(
        UnsupportedModel, match=re.escape("tensor model.layers.0.self_attn.q_proj.qweight has dtype I32")
    ):
        load_model(str(directory), dtype="float32", quant="none", device="cpu")


def _tiny_gguf(
    tmp_path: pathlib.Path, arch: str = "llama", extra_tensor: tuple | None = None, pre: str = "gpt2"
) -> pathlib.Path:
    directory = make_tiny_model(tmp_path / "model")
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    model = json.loads((directory / "tokenizer.json").read_text())
    vocab = model["model"]["vocab"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(sorted(vocab, key=vocab.get))
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["model"]["merges"]])
    writer.add_tensor("token_embd.weight", np.zeros((len(vocab), 64), dtype=np.float32))
    if extra_tensor is not None:
        name, raw, qtype = extra_tensor
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_gguf_architecture_is_refused_by_name(tmp_path: pathlib.Path, no_weights_read: None) -> None:
    with pytest.raises(
        UnsupportedModel,
        match=re.escape(
            "GGUF architecture 'mamba' is not supported (supported: gemma2, gemma3, llama, phi3, qwen2, qwen3, qwen3moe)"
        ),
    ):
        load_model(str(_tiny_gguf(tmp_path, "mamba")), dtype="float32", quant="none", device="cpu")


def test_unreadable_gguf_tensor_type_is_refused_by_tensor_and_type(
    tmp_path: pathlib.Path, no_weights_read: None
) -> None:
    q8_k_block = np.zeros((1, 292), dtype=np.uint8)  # one 256-value Q8_K block: a type only llama.cpp's kernels use
    path = _tiny_gguf(tmp_path, extra_tensor=("blk.0.attn_q.weight", q8_k_block, gguf.GGMLQuantizationType.Q8_K))
    with pytest.raises(
        UnsupportedModel, match=re.escape("tensor blk.0.attn_q.weight has type Q8_K, which lmq cannot read")
    ):
        load_model(str(path), dtype="float32", quant="none", device="cpu")


def test_unknown_gguf_pre_tokenizer_is_refused(tmp_path: pathlib.Path, no_weights_read: None) -> None:
    with pytest.raises(UnsupportedTokenizer, match=re.escape("GGUF pre-tokenizer 'chatglm-bpe' is not supported")):
        load_model(str(_tiny_gguf(tmp_path, pre="chatglm-bpe")), dtype="float32", quant="none", device="cpu")


# --- end of turn -----------------------------------------------------------------------------------

TURN_ENDS = {  # template -> (messages with an assistant turn, extra variables) and the text right after the answer
    "Qwen-Qwen3-0.6B": "<|im_end|>",
    "Qwen-QwQ-32B": "<|im_end|>",
    "meta-llama-Llama-3.2-3B-Instruct": "<|eot_id|>",
    "meta-llama-Llama-3.3-70B-Instruct": "<|eot_id|>",
    "google-gemma-2-2b-it": "<end_of_turn>",
    "google-gemma-3-it": "<end_of_turn>",
    "microsoft-Phi-3.5-mini-instruct": "<|end|>",
    "mistralai-Mistral-Nemo-Instruct-2407": "</s>",
}


def _turn_end(source: str, **variables) -> str:
    messages = [
        {"role": "user", "content": "Question"},
        {"role": "assistant", "content": "ANSWER"},
        {"role": "user", "content": "More"},
    ]
    text = ChatTemplate(source, bos_token="<s>", eos_token="</s>").render(messages, **variables)
    return re.match(r"<[^>]+>", text[text.index("ANSWER") + len("ANSWER") :]).group(0)


@pytest.mark.parametrize("template", sorted(TURN_ENDS))
def test_the_token_ending_an_assistant_turn_stops_generation(template: str) -> None:
    """The token each real template writes after an answer is an end-of-turn token (or the eos token)."""
    end = _turn_end((TEMPLATE_DIR / f"{template}.jinja").read_text(encoding="utf-8"))
    assert end == TURN_ENDS[template]
    assert end in END_OF_TURN_TOKENS or end == "</s>"


def test_llama_ipython_turns_end_with_eom_which_stops_too() -> None:
    source = (TEMPLATE_DIR / "meta-llama-Llama-3.3-70B-Instruct.jinja").read_text(encoding="utf-8")
    call = {"role": "assistant", "tool_calls": [{"function": {"name": "brave_search", "arguments": {"query": "x"}}}]}
    text = ChatTemplate(source).render([{"role": "user", "content": "Search"}, call], builtin_tools=["brave_search"])
    assert text.split('brave_search.call(query="x")')[1].startswith("<|eom_id|>") and "<|eom_id|>" in END_OF_TURN_TOKENS


# --- a SentencePiece GGUF end to end (Gemma 3) -----------------------------------------------------


@pytest.fixture(scope="module")
def gemma_sentencepiece(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, pathlib.Path]:
    spec = FAMILY_BY_NAME["gemma3"]
    template = (TEMPLATE_DIR / "google-gemma-3-it.jinja").read_text(encoding="utf-8")
    directory = make_family_model(
        spec, tmp_path_factory.mktemp("gemma3-spm"), chat_template=template, sentencepiece_vocab=True
    )
    return directory, write_family_gguf(spec, directory, directory.parent / "gemma3-spm.gguf")


def test_sentencepiece_gguf_serves_like_its_hf_directory(
    gemma_sentencepiece: tuple[pathlib.Path, pathlib.Path],
) -> None:
    directory, path = gemma_sentencepiece
    from_hf = load_model(str(directory), dtype="float32", quant="none", device="cpu")
    from_gguf = load_model(str(path), dtype="float32", quant="none", device="cpu")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Café  ✓ 日本語 🙂? 12345"}]
    text = from_gguf.chat_template.render(messages)
    assert text == from_hf.chat_template.render(messages) and text.startswith("<bos><start_of_turn>user\nBe brief.")
    ids = from_gguf.tokenizer.encode(text, add_special_tokens=False).ids
    assert ids == from_hf.tokenizer.encode(text, add_special_tokens=False).ids
    assert from_gguf.tokenizer.encode("Hi").ids == from_hf.tokenizer.encode("Hi").ids  # add_bos: <bos> first
    assert from_gguf.bos_token_id == from_hf.bos_token_id == from_hf.tokenizer.token_to_id("<bos>")
    end_of_turn = from_hf.tokenizer.token_to_id("<end_of_turn>")
    assert end_of_turn in from_gguf.stop_token_ids and end_of_turn in from_hf.stop_token_ids
    assert from_gguf.tokenizer.decode(ids, skip_special_tokens=False) == text
    kv_hf, kv_gguf = (
        allocate_kv(m.config, num_pages=8, page_size=8, dtype=torch.float32) for m in (from_hf, from_gguf)
    )
    batch = make_batch([Chunk(ids, 0, list(range(len(ids) // 8 + 1)))], 8)
    torch.testing.assert_close(from_gguf.model(batch, kv_gguf), from_hf.model(batch, kv_hf), atol=1e-5, rtol=1e-5)


# --- weight modes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "qwen3-moe", "phi3-partial-rotary", "mixtral"])
@pytest.mark.parametrize(
    "dtype, quant, min_cosine", [("bfloat16", "none", 0.999), ("bfloat16", "int8", 0.99), ("bfloat16", "int4", 0.95)]
)
def test_quantized_and_bfloat16_modes_stay_close_to_float32(
    tmp_path: pathlib.Path, name: str, dtype: str, quant: str, min_cosine: float
) -> None:
    directory = make_family_model(FAMILY_BY_NAME[name], tmp_path / name)
    exact = load_model(str(directory), dtype="float32", quant="none", device="cpu")
    reduced = load_model(str(directory), dtype=dtype, quant=quant, device="cpu")
    ids = list(range(5, 45))
    batch = make_batch([Chunk(ids, 0, list(range(10)))], 4)
    expected = exact.model(batch, allocate_kv(exact.config, 10, 4, torch.float32))
    logits = reduced.model(batch, allocate_kv(reduced.config, 10, 4, reduced.dtype))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert torch.nn.functional.cosine_similarity(logits, expected).item() > min_cosine


# --- mixture of experts ----------------------------------------------------------------------------


class CountingExpert(torch.nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.scale, self.calls = float(index + 1), []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape[0])
        return torch.tanh(x) * self.scale


@pytest.mark.parametrize("normalize", [True, False])
def test_experts_run_once_per_step_on_all_their_tokens(normalize: bool) -> None:
    torch.manual_seed(0)
    router = torch.nn.Linear(8, 6, bias=False)
    experts = [CountingExpert(i) for i in range(6)]
    moe = SparseMoE(router, experts, top_k=2, normalize_top_k=normalize)
    x = torch.randn(37, 8)
    out = moe(x)
    probabilities = router(x).softmax(-1)
    expected = torch.zeros_like(x)
    for token in range(x.shape[0]):  # the textbook per-token loop
        weights, chosen = probabilities[token].topk(2)
        weights = weights / weights.sum() if normalize else weights
        for weight, expert in zip(weights, chosen):
            expected[token] += weight * torch.tanh(x[token]) * (int(expert) + 1)
    torch.testing.assert_close(out, expected)
    chosen = probabilities.topk(2).indices
    for index, expert in enumerate(experts):
        tokens = int((chosen == index).sum())
        assert expert.calls == ([tokens] if tokens else [])


# --- the engine against transformers' generate -----------------------------------------------------


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "qwen3-moe", "mistral-window", "phi3"])
async def test_engine_greedy_tokens_equal_transformers_generate(tmp_path: pathlib.Path, name: str) -> None:
    directory = make_family_model(FAMILY_BY_NAME[name], tmp_path / name)
    model = load_model(str(directory), dtype="float32", quant="none", device="cpu")
    prompts = {"a": [5, 17, 99, 3, 250, 8, 41, 77, 12], "b": [300, 2, 64, 64, 9]}
    requests = [GenRequest(rid, ids, greedy(max_tokens=14)) for rid, ids in prompts.items()]
    results = await generate(model, requests, page_size=4, step_tokens=6)
    reference = reference_model(directory)
    for rid, ids in prompts.items():
        with torch.no_grad():
            output = reference.generate(torch.tensor([ids]), max_new_tokens=14, do_sample=False, min_new_tokens=14)
        assert results[rid].token_ids == output[0, len(ids) :].tolist(), f"{name} request {rid}"


def test_multimodal_gemma3_directory_serves_its_language_model(tmp_path: pathlib.Path) -> None:
    """Gemma 3 4B+ ship as Gemma3ForConditionalGeneration: text config nested, tensors under language_model."""
    from safetensors.torch import load_file

    text_dir = make_family_model(FAMILY_BY_NAME["gemma3"], tmp_path / "text")
    multimodal = make_family_model(FAMILY_BY_NAME["gemma3"], tmp_path / "multimodal")
    text_config = json.loads((text_dir / "config.json").read_text())
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": text_config,
        "vision_config": {},
    }
    (multimodal / "config.json").write_text(json.dumps(config))
    tensors = {
        name.replace("model.", "language_model.model.", 1): tensor
        for name, tensor in load_file(str(text_dir / "model.safetensors")).items()
    }
    tensors["vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(8, 3, 2, 2)
    save_file(tensors, str(multimodal / "model.safetensors"))
    text, both = (load_model(str(d), dtype="float32", quant="none", device="cpu") for d in (text_dir, multimodal))
    assert both.config == text.config and both.parameter_count == text.parameter_count
    batch = make_batch([Chunk(list(range(3, 30)), 0, list(range(4)))], 8)
    logits = [m.model(batch, allocate_kv(m.config, 4, 8, torch.float32)) for m in (text, both)]
    torch.testing.assert_close(logits[1], logits[0], atol=0, rtol=0)
