"""bench/service/shapes.py: llama.cpp's better thread setting per level, the ceilings beside, the peers' settings."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.service import shapes


def level(streams: int, tok_s: float, ttft_s: float) -> dict:
    return {"concurrency": streams, "output_tok_s": tok_s, "ttft_median_s": ttft_s}


RUNS = {
    shapes.LMQ: {"levels": [level(1, 35.0, 0.294), level(16, 92.0, 0.802)]},
    shapes.PEER_DEFAULT: {"levels": [level(1, 39.1, 0.236), level(16, 60.0, 5.0)]},
    shapes.PEER_PASSIVE: {"levels": [level(1, 30.0, 0.300), level(16, 90.3, 3.314)]},
}
CEILINGS = {"one_stream_tok_s": 40.0, "compute_tok_s_vpdpwssd": 95.0, "compute_tok_s_vpdpbusd": 190.0}


def test_each_level_takes_llama_cpp_s_better_setting():
    rows = shapes.level_rows("llama", RUNS, CEILINGS)
    assert [(r["streams"], r["llama_tok_s"], r["llama_ttft_s"]) for r in rows] == [(1, 39.1, 0.236), (16, 90.3, 3.314)]
    assert rows[0]["ceiling_tok_s"] == 40.0 and rows[0]["compute_tok_s"] is None
    assert rows[1]["ceiling_tok_s"] is None and rows[1]["compute_tok_s"] == 95.0


def test_the_table_prints_the_ratio_and_the_ceiling_beside_each_figure():
    table = shapes.format_rows(shapes.level_rows("Llama-3.2-1B shape, Q4_0", RUNS, CEILINGS)).splitlines()
    assert table[2] == (
        "| Llama-3.2-1B shape, Q4_0 | 1 | 35.0 | 39.1 | 0.90× | 294 ms | 236 ms | bandwidth: lmq at 88% of 40.0 |"
    )
    assert table[3] == (
        "| Llama-3.2-1B shape, Q4_0 | 16 | 92.0 | 90.3 | 1.02× | 802 ms | 3,314 ms "
        "| compute: vpdpwssd 95 tok/s, vpdpbusd 190 |"
    )


def test_the_two_llama_server_settings():
    args = argparse.Namespace(peer_slots=16, threads=2)
    defaults = shapes.peer_command(Path("/bin/llama-server"), Path("m.gguf"), 9000, 50, None, args)
    passive = shapes.peer_command(Path("/bin/llama-server"), Path("m.gguf"), 9001, 0, shapes.PASSIVE_ENV, args)
    assert defaults[:5] == ["env", "-u", "OMP_WAIT_POLICY", "-u", "GOMP_SPINCOUNT"]  # OpenMP's own spinning
    assert passive[:3] == ["env", "OMP_WAIT_POLICY=PASSIVE", "GOMP_SPINCOUNT=3000"]
    assert defaults[defaults.index("--poll") + 1] == "50" and passive[passive.index("--poll") + 1] == "0"
    assert passive[passive.index("--binary") + 1] == "/bin/llama-server"


def test_the_section_names_the_machine_its_load_and_the_command_that_measured_it():
    from bench.harness.roofline import Ceilings

    ceilings = Ceilings(threads=2, read_bytes_s_1_thread=3e10, read_bytes_s_all_threads=3e10)
    args = argparse.Namespace(threads=2, max_tokens=64, requests=4, rounds=1)
    rows = shapes.level_rows("qwen3", RUNS, CEILINGS)
    section = shapes.render(rows, ceilings, ["--shapes", "qwen3-0.6b", "--levels", "1,16"], 7.5, args)
    assert "load average when the run began: 7.50" in section and "30 GB/s (1 thread)" in section
    assert shapes.format_rows(rows) in section
    assert "`.venv/bin/python bench/service/shapes.py --shapes qwen3-0.6b --levels 1,16`" in section
    assert str(shapes.ROOT) not in section  # the doc names no path of one machine
