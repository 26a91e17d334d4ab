"""How close each weight mode stays to float32: KL divergence and top-1 agreement, teacher-forced.

    .venv/bin/python -m bench.engine.quality                          # the table of docs/weight-modes.md
    .venv/bin/python -m bench.engine.quality --modes bfloat16/int4    # some modes only
    .venv/bin/python -m bench.engine.quality --json                   # the figures as JSON
    .venv/bin/python -m bench.engine.quality --modes --broken         # deliberately broken modes only

The measure llama.cpp's `perplexity --kl-divergence` uses. Every mode reads the same token stream:
each reference prompt (shared/reference/smollm2-greedy.json) followed by the reference's greedy
continuation (which lmq's float32 reproduces), in one prefill chunk, with logits at every continuation position. At each position,
KL(p_float32 || p_mode) over the whole vocabulary, and whether the mode's top token is float32's.
Teacher forcing makes every position count once and alone: a free-running comparison ("greedy
tokens agree up to step N") is decided by the first near-tie, and everything after it compares
different texts.

Top-1 figures suppress EOS (id 2), as the reference's greedy decoding did; KL does not (it compares
the models' whole distributions). "Clear" positions are those where float32's own top-2 margin is
at least CLEAR_MARGIN logits: a mode that picks another token there is wrong, not unlucky.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from tests.support.paged_steps import allocate_kv
from worker.batch import PagedKV, StepBatch
from worker.model.loader import LoadedModel, load_model
from worker.runtime.backend import StepBackend
from worker.runtime.select import select_backend

REFERENCE_NAME = "smollm2-greedy.json"
REFERENCE_DIRS = [Path(__file__).resolve().parents[3] / "shared" / "reference", Path("/work/shared/reference")]
EOS_ID = 2  # the reference suppressed EOS (min_new_tokens) for all 32 steps
CLEAR_MARGIN = 0.5  # logits between float32's best and second-best token
# bfloat16/int4 runs on the native step where the CPU has AVX-512 VNNI (worker/runtime/native_step.py); /torch: torch's
MODES = ["bfloat16/none", "bfloat16/int4", "bfloat16/int4/torch", "bfloat16/int8", "float32/int4"]
PAGE_SIZE = 16


def find_reference() -> Path | None:
    """Where the reference JSON is: shared/reference beside the checkout (as CI lays it), else /work/shared."""
    return next((d / REFERENCE_NAME for d in REFERENCE_DIRS if (d / REFERENCE_NAME).exists()), None)


def fresh_pool(loaded: LoadedModel, tokens: int) -> tuple[int, PagedKV]:
    """A zeroed KV pool of the model's dtype and device for one chunk of `tokens` (slot = position): (its pages, the pool)."""
    pages = (tokens + PAGE_SIZE - 1) // PAGE_SIZE
    return pages, allocate_kv(loaded.config, pages, PAGE_SIZE, loaded.dtype, loaded.device)


def teacher_forced_logits(loaded: LoadedModel, prompt_ids: Sequence[int], continuation: Sequence[int]) -> torch.Tensor:
    """float32 logits [len(continuation), vocab]: row i predicts continuation[i] after prompt + continuation[:i].

    One forward over prompt + continuation[:-1] as a single prefill chunk, logits at its last
    len(continuation) positions, in a KV pool of the model's own dtype sized to fit.
    """
    tokens = list(prompt_ids) + list(continuation[:-1])
    pages, kv = fresh_pool(loaded, len(tokens))
    batch = StepBatch(
        input_ids=torch.tensor(tokens),
        positions=torch.arange(len(tokens)),
        slots=torch.arange(len(tokens)),  # pages 0.. in order: slot = position
        query_lens=[len(tokens)],
        context_lens=[len(tokens)],
        page_tables=torch.arange(pages)[None, :],
        logits_indices=torch.arange(len(prompt_ids) - 1, len(tokens)),
    )
    return step_forward(loaded)(batch, kv).float().cpu()


_BACKENDS: dict[int, tuple[torch.nn.Module, StepBackend]] = {}  # id(model) -> (the model, kept alive; its backend)


def step_backend(loaded: LoadedModel) -> StepBackend:
    """The step backend the worker would run `loaded`'s steps on (worker/runtime/select.py), the native step
    included where it serves the mode, built once per model."""
    key = id(loaded.model)
    if key not in _BACKENDS or _BACKENDS[key][0] is not loaded.model:
        _BACKENDS[key] = (loaded.model, select_backend(loaded, max_threads=torch.get_num_threads()))
    return _BACKENDS[key][1]


def step_forward(loaded: LoadedModel) -> Callable:
    """The forward of step_backend(loaded)."""
    return step_backend(loaded).forward


def chat_logits(loaded: LoadedModel, chats: Sequence[dict]) -> list[torch.Tensor]:
    """teacher_forced_logits of every reference chat case over its reference greedy ids."""
    return [teacher_forced_logits(loaded, case["prompt_ids"], case["greedy_ids"]) for case in chats]


def top2_margins(logits: torch.Tensor, suppress: Sequence[int] = (EOS_ID,)) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax ids, top-2 logit margins) per row, with `suppress`ed ids masked out."""
    masked = logits.clone()
    masked[:, list(suppress)] = float("-inf")
    top = masked.topk(2, dim=-1)
    return top.indices[:, 0], top.values[:, 0] - top.values[:, 1]


@dataclasses.dataclass
class Quality:
    """One mode against float32, over every continuation position of every prompt."""

    positions: int
    mean_kl: float  # nats
    max_kl: float
    top1: float  # share of positions whose top token is float32's
    clear_positions: int  # positions where float32's top-2 margin is at least CLEAR_MARGIN
    clear_top1: float  # top-1 agreement at those

    def row(self, mode: str) -> str:
        agree, clear_agree = round(self.top1 * self.positions), round(self.clear_top1 * self.clear_positions)
        return (f"| {mode} | {self.mean_kl:.3g} | {self.max_kl:.3g} | {self.top1:.1%} ({agree}/{self.positions}) "
                f"| {self.clear_top1:.1%} ({clear_agree}/{self.clear_positions}) |")  # fmt: skip


TABLE_HEADER = (
    "| mode (dtype/quant) | mean KL (nats) | max KL | top-1 agreement, all | top-1 agreement, margin ≥ 0.5 |\n"
    "|---|---:|---:|---:|---:|"
)


def compare(base: Sequence[torch.Tensor], other: Sequence[torch.Tensor], clear_margin: float = CLEAR_MARGIN) -> Quality:
    """KL(base || other) and top-1 agreement, over all rows of all prompts together."""
    kls, agree, clear = [], [], []
    for p_logits, q_logits in zip(base, other, strict=True):
        log_p, log_q = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
        kls.append((log_p.exp() * (log_p - log_q)).sum(-1))
        base_ids, margins = top2_margins(p_logits)
        other_ids, _ = top2_margins(q_logits)
        agree.append(base_ids == other_ids)
        clear.append(margins >= clear_margin)
    kl, agree_all, clear_all = torch.cat(kls), torch.cat(agree), torch.cat(clear)
    return Quality(
        positions=len(kl),
        mean_kl=float(kl.mean()),
        max_kl=float(kl.max()),
        top1=float(agree_all.double().mean()),
        clear_positions=int(clear_all.sum()),
        clear_top1=float(agree_all[clear_all].double().mean()),
    )


def cpu_model() -> str:
    """lscpu's "Model name", else /proc/cpuinfo's "model name", else platform.processor()."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        name = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "")
        if name:
            return name
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def load_mode(mode: str) -> LoadedModel:
    """ "dtype/quant", or "dtype/quant/STEPS" with a --cpu-steps value (torch, invariant) where the native step would run."""
    dtype, quant, *steps = mode.split("/")
    return load_model(dtype=dtype, quant=quant, device="cpu", cpu_steps=steps[0] if steps else "native")


def _linears(loaded: LoadedModel, layer: int | None = None) -> list[torch.nn.Module]:
    layers = loaded.model.layers if layer is None else [loaded.model.layers[layer]]
    return [linear for block in layers for linear in (block.qkv, block.o_proj, block.gate_up, block.down)]


def _zero_down(loaded: LoadedModel) -> None:
    loaded.model.layers[15].down.scale_and_zero.zero_()  # int4: every weight of the block reads as 0


def _zero_point_one_step_low(loaded: LoadedModel) -> None:
    for linear in _linears(loaded, 15):  # value = (q - 8) * a + (b + 7a): the off-by-one a Q4_1 reader can make
        linear.scale_and_zero[..., 1] -= linear.scale_and_zero[..., 0]


def _noise(loaded: LoadedModel, relative: float = 0.02) -> None:
    generator = torch.Generator().manual_seed(0)
    for linear in _linears(loaded):
        weight = linear.weight.data.float()
        noise = torch.randn(weight.shape, generator=generator) * weight.std() * relative
        linear.weight.data = (weight + noise).to(linear.weight.dtype)


def _shuffle_rows(loaded: LoadedModel) -> None:
    o_proj = loaded.model.layers[15].o_proj
    o_proj.weight.data = o_proj.weight.data[
        torch.randperm(o_proj.weight.shape[0], generator=torch.Generator().manual_seed(0))
    ]


# Deliberately broken modes (--broken): how far outside tests/worker/model/test_reference.py's limits real bugs land.
BROKEN = {
    "bfloat16/int4, layer 15 of 30: down_proj zeroed": ("bfloat16/int4/torch", _zero_down),
    "bfloat16/int4, layer 15: int4 zero point one step low": ("bfloat16/int4/torch", _zero_point_one_step_low),
    "bfloat16/none, layer 15: o_proj rows shuffled": ("bfloat16/none", _shuffle_rows),
    "bfloat16/none, Gaussian noise of 2% of each weight's std, every layer": ("bfloat16/none", _noise),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--modes", nargs="*", default=MODES, help="dtype/quant[/torch or /invariant] to compare with float32/none"
    )
    parser.add_argument(
        "--reference",
        type=Path,
        default=None,
        help=f"the reference JSON (default: {REFERENCE_NAME} in shared/reference)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--broken",
        action="store_true",
        help="also measure deliberately broken modes (a sanity check of the test's limits)",
    )
    args = parser.parse_args(argv)
    path = args.reference or find_reference()
    if path is None:
        print(f"{REFERENCE_NAME} not found in {[str(d) for d in REFERENCE_DIRS]}; pass --reference", file=sys.stderr)
        return 2
    chats = json.loads(path.read_text())["chat"]
    base = chat_logits(load_mode("float32/none"), chats)
    figures: dict[str, dict] = {}
    runs = [(mode, mode, None) for mode in args.modes]
    runs += [(name, mode, breaking) for name, (mode, breaking) in BROKEN.items()] if args.broken else []
    for name, mode, breaking in runs:
        started = time.perf_counter()
        loaded = load_mode(mode)
        if breaking is not None:
            breaking(loaded)
        quality = compare(base, chat_logits(loaded, chats))
        figures[name] = dataclasses.asdict(quality) | {"seconds": round(time.perf_counter() - started, 1)}
        print(f"{name}: {figures[name]}", file=sys.stderr)
    machine = f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}"
    if args.json:
        print(json.dumps({"date": datetime.date.today().isoformat(), "machine": machine, "modes": figures}, indent=2))
        return 0
    positions = next(iter(figures.values()))["positions"] if figures else 0
    print(f"Weight modes against float32/none, teacher-forced over {len(chats)} prompts × their greedy ids "
          f"({positions} positions); {datetime.date.today().isoformat()}, {machine}\n")  # fmt: skip
    print(TABLE_HEADER)
    for mode, values in figures.items():
        print(Quality(**{k: v for k, v in values.items() if k != "seconds"}).row(mode))
    return 0


if __name__ == "__main__":
    sys.exit(main())
