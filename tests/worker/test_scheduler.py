"""The scheduler: one token budget per step, decodes first, chunked prefill, admissions, preemption."""

from __future__ import annotations

import subprocess
import sys

import torch

from worker.kv_cache import KVCache
from worker.scheduler import Scheduler, Sequence, StepPlan

PAGE = 4


def make_scheduler(
    num_pages: int, *, max_seqs: int = 8, step_tokens: int = 16, batch_tokens_beside_interactive: int = 8
) -> Scheduler:
    cache = KVCache(
        num_pages=num_pages,
        page_size=PAGE,
        num_layers=1,
        num_kv_heads=1,
        head_dim=4,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    return Scheduler(
        cache,
        max_seqs=max_seqs,
        step_tokens=step_tokens,
        max_context=64,
        batch_tokens_beside_interactive=batch_tokens_beside_interactive,
    )


def seq(name: str, length: int, first_token: int = 0) -> Sequence:
    return Sequence(id=name, token_ids=list(range(first_token, first_token + length)), num_prompt_tokens=length)


def run_step(scheduler: Scheduler) -> StepPlan:
    """Schedule, mark the tokens computed, and append a token to every sequence that samples."""
    plan = scheduler.schedule()
    sampling = [item.seq for item in plan.scheduled if item.samples]
    scheduler.complete(plan)
    for s in sampling:
        s.token_ids.append(1000 + len(s.token_ids))
    return plan


def fed(plan: StepPlan) -> dict[str, int]:
    return {item.seq.id: item.num_tokens for item in plan.scheduled}


def test_long_prompt_is_chunked_while_decodes_keep_going() -> None:
    scheduler = make_scheduler(32, step_tokens=8)
    short, long = seq("short", 3), seq("long", 20, first_token=100)
    scheduler.add(short)
    assert fed(run_step(scheduler)) == {"short": 3}
    scheduler.add(long)
    assert fed(run_step(scheduler)) == {"short": 1, "long": 7}
    assert fed(run_step(scheduler)) == {"short": 1, "long": 7}
    plan = run_step(scheduler)
    assert fed(plan) == {"short": 1, "long": 6}
    assert [item.samples for item in plan.scheduled] == [True, True]
    assert fed(run_step(scheduler)) == {"short": 1, "long": 1}


def test_decodes_come_first_in_the_batch_and_in_the_budget() -> None:
    scheduler = make_scheduler(32, step_tokens=4)
    first, second = seq("a", 2), seq("b", 9, first_token=50)
    scheduler.add(first)
    run_step(scheduler)
    scheduler.add(second)
    plan = run_step(scheduler)
    assert [(item.seq.id, item.num_tokens) for item in plan.scheduled] == [("a", 1), ("b", 3)]


def test_max_seqs_limits_admissions() -> None:
    scheduler = make_scheduler(32, max_seqs=2)
    for i in range(3):
        scheduler.add(seq(f"s{i}", 2, first_token=10 * i))
    assert set(fed(run_step(scheduler))) == {"s0", "s1"}
    assert len(scheduler.waiting) == 1


def test_newest_sequence_is_preempted_when_pages_run_out() -> None:
    scheduler = make_scheduler(4)
    old, new = seq("old", 4), seq("new", 4, first_token=40)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)  # each holds 1 full page + sampled one token
    run_step(scheduler)  # each takes a second page: all 4 used
    assert scheduler.kv.num_free == 0
    for _ in range(3):
        run_step(scheduler)
    plan = run_step(scheduler)  # "old" needs a third page: "new" is preempted
    assert [s.id for s in plan.preempted] == ["new"]
    assert fed(plan) == {"old": 1}
    assert new.pages == [] and new.num_computed == 0 and scheduler.waiting[0] is new


def test_preempted_sequence_resumes_from_its_cached_pages() -> None:
    scheduler = make_scheduler(4)
    old, new = seq("old", 4), seq("new", 4, first_token=40)
    scheduler.add(old)
    scheduler.add(new)
    for _ in range(6):
        run_step(scheduler)
    assert new.row < 0 and len(new.token_ids) == 9
    scheduler.remove(old)
    plan = run_step(scheduler)
    # "old" took the deepest of new's two full pages; the first comes back from the prefix cache.
    assert fed(plan) == {"new": 9 - PAGE}
    assert new.cached_prompt_tokens == 0  # counted once, at first admission, when nothing was cached
    assert scheduler.prefix.hit_tokens == 0


def test_a_waiting_prompt_reuses_a_running_prompts_pages() -> None:
    scheduler = make_scheduler(16)
    first = seq("first", 10)
    scheduler.add(first)
    run_step(scheduler)
    second = Sequence(id="second", token_ids=list(range(9)) + [77], num_prompt_tokens=10)
    scheduler.add(second)
    plan = run_step(scheduler)
    assert fed(plan) == {"first": 1, "second": 2}
    assert second.pages[:2] == first.pages[:2] and second.cached_prompt_tokens == 8
    assert scheduler.prefix.hit_tokens == 8 and scheduler.prefix.lookup_tokens == 20


def test_a_fully_cached_prompt_still_feeds_its_last_token() -> None:
    scheduler = make_scheduler(16)
    first = seq("first", 8)
    scheduler.add(first)
    run_step(scheduler)
    scheduler.remove(first)
    again = seq("again", 8)
    scheduler.add(again)
    assert fed(run_step(scheduler)) == {"again": 4}
    assert again.cached_prompt_tokens == 4


def test_removing_sequences_frees_every_page() -> None:
    scheduler = make_scheduler(8)
    sequences = [seq(f"s{i}", 5, first_token=10 * i) for i in range(3)]
    for s in sequences:
        scheduler.add(s)
    run_step(scheduler)
    for s in sequences:
        scheduler.remove(s)
    assert scheduler.kv.num_free == 8 and not scheduler.has_work()


def test_the_scheduler_imports_no_torch() -> None:
    """It plans with page numbers alone (worker/pages.py); the tensors stay with the step backends."""
    probe = (
        "import sys, worker.scheduler; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
