"""Python's garbage collector while partc plans.

A compile keeps about a million objects alive for its whole length (the traced graphs,
their fake tensors, the cost tables and schedule orders of thousands of configurations),
few of which are garbage, and a full collection walks every one of them: on
Llama-3-70B's plan, eight full collections took 2.9 of its 18 CPU-seconds, and a 1T GPT's
whole process took 82 CPU-seconds with them and 64 without.
:func:`young_collections_only` holds the full collections off while it is entered and
leaves the young generations' collections as they were, which reclaim the short-lived
cycles (a fake tensor's, an fx node's); the thresholds are put back when the outermost
entry leaves, and the next full collection runs as it would have. It is entered by
``partc.compile``, ``partc.load``, the planner's ``solve`` and ``plan_problem``, and by
``Program.lower`` (under ``build``, ``code`` and ``save``), which traces the whole model
again (emitting a 48-block Llama's four stages: two full collections, 0.56 of 6.2
CPU-seconds).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

#: The oldest generation's threshold while held: that many collections of the middle
#: generation before a full one (Python's default is 10), far more than one compile makes.
HELD_THRESHOLD = 1_000_000


class _Hold:
    """Who holds the full collections off: how many entries, and the thresholds to put
    back when the last leaves."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.saved: tuple[int, ...] = ()

    def enter(self) -> None:
        with self.lock:
            if self.depth == 0:
                self.saved = gc.get_threshold()
                young, middle, oldest = self.saved
                gc.set_threshold(young, middle, max(oldest, HELD_THRESHOLD))
            self.depth += 1

    def leave(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                gc.set_threshold(*self.saved)


_HOLD = _Hold()


@contextlib.contextmanager
def young_collections_only() -> Iterator[None]:
    """No full collection while entered (from any thread); re-entrant."""
    _HOLD.enter()
    try:
        yield
    finally:
        _HOLD.leave()
