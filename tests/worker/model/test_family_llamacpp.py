"""Cross-check with llama.cpp itself (through the `xllamacpp` wheel; skipped where it is not installed):
each family's tiny GGUF gives the same next-token distribution in lmq and in llama.cpp after every
prefix of a prompt: the same greedy token (unless lmq's top two are within 0.01), and the same
log-probabilities of llama.cpp's top 3 tokens within 1e-3.

llama.cpp runs with a float32 KV cache (its f16 default rounds K/V by ~1e-3). It reports nothing for
a token that is an incomplete UTF-8 sequence; those prefixes are skipped. llama.cpp disables Phi-3's
sliding window ("Phi SWA is currently disabled", llama.cpp PR 13676) while lmq and transformers apply
it, so Phi-3 with a window is compared only on prefixes the window covers. ggml computes GELU
(Gemma's MLP activation) from an fp16 lookup table, off by ~1e-3 in the log-probabilities; for the
comparison lmq's Gemma MLPs round GELU's input and output to fp16 the same way (with the exact GELU
the two agree to ~2e-3, with the table's to ~2e-4). Gemma 2's final soft-cap leaves these random
tiny models' top tokens within 0.01 of each other, so there only the log-probabilities are compared.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.nn.functional as F

from tests.support.paged_steps import Chunk, allocate_kv, make_batch
from tests.support.tiny_families import FAMILIES, TinyFamily, make_family_model, write_family_gguf
from worker.model.loader import LoadedModel, load_model

xllamacpp = pytest.importorskip("xllamacpp")

PROMPT = [5, 17, 99, 3, 250, 8, 41, 77, 12, 300, 2, 64, 64, 9, 120, 33, 18, 200, 7]  # past the 6-7 key windows
NEAR_TIE = 0.01
TOLERANCE = 1e-3


def llama_cpp_server(path: pathlib.Path):
    params = xllamacpp.CommonParams()
    params.model.path = str(path)
    params.n_ctx = 128
    params.n_parallel = 1
    params.warmup = False
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = 1
    params.cache_type_k = params.cache_type_v = xllamacpp.ggml_type.GGML_TYPE_F32
    params.flash_attn_type = xllamacpp.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED
    return xllamacpp.Server(params)


def llama_cpp_top3(server, prefix: list[int]) -> list[tuple[int, float]] | None:
    reply = server.handle_completions(
        {"prompt": prefix, "n_predict": 1, "temperature": 0.0, "logprobs": 3, "cache_prompt": False}
    )
    logprobs = reply["choices"][0].get("logprobs")
    if not logprobs:
        return None
    return [(entry["id"], entry["logprob"]) for entry in logprobs["content"][0]["top_logprobs"]]


def ggml_gelu(x: torch.Tensor) -> torch.Tensor:
    """ggml's CPU GELU: a table indexed by the fp16 input, holding fp16 results."""
    return F.gelu(x.half().float(), approximate="tanh").half().float()


def lmq_logprobs(model: LoadedModel, prefix: list[int]) -> torch.Tensor:
    kv = allocate_kv(model.config, num_pages=4, page_size=8, dtype=torch.float32)
    return model.model(make_batch([Chunk(prefix, 0, [0, 1, 2])], 8), kv)[0].log_softmax(-1)


@pytest.mark.parametrize("spec", [spec for spec in FAMILIES if spec.gguf_arch is not None], ids=str)
def test_llama_cpp_gives_the_same_next_token_distribution(spec: TinyFamily, tmp_path: pathlib.Path) -> None:
    directory = make_family_model(spec, tmp_path / spec.name)
    path = write_family_gguf(spec, directory, tmp_path / f"{spec.name}.gguf")
    model = load_model(str(path), dtype="float32", quant="none", device="cpu")
    if spec.model_class.startswith("Gemma"):
        for layer in model.model.layers:
            layer.mlp.act = ggml_gelu
    longest = (
        model.config.window(0) if spec.model_class == "Phi3ForCausalLM" and model.config.layer_windows else len(PROMPT)
    )
    server = llama_cpp_server(path)
    compared = greedy_compared = 0
    try:
        for length in range(1, longest + 1):
            theirs = llama_cpp_top3(server, PROMPT[:length])
            if theirs is None:
                continue
            ours = lmq_logprobs(model, PROMPT[:length])
            top = ours.topk(2)
            if float(top.values[0] - top.values[1]) >= NEAR_TIE:
                assert theirs[0][0] == int(top.indices[0]), f"{spec}: greedy token after {length} prompt tokens"
                greedy_compared += 1
            for token, logprob in theirs:
                assert abs(float(ours[token]) - logprob) < TOLERANCE, (
                    f"{spec}: token {token} after {length} prompt tokens"
                )
            compared += 1
    finally:
        del server
    assert compared >= min(5, longest - 2)
    assert greedy_compared >= 3 or spec.name == "gemma2"
