"""Servers measured level by level in turn, with all of them up: lmq, peer, lmq, peer, best round of each.

On 2 shared cores the host's speed drifts by up to 30% within minutes, so measuring all of one
server and then all of the other compares two different machines. Here every level runs once per
server per round, servers in a fixed order within a round, and each server keeps its best round
(highest aggregate tokens/s) of each level: the drift hits every server alike, and a round stalled
by other work on the cores does not decide the figure.

Each run is one `bench/service/serve.py` call (its JSON kept under bench/results/), at one level, with its own
block of questions: every server sees the same questions in a round and never a question twice, so no
run starts with its prompts in a prefix cache (the shared system prompt of the prefix workload is the
only thing meant to be cached).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness import processes


@dataclass
class Workload:
    """One kind of run: its name (for file names), serve.py arguments, levels and requests per level."""

    slug: str
    extra: list[str]
    levels: list[int]
    requests: Callable[[int], int]  # requests of a level, from its concurrency
    warmup: int = 2


@dataclass
class Alternation:
    servers: dict[str, str]  # label -> base URL, in the order each round visits them
    max_tokens: int
    results: Path
    rounds: int = 2
    commands: list[str] = field(default_factory=list)
    shown: Callable[[list[str]], str] = " ".join
    next_question: int = 0

    def measure(self, workload: Workload, only: list[str] | None = None) -> dict[str, dict]:
        """label -> a serve.py-shaped report ({"levels": [...]}) holding each level's best round."""
        labels = [label for label in self.servers if only is None or label in only]
        best: dict[str, dict[int, dict]] = {label: {} for label in labels}
        for level in workload.levels:
            for round_index in range(self.rounds):
                first_question = self._questions(workload.warmup + workload.requests(level))
                for label in labels:
                    report = self._run(label, workload, level, round_index, first_question)
                    found = report["levels"][0]
                    found["round"] = round_index + 1
                    kept = best[label].get(level)
                    if kept is None or found["output_tok_s"] > kept["output_tok_s"]:
                        best[label][level] = found
        return {
            label: {"label": label, "levels": [best[label][level] for level in workload.levels]} for label in labels
        }

    def _questions(self, count: int) -> int:
        first = self.next_question
        self.next_question += count
        return first

    def _run(self, label: str, workload: Workload, level: int, round_index: int, first_question: int) -> dict:
        slug = _slug(label)
        out = self.results / f"{workload.slug}-{slug}-c{level}-r{round_index + 1}.json"
        command = processes.python_command(
            "bench/service/serve.py", "--url", self.servers[label], "--label", label, "--max-tokens", str(self.max_tokens),
            "--ignore-eos", "--concurrency", str(level), "--requests", str(workload.requests(level)),
            "--warmup", str(workload.warmup), "--prompt-offset", str(first_question), *workload.extra, "--json", str(out),
        )  # fmt: skip
        self.commands.append(self.shown(command))
        print(f"\n$ {self.commands[-1]}", flush=True)
        subprocess.run(command, cwd=processes.ROOT, check=True)
        return json.loads(out.read_text())


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in label.lower()).strip("-").replace("--", "-")
