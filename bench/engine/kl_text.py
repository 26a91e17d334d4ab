"""KL divergence the way the field measures it: a fixed text, teacher-forced, each mode against float32, beside llama.cpp.

    .venv/bin/python -m bench.engine.kl_text                                   # the default model, lmq only
    .venv/bin/python -m bench.engine.kl_text --llama-perplexity "$(dirname "$(bash bench/harness/build_llama_server.sh)")/llama-perplexity"
    .venv/bin/python -m bench.engine.kl_text --model path/to/model.Q4_K_M.gguf --json out.json

The text (bench/engine/kl_text.txt: public-domain English prose, about 3,100 tokens) is cut the way
`llama-perplexity` cuts it: tokenized whole (BOS first where the file's tokenizer adds one), chunks of
--ctx tokens with each chunk's first token set to BOS where it adds one, and in each chunk the positions
from ctx/2 on scored (ctx/2 - 1 of them), each predicting the next token of the text. At every scored
position: KL(p_float32 || p_mode) over the whole vocabulary and whether the two top tokens agree
("same top p" in llama.cpp's words), with float32 = lmq's `--dtype float32 --quant none`, the exact
dequantization of the file's blocks.

lmq feeds each chunk in steps of --step-rows tokens (fewer than the loader's dense-copy threshold), so
the default mode runs the native step's kernels as decodes and short prompts do, not the dense path of
long prefills. A mode with a third part, `auto/auto/int8`, is the default mode as batched decodes run it:
each chunk's unscored first half fed as a prompt (int16 x), then every scored position one decode step
on int8 x (worker/native/int8_linear.h; the tier forced on whatever the step's rows). `auto/auto/int8-context`
is the default mode as a long prompt runs (worker/runtime/native_step.py: every row but the sampled one on
int8 x): the whole chunk fed on int8 x, then each scored position, last first, one step on int16 x that
writes its own K/V over its int8 one, so each sees int8 keys and values for every earlier position.

Beside it, llama.cpp's own figure for the same file and text: the file dequantized to F32
(bench/harness/ggufs.py: write_f32_gguf) run by `llama-perplexity --kl-divergence-base`, then the file
itself with `--kl-divergence`. Both sides' float32 perplexities are printed: equal figures say the two
read the same tokens at the same positions.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from bench.engine.quality import fresh_pool, step_forward
from worker.batch import StepBatch
from worker.runtime.native_step import INT8_FROM_ROWS

TEXT = Path(__file__).with_name("kl_text.txt")
ROOT = Path(__file__).resolve().parents[2]
BASE_MODE = "float32/none"
# lmq's modes as `lmq serve` flags name them: the default (--dtype auto --quant auto) and --dtype float32
# (quant auto: int4 weights, float32 activations); any dtype/quant pair can be asked for.
MODES = ("auto/auto", "float32/auto")
MODE_LABELS = {
    "auto/auto": "default (--dtype auto --quant auto)",
    "float32/auto": "--dtype float32",
    "auto/auto/int8": "default, batched decodes (int8 x on vpdpbusd)",
    "auto/auto/int8-context": "default, long prompts (every earlier row int8 x, the sampled row int16)",
}
CLEAR_MARGIN = 0.5  # logits between float32's best and second-best token: a disagreement there is an error


def chunks(tokens: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: whole ctx-token windows of the text, first token BOS where the model adds one."""
    out = []
    for start in range(0, len(tokens) - ctx + 1, ctx):
        chunk = list(tokens[start : start + ctx])
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    return out


def scored_rows(ctx: int) -> range:
    """Positions of a chunk whose logits are scored: from ctx/2 to ctx-2, each predicting the next token."""
    return range(ctx // 2, ctx - 1)


def chunk_logits(loaded, chunk: list[int], step_rows: int, tier: str = "") -> torch.Tensor:
    """float32 logits [len(scored_rows), vocab] of one chunk, fed in steps of step_rows tokens into a fresh pool
    (tier "int8": the scored positions one decode a step; "int8-context": see int8_context_logits)."""
    if tier == "int8-context":
        return int8_context_logits(loaded, chunk, step_rows)
    ctx = len(chunk)
    pages, kv = fresh_pool(loaded, ctx)
    wanted = scored_rows(ctx)
    forward = step_forward(loaded)  # the worker's step backend: the native step where it serves the mode
    parts = []
    first = wanted.start if tier == "int8" else ctx
    starts = [*range(0, first, step_rows), *range(first, ctx)]
    for start, end in zip(starts, [*starts[1:], ctx]):
        rows = [row - start for row in wanted if start <= row < end]
        batch = StepBatch(
            input_ids=torch.tensor(chunk[start:end]),
            positions=torch.arange(start, end),
            slots=torch.arange(start, end),  # pages 0.. in order: slot = position
            query_lens=[end - start],
            context_lens=[end],
            page_tables=torch.arange(pages)[None, :],
            logits_indices=torch.tensor(rows or [end - start - 1], dtype=torch.int64),  # the engine always asks for one
            prompt_ends=None if start < first else [False],  # a decode's row: int8 x in the int8 tier
        )
        logits = forward(batch, kv)
        if rows:
            parts.append(logits.float())
    return torch.cat(parts)


def int8_context_logits(loaded, chunk: list[int], step_rows: int) -> torch.Tensor:
    """As chunk_logits, with every scored position seeing int8-x keys and values for all earlier positions and
    its own row on int16 x: the chunk fed in steps that sample nothing (int8 x from INT8_FROM_ROWS rows), then
    the scored positions one row each, last first (a row overwrites only its own K/V, which no earlier
    position reads)."""
    ctx = len(chunk)
    pages, kv = fresh_pool(loaded, ctx)
    forward = step_forward(loaded)

    def step(start: int, end: int, sample: bool) -> torch.Tensor:
        return forward(StepBatch(
            input_ids=torch.tensor(chunk[start:end]), positions=torch.arange(start, end), slots=torch.arange(start, end),
            query_lens=[end - start], context_lens=[end], page_tables=torch.arange(pages)[None, :],
            logits_indices=torch.tensor([end - start - 1] if sample else [], dtype=torch.int64),
            prompt_ends=[sample],
        ), kv)  # fmt: skip

    for start in range(0, ctx, step_rows):
        step(start, min(start + step_rows, ctx), sample=False)
    rows = {row: step(row, row + 1, sample=True)[0].float() for row in reversed(scored_rows(ctx))}
    return torch.stack([rows[row] for row in scored_rows(ctx)])


@dataclasses.dataclass
class KLStats:
    """Running KL(base || other) and top-1 agreement over scored positions, and the base's perplexity."""

    positions: int = 0
    kl_sum: float = 0.0
    kl_sq_sum: float = 0.0
    kl_max: float = 0.0
    same_top: int = 0
    clear_positions: int = 0
    clear_same_top: int = 0
    base_nll_sum: float = 0.0  # -log p_base(next token)

    def add(self, base: torch.Tensor, other: torch.Tensor, targets: torch.Tensor) -> None:
        log_p, log_q = base.double().log_softmax(-1), other.double().log_softmax(-1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1)
        top2 = base.topk(2, dim=-1)
        same = top2.indices[:, 0] == other.argmax(-1)
        clear = (top2.values[:, 0] - top2.values[:, 1]) >= CLEAR_MARGIN
        self.positions += len(kl)
        self.kl_sum += float(kl.sum())
        self.kl_sq_sum += float((kl * kl).sum())
        self.kl_max = max(self.kl_max, float(kl.max()))
        self.same_top += int(same.sum())
        self.clear_positions += int(clear.sum())
        self.clear_same_top += int(same[clear].sum())
        self.base_nll_sum -= float(log_p.gather(-1, targets[:, None]).sum())

    def summary(self) -> dict:
        n = max(self.positions, 1)
        mean = self.kl_sum / n
        spread = math.sqrt(max(self.kl_sq_sum / n - mean * mean, 0.0) / max(n - 1, 1))
        return {
            "positions": self.positions,
            "mean_kl": mean,
            "mean_kl_stderr": spread,
            "max_kl": self.kl_max,
            "same_top": self.same_top / n,
            "clear_positions": self.clear_positions,
            "clear_same_top": self.clear_same_top / max(self.clear_positions, 1),
            "base_ppl": math.exp(self.base_nll_sum / n),
        }


def lmq_kl(path: str | None, modes: list[str], ctx: int, step_rows: int, text: str) -> dict:
    """mode -> KLStats.summary() against float32/none over the text's chunks; plus the token count."""
    from worker.model.loader import load_model

    def load(mode: str):
        dtype, quant, *tier = mode.split("/")
        loaded = load_model(path, dtype=dtype, quant=quant, device="cpu")
        if tier == ["int8"]:
            force_int8_decodes(loaded)
        elif tier == ["int8-context"]:
            force_int8_decodes(loaded, rows=INT8_FROM_ROWS)  # the worker's tier: sampling-free steps of 5 rows or more
        elif tier:
            raise SystemExit(f"unknown tier {tier[0]!r} in mode {mode!r}")
        return loaded

    base = load(BASE_MODE)
    bos = base.bos_token_id if _adds_bos(base) else None
    tokens = base.tokenizer.encode(text, add_special_tokens=False).ids
    if bos is not None:
        tokens = [bos, *tokens]
    windows = chunks(tokens, ctx, bos)
    if not windows:
        raise SystemExit(f"the text has {len(tokens)} tokens: fewer than one chunk of {ctx}")
    others = {mode: load(mode) for mode in modes}
    stats = {mode: KLStats() for mode in modes}
    for index, chunk in enumerate(windows):
        targets = torch.tensor([chunk[row + 1] for row in scored_rows(ctx)])
        started = time.perf_counter()
        base_logits = chunk_logits(base, chunk, step_rows)
        seconds = {BASE_MODE: time.perf_counter() - started}
        for mode, loaded in others.items():
            started = time.perf_counter()
            tier = mode.split("/")[2] if mode.count("/") == 2 else ""
            stats[mode].add(base_logits, chunk_logits(loaded, chunk, step_rows, tier), targets)
            seconds[mode] = time.perf_counter() - started
        timing = ", ".join(f"{mode} {value:.1f} s" for mode, value in seconds.items())
        print(f"chunk {index + 1}/{len(windows)}: {timing}", file=sys.stderr, flush=True)
    return {"tokens": len(tokens), "chunks": len(windows), "modes": {m: s.summary() for m, s in stats.items()}}


def force_int8_decodes(loaded, rows: int = 1) -> None:
    """Steps of `loaded` of `rows` rows or more on int8 x where no sampled row is a prompt's (the worker's tier
    starts at INT8_FROM_ROWS; 1: every decode step); the native step must serve the mode."""
    from bench.engine.quality import step_backend
    from worker.runtime.cpu_native import CpuNativeBackend

    backend = step_backend(loaded)
    if not isinstance(backend, CpuNativeBackend):
        raise SystemExit(f"int8 decodes need the native step; this mode runs on {backend.name}")
    backend.native.struct.int8_from_rows = rows


def _adds_bos(loaded) -> bool:
    """Whether the file's tokenizer puts BOS first (tokenizer.ggml.add_bos_token; llama.cpp's rule)."""
    import gguf

    if loaded.bos_token_id is None or not loaded.path.is_file():
        return False
    field = gguf.GGUFReader(loaded.path).fields.get("tokenizer.ggml.add_bos_token")
    return bool(field.contents()) if field is not None else False


LLAMA_PATTERNS = {
    "mean_kl": r"Mean\s+KLD:\s+([-\d.e+]+)",
    "mean_kl_stderr": r"Mean\s+KLD:\s+[-\d.e+]+\s+±\s+([-\d.e+]+)",
    "max_kl": r"Maximum KLD:\s+([-\d.e+]+)",
    "same_top": r"Same top p:\s+([-\d.e+]+)",
    "ppl": r"Mean PPL\(Q\)\s*:\s+([-\d.e+]+)",
    "base_ppl": r"Mean PPL\(base\)\s*:\s+([-\d.e+]+)",
}


def parse_llama_kl(output: str) -> dict:
    """The figures of `llama-perplexity --kl-divergence`'s summary; "same_top" as a share (it prints percent)."""
    found = {}
    for key, pattern in LLAMA_PATTERNS.items():
        match = re.search(pattern, output)
        if match:
            found[key] = float(match.group(1))
    if "same_top" in found:
        found["same_top"] /= 100
    return found


def llama_kl(binary: Path, model: Path, ctx: int, threads: int, text_path: Path, work: Path) -> dict:
    """llama.cpp's KL of `model` to its F32 dequantization over the text, and the commands that measured it."""
    from bench.harness.ggufs import write_f32_gguf

    f32 = write_f32_gguf(model, work / (model.stem + ".F32.gguf"))
    base_file = work / (model.stem + ".kld")
    common = ["-f", str(text_path), "-c", str(ctx), "-b", str(ctx), "-t", str(threads)]
    base_command = [str(binary), "-m", str(f32), *common, "--kl-divergence-base", str(base_file)]
    kl_command = [str(binary), "-m", str(model), *common, "--kl-divergence-base", str(base_file), "--kl-divergence"]
    subprocess.run(base_command, check=True, capture_output=True)
    done = subprocess.run(kl_command, check=True, capture_output=True, text=True)
    figures = parse_llama_kl(done.stdout + done.stderr)
    chunk_count = re.search(r"over (\d+) chunks", done.stdout + done.stderr)
    figures["chunks"] = int(chunk_count.group(1)) if chunk_count else None
    figures["commands"] = [" ".join(base_command), " ".join(kl_command)]
    return figures


def format_table(model: str, lmq: dict, llama: dict | None) -> str:
    """The markdown table of one file: each lmq mode, then llama.cpp, against their float32 dequantizations."""
    lines = [
        f"{model}: {lmq['tokens']} tokens, {lmq['chunks']} chunks",
        "",
        "| server, mode | mean KL to float32 (nats) | max KL | same top token | same top, float32 margin ≥ 0.5 |",
        "|---|---:|---:|---:|---:|",
    ]
    for mode, figures in lmq["modes"].items():
        lines.append(
            f"| lmq, {MODE_LABELS.get(mode, mode)} | {figures['mean_kl']:.3g} ± {figures['mean_kl_stderr']:.1g} "
            f"| {figures['max_kl']:.3g} | {figures['same_top']:.1%} | {figures['clear_same_top']:.1%} "
            f"({figures['clear_positions']} positions) |"
        )
    if llama:
        stderr = f" ± {llama['mean_kl_stderr']:.1g}" if "mean_kl_stderr" in llama else ""
        lines.append(
            f"| llama.cpp (llama-perplexity) | {llama.get('mean_kl', float('nan')):.3g}{stderr} "
            f"| {llama.get('max_kl', float('nan')):.3g} | {llama.get('same_top', float('nan')):.1%} | — |"
        )
    base = next(iter(lmq["modes"].values()), {}).get("base_ppl")
    if base:
        theirs = f"; llama.cpp's F32 file: {llama['base_ppl']:.3f}" if llama and "base_ppl" in llama else ""
        lines += ["", f"Perplexity of the float32 base over the scored positions: lmq {base:.3f}{theirs}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", action="append", default=[], help="GGUF file (repeatable); default: the default model"
    )
    parser.add_argument("--gemma", choices=["auto", "yes", "no"], default="auto",
                        help="also the real Gemma 3 270M Q4_K_M: auto = when its package is installed")  # fmt: skip
    parser.add_argument("--modes", default=",".join(MODES), help="dtype/quant pairs, against float32/none")
    parser.add_argument("--ctx", type=int, default=512, help="tokens a chunk (llama-perplexity -c)")
    parser.add_argument("--step-rows", type=int, default=64, help="tokens lmq feeds a step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--text", type=Path, default=TEXT)
    parser.add_argument("--llama-perplexity", type=Path, default=None, help="the binary; without it lmq only")
    parser.add_argument("--work", type=Path, default=ROOT / ".bench/kl", help="F32 files and llama.cpp's base logits")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from bench.engine.quality import cpu_model
    from bench.harness.ggufs import gemma_file
    from worker.model.loader import default_model_path

    models = [Path(model) for model in args.model] or [default_model_path()]
    gemma = gemma_file(ROOT / ".bench/shapes", args.gemma)
    models += [gemma] if gemma is not None else []
    text = args.text.read_text()
    args.work.mkdir(parents=True, exist_ok=True)
    if not (args.work / ".gitignore").exists():
        (args.work / ".gitignore").write_text("*\n")
    files = []
    for model in models:
        lmq = lmq_kl(str(model), [m for m in args.modes.split(",") if m], args.ctx, args.step_rows, text)
        llama = None
        if args.llama_perplexity:
            llama = llama_kl(args.llama_perplexity, model, args.ctx, args.threads, args.text, args.work)
        files.append({"model": model.name, "lmq": lmq, "llama_cpp": llama})
        print(format_table(model.name, lmq, llama) + "\n", flush=True)
    report = {"date": datetime.date.today().isoformat(), "machine": f"{cpu_model()}, {os.cpu_count()} cores",
              "load_average": os.getloadavg()[0], "ctx": args.ctx, "step_rows": args.step_rows, "files": files}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print(f"{report['date']}, {report['machine']}, load average {report['load_average']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
