"""Progress of partc's long phases, for whoever wants to show it.

The library only reports: ``progress.update("search", done, total, detail, ...)`` at each
step of a long phase, which does nothing unless a listener was installed around the call
(``with progress.listening(callback): partc.compile(...)``). The command line installs one
that draws progress bars; the library never prints. The phases:

- ``"trace"``: tracing the model, then each analysis pass (shapes, layers, measurement);
- ``"tensor parallelism"``: per tensor-parallel degree, with and without sequence
  parallelism, per objective: choosing the layers' shardings and measuring one rank's
  share (the long phase of a large model);
- ``"search"``: the planner's configurations, with the best step time found so far
  (``incumbent_s``) and the lowest any configuration could still reach (``bound_s``);
- ``"schedules"``: with the schedule left to the planner, each other schedule solved on
  the chosen configuration, with the fastest played-out step so far (``incumbent_s``).

A phase may start again (``done=0``), as tracing does when repeated blocks cannot stand for
the whole model; it ends with ``done == total``.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Iterator


@dataclass(frozen=True, kw_only=True)
class Event:
    phase: str
    done: int
    total: int
    detail: str = ""                   # what the phase works on now
    incumbent_s: float | None = None   # search: the best step time found so far
    bound_s: float | None = None       # search: no plan can step faster than this

    @property
    def gap(self) -> float | None:
        """How far the incumbent may be from the best plan, as a fraction of it."""
        if self.incumbent_s is None or self.bound_s is None or self.incumbent_s <= 0:
            return None
        return max(0.0, self.incumbent_s - self.bound_s) / self.incumbent_s


Listener = Callable[[Event], None]
_listener: ContextVar[Listener | None] = ContextVar("partc_progress", default=None)


def update(phase: str, done: int, total: int, detail: str = "", *,
           incumbent_s: float | None = None, bound_s: float | None = None) -> None:
    """Tell the listener, if any, that ``phase`` has done ``done`` of ``total`` steps."""
    listener = _listener.get()
    if listener is not None:
        listener(Event(phase=phase, done=done, total=total, detail=detail,
                       incumbent_s=incumbent_s, bound_s=bound_s))


@contextlib.contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Send the progress of everything run inside the block to ``listener``."""
    token = _listener.set(listener)
    try:
        yield
    finally:
        _listener.reset(token)
