"""A watchdog: a rank that stops making progress is reported on every other rank, and
the job exits instead of hanging until the collective timeout.

Without it a hung peer shows only when a collective times out (``PARTC_TIMEOUT_S``, 600 s
by default), with an error that names no rank. With it every rank runs a daemon thread
that, every ``limit / 5`` seconds (at most 1 s), publishes a heartbeat — a counter, the
step, the phase and how long the main thread has been in that phase — under its own key
in the launcher's rendezvous store (a TCPStore client of its own at
``MASTER_ADDR:MASTER_PORT``: it does not depend on the process group, which a hung peer
may have blocked), and reads every other rank's.

*No progress for ``limit`` seconds* means one of:

- **no heartbeat**: a rank's counter has not changed for ``limit`` s, measured on the
  reader's clock. The thread beats whatever the main thread does, so this is a process
  that is stopped (``SIGSTOP``, a debugger) or frozen whole. That rank is reported.
- **stuck in a phase**: a rank's main thread has been in one of partc's phases
  (``PHASES``) for ``limit`` s. Every rank waiting on a hung peer is stuck too, so the
  ranks reported are those stuck at the earliest (step, phase) of all ranks: the ones the
  others wait on.
- **at work too long**: between steps, a rank has been in the data call
  (``module.watch_data(step)``: ``partc train``'s ``data(step)``), or at a checkpoint's
  storage work (writing or hashing its files in a save, reading or checking them in a
  load: ``"checkpoint save(step=12): writing"``), for longer than that phase's own limit
  (``PHASE_LIMIT_ENV``) while another rank waits (is in a partc phase, a collective's
  side of a save or load included). While a rank is at such work the previous verdict
  waits: the ranks in partc's phases may be waiting for it. Ranks all at such work at
  once (a slow loader on every rank) wait for no one and are not judged: no collective
  would time out either.

Other time between steps (``IDLE``: the user's optimizer, evaluation, anything partc is
not told of) is never judged, nor are ranks that wait on a rank there.

A rank that sees either logs an error naming the stuck rank(s), the step and the phase
each was in (as last published: each change is, at most ``PUBLISH_GAP_S`` late) and its
own, then ends its process with ``os._exit(EXIT_CODE)`` (a thread cannot interrupt a
blocked collective); torchrun then stops the other ranks. Ranks that
have not published yet (still building) are not judged, and while one is unheard of no
rank is judged by its phase (it may be waiting on that one); ranks that closed (their
module was freed, or the process exited normally or with an exception) are not judged.
While a rank's heartbeat is late (2.5 intervals), phase verdicts wait for the heartbeat
verdict, which names the stopped rank rather than the ranks waiting on it.

``PARTC_WATCHDOG_S`` sets the limit (default ``DEFAULT_LIMIT_S`` = 60 s, well under the
collective timeout; ``0`` turns the watchdog off). A single phase that legitimately takes
longer than the limit (one very long microbatch on a slow device) needs a larger limit.
The data call, saves and loads have limits of their own, ``PARTC_WATCHDOG_DATA_S``,
``PARTC_WATCHDOG_SAVE_S`` and ``PARTC_WATCHDOG_LOAD_S`` (``0``: that phase not judged), by
default ``SHARE_OF_TIMEOUT`` of the collective timeout (540 s of 600): a rank is named
before the collective timeout would end the ranks waiting for it without a name, and
nothing that timeout would have let finish is ended much sooner.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
import contextlib
from typing import Any, Callable, Iterator, Mapping

import torch.distributed as dist

log = logging.getLogger("partc.runtime.watchdog")

DEFAULT_LIMIT_S = 60.0
ENV_LIMIT = "PARTC_WATCHDOG_S"
EXIT_CODE = 75  # EX_TEMPFAIL: the job may succeed when launched again
IDLE = "between steps"
PUBLISH_GAP_S = 0.1  # the least time between two beats a rank publishes
# Between steps: the data call and a checkpoint's save and load, each with its limit.
DATA, SAVE, LOAD = "data", "checkpoint save", "checkpoint load"
PHASE_LIMIT_ENV = {DATA: "PARTC_WATCHDOG_DATA_S", SAVE: "PARTC_WATCHDOG_SAVE_S",
                   LOAD: "PARTC_WATCHDOG_LOAD_S"}
ENV_COLLECTIVE_TIMEOUT = "PARTC_TIMEOUT_S"   # topology.init's; 600 s by default
SHARE_OF_TIMEOUT = 0.9
# A save's or load's storage work ("checkpoint save(step=3): writing"); the rest of it
# is bookkeeping and collectives, where the ranks done with their files wait.
AT_WORK = ("writing", "reading", "hashing")
# partc's phases in the order one step runs them; (step, phase) orders ranks' progress.
PHASES = ("forward_backward", "schedule", "gradient sync", "loss all-reduce", "clip",
          "optimizer step", IDLE, SAVE, LOAD, DATA)


def limit_from_env(name: str = ENV_LIMIT, default: float = DEFAULT_LIMIT_S) -> float:
    """A limit in seconds from the environment variable ``name`` (the watchdog's,
    ``PARTC_WATCHDOG_S``, by default); 0 means off."""
    raw = os.environ.get(name, "")
    try:
        limit = float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if not limit >= 0 or limit == float("inf"):
        raise ValueError(f"{name}={raw!r}: give a finite number of seconds, 0 for off")
    return limit


def phase_limits_from_env() -> dict[str, float]:
    """The data call's, saves' and loads' limits (``PHASE_LIMIT_ENV``), by default
    ``SHARE_OF_TIMEOUT`` of the collective timeout; a phase set to 0 is left out."""
    timeout = limit_from_env(ENV_COLLECTIVE_TIMEOUT, 600.0)
    limits = {phase: limit_from_env(name, SHARE_OF_TIMEOUT * timeout)
              for phase, name in PHASE_LIMIT_ENV.items()}
    return {phase: limit for phase, limit in limits.items() if limit > 0}


@dataclass(frozen=True)
class Beat:
    """What a rank last published: its counter, where its main thread is, since when."""
    beat: int
    step: int
    phase: str
    in_phase_s: float
    closed: bool = False

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @staticmethod
    def from_json(text: bytes | str) -> "Beat":
        return Beat(**json.loads(text))

    @property
    def base(self) -> str:
        """The phase's name: "schedule: backward, microbatch 3" is "schedule",
        "data(step=12)" is "data"."""
        return self.phase.partition(":")[0].partition("(")[0].strip()

    @property
    def at_work(self) -> bool:
        """In the data call, or at a save's or load's storage work."""
        return self.base == DATA or self.phase.partition(":")[2].strip() in AT_WORK

    @property
    def waits(self) -> bool:
        """In partc's own phases (collectives), or a save's or load's other part."""
        return self.phase != IDLE and not self.at_work

    @property
    def position(self) -> tuple[int, int]:
        return self.step, PHASES.index(self.base) if self.base in PHASES else 0


@dataclass(frozen=True)
class Stuck:
    rank: int
    beat: Beat
    seconds: float
    why: str  # "no heartbeat", "stuck in a phase" or "at work" (too long)
    limit: float | None = None  # the limit it went over, when the phase has its own

    def describe(self) -> str:
        if self.why == "at work":
            return (f"rank {self.rank} spent {self.seconds:.1f} s in {self.beat.phase} while "
                    f"other ranks waited for it (the limit: {self.limit:g} s, "
                    f"{PHASE_LIMIT_ENV[self.beat.base]})")
        what = ("no heartbeat (the process is stopped or frozen)" if self.why == "no heartbeat"
                else "its main thread did not leave the phase")
        return (f"rank {self.rank} made no progress for {self.seconds:.1f} s: {what}; "
                f"it was at step {self.beat.step}, phase '{self.beat.phase}'")


@dataclass
class Seen:
    """A reader's record of one rank: its last beat, and when (reader's clock) it changed."""
    beat: Beat
    changed_at: float


def stuck_ranks(seen: Mapping[int, Seen], now: float, limit: float,
                grace: float = 2.0, limits: Mapping[str, float] | None = None
                ) -> list[Stuck]:
    """The ranks to report, from what one rank has seen of all (itself included).
    ``grace``: how late a heartbeat may be (a few intervals) before it is suspect;
    ``limits``: the phases with a limit of their own (``phase_limits_from_env``)."""
    limits = limits or {}
    live = {rank: s for rank, s in seen.items() if not s.beat.closed}
    stopped = [Stuck(rank, s.beat, now - s.changed_at, "no heartbeat")
               for rank, s in sorted(live.items()) if now - s.changed_at > limit]
    if stopped:
        return stopped
    if not live or any(now - s.changed_at > grace for s in live.values()):
        # A rank whose heartbeat is late may be stopped: the ranks waiting on it are
        # stuck in their phase too; the heartbeat verdict, due soon, names the right one.
        return []

    def in_phase(s: Seen) -> float:
        return s.beat.in_phase_s + (now - s.changed_at)

    if any(s.beat.at_work for s in live.values()):
        # The ranks in partc's phases may be waiting for one at work: only those at work
        # are judged, and only while someone waits.
        if not any(s.beat.waits for s in live.values()):
            return []
        return [Stuck(rank, s.beat, in_phase(s), "at work", limits[s.beat.base])
                for rank, s in sorted(live.items()) if s.beat.at_work
                and s.beat.base in limits and in_phase(s) > limits[s.beat.base]]
    earliest = min(s.beat.position for s in live.values())
    return [Stuck(rank, s.beat, in_phase(s), "stuck in a phase")
            for rank, s in sorted(live.items())
            if s.beat.position == earliest and s.beat.phase != IDLE
            and in_phase(s) > limits.get(s.beat.base, limit)]


class Watchdog:
    """One rank's watchdog: :meth:`mark` records progress, a daemon thread publishes it
    and judges the other ranks'. ``store`` is any ``torch.distributed.Store``; ``clock``
    and ``on_stuck`` (default: log and ``os._exit``) are there for tests."""

    def __init__(self, store: Any, *, rank: int, world_size: int, limit: float,
                 limits: Mapping[str, float] | None = None,
                 prefix: str = "partc/watchdog", clock: Callable[[], float] = time.monotonic,
                 on_stuck: Callable[[str], None] | None = None) -> None:
        self.store, self.rank, self.world_size, self.limit = store, rank, world_size, limit
        self.limits = dict(limits or {})  # the phases with a limit of their own
        self.clock = clock
        self.interval = min(1.0, min([limit, *self.limits.values()]) / 5)
        self.on_stuck = on_stuck or _exit
        # Every rank builds its modules in the same order: the nth build's keys match.
        generation = store.add(f"{prefix}/builds/{rank}", 1)
        self._keys = [f"{prefix}/{generation}/{r}" for r in range(world_size)]
        self._lock = threading.Lock()
        self._step, self._phase, self._since = 0, IDLE, clock()
        self._beat = 0
        self._seen: dict[int, Seen] = {}
        self._stop = threading.Event()
        self._changed = threading.Event()  # set by mark(): publish soon
        self._store_failing = False
        self._thread: threading.Thread | None = None

    def mark(self, phase: str, step: int | None = None) -> None:
        """The main thread entered ``phase`` (of ``step``, if a new step began)."""
        with self._lock:
            if step is not None:
                self._step = step
            self._phase, self._since = phase, self.clock()
        self._changed.set()

    def start(self) -> "Watchdog":
        self.tick()  # published before the first step: a rank stopped early is seen
        self._thread = threading.Thread(target=self._run, name=f"partc-watchdog-{self.rank}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and tell the other ranks this one is done (not stuck)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval + 1)
        try:
            self.store.set(self._keys[self.rank], self._current(closed=True).to_json())
        except Exception:  # the store may be gone at exit; the peers stop judging anyway
            pass

    def _run(self) -> None:
        # Publish each change (at most every PUBLISH_GAP_S, so that a peer learns where a
        # rank stopped), and publish and judge every interval.
        next_check = time.monotonic() + self.interval
        while not self._stop.is_set():
            changed = self._changed.wait(max(0.0, next_check - time.monotonic()))
            if self._stop.is_set():
                break
            self._changed.clear()  # before reading the state: a later mark is not lost
            if time.monotonic() >= next_check:
                self.tick()
                next_check = time.monotonic() + self.interval
            elif changed:
                self._publish()
            if changed:
                self._stop.wait(PUBLISH_GAP_S)

    def _publish(self) -> None:
        try:
            self.store.set(self._keys[self.rank], self._current().to_json())
        except Exception:  # tick() reports a failing store
            pass

    def tick(self) -> None:
        """Publish this rank's beat, read the others', and act on a stuck rank."""
        if self._stop.is_set():
            return
        try:
            self.store.set(self._keys[self.rank], self._current().to_json())
            peers = self._read_peers()
        except Exception as error:  # a store that does not answer is not a verdict
            if not self._store_failing:
                log.warning("partc watchdog on rank %d: the store failed (%s); retrying",
                            self.rank, error)
            self._store_failing = True
            return
        self._store_failing = False
        now = self.clock()
        for rank, beat in peers.items():
            old = self._seen.get(rank)
            if old is None or old.beat.beat != beat.beat or beat.closed:
                self._seen[rank] = Seen(beat, now)
        self._seen[self.rank] = Seen(self._current(), now)
        stuck = stuck_ranks(self._seen, now, self.limit, grace=2.5 * self.interval,
                            limits=self.limits)
        if len(self._seen) < self.world_size:
            # A rank not heard of yet may be the one this rank waits on: no phase verdict.
            stuck = [s for s in stuck if s.why == "no heartbeat"]
        if stuck:
            self._stop.set()  # one report: os._exit does not return, a test's on_stuck does
            self.on_stuck(self._message(stuck))

    def _current(self, closed: bool = False) -> Beat:
        with self._lock:
            self._beat += 1
            return Beat(self._beat, self._step, self._phase,
                        round(self.clock() - self._since, 3), closed)

    def _read_peers(self) -> dict[int, Beat]:
        others = [r for r in range(self.world_size) if r != self.rank]
        keys = [self._keys[r] for r in others]
        if self.store.check(keys):
            values = self.store.multi_get(keys)
            return {r: Beat.from_json(v) for r, v in zip(others, values)}
        return {r: Beat.from_json(self.store.get(self._keys[r]))
                for r in others if self.store.check([self._keys[r]])}

    def _message(self, stuck: list[Stuck]) -> str:
        me = self._current()
        lines = [f"partc watchdog on rank {self.rank}: " + s.describe() for s in stuck]
        lines.append(f"partc watchdog on rank {self.rank}: this rank is at step {me.step}, "
                     f"phase '{me.phase}'; ending the process with exit code {EXIT_CODE} so "
                     f"the job stops instead of hanging ({ENV_LIMIT}={self.limit:g} s sets "
                     "the limit, 0 turns the watchdog off)")
        return "\n".join(lines)


class PhaseMarks:
    """The parts of one phase between steps (a checkpoint's save or load) as the
    watchdog hears them: ``with marks.at_work("writing"):`` marks the block
    ``"<phase>: writing"``, storage work that ranks done with theirs wait for; outside
    such blocks the rank is in ``phase`` itself (bookkeeping and collectives)."""

    def __init__(self, mark: Callable[[str], None], phase: str) -> None:
        self._mark, self.phase = mark, phase

    @contextlib.contextmanager
    def at_work(self, what: str) -> Iterator[None]:
        self._mark(f"{self.phase}: {what}")
        try:
            yield
        finally:
            self._mark(self.phase)


def at_work(marks: PhaseMarks | None, what: str) -> contextlib.AbstractContextManager:
    """``marks.at_work(what)``, or nothing without marks (no watchdog listening)."""
    return marks.at_work(what) if marks is not None else contextlib.nullcontext()


def _exit(message: str) -> None:
    log.error("%s", message)
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    os._exit(EXIT_CODE)


def start(rank: int, world_size: int) -> Watchdog | None:
    """This rank's watchdog on the launcher's store, or None: one process, no
    ``MASTER_ADDR``/``MASTER_PORT``, ``PARTC_WATCHDOG_S=0``, or no store to reach."""
    limit = limit_from_env()
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if world_size < 2 or limit == 0 or not address or not port:
        return None
    try:
        # A client of its own: the process group's store may be busy in a blocking wait.
        store = dist.TCPStore(address, int(port), is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=max(limit, 5.0)))
    except Exception as error:
        log.warning("partc watchdog on rank %d: no store at %s:%s (%s); running without it",
                    rank, address, port, error)
        return None
    run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/" \
          f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return Watchdog(store, rank=rank, world_size=world_size, limit=limit,
                    limits=phase_limits_from_env(), prefix=f"partc/watchdog/{run}").start()
