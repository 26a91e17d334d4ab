"""bench/harness/roofline.py: the ceilings' arithmetic, and the microbenchmark's measurements (slow: it compiles)."""

from __future__ import annotations

import shutil

import pytest

from bench.harness import roofline
from bench.harness.roofline import Tensor

TIED = [
    Tensor("token_embd.weight", (1000, 64), 1000 * 64 // 2),  # 4-bit: half a byte a weight
    Tensor("blk.0.attn_norm.weight", (64,), 64 * 4),
    Tensor("blk.0.attn_q.weight", (64, 64), 64 * 64 // 2),
    Tensor("blk.0.ffn_down.weight", (64, 256), 64 * 256 // 2),
]
UNTIED = [*TIED, Tensor("output.weight", (1000, 64), 1000 * 64)]  # an 8-bit head


def test_a_tied_embedding_is_read_whole_by_the_head():
    assert roofline.weight_bytes_per_token(TIED) == 32_000 + 256 + 2048 + 8192
    assert roofline.macs_per_token(TIED) == 64_000 + 4096 + 16384


def test_an_untied_embedding_reads_one_row():
    assert roofline.weight_bytes_per_token(UNTIED) == 32 + 256 + 2048 + 8192 + 64_000
    assert roofline.macs_per_token(UNTIED) == 4096 + 16384 + 64_000


def test_a_token_reads_the_experts_its_router_picks():
    moe = [
        *TIED,
        Tensor("blk.0.ffn_gate_inp.weight", (8, 64), 8 * 64 * 4),  # the router, read whole (F32)
        Tensor("blk.0.ffn_up_exps.weight", (8, 32, 64), 8 * 32 * 64 // 2, read=2 / 8),  # 2 of 8 experts a token
    ]
    assert roofline.weight_bytes_per_token(moe) == roofline.weight_bytes_per_token(TIED) + 2048 + 2048
    assert roofline.macs_per_token(moe) == roofline.macs_per_token(TIED) + 512 + 4096


def test_tokens_per_second_ceilings():
    assert roofline.bandwidth_tok_s(500_000_000, 30e9) == pytest.approx(60.0)
    # 2.1 G multiply-adds a token at 400 G ops/s: 4.2 G ops a token, ~95 tokens/s
    assert roofline.compute_tok_s(2_100_000_000, 400e9) == pytest.approx(95.238, rel=1e-4)
    assert roofline.share(35.0, 40.0) == "88% of 40.0"
    assert roofline.share(35.0, None) == "—"


def test_ceilings_read_the_binary_json_and_name_absent_instructions():
    ceilings = roofline.Ceilings.from_json({
        "threads": 2, "read_bytes_s_1_thread": 3e10, "read_bytes_s_all_threads": 4e10,
        "vpdpwssd_ops_s_all_threads": 2e11, "vpdpbusd_ops_s_all_threads": 4e11, "amx_tdpbusd_ops_s_all_threads": None,
        "sink": 0,
    })  # fmt: skip
    text = ceilings.describe()
    assert "30 GB/s (1 thread)" in text and "40 GB/s (2 threads)" in text
    assert "vpdpwssd 200 Gop/s" in text and "AMX absent" in text


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_the_microbenchmark_measures_positive_rates():
    ceilings = roofline.measure(threads=1, mib=64)
    assert ceilings.threads == 1
    assert ceilings.read_bytes_s_1_thread > 1e8 and ceilings.read_bytes_s_all_threads > 1e8
    flags = open("/proc/cpuinfo").read()
    if "avx512_vnni" in flags:
        assert ceilings.vpdpbusd_ops_s_1_thread > 1e9 and ceilings.vpdpwssd_ops_s_1_thread > 1e9
    else:
        assert ceilings.vpdpbusd_ops_s_1_thread is None
