"""Where one decode step's milliseconds go, per group of operations, on this CPU.

    .venv/bin/python -m bench.step_profile                          # bf16/int4 and bf16/int8, batch 1 and 16
    .venv/bin/python -m bench.step_profile --modes auto/auto --batches 16 --context 1100 --shared 1008
    .venv/bin/python -m bench.step_profile --threads 1 --clock thread  # one core's CPU time: blind to other load

A decode step of `batch` sequences with `context` tokens each in the paged KV pool, outside the
engine (no Redis, no event loop): the step's input built the engine's way (`build_step_batch`),
the model forward, greedy sampling. Two timings, alternated round by round so that the host's
drift hits both alike:

- **plain**: the step as it runs in the worker;
- **by group**: the same forward with a timer around every group of operations (embedding, norms,
  the linear layers, rope, the attention's plan, K/V write, gather and SDPA, lm_head). Each timer
  costs about a microsecond, so this forward is slower than the plain one by a few percent; its
  remainder ("glue") is what no group covers: splits, views, residual adds, the activation, and the
  Python between them.

CPU kernels are synchronous, so a wall-clock timer around a call is the call's cost. Other processes
on the cores stall some steps by whole scheduler slices, so each figure comes from the fastest half of
its steps; with `--threads 1 --clock thread` the timers read the torch thread's own CPU time instead.
The attention of git c54c0ae (token-by-token gathers) is timed too, so that the script can profile a
checkout from before page gathers (docs/benchmarks.md shows how).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the worker runs (worker/config.py); before torch loads

import argparse
import contextlib
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

from protocol import SamplingParams
from worker import compute_thread
from worker.batch import StepBatch
from worker.kv_cache import KVCache
from worker.model import llama, paged_attention
from worker.model.loader import LoadedModel, load_model
from worker.runtime.backend import build_step_batch
from worker.sampler import SamplingState, sample
from worker.scheduler import Scheduled, Sequence

clock = time.perf_counter  # --clock thread: this thread's CPU time, blind to other processes taking the cores

GROUPS = [
    "step input", "embedding", "norms", "rope cos/sin", "qkv", "rope", "attention plan", "K/V write",
    "K/V gather", "SDPA", "o_proj", "gate_up", "down", "lm_head", "glue", "sampling",
]  # fmt: skip


class GroupTimer:
    """Accumulates seconds per group; `wrap` puts a timer around a callable."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, group: str, function: Callable) -> Callable:
        seconds = self.seconds

        def timed(*args, **kwargs):
            start = clock()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[group] += clock() - start

        return timed


class _TimedFunctional:
    """torch.nn.functional as seen by one module, with some functions timed."""

    def __init__(self, timed: dict[str, Callable]) -> None:
        self._timed = timed

    def __getattr__(self, name: str):
        return self._timed.get(name) or getattr(torch.nn.functional, name)


@contextlib.contextmanager
def instrumented(model: torch.nn.Module, timer: GroupTimer) -> Iterator[GroupTimer]:
    """Timers around each group of the Llama forward (worker/model/llama.py, paged_attention.py); undone on exit."""
    F = torch.nn.functional
    patches = {
        (llama, "F"): _TimedFunctional({"embedding": timer.wrap("embedding", F.embedding)}),
        (paged_attention, "F"): _TimedFunctional(
            {"scaled_dot_product_attention": timer.wrap("SDPA", F.scaled_dot_product_attention)}
        ),
        (llama, "plan_attention"): timer.wrap("attention plan", llama.plan_attention),
        (llama, "apply_rotary"): timer.wrap("rope", llama.apply_rotary),
    }
    if hasattr(paged_attention, "gather_pages"):
        patches |= {
            (paged_attention, "write_kv"): timer.wrap("K/V write", paged_attention.write_kv),
            (paged_attention, "gather_pages"): timer.wrap("K/V gather", paged_attention.gather_pages),
            (paged_attention, "_flash"): timer.wrap("SDPA", paged_attention._flash),
            (paged_attention, "merge_attention"): timer.wrap("SDPA", paged_attention.merge_attention),
        }
    else:  # the attention before page gathers (git c54c0ae): the parts come out of split_old_attention
        patches |= {
            (llama, "paged_attention"): timer.wrap("attention", llama.paged_attention),
            (paged_attention, "_attend_decodes"): timer.wrap("attend", paged_attention._attend_decodes),
        }
    saved = {key: getattr(*key) for key in patches}
    for (module, name), value in patches.items():
        setattr(module, name, value)
    instance_forwards = []
    for name, module in model.named_modules():
        group = _group_of(name, module)
        if group:
            instance_forwards.append(module)
            module.forward = timer.wrap(group, module.forward)
    rotary = getattr(model, "rotary", None)
    if rotary is not None:
        rotary.cos_sin = timer.wrap("rope cos/sin", rotary.cos_sin)
    try:
        yield timer
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)
        for module in instance_forwards:
            del module.forward
        if rotary is not None:
            del rotary.cos_sin


def _group_of(name: str, module: torch.nn.Module) -> str | None:
    last = name.rsplit(".", 1)[-1]
    if isinstance(module, llama.RMSNorm):
        return "norms"
    return {"qkv": "qkv", "o_proj": "o_proj", "gate_up": "gate_up", "down": "down", "lm_head": "lm_head"}.get(last)


def split_old_attention(seconds: dict[str, float]) -> dict[str, float]:
    """Before page gathers: attention = K/V write + attend, attend = gather + SDPA."""
    if "attention" not in seconds:
        return seconds
    out = dict(seconds)
    attention, attend = out.pop("attention"), out.pop("attend", 0.0)
    out["K/V write"] = attention - attend
    out["K/V gather"] = attend - out.get("SDPA", 0.0)
    return out


class DecodeStep:
    """`batch` sequences of `context` tokens in a KV pool, each about to decode its next token."""

    def __init__(self, loaded: LoadedModel, batch: int, context: int, shared: int = 0, page_size: int = 16) -> None:
        """shared: leading tokens every sequence holds in the same pages (a cached system prompt); whole pages."""
        config = loaded.config
        pages_per_seq = -(-(context + 1) // page_size)
        shared_pages = shared // page_size
        self.kv = KVCache(
            num_pages=batch * pages_per_seq + 1, page_size=page_size, num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=loaded.dtype, device=loaded.device,
        )  # fmt: skip
        generator = torch.Generator().manual_seed(0)
        for pool in (self.kv.kv.k, self.kv.kv.v):
            pool.copy_(torch.randn(pool.shape, generator=generator).to(pool.dtype))
        self.page_table = torch.zeros((batch, pages_per_seq), dtype=torch.int64)
        self.scheduled = []
        common = self.kv.allocate(shared_pages)
        for row in range(batch):
            seq = Sequence(
                id=f"s{row}",
                token_ids=[(7 * row + i) % 1000 + 1 for i in range(context + 1)],
                num_prompt_tokens=context,
            )
            seq.pages = common + self.kv.allocate(pages_per_seq - shared_pages)
            seq.num_computed, seq.row = context, row
            self.page_table[row] = torch.tensor(seq.pages)
            self.scheduled.append(Scheduled(seq, 1, True))
        self.loaded = loaded
        greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        self.states = [
            SamplingState(greedy, prompt_ids=[1], generated_ids=[], vocab_size=config.vocab_size, device=loaded.device)
            for _ in range(batch)
        ]

    def batch(self) -> StepBatch:
        return build_step_batch(self.scheduled, self.kv.page_size, self.loaded.device)

    def forward(self, batch: StepBatch) -> torch.Tensor:
        with torch.inference_mode():
            return self.loaded.model(batch, self.kv.kv)

    def run(self) -> float:
        """One whole step (input, forward, sampling); its seconds."""
        start = clock()
        logits = self.forward(self.batch())
        sample(logits, self.states)
        return clock() - start

    def run_grouped(self, timer: GroupTimer) -> float:
        start = clock()
        batch = timer.wrap("step input", self.batch)()
        logits = self.forward(batch)
        timer.wrap("sampling", sample)(logits, self.states)
        return clock() - start


def profile(step: DecodeStep, steps: int, rounds: int) -> tuple[float, float, dict[str, float]]:
    """(plain step ms, grouped step ms, ms per group), alternating plain and grouped rounds.

    Other processes on the cores stall some steps by whole scheduler slices, so each figure is taken
    over the fastest half of its steps: the plain step is their median, the groups their mean.
    """
    for _ in range(3):
        step.run()
    plain: list[float] = []
    grouped: list[tuple[float, dict[str, float]]] = []
    for _ in range(rounds):
        plain += [step.run() for _ in range(steps)]
        with instrumented(step.loaded.model, GroupTimer()) as timer:
            for _ in range(steps):
                timer.seconds.clear()
                total = step.run_grouped(timer)
                grouped.append((total, split_old_attention(timer.seconds)))
    fastest = sorted(grouped, key=lambda item: item[0])[: max(1, len(grouped) // 2)]
    groups = {name: 1000 * statistics.fmean(g.get(name, 0.0) for _, g in fastest) for name in fastest[0][1]}
    grouped_ms = 1000 * statistics.fmean(total for total, _ in fastest)
    groups["glue"] = grouped_ms - sum(groups.values())
    plain_ms = 1000 * statistics.median(sorted(plain)[: max(1, len(plain) // 2)])
    return plain_ms, grouped_ms, groups


def table(rows: dict[str, tuple[float, float, dict[str, float]]]) -> str:
    labels = list(rows)
    lines = ["| group | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    lines.append("| **step, plain (median)** | " + " | ".join(f"**{rows[k][0]:.2f}**" for k in labels) + " |")
    lines.append("| step, with timers (mean) | " + " | ".join(f"{rows[k][1]:.2f}" for k in labels) + " |")
    for group in GROUPS:
        cells = []
        for label in labels:
            value = rows[label][2].get(group)
            cells.append("–" if value is None or (abs(value) < 0.005 and group != "glue") else f"{value:.2f}")
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--modes", nargs="+", default=["bfloat16/int4", "bfloat16/int8"], help="dtype/quant pairs")
    parser.add_argument("--batches", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--context", type=int, default=64, help="tokens already in each sequence's cache")
    parser.add_argument("--shared", type=int, default=0, help="of which leading tokens in pages every sequence shares")
    parser.add_argument("--steps", type=int, default=20, help="steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--label", default="", help="prefix of the columns' names (e.g. before / after)")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="thread: the torch thread's CPU time (with --threads 1 only): what the step costs on a quiet machine")  # fmt: skip
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    global clock
    if args.clock == "thread":
        if args.threads != 1:
            raise SystemExit("--clock thread measures one thread: pass --threads 1")
        clock = time.thread_time
    torch.set_num_threads(args.threads)  # the torch thread (worker/compute_thread.py) takes this count
    rows = {}
    for mode in args.modes:
        dtype, quant = mode.split("/")
        loaded = compute_thread.run(load_model, args.model, dtype=dtype, quant=quant, device="cpu")
        for batch in (int(b) for b in args.batches.split(",")):
            step = compute_thread.run(DecodeStep, loaded, batch, args.context, args.shared)
            label = f"{args.label + ' ' if args.label else ''}{mode}, batch {batch}"
            rows[label] = compute_thread.run(profile, step, args.steps, args.rounds)
            print(f"{label}: {rows[label][0]:.2f} ms", flush=True)
    print(
        f"\n{args.clock} ms per decode step, context {args.context} (shared {args.shared}), {args.threads} threads ({' '.join(sys.argv[1:])})\n"
    )
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
