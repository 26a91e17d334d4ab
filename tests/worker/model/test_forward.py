"""The paged forward equals a plain full-sequence computation of the same weights (tiny model, float32)."""

from __future__ import annotations

import pathlib
import random

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tests.support.paged_steps import Chunk, allocate_kv, make_batch
from tests.support.tiny_model import make_tiny_model
from worker.model.config import ModelConfig
from worker.model.loader import load_model
from worker.model.rope import inverse_frequencies

PAGE_SIZE = 4


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rotate(x: torch.Tensor, positions: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    angles = positions[:, None].double() * inverse_frequencies(config)[None, :]
    cos, sin = torch.cat((angles, angles), -1).cos().float(), torch.cat((angles, angles), -1).sin().float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def contiguous_logits(weights: dict[str, torch.Tensor], config: ModelConfig, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence, computed the textbook way (no cache)."""
    length, heads, kv_heads, dim = len(token_ids), config.num_heads, config.num_kv_heads, config.head_dim
    positions = torch.arange(length)
    hidden = weights["model.embed_tokens.weight"][torch.tensor(token_ids)]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        x = rms_norm(hidden, weights[p + "input_layernorm.weight"], config.rms_norm_eps)
        q = rotate((x @ weights[p + "self_attn.q_proj.weight"].T).view(length, heads, dim), positions, config)
        k = rotate((x @ weights[p + "self_attn.k_proj.weight"].T).view(length, kv_heads, dim), positions, config)
        v = (x @ weights[p + "self_attn.v_proj.weight"].T).view(length, kv_heads, dim)
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q, k) / dim**0.5
        attention = torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)
        hidden = hidden + attention.reshape(length, -1) @ weights[p + "self_attn.o_proj.weight"].T
        x = rms_norm(hidden, weights[p + "post_attention_layernorm.weight"], config.rms_norm_eps)
        mlp = F.silu(x @ weights[p + "mlp.gate_proj.weight"].T) * (x @ weights[p + "mlp.up_proj.weight"].T)
        hidden = hidden + mlp @ weights[p + "mlp.down_proj.weight"].T
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    return rms_norm(hidden, weights["model.norm.weight"], config.rms_norm_eps) @ head.T


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tiny_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), tied=request.param, seed=3)


# Each step lists (sequence, new token count); sequences have lengths 14, 11 and 23.
SCHEDULE = [
    [(0, 7), (1, 8)],  # two prefills from empty caches
    [(0, 4), (1, 1), (2, 13)],  # a chunk continuing a cache, a decode, a fresh prefill
    [(0, 1), (1, 1), (2, 8)],  # decodes of different lengths with a chunk
    [(0, 1), (1, 1), (2, 1)],  # decodes only
    [(2, 1), (0, 1)],  # decodes, sequences in another order
]


def test_paged_forward_matches_contiguous_computation(tiny_dir: pathlib.Path) -> None:
    loaded = load_model(str(tiny_dir), dtype="float32", quant="none", device="cpu")
    weights = load_file(str(tiny_dir / "model.safetensors"))
    rng = random.Random(0)
    sequences = [[rng.randrange(loaded.config.vocab_size) for _ in range(n)] for n in (14, 11, 23)]
    pages = list(range(1, 20))
    rng.shuffle(pages)
    page_tables = [pages[0:4], pages[4:7], pages[7:13]]
    kv = allocate_kv(loaded.config, num_pages=20, page_size=PAGE_SIZE, dtype=torch.float32)
    done = [0, 0, 0]
    for step in SCHEDULE:
        chunks = [Chunk(sequences[s][done[s] : done[s] + n], done[s], page_tables[s]) for s, n in step]
        logits = loaded.model(make_batch(chunks, PAGE_SIZE), kv)
        for row, (s, n) in enumerate(step):
            done[s] += n
            expected = contiguous_logits(weights, loaded.config, sequences[s][: done[s]])[-1]
            torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=1e-4)
    assert logits.dtype == torch.float32


def test_untouched_pages_stay_zero(tiny_dir: pathlib.Path) -> None:
    loaded = load_model(str(tiny_dir), dtype="float32", quant="none", device="cpu")
    kv = allocate_kv(loaded.config, num_pages=6, page_size=PAGE_SIZE, dtype=torch.float32)
    loaded.model(make_batch([Chunk([5, 6, 7, 8, 9], 0, [4, 2])], PAGE_SIZE), kv)
    assert kv.k[:, [0, 1, 3, 5]].abs().sum() == 0
    assert kv.k[:, 4].abs().sum() > 0 and kv.k[:, 2, 0].abs().sum() > 0 and kv.k[:, 2, 1:].abs().sum() == 0
