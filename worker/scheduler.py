"""Which sequences run in the next step, and how many tokens each feeds.

One token budget per step: running decodes first, then prefill chunks of running sequences,
then new admissions while pages allow. Pages are reserved oldest sequence first; when they run
out, the most recently admitted sequences are preempted (pages released, recomputed later).

Two priorities (protocol: `interactive`, the default, and `batch`). Everywhere above, "oldest
first" reads "interactive sequences oldest first, then batch sequences oldest first", and "the
most recent" reads "the newest batch sequence, then the newest interactive one": the one order
(`_in_priority_order`) serves decodes, prefill chunks, page reservations and the choice of
victims, so the rules stay those of one queue. Four rules on top, each for time to first token:

- **Interactive sequences take slots and pages from batch ones.** The waiting queue keeps every
  interactive sequence ahead of every batch one. When the interactive sequence at its head lacks a
  slot or pages, the newest running batch sequence is preempted until it fits; when an interactive
  prompt chunk gets fewer pages than it asked for, batch sequences are preempted for the rest. A
  preempted batch sequence keeps its full pages in the prefix cache, so resuming it is mostly a
  cache hit. A batch sequence never takes anything from an interactive one.
- **A step that reads an interactive prompt carries no batch work.** The step's time is then that
  prompt's alone, so an interactive request's first token comes as fast under a batch load as on
  an idle worker, less the step it arrived during. Batch sequences keep their slots and pages and
  lose one step per interactive prompt (a long prompt: one per chunk).
- **Beside interactive work, batch work is small.** While an interactive sequence runs or waits,
  and for `QUIET_STEPS` steps after the last one left, a step carries at most
  `batch_tokens_beside_interactive` batch tokens (the oldest batch sequences first; the others
  keep their pages and wait their turn). An interactive request that arrives mid-step waits for
  the rest of that step: a step of 64 batch decodes took ~1 s on 2 CPU cores, one of 8 a fraction
  of that, and a client that sends its next request as soon as the last one ends arrives within
  the quiet steps. With no interactive traffic, batch work has the whole step budget. (The CUDA step
  backend sets no such limit, where a decode step costs about the same at 8 rows as at 64.)
- **Preempting batch sequences for an interactive one does not stop admissions**, as running out
  of pages does: the room was made for the sequence being admitted.

One rule for the prefix cache: **a prompt whose first page a running sequence is still reading
waits until it has read it** (`_reading_its_prefix`), then finds those pages in the cache. The `n`
choices of one request, or many requests with one long system prompt arriving together, are so
prefilled once instead of n times; the queue behind waits at most that prefill.

So batch work gets exactly the capacity interactive work leaves, and gives it back a step later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from protocol.keys import BATCH, INTERACTIVE
from worker.pages import PagePool, page_key


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
    priority: str = INTERACTIVE  # or BATCH: runs on what interactive sequences leave (see the module)

    @property
    def batch(self) -> bool:
        return self.priority == BATCH

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


@dataclass
class Budget:
    """The tokens a step may still take: in all, and for batch sequences."""

    total: int
    batch: int

    def room(self, seq: Sequence) -> int:
        return min(self.total, self.batch) if seq.batch else self.total

    def take(self, seq: Sequence, wanted: int) -> int:
        """Take up to `wanted` tokens for `seq`; returns how many it got."""
        granted = min(wanted, self.room(seq))
        self.total -= granted
        if seq.batch:
            self.batch -= granted
        return granted


QUIET_STEPS = 16  # steps after the last interactive sequence left during which batch work stays small
BATCH_TOKENS_BESIDE_INTERACTIVE = 8


def _pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class Scheduler:
    def __init__(
        self,
        kv: PagePool,
        *,
        max_seqs: int,
        step_tokens: int,
        max_context: int,
        batch_tokens_beside_interactive: int = BATCH_TOKENS_BESIDE_INTERACTIVE,
    ) -> None:
        self.kv = kv
        self.max_seqs = max_seqs
        self.step_tokens = step_tokens
        self.batch_tokens_beside_interactive = batch_tokens_beside_interactive
        self.steps_without_interactive = QUIET_STEPS  # an idle worker gives batch work the whole step
        self.page_size = kv.page_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.prefix = PrefixStats()
        self.preemptions = 0
        self._free_rows = list(range(max_seqs - 1, -1, -1))

    def add(self, seq: Sequence) -> None:
        self._enqueue(seq)

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
        """The next step: decodes, then prompt chunks, then admissions, each in priority order; no
        batch tokens in a step that reads an interactive prompt (one running, or one to admit), and
        few beside interactive work."""
        order = self._in_priority_order()
        reading_interactive = any(not seq.batch and seq.num_pending > 1 for seq in order) or self._interactive_waits()
        eligible = [seq for seq in order if not (reading_interactive and seq.batch)]
        batch_limit = self._batch_token_limit(order)
        budget = Budget(self.step_tokens, batch_limit)
        tokens: dict[Sequence, int] = {}
        for seq in eligible:
            if seq.num_pending == 1 and budget.take(seq, 1):
                tokens[seq] = 1
        for seq in eligible:
            if seq.num_pending > 1 and (granted := budget.take(seq, seq.num_pending)):
                tokens[seq] = granted
        preempted = self._reserve_pages(tokens)
        scheduled = [_scheduled(seq, n) for seq, n in tokens.items() if seq.row >= 0]
        interactive_lost = any(not seq.batch for seq in preempted)
        if not interactive_lost:
            left = Budget(self.step_tokens, batch_limit)  # what the reserved pages left of the step
            for item in scheduled:
                left.take(item.seq, item.num_tokens)
            admit_batch = not reading_interactive and not preempted
            scheduled += self._admit(left, admit_batch, {item.seq for item in scheduled}, preempted)
        return StepPlan(scheduled=scheduled, preempted=preempted)

    def _batch_token_limit(self, order: list[Sequence]) -> int:
        """How many batch tokens the next step may carry (see "Beside interactive work" above)."""
        if any(not seq.batch for seq in order) or self._interactive_waits():
            self.steps_without_interactive = 0
        else:
            self.steps_without_interactive += 1
        return (
            self.step_tokens if self.steps_without_interactive > QUIET_STEPS else self.batch_tokens_beside_interactive
        )

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
        """Give each scheduled sequence, in priority order, the pages its tokens need; preempt the last
        in that order when short (an interactive chunk that got only part: batch sequences, for the rest)."""
        preempted: list[Sequence] = []
        for seq in self._in_priority_order():
            if seq not in tokens or seq.row < 0:
                continue
            granted = self._grow(seq, tokens[seq])
            while granted < tokens[seq]:
                victim = self._in_priority_order()[-1]
                if granted and not (victim.batch and not seq.batch):
                    break  # a shorter chunk, rather than taking pages from an equal
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    granted = 0
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

    def _admit(
        self, budget: Budget, admit_batch: bool, busy: set[Sequence], preempted: list[Sequence]
    ) -> list[Scheduled]:
        """Start waiting sequences in queue order while the budget, slots and pages allow. An
        interactive one that does not fit preempts batch sequences not in this step (`busy`) until it does."""
        admitted = []
        while self.waiting and budget.room(self.waiting[0]) > 0:
            seq = self.waiting[0]
            if (seq.batch and not admit_batch) or self._reading_its_prefix(seq):
                break
            fit = self._fit(seq, budget.room(seq)) if len(self.running) < self.max_seqs else None
            if fit is None:
                victim = None if seq.batch else self._newest_batch(busy)
                if victim is None:
                    break
                self._preempt(victim)
                preempted.append(victim)
                continue
            cached_pages, num_tokens, new_pages = fit
            self.waiting.popleft()
            self.kv.acquire(cached_pages)
            self._start(seq, cached_pages + self.kv.allocate(new_pages), len(cached_pages) * self.page_size)
            admitted.append(_scheduled(seq, num_tokens))
            budget.take(seq, num_tokens)
        return admitted

    def _reading_its_prefix(self, seq: Sequence) -> bool:
        """Whether a running sequence still reading its prompt starts with the same full page."""
        if len(seq.token_ids) <= self.page_size:
            return False
        first = seq.keys_upto(1, self.page_size)[0]
        return any(
            other.num_computed < other.num_prompt_tokens and other.keys_upto(1, self.page_size)[0] == first
            for other in self.running
            if len(other.token_ids) > self.page_size and not (other.batch and not seq.batch)  # never wait on batch work
        )

    def _fit(self, seq: Sequence, budget: int) -> tuple[list[int], int, int] | None:
        """(cached pages, tokens to feed, new pages) to start `seq` now, or None when pages lack."""
        reusable_pages = (len(seq.token_ids) - 1) // self.page_size  # the last token is always fed
        cached_pages = self.kv.lookup(seq.keys_upto(reusable_pages, self.page_size))
        cached_tokens = len(cached_pages) * self.page_size
        num_tokens = min(len(seq.token_ids) - cached_tokens, budget)
        new_pages = _pages_for(cached_tokens + num_tokens, self.page_size) - len(cached_pages)
        if not self.kv.can_allocate(new_pages, cached_pages):
            return None
        return cached_pages, num_tokens, new_pages

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
        seq.pages += pages

    def _preempt(self, seq: Sequence) -> None:
        self.preemptions += 1
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.num_registered_pages = 0
        self._enqueue(seq, resumed=True)

    def _enqueue(self, seq: Sequence, resumed: bool = False) -> None:
        """Interactive sequences wait ahead of batch ones; within a priority, a preempted sequence
        resumes before the new ones."""
        if not seq.batch and resumed:
            self.waiting.appendleft(seq)
            return
        first_batch = next((i for i, other in enumerate(self.waiting) if other.batch), len(self.waiting))
        if seq.batch and not resumed:
            self.waiting.append(seq)
        else:
            self.waiting.insert(first_batch, seq)

    def _interactive_waits(self) -> bool:
        return bool(self.waiting) and not self.waiting[0].batch

    def _in_priority_order(self) -> list[Sequence]:
        """Running sequences, interactive ones first, each priority in admission order."""
        return [seq for seq in self.running if not seq.batch] + [seq for seq in self.running if seq.batch]

    def _newest_batch(self, busy: set[Sequence]) -> Sequence | None:
        return next((seq for seq in reversed(self.running) if seq.batch and seq not in busy), None)

    def _release(self, seq: Sequence) -> None:
        self.kv.release(seq.pages)
        seq.pages = []
        self._free_rows.append(seq.row)
        seq.row = -1
