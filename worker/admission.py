"""The worker's admission budget: slots promised to reads in flight, shared by all its readers.

A worker reads one stream per lane (worker/claims.py: a priority's stream in each shard) and takes
entries only into its free slots (pull = load balancing). With one reader that is exact; with K
readers each asking for "the free slots" at once, they could together take K times that (a
max_seqs=4 worker took 5 of 6 requests while another worker idled). So every read first *takes*
its count from this budget, and the slots it took stay promised until each entry it got has been
started or refused (the engine counts it from then on) or, for what the read did not get, until it
returns. Taking is synchronous (no await between looking at the room and taking it), so on one
event loop two readers can never both take the same slot.

Readers never block on a stream holding slots: they wait for entries without taking them
(claims.py `wait_beyond`), then take a budget and read without blocking.
"""

from __future__ import annotations

from collections.abc import Callable


class AdmissionBudget:
    """`on_returned` is called whenever slots come back (the service wakes its waiting readers)."""

    def __init__(self, on_returned: Callable[[], None]) -> None:
        self._promised = 0
        self._on_returned = on_returned

    @property
    def promised(self) -> int:
        """Slots taken by reads whose entries are not yet started or refused."""
        return self._promised

    def take(self, room: int) -> int:
        """Promise up to `room` slots (the engine's room for this priority) minus those already promised; how many."""
        taken = max(room - self._promised, 0)
        self._promised += taken
        return taken

    def give_back(self, slots: int = 1) -> None:
        """Slots a read did not use, or an entry that is now started or refused (the engine counts it)."""
        if slots <= 0:
            return
        if slots > self._promised:
            raise ValueError(f"giving back {slots} slots of {self._promised} promised")
        self._promised -= slots
        self._on_returned()
