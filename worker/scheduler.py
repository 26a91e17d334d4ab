"""Which sequences run in the next step, and how many tokens each feeds.

One token budget per step: running decodes first, then prefill chunks of running sequences,
then new admissions while pages allow. Pages are reserved oldest sequence first; when they run
out, the most recently admitted sequences are preempted (pages released, recomputed later).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from worker.kv_cache import KVCache, page_key


@dataclass(eq=False)
class Sequence:
    """A request's tokens and where their K/V live. Tokens [0, num_computed) are in the cache."""

    id: str
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_registered_pages: int = 0  # leading pages offered to the prefix cache
    page_keys: list[bytes] = field(default_factory=list)  # chained keys of full pages of token_ids
    cached_prompt_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    row: int = -1  # row in the scheduler's page table while running

    @property
    def num_pending(self) -> int:
        """Tokens still to feed before the next token can be sampled."""
        return len(self.token_ids) - self.num_computed

    def keys_upto(self, num_pages: int, page_size: int) -> list[bytes]:
        """Keys of the first `num_pages` full pages, computing the missing ones."""
        while len(self.page_keys) < num_pages:
            index = len(self.page_keys)
            parent = self.page_keys[-1] if index else None
            tokens = self.token_ids[index * page_size : (index + 1) * page_size]
            self.page_keys.append(page_key(parent, tokens))
        return self.page_keys[:num_pages]


@dataclass
class Scheduled:
    seq: Sequence
    num_tokens: int  # tokens fed this step, from seq.num_computed on
    samples: bool  # the step reaches the sequence's last token, so a new token is sampled


def _scheduled(seq: Sequence, num_tokens: int) -> Scheduled:
    return Scheduled(seq, num_tokens, samples=num_tokens == seq.num_pending)


@dataclass
class StepPlan:
    scheduled: list[Scheduled]  # decodes first, then prefill chunks
    preempted: list[Sequence]


@dataclass
class PrefixStats:
    lookup_tokens: int = 0
    hit_tokens: int = 0


def _pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class Scheduler:
    def __init__(self, kv: KVCache, *, max_seqs: int, step_tokens: int, max_context: int) -> None:
        self.kv = kv
        self.max_seqs = max_seqs
        self.step_tokens = step_tokens
        self.page_size = kv.page_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.prefix = PrefixStats()
        self.preemptions = 0
        max_pages = _pages_for(max_context, kv.page_size)
        self.page_table = torch.zeros((max_seqs, max_pages), dtype=torch.int64)
        self._free_rows = list(range(max_seqs - 1, -1, -1))

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or cancelled sequence out, releasing its pages."""
        if seq.row >= 0:
            self.running.remove(seq)
            self._release(seq)
        else:
            self.waiting.remove(seq)

    def schedule(self) -> StepPlan:
        budget = self.step_tokens
        tokens: dict[Sequence, int] = {}
        for seq in self.running:
            if seq.num_pending == 1 and budget > 0:
                tokens[seq] = 1
                budget -= 1
        for seq in self.running:
            if seq.num_pending > 1 and budget > 0:
                tokens[seq] = min(seq.num_pending, budget)
                budget -= tokens[seq]
        preempted = self._reserve_pages(tokens)
        scheduled = [_scheduled(seq, n) for seq, n in tokens.items() if seq.row >= 0]
        if not preempted:
            scheduled += self._admit(self.step_tokens - sum(s.num_tokens for s in scheduled))
        return StepPlan(scheduled=scheduled, preempted=preempted)

    def complete(self, plan: StepPlan) -> None:
        """Record that the plan's tokens are now in the cache; offer newly full pages to the prefix cache."""
        for item in plan.scheduled:
            seq = item.seq
            seq.num_computed += item.num_tokens
            full = seq.num_computed // self.page_size
            if full > seq.num_registered_pages:
                keys = seq.keys_upto(full, self.page_size)
                for index in range(seq.num_registered_pages, full):
                    self.kv.register(seq.pages[index], keys[index])
                seq.num_registered_pages = full

    def _reserve_pages(self, tokens: dict[Sequence, int]) -> list[Sequence]:
        """Give each scheduled sequence, oldest first, the pages its tokens need; preempt the newest if short."""
        preempted: list[Sequence] = []
        for seq in list(self.running):
            if seq not in tokens or seq.row < 0:
                continue
            granted = self._grow(seq, tokens[seq])
            while not granted:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
                granted = self._grow(seq, tokens[seq])
            tokens[seq] = granted
        return preempted

    def _grow(self, seq: Sequence, wanted: int) -> int:
        """Allocate pages for up to `wanted` tokens of seq (a prefill chunk shrinks to what is free)."""
        room = len(seq.pages) * self.page_size - seq.num_computed + self.kv.num_free * self.page_size
        granted = min(wanted, room)
        if granted:
            needed = _pages_for(seq.num_computed + granted, self.page_size) - len(seq.pages)
            self._append_pages(seq, self.kv.allocate(needed))
        return granted

    def _admit(self, budget: int) -> list[Scheduled]:
        admitted = []
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            reusable_pages = (len(seq.token_ids) - 1) // self.page_size  # the last token is always fed
            cached_pages = self.kv.lookup(seq.keys_upto(reusable_pages, self.page_size))
            cached_tokens = len(cached_pages) * self.page_size
            num_tokens = min(len(seq.token_ids) - cached_tokens, budget)
            new_pages = _pages_for(cached_tokens + num_tokens, self.page_size) - len(cached_pages)
            if not self.kv.can_allocate(new_pages, cached_pages):
                break
            self.waiting.popleft()
            self.kv.acquire(cached_pages)
            self._start(seq, cached_pages + self.kv.allocate(new_pages), cached_tokens)
            admitted.append(_scheduled(seq, num_tokens))
            budget -= num_tokens
        return admitted

    def _start(self, seq: Sequence, pages: list[int], cached_tokens: int) -> None:
        if seq.cached_prompt_tokens is None:
            seq.cached_prompt_tokens = min(cached_tokens, seq.num_prompt_tokens)
            self.prefix.lookup_tokens += seq.num_prompt_tokens
            self.prefix.hit_tokens += seq.cached_prompt_tokens
        seq.row = self._free_rows.pop()
        seq.num_computed = cached_tokens
        seq.num_registered_pages = cached_tokens // self.page_size
        self._append_pages(seq, pages)
        self.running.append(seq)

    def _append_pages(self, seq: Sequence, pages: list[int]) -> None:
        if pages:
            start = len(seq.pages)
            seq.pages += pages
            self.page_table[seq.row, start : len(seq.pages)] = torch.tensor(pages)

    def _preempt(self, seq: Sequence) -> None:
        self.preemptions += 1
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.num_registered_pages = 0
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.kv.release(seq.pages)
        seq.pages = []
        self._free_rows.append(seq.row)
        seq.row = -1
