"""The admission budget that a worker's lane readers share (worker/admission.py)."""

from __future__ import annotations

import pytest

from worker.admission import AdmissionBudget


def test_readers_together_take_no_more_than_the_room_until_slots_come_back():
    returned = []
    budget = AdmissionBudget(on_returned=lambda: returned.append(budget.promised))
    assert budget.take(4) == 4  # the first reader promises every free slot
    assert budget.take(4) == 0  # the next one, asking for the same room, gets none
    budget.give_back(3)  # the read got one entry: three slots come back at once
    assert returned == [1]
    assert budget.take(4) == 3  # the room is still 4 (the entry is not started yet): 3 are left
    budget.give_back(1)  # the entry started: the engine counts it now, the room is 3
    assert budget.take(3) == 0  # and the second read still holds all 3
    budget.give_back(3)
    assert budget.promised == 0


def test_giving_back_more_than_was_taken_is_a_bug_and_says_so():
    budget = AdmissionBudget(on_returned=lambda: None)
    budget.take(1)
    with pytest.raises(ValueError, match="giving back 2 slots of 1 promised"):
        budget.give_back(2)
    budget.give_back(0)  # nothing to give back: no wake-up either
    assert budget.promised == 1
