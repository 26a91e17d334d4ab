"""bench/engine/kl_text.py: llama-perplexity's chunking, the KL statistics, its summary's parsing, the table."""

from __future__ import annotations

import math

import pytest
import torch

from bench.engine import kl_text
from worker.model.loader import load_model
from worker.native import build

# The summary lines of `llama-perplexity --kl-divergence`, in its printf formats (tools/perplexity/perplexity.cpp).
LLAMA_OUTPUT = """
kl_divergence: computing over 6 chunks, n_ctx=512, batch_size=512, n_seq=1
====== Perplexity statistics ======
Mean PPL(Q)                   :  13.912345 ±   0.412345
Mean PPL(base)                :  13.501234 ±   0.401234
Cor(ln(PPL(Q)), ln(PPL(base))):  99.12%
Mean PPL(Q)/PPL(base)         :   1.030450 ±   0.002345

====== KL divergence statistics ======
Mean    KLD:   0.031234 ±   0.000812
Maximum KLD:   1.234500
99.9%   KLD:   0.987600

====== Token probability statistics ======
Same top p: 93.456 ± 0.611 %
"""


def test_chunks_are_llama_perplexity_s():
    tokens = list(range(100, 1300))
    windows = kl_text.chunks(tokens, 512, bos=None)
    assert [w[0] for w in windows] == [100, 612] and all(len(w) == 512 for w in windows)  # the tail is dropped
    with_bos = kl_text.chunks(tokens, 512, bos=1)
    assert [w[:2] for w in with_bos] == [[1, 101], [1, 613]]
    rows = kl_text.scored_rows(512)
    assert (rows.start, rows.stop, len(rows)) == (256, 511, 255)  # n_ctx - 1 - n_ctx/2 positions, as llama.cpp


def test_kl_stats_of_a_model_against_itself_and_a_known_pair():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    same = kl_text.KLStats()
    targets = torch.tensor([0, 1, 2, 3, 4])
    same.add(logits, logits, targets)
    summary = same.summary()
    assert summary["mean_kl"] == pytest.approx(0.0, abs=1e-12) and summary["same_top"] == 1.0
    expected_ppl = math.exp(-float(logits.double().log_softmax(-1)[torch.arange(5), targets].mean()))
    assert summary["base_ppl"] == pytest.approx(expected_ppl)

    p = torch.tensor([[math.log(0.5), math.log(0.5)]])  # KL([.5,.5] || [.9,.1]) = .5 ln(.5/.9) + .5 ln(.5/.1)
    q = torch.tensor([[math.log(0.9), math.log(0.1)]])
    pair = kl_text.KLStats()
    pair.add(p, q, torch.tensor([0]))
    assert pair.summary()["mean_kl"] == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(5.0))
    assert pair.summary()["clear_positions"] == 0  # a tie in the base: no clear margin


def test_parse_llama_kl_reads_the_summary():
    figures = kl_text.parse_llama_kl(LLAMA_OUTPUT)
    assert figures == {
        "mean_kl": 0.031234, "mean_kl_stderr": 0.000812, "max_kl": 1.2345, "same_top": pytest.approx(0.93456),
        "ppl": 13.912345, "base_ppl": 13.501234,
    }  # fmt: skip


def test_the_table_puts_lmq_modes_beside_llama_cpp():
    stats = kl_text.KLStats()
    logits = torch.randn(4, 7, generator=torch.Generator().manual_seed(1))
    stats.add(logits, logits + 0.01 * torch.randn(4, 7, generator=torch.Generator().manual_seed(2)), torch.arange(4))
    lmq = {"tokens": 3126, "chunks": 6, "modes": {"auto/auto": stats.summary()}}
    table = kl_text.format_table("model.gguf", lmq, kl_text.parse_llama_kl(LLAMA_OUTPUT))
    lines = table.splitlines()
    assert lines[0] == "model.gguf: 3126 tokens, 6 chunks"
    assert lines[4].startswith("| lmq, default (--dtype auto --quant auto) | ")
    assert lines[5] == "| llama.cpp (llama-perplexity) | 0.0312 ± 0.0008 | 1.23 | 93.5% | — |"
    assert "llama.cpp's F32 file: 13.501" in table


@pytest.mark.slow
@pytest.mark.skipif(build.missing_requirements() is not None, reason="the int8 modes need the native step")
def test_the_int8_context_mode_scores_int16_rows_over_int8_keys_and_values():
    """Each scored position's own row on int16 x, every earlier one's K/V from int8 x: not the all-int16 figure
    (which scoring one row at a time over int16 keys would reproduce bit for bit), and close to it."""
    loaded = load_model(device="cpu")
    kl_text.force_int8_decodes(loaded, rows=kl_text.INT8_FROM_ROWS)
    chunk = loaded.tokenizer.encode(kl_text.TEXT.read_text(), add_special_tokens=False).ids[:64]
    int16 = kl_text.chunk_logits(loaded, chunk, 16)
    context = kl_text.chunk_logits(loaded, chunk, 16, "int8-context")
    assert context.shape == int16.shape == (len(kl_text.scored_rows(64)), loaded.config.vocab_size)
    assert not torch.equal(context, int16)
    log_p, log_q = int16.log_softmax(-1), context.log_softmax(-1)
    assert float((log_p.exp() * (log_p - log_q)).sum(-1).mean()) < 0.02
