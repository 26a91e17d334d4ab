"""worker/runtime/long_prompts.py: a step with a long prompt's end, split so that only sampled prompt rows stay on int16.

The split is pure bookkeeping over a StepBatch; tests/worker/test_native_steps.py runs it on the native step.
"""

from __future__ import annotations

import dataclasses

import torch

from tests.support.paged_steps import Chunk, make_batch
from worker.runtime.long_prompts import LONG_PROMPT_ROWS, merge_logits, split_long_prompts

PAGE = 16


def _step() -> tuple:
    """A decode, a long prompt's last chunk, a chunk short of its prompt's end, a short prompt: in that order."""
    decode = Chunk([7], 40, [0, 1, 2])
    long_end = Chunk(list(range(100, 100 + LONG_PROMPT_ROWS + 5)), 32, list(range(3, 15)))
    earlier_chunk = Chunk(list(range(50)), 0, [15, 16, 17, 18], samples=False)
    short_end = Chunk(list(range(20)), 0, [19, 20])
    return decode, long_end, earlier_chunk, short_end


def test_a_long_prompts_sampled_row_alone_goes_last_and_every_other_row_first() -> None:
    decode, long_end, earlier_chunk, short_end = _step()
    batch = make_batch([decode, long_end, earlier_chunk, short_end], PAGE)
    split = split_long_prompts(batch)
    assert split is not None
    earlier, last = split.earlier, split.last
    long_rows = len(long_end.token_ids)
    # first: the decode, the long prompt but its last row, the earlier chunk (the short prompt whole goes last)
    assert earlier.query_lens == [1, long_rows - 1, 50]
    assert earlier.context_lens == [41, 32 + long_rows - 1, 50]
    assert earlier.input_ids.tolist() == [7, *long_end.token_ids[:-1], *range(50)]
    assert earlier.positions.tolist() == [40, *range(32, 32 + long_rows - 1), *range(50)]
    assert earlier.logits_indices.tolist() == [0]  # only the decode samples in it
    assert earlier.prompt_ends == [False, False, False]
    # last: the long prompt's last row, the short prompt's chunk, each sampling
    assert last.query_lens == [1, 20] and last.context_lens == [32 + long_rows, 20]
    assert last.input_ids.tolist() == [long_end.token_ids[-1], *range(20)]
    assert last.positions.tolist() == [32 + long_rows - 1, *range(20)]
    assert last.slots.tolist() == [batch.slots[long_rows].item(), *batch.slots[-20:].tolist()]
    assert last.logits_indices.tolist() == [0, 20] and last.prompt_ends == [True, True]
    assert torch.equal(last.page_tables, batch.page_tables[[1, 3]])
    # the step's logit rows: decode, long prompt, short prompt
    assert split.from_last.tolist() == [False, True, True]
    merged = merge_logits(split, torch.tensor([[1.0]]), torch.tensor([[2.0], [3.0]]))
    assert merged.tolist() == [[1.0], [2.0], [3.0]]


def test_no_split_without_a_long_prompt_end_or_where_the_batch_does_not_say() -> None:
    decode, long_end, earlier_chunk, short_end = _step()
    assert split_long_prompts(make_batch([decode, earlier_chunk, short_end], PAGE)) is None
    long_not_ending = dataclasses.replace(long_end, samples=False)
    assert split_long_prompts(make_batch([decode, long_not_ending], PAGE)) is None
    unknown = dataclasses.replace(make_batch([long_end], PAGE), prompt_ends=None)
    assert split_long_prompts(unknown) is None
    one_short = Chunk(list(range(LONG_PROMPT_ROWS - 1)), 0, list(range(8)))
    assert split_long_prompts(make_batch([one_short], PAGE)) is None
