"""A long prompt's chunk on int8 activations, all but the row that gives the answer's first token.

Why: a unique 1,000-token prompt's time to first token is mostly its linears, and on a CPU without AMX
tiles int8 x on vpdpbusd runs them in about 0.7x int16's time (worker/native/int8_linear.h; docs/
benchmarks.md, "Long prompts on int8 activations"). A chunk that samples nothing (a long prompt's
earlier chunks) takes int8 x by the native step's own rule; a prompt's last chunk samples the answer's
first token from its last row, which int8 x never computes. So the native step runs such a step as two
(worker/runtime/native_step.py): every other row first, on int8 x wherever its rows reach the tier, then
the prompts' last rows alone on int16 x, attending to the keys and values the first part wrote: the same
rows in causal order, an extra pass over the weights for one row each.

Quality: every earlier row's K/V from int8 x, the sampled row on int16, measured teacher-forced
(bench/engine/kl_text.py, mode `auto/auto/int8-context`; docs/models.md): KL to float32 about twice the
all-int16 figure, under llama.cpp's own for the same file. A prompt whose chunk is shorter than
LONG_PROMPT_ROWS keeps every row on int16: near-tied short answers flip on int8 context (the default
model's "What is the capital of France?", docs/dev/measurements.md), and its step is short anyway.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from worker.batch import StepBatch

# A prompt's last chunk of at least this many rows runs all but its sampled row on int8 x.
LONG_PROMPT_ROWS = 128


@dataclass(frozen=True)
class PromptSplit:
    earlier: StepBatch  # every row but the prompts' sampled ones (a short prompt's whole chunk included)
    last: StepBatch  # each long prompt's sampled row, and short prompts' chunks whole
    from_last: torch.Tensor  # bool [the step's logit rows]: which come from `last`, in order


def split_long_prompts(batch: StepBatch) -> PromptSplit | None:
    """The step as two, or None where no long prompt ends in it (or the batch does not say which do)."""
    ends = batch.prompt_ends
    if ends is None or not any(end and rows >= LONG_PROMPT_ROWS for end, rows in zip(ends, batch.query_lens)):
        return None
    logit_rows = set(batch.logits_indices.tolist())
    samples = [row - 1 in logit_rows for row in itertools.accumulate(batch.query_lens)]  # a sequence's last row
    earlier: list[tuple[int, int, bool]] = []  # (sequence, its rows in this part, samples)
    last: list[tuple[int, int, bool]] = []
    for seq, (rows, end) in enumerate(zip(batch.query_lens, ends)):
        if not end:
            earlier.append((seq, rows, samples[seq]))
        elif rows >= LONG_PROMPT_ROWS:
            earlier.append((seq, rows - 1, False))
            last.append((seq, 1, True))
        else:
            last.append((seq, rows, True))
    from_last = torch.tensor([end for end, sampled in zip(ends, samples) if sampled], dtype=torch.bool)
    return PromptSplit(_part(batch, earlier, at_end=False), _part(batch, last, at_end=True), from_last)


def merge_logits(split: PromptSplit, earlier: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The two parts' logits in the step's own order of logit rows (`last` has one at least: a long prompt's)."""
    out = torch.empty(len(split.from_last), last.shape[1], dtype=last.dtype)
    out[split.from_last] = last
    out[~split.from_last] = earlier
    return out


def _part(batch: StepBatch, parts: list[tuple[int, int, bool]], at_end: bool) -> StepBatch:
    """The rows of each (sequence, rows, samples): its first `rows` (at_end False) or its last."""
    starts = [0, *itertools.accumulate(batch.query_lens)]
    indices, logits, query_lens, context_lens = [], [], [], []
    for seq, rows, samples in parts:
        first = starts[seq + 1] - rows if at_end else starts[seq]
        indices += range(first, first + rows)
        if samples:
            logits.append(len(indices) - 1)
        query_lens.append(rows)
        context_lens.append(batch.context_lens[seq] - (0 if at_end else batch.query_lens[seq] - rows))
    index = torch.tensor(indices, dtype=torch.int64)
    return replace(
        batch,
        input_ids=batch.input_ids[index],
        positions=batch.positions[index],
        slots=batch.slots[index],
        query_lens=query_lens,
        context_lens=context_lens,
        page_tables=batch.page_tables[torch.tensor([seq for seq, _, _ in parts], dtype=torch.int64)],
        logits_indices=torch.tensor(logits, dtype=torch.int64),
        prompt_ends=[at_end] * len(parts),
    )
