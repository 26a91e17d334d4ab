"""The scheduler's priorities: interactive sequences first, batch ones on what is left (worker/scheduler.py).

The examples state each rule on a small pool; the fuzz drives random mixes of both priorities
through arrivals, steps, finishes and cancellations on a pool small enough to force preemption,
and checks after every step that pages and slots are accounted for, that the rules held, and
that every sequence finishes.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.worker.test_scheduler import fed, make_scheduler, run_step
from worker.scheduler import QUIET_STEPS, Scheduler, Sequence, StepPlan


def seq(name: str, length: int, first_token: int = 0, priority: str = "interactive") -> Sequence:
    return Sequence(
        id=name, token_ids=list(range(first_token, first_token + length)), num_prompt_tokens=length, priority=priority
    )


def batch(name: str, length: int, first_token: int = 0) -> Sequence:
    return seq(name, length, first_token, "batch")


def test_interactive_sequences_wait_ahead_of_batch_ones() -> None:
    scheduler = make_scheduler(32, max_seqs=1)
    running = batch("running", 3)
    scheduler.add(running)
    run_step(scheduler)
    for s in (batch("b1", 3, 10), seq("i1", 3, 20), batch("b2", 3, 30), seq("i2", 3, 40)):
        scheduler.add(s)
    assert [s.id for s in scheduler.waiting] == ["i1", "i2", "b1", "b2"]


def test_an_interactive_arrival_takes_the_slot_of_the_newest_batch_sequence() -> None:
    scheduler = make_scheduler(32, max_seqs=2)
    old, new = batch("old", 3), batch("new", 3, first_token=10)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)
    urgent = seq("urgent", 3, first_token=20)
    scheduler.add(urgent)
    plan = run_step(scheduler)
    assert [s.id for s in plan.preempted] == ["new"]
    assert fed(plan) == {"urgent": 3}  # its prompt is read alone: no batch decode in that step
    assert [s.id for s in scheduler.waiting] == ["new"]
    assert fed(run_step(scheduler)) == {"urgent": 1, "old": 1}  # decodes of both priorities share steps
    scheduler.remove(urgent)
    plan = run_step(scheduler)
    assert fed(plan) == {"old": 1, "new": 4}  # the preempted one resumes: recomputed, its tokens kept


def test_an_interactive_arrival_takes_pages_from_batch_sequences() -> None:
    scheduler = make_scheduler(4, max_seqs=4, step_tokens=16)
    hogs = [batch("hog0", 8), batch("hog1", 7, first_token=20)]
    for hog in hogs:
        scheduler.add(hog)
    run_step(scheduler)  # 2 + 2 pages: the pool is full
    assert scheduler.kv.num_free == 0
    urgent = seq("urgent", 10, first_token=40)  # 3 pages: more than the newest one holds
    scheduler.add(urgent)
    plan = run_step(scheduler)
    assert [s.id for s in plan.preempted] == ["hog1", "hog0"]  # newest first, as many as it takes
    assert fed(plan) == {"urgent": 10}


def test_an_interactive_prompt_chunk_takes_the_pages_it_asked_for() -> None:
    scheduler = make_scheduler(6, max_seqs=4, step_tokens=8)
    long = seq("long", 16, first_token=50)
    scheduler.add(long)
    assert fed(run_step(scheduler)) == {"long": 8}  # 2 pages, 4 free
    hog = batch("hog", 12)
    scheduler.remove(long)  # out of the way for a moment so the batch sequence can fill the pool
    scheduler.add(hog)
    run_step(scheduler)
    run_step(scheduler)  # hog: 12 prompt tokens (3 pages) + one sampled (a 4th page on its next decode)
    again = seq("again", 16, first_token=50)  # finds 2 pages of "long" in the prefix cache
    scheduler.add(again)
    plan = run_step(scheduler)
    assert fed(plan) == {"again": 8} and [s.id for s in plan.preempted] == ["hog"]


def test_batch_sequences_never_take_from_interactive_ones() -> None:
    scheduler = make_scheduler(4, max_seqs=2)
    urgent = seq("urgent", 12)
    scheduler.add(urgent)
    run_step(scheduler)  # 3 pages
    slow = batch("slow", 6, first_token=30)
    scheduler.add(slow)
    plan = run_step(scheduler)
    assert fed(plan) == {"urgent": 1} and not plan.preempted  # 1 page left: not enough for the batch prompt
    assert [s.id for s in scheduler.waiting] == ["slow"]


def test_batch_sequences_run_when_no_interactive_prompt_is_read() -> None:
    scheduler = make_scheduler(32, max_seqs=4)
    scheduler.add(seq("chat", 3))
    scheduler.add(batch("job", 3, first_token=10))
    assert fed(run_step(scheduler)) == {"chat": 3}  # the interactive prompt's step
    assert fed(run_step(scheduler)) == {"chat": 1, "job": 3}  # then the batch prompt joins the decodes


def test_beside_interactive_work_batch_sequences_take_turns_in_small_steps() -> None:
    scheduler = make_scheduler(64, max_seqs=8, step_tokens=16, batch_tokens_beside_interactive=2)
    jobs = [batch(f"job{i}", 3, first_token=10 * i) for i in range(4)]
    for job in jobs:
        scheduler.add(job)
    assert fed(run_step(scheduler)) == {f"job{i}": 3 for i in range(4)}  # an idle worker: the whole step
    scheduler.add(seq("chat", 3, first_token=100))
    assert fed(run_step(scheduler)) == {"chat": 3}
    assert fed(run_step(scheduler)) == {"chat": 1, "job0": 1, "job1": 1}  # the oldest batch sequences, 2 tokens
    scheduler.remove(jobs[0])
    assert fed(run_step(scheduler)) == {"chat": 1, "job1": 1, "job2": 1}


def test_batch_steps_stay_small_for_a_while_after_interactive_work() -> None:
    scheduler = make_scheduler(64, max_seqs=8, step_tokens=16, batch_tokens_beside_interactive=2)
    for i in range(4):
        scheduler.add(batch(f"job{i}", 3, first_token=10 * i))
    chat = seq("chat", 3, first_token=100)
    scheduler.add(chat)
    run_step(scheduler)
    scheduler.remove(chat)
    # A client that sends its next request at once finds small steps, not a step of every batch sequence.
    for _ in range(QUIET_STEPS):
        assert sum(fed(run_step(scheduler)).values()) == 2
    assert fed(run_step(scheduler)) == {"job0": 1, "job1": 1, "job2": 3, "job3": 3}  # then the whole step again


operation = st.one_of(
    st.tuples(
        st.just("add"), st.sampled_from(["interactive", "batch"]), st.integers(1, 14), st.integers(1, 10), st.booleans()
    ),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
)


class Driver:
    """Runs the scheduler as the engine does; sequences stop after their own number of new tokens."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.limits: dict[Sequence, int] = {}
        self.finished: list[Sequence] = []
        self.cancelled: list[Sequence] = []
        self.count = 0

    def add(self, priority: str, length: int, new_tokens: int, shared: bool) -> None:
        self.count += 1
        first = 0 if shared else 100 * self.count  # shared: prompts that start alike hit the prefix cache
        s = seq(f"s{self.count}", length, first, priority)
        self.limits[s] = new_tokens
        self.scheduler.add(s)

    def cancel(self, pick: int) -> None:
        live = [s for s in self.limits if s not in self.finished and s not in self.cancelled]
        if live:
            victim = live[pick % len(live)]
            self.scheduler.remove(victim)
            self.cancelled.append(victim)

    def step(self) -> StepPlan:
        scheduler = self.scheduler
        pending = {s: s.num_pending for s in scheduler.running}
        waiting_before = set(scheduler.waiting)
        reads_prefix_before = {s for s in scheduler.waiting if scheduler._reading_its_prefix(s)}
        plan = run_step(scheduler)
        check_rules(scheduler, plan, pending, waiting_before, reads_prefix_before)
        for item in plan.scheduled:
            s = item.seq
            if item.samples and len(s.token_ids) - s.num_prompt_tokens >= self.limits[s]:
                scheduler.remove(s)
                self.finished.append(s)
        check_accounts(scheduler)
        return plan


def check_rules(
    scheduler: Scheduler,
    plan: StepPlan,
    pending: dict[Sequence, int],
    waiting_before: set[Sequence],
    reads_prefix_before: set[Sequence],
) -> None:
    items = plan.scheduled
    reads_interactive_prompt = any(
        not item.seq.batch and (item.seq in waiting_before or pending.get(item.seq, 0) > 1) for item in items
    )
    if reads_interactive_prompt:
        assert not any(item.seq.batch for item in items), "a step reading an interactive prompt carried batch work"
    assert sum(item.num_tokens for item in items) <= scheduler.step_tokens
    budget_spent = sum(item.num_tokens for item in items) == scheduler.step_tokens
    interactive_preempted = any(not s.batch for s in plan.preempted)
    head = scheduler.waiting[0] if scheduler.waiting else None
    # A prompt whose first page another is still reading waits on purpose (the prefix cache rule).
    prompt_readers = [item.seq for item in items if item.seq in waiting_before or pending.get(item.seq, 0) > 1]
    waits_for_prefix = head is not None and (
        head in reads_prefix_before
        or any(same_first_page(head, reader, scheduler.page_size) for reader in prompt_readers)
    )
    waits_for_room = head is not None and not head.batch and not waits_for_prefix
    if waits_for_room and any(s.batch for s in scheduler.running):
        assert budget_spent or interactive_preempted, "an interactive sequence waits while a batch one holds its room"
    interactive_work = any(not item.seq.batch for item in items) or any(not s.batch for s in scheduler.waiting)
    if interactive_work:
        batch_tokens = sum(item.num_tokens for item in items if item.seq.batch)
        assert batch_tokens <= scheduler.batch_tokens_beside_interactive, "a big batch step beside interactive work"
    if any(s.batch for s in plan.preempted) and any(not s.batch for s in plan.preempted):
        assert not any(s.batch for s in scheduler.running), "an interactive sequence lost pages a batch one kept"


def same_first_page(a: Sequence, b: Sequence, page_size: int) -> bool:
    return min(len(a.token_ids), len(b.token_ids)) > page_size and a.token_ids[:page_size] == b.token_ids[:page_size]


def check_accounts(scheduler: Scheduler) -> None:
    kv = scheduler.kv
    refs = Counter(page for s in scheduler.running for page in s.pages)
    assert all(kv._refs[page] == count for page, count in refs.items())
    assert sum(1 for count in kv._refs if count) == len(refs)
    assert kv.num_free + len(refs) == kv.num_pages
    assert len(scheduler.running) <= scheduler.max_seqs
    assert len({s.row for s in scheduler.running}) == len(scheduler.running)
    assert all(s.row < 0 and not s.pages for s in scheduler.waiting)
    kinds = [s.batch for s in scheduler.waiting]
    assert kinds == sorted(kinds), "an interactive sequence waits behind a batch one"


@settings(max_examples=300, deadline=None)
@given(
    operations=st.lists(operation, min_size=1, max_size=40),
    pages=st.integers(7, 14),  # the longest sequence (14 + 10 tokens) needs 6 pages of 4
    max_seqs=st.integers(1, 5),
    step_tokens=st.integers(1, 16),
    batch_tokens=st.integers(1, 16),
)
def test_random_mixes_keep_the_rules_and_every_page(
    operations: list, pages: int, max_seqs: int, step_tokens: int, batch_tokens: int
) -> None:
    driver = Driver(
        make_scheduler(pages, max_seqs=max_seqs, step_tokens=step_tokens, batch_tokens_beside_interactive=batch_tokens)
    )
    for op in operations:
        if op[0] == "add":
            driver.add(*op[1:])
        elif op[0] == "step":
            for _ in range(op[1]):
                driver.step()
        else:
            driver.cancel(op[1])
    steps = 0
    while driver.scheduler.has_work():
        steps += 1
        assert steps < 2000, "the scheduler stopped making progress"
        driver.step()
    assert len(driver.finished) + len(driver.cancelled) == driver.count
    assert driver.scheduler.kv.num_free == pages
