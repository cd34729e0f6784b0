"""The CP-SAT model of one pipeline configuration: which layers sit in which run (stage)
and in which recompute mode, for the least step time under each stage's memory limit.

The configuration ``(tp, pp, dp, b, m, schedule, ZeRO stage, chunks v)`` is fixed here
(:mod:`.search` enumerates them); all costs come from its :mod:`partc.cost.tables` table.

Sets
    layers ``l = 0..L-1`` in topological order; runs ``j = 0..pv-1`` (contiguous groups
    of layers; run ``j`` is on stage ``j mod p``, so with ``v = 1`` runs are stages);
    stages ``s = 0..p-1``; segments ``k = 0..K-1``: maximal runs of consecutive layers
    ``a_k..b_k`` (``n_k`` of them) with one cost row, one set of allowed recompute modes
    ``r``, one set of shared (tied) parameter groups ``g`` using them, one pinned stage
    and one cut row on the cuts between them: interchangeable layers, so the model
    counts them instead of placing each (80 equal blocks are one segment). Below,
    ``j ~ s`` reads "run ``j`` is on stage ``s``".
Parameters
    per segment, as for each of its layers: ``C[k,r]`` compute per microbatch (forward +
    backward + recompute), ``F_k`` its forward; ``T_k`` tail time (optimizer step,
    ZeRO-1's gather unless it overlaps forward); ``G_k`` ZeRO-1's gather overlapping the
    next forward, ``G_first`` one bucket's; ``D_k`` dp gradient all-reduce; ``B_k``
    backward per microbatch; ``W_k`` parameter + gradient + optimizer bytes; ``A[k,r]``
    saved bytes per microbatch; ``X[k,r]`` transient bytes. ``I_k[j]`` / ``E_k[j]``
    send/recv time when the boundary between run ``j`` and ``j+1`` falls inside segment
    ``k`` / right after it; ``T_g``, ``D_g``, ``G_g``, ``W_g`` likewise per shared group;
    ``H_s`` the schedule's peaks on stage ``s``: vectors ``h`` of microbatches in
    flight per run ``j ~ s`` (1F1B one, ``min(m, p - s)``; an interleaved stage holds
    its first run's warm-up forwards more often than its later runs',
    :meth:`partc.cost.pipeline_config.PipelineConfig.held`); ``R_k`` / ``Q_k`` bytes crossing a
    cut inside segment ``k`` / right after it, per microbatch (one receive buffer);
    ``M_s`` memory limit; ``S_g`` tied-gradient sync. The recompute modes ``r`` include
    ``offload`` (:mod:`partc.cost.offload_time`: its ``C`` pays the copies' exposed
    time, its ``A`` is 0, its ``X`` holds the window in flight).
Variables
    ``P[k,j]`` in ``0..n_k``: layers of segment ``k`` in runs ``<= j`` (so ``c[k,j] =
    P[k,j] - P[k,j-1]`` sit in run ``j`` and ``N[k,s] = sum_{j ~ s} c[k,j]`` on stage
    ``s``); booleans ``started[k,j] = [P[k,j] >= 1]``, ``finished[k,j] = [P[k,j] =
    n_k]``; ``n[k,s,r]`` layers of ``k`` on ``s`` in mode ``r`` (a stage whose peaks
    hold its runs unequally splits it per run, ``n[k,s,r] = sum_{j ~ s} n[k,j,r]``),
    ``u[k,s,r]`` mode ``r`` used there; ``h[g,s]`` stage ``s`` holds group ``g``;
    ``peak_busy``; ``tail``; ``transient[s]``. (A segment of one layer: ``P = started =
    finished`` is the boolean "the layer sits in a run ``<= j``" and ``n = u``.)
Objective
    minimise ``v m peak_busy + (sum_s busy_s - peak_busy + delays) + v (tail + sum_g S_g
    (sum_s h[g,s] - 1))`` (``delays``: what of every boundary's transfers neither end
    pays, the cut's ``I``/``E`` less one end's share, as ``busy_s`` sums them), ``v`` times
    the step time (``v = 1``: ``(m - 1) peak_busy + sum_s
    busy_s + ...``), where ``busy_s = sum_{k,r} C[k,r] n[k,s,r] + sum_{j ~ s, j < pv-1}
    sum_k (I_k[j] (started[k,j] - finished[k,j]) + E_k[j] (finished[k,j] -
    started[k+1,j]))`` plus, for the boundary into each run ``j ~ s, j > 0``, the same
    sum at ``j - 1``, ``I`` and ``E`` each end's share of the cut's transfers
    (:func:`partc.cost.evaluate.boundary_share_ps`: ``(1000 - O) / 1000`` of them; the
    transfers' delays are the simulation's, which the plan reports).
Constraints
    (1) every layer has exactly one mode: ``sum_r n[k,s,r] = N[k,s]``, ``n[k,s,r] <= n_k
        u[k,s,r]``;
    (2) contiguity: ``P[k,j] <= P[k,j+1]``, ``P[k,pv-1] = n_k``, ``started`` and
        ``finished`` linked to ``P`` (``started <= P <= n_k started``, ``n_k finished <=
        P <= n_k - 1 + finished``), a segment starts only after the previous one
        finished: ``started[k+1,j] <= finished[k,j]``, and every run holds a layer:
        ``sum_k c[k,j] >= 1``; layer ``l`` can only sit in runs ``pv-1-(L-1-l)..l``,
        which bounds ``P``;
    (3) with (2), the boundary ``j -> j+1`` falls inside segment ``k`` exactly when
        ``started[k,j] - finished[k,j] = 1`` and right after it exactly when
        ``finished[k,j] - started[k+1,j] = 1``: one of these terms is 1 for each ``j``;
    (4) ``peak_busy >= busy_s``;
    (5) ``n_k h[g,s] >= N[k,s]`` for segments ``k`` using ``g``;
    (6) ``tail >= sum_k T_k N[k,s] + sum_g T_g h[g,s] + exposed[s] + gathered[s]`` with
        ``4000 v exposed[s] >= 4000 j (D_s - D_last) - O K_j B_s`` for each ``j`` of
        ``1 .. v`` and ``1000 exposed[s] >= (1000 - O) (D_s - D_last)`` where ``D_s =
        sum_k D_k N[k,s] + sum_g D_g h[g,s]`` and ``B_s = sum_k B_k N[k,s]``: the dp
        all-reduce ``D`` (ZeRO 0/1) of each of the rank's ``v`` virtual stages starts as
        that stage's last backward does; the ``j`` finished last, ``j / v`` of ``D_s``,
        are reduced beside what the rank's backwards do from the ``j``-th from last on,
        ``K_j`` quarters of one stage's ``B_s / v`` (the schedule's order,
        :func:`partc.cost.timeline.overlap_windows`; 4 for one stage per rank: the last
        microbatch's backward), which hides ``O``/1000 of them (``comm_overlap``), all but
        the last bucket's ``D_last``, which starts as that backward ends (a constant of
        the step: ``CostTable.tail_latency_ps``); likewise ``gathered[s]`` for ZeRO-1's
        weight all-gather ``G`` (``G_s`` summed as ``D_s``) beside the next step's forwards
        ``F_s = sum_k F_k N[k,s]`` of a microbatch, the ``j``-th stage's waited for by its
        first forward after ``K_j`` quarters of forwards, all but the first bucket's
        ``G_first``, which the first layer waits for before any runs (a constant of the
        step: ``CostTable.tail_latency_ps``);
    (7) ``transient[s] >= X[k,r] u[k,s,r]``;
    (8) memory, at each peak ``h`` in ``H_s``: ``sum_k W_k N[k,s] + sum_g W_g h[g,s] +
        transient[s] + sum_{j ~ s} h_j sum_{k,r} A[k,r] n[k,j,r] + sum_{j ~ s, j < pv-1}
        cut[j] <= M_s`` (``n[k,j,r]`` the stage's ``n[k,s,r]`` where its peaks hold every
        run alike), where ``cut[j] = sum_k (R_k (started[k,j] - finished[k,j]) + Q_k
        (finished[k,j] - started[k+1,j]))`` are the bytes crossing the boundary ``j ->
        j+1`` (as (3)): the pipeline's receive buffers, one per run for the gradient
        coming back while its backward runs; the activations coming in are the runs'
        saved inputs, already in ``A`` (:func:`partc.cost.evaluate.receive_bytes`); and at
        the optimizer step, the activations gone: ``sum_k W_k N[k,s] + sum_g W_g h[g,s] +
        step[s] <= M_s``, ``step[s]`` the step's temporaries ``T_k``, ``T_g`` of the
        stage's layers and groups summed (torch's foreach step) or their largest (one
        tensor at a time: ``step[s] >= T_k u[k,s,r]``)
        (:func:`partc.cost.state_bytes.step_bytes`);
    (9) pins: pinned stages fix ``P``, pinned recompute leaves one mode (segments never
        straddle a change of either);
    (10) host memory, per node ``c`` (none where the host's memory is not known):
        ``R host_state + sum_s C[c,s] host_act[s] <= M^host``, ``M^host`` the node's
        host memory, ``R`` its ranks, ``C[c,s]`` how many of them hold stage ``s``; with
        ``host_state >= sum_k Y_k N[k,s] + sum_g Y_g h[g,s]`` for every stage, ``Y`` the
        host bytes a rank keeps for a layer's parameters under optimizer and parameter
        offload (fp32 master, gradient and optimizer state of its stepped share; as the
        validator, the busiest stage's rank's counted for every rank of a node), and
        ``host_act[s] >= sum_{j ~ s} h_j sum_k O_k n[k,j,offload]`` at each peak ``h``
        in ``H_s``, ``O_k`` the bytes an offloaded layer of ``k`` keeps on the host per
        microbatch (its saved bytes without recompute).

The plan names each layer again: a segment's layers fill its runs in order, and on each
stage (or run, where modes split per run) take their modes heaviest first (full,
selective, none). Every layer of a segment costs the same in any mode and any position,
and the cuts inside it cost alike, so the model is exact: its optimum is the optimum over
per-layer assignments.

Integers
    times are picoseconds, integers already in the cost table, in units of
    :func:`time_unit` of them (:meth:`StageModel.ticks`: one picosecond, unless the
    objective could pass 2^53, where its double stops being exact, as a million-token
    pipeline's does: then a coarser power of two, each time rounded up); bytes are scaled to units
    of about 2^-20 of the largest limit by one helper (:meth:`StageModel.memory_units`:
    sizes rounded up, limits down, so whatever fits in units fits in bytes). The
    objective is ``v`` times the step time so that it stays integral.
Names
    every CP-SAT variable is named after its symbol: ``P[k,j]`` is
    ``segment{k}_in_runs_to{j}``, ``started``/``finished`` ``segment{k}_started_by_run{j}``
    / ``segment{k}_finished_by_run{j}``, ``n[k,s,r]`` ``segment{k}_rank{s}_{r}``
    (``n[k,j,r]`` ``segment{k}_rank{s}_run{j}_{r}``), ``u[k,s,r]``
    ``segment{k}_rank{s}_uses_{r}``, ``h[g,s]`` ``shared{g}_on_stage{s}``,
    ``exposed[s]`` ``exposed_sync_stage{s}``, ``gathered[s]`` ``exposed_gather_stage{s}``
    (with several runs a rank, ``D_s - D_last`` and ``B_s`` as ``sync_stage{s}_collective``
    and ``sync_stage{s}_hiding``, the gather's likewise),
    ``transient[s]`` ``transient_stage{s}``;
    bounds that leave a variable one value make it a constant instead.

CP-SAT starts from a hint (:func:`~.bounds.incumbent`, :meth:`StageModel.add_hint`), so
it holds a plan at once, and it is stopped by work (deterministic seconds,
:mod:`partc.cp_sat`), never by the clock, so where it stops is the same on any machine.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ortools.sat.python import cp_model, cp_model_helper

from partc.cost.evaluate import boundary_share_ps, stage_windows
from partc.cost.offload_time import host_bytes
from partc.cost.tables import CostTable
from partc.cost.timeline import WINDOW_STEPS, overlap_windows
from partc.planner.results import Assignment
from partc.problem import RECOMPUTE_MODES, PlanningProblem


@dataclass(frozen=True, kw_only=True)
class Segment:
    """Layers ``first..last`` (inclusive): one row, one set of allowed modes, one set of
    shared groups using them, one pinned stage, and one cut row (time and bytes) on every
    cut between them. Its layers are interchangeable, so the model only counts them."""

    first: int
    last: int
    modes: tuple[str, ...]
    groups: frozenset[int]

    @property
    def size(self) -> int:
        return self.last - self.first + 1


def segments(problem: PlanningProblem, table: CostTable,
             pinned: list[int] | None) -> list[Segment]:
    """The layers cut into maximal segments ``k`` of equal neighbours (see
    :class:`Segment`); a pinned mode or stage (9) ends a segment."""
    users = [frozenset(g for g, group in enumerate(table.shared) if l in group.layers)
             for l in range(table.num_layers)]

    def key(l: int) -> tuple:
        return (table.layers[l], problem.allowed_modes(l), users[l],
                pinned[l] if pinned is not None else None)

    found: list[Segment] = []
    first, current = 0, key(0)
    for layer in range(1, table.num_layers + 1):
        following = key(layer) if layer < table.num_layers else None
        if following == current and (layer - 1 == first
                                      or table.cut_ps[layer - 1] == table.cut_ps[first]
                                      and table.cut_bytes[layer - 1] == table.cut_bytes[first]):
            continue
        found.append(Segment(first=first, last=layer - 1, modes=tuple(current[1]),
                              groups=current[2]))
        first, current = layer, following
    return found


class StageModel:
    """The CP-SAT model of one configuration (the module docstring's formulation); one
    method per constraint group, each citing its numbers.

    Run membership is encoded by prefix counts ``prefix[k][j]`` = "how many layers of
    segment ``k`` sit in runs ``<= j``", monotone in ``j``, with the booleans
    ``started[k][j]`` (some do) and ``finished[k][j]`` (all do). A segment of one layer
    is the interval encoding of a single layer (its prefix is the boolean "before").
    Counting interchangeable layers instead of naming them leaves CP-SAT one integer per
    segment and run where it had a boolean per layer, run and mode, and none of the
    equivalent orders of 128 equal blocks to search through.
    """

    def __init__(self, problem: PlanningProblem, table: CostTable,
                 pinned: list[int] | None, *, step: bool = True) -> None:
        """``step``: with (8)'s constraint at the optimizer step (without it the model is
        a relaxation, which :func:`partc.planner.search.solve_config` solves first)."""
        self.problem, self.table = problem, table
        self.model = cp_model.CpModel()
        self.segments = segments(problem, table, pinned)
        self.unit = memory_unit(table)
        self.tick = time_unit(table)
        self.runs = range(table.config.virtual_stages)
        self.ranks = range(table.config.pp)
        self._add_runs(pinned)                       # (2), (9)
        self._add_modes()                            # (1), (9)
        busy = self._add_busy()                      # (3), (4)
        held = self._add_holders()                   # (5)
        tail = self._add_tail(held)                  # (6)
        self._add_memory(held, step)                 # (7), (8)
        tie = sum(self.ticks(g.tie_sync_ps) * (sum(held[gi]) - 1)
                  for gi, g in enumerate(table.shared))
        m, v = table.config.num_microbatches, table.config.fill_divisor
        # Objective: v times the step time (see partc.cost.evaluate.pipeline_ps, v its fill
        # divisor): the fill-and-drain term is divided by v, the rest multiplied, so that
        # the objective stays integral.
        delays = sum(self.delay_boundary_ps(run) for run in range(len(self.runs) - 1))
        self.model.minimize(v * m * self.peak_busy + sum(busy) - self.peak_busy + delays
                            + v * (tail + tie + self.ticks(table.tail_latency_ps)))

    def _variable(self, low: int, high: int, name: str, boolean: bool = False):
        """A constant when ``low == high``, else a new integer (or boolean) variable."""
        if low == high:
            return low
        if boolean:
            return self.model.new_bool_var(name)
        return self.model.new_int_var(low, high, name)

    def _require(self, constraint) -> None:
        """Add ``constraint``, unless both its sides are constants and it holds."""
        if constraint is not True:
            self.model.add(constraint)

    def memory_units(self, nbytes: int, *, limit: bool = False) -> int:
        """``nbytes`` in units of :func:`memory_unit` bytes, the one scaling of bytes to
        the model's integers: a size rounded up, a limit down, so whatever fits in units
        fits in bytes."""
        return nbytes // self.unit if limit else -(-nbytes // self.unit)

    def ticks(self, ps: int) -> int:
        """``ps`` picoseconds in units of :func:`time_unit` picoseconds, the one scaling
        of times to the model's integers: rounded up (itself at one picosecond)."""
        return -(-ps // self.tick)

    def step_ps(self, objective: float, *, bound: bool = False) -> int:
        """The objective (``v`` times the step time, in units) in picoseconds: at one
        picosecond a unit, the integer itself; else its picoseconds give or take the
        rounding of :meth:`ticks` (each coefficient up by under a unit, a few thousand
        units in all against an objective kept near 2^52 units), so ``bound`` (a lower
        bound) takes ``_ROUNDING`` of it off and a value adds it."""
        value = round(objective) if not bound else math.ceil(objective - 1e-6)
        if self.tick == 1:
            return value
        return math.floor(value * self.tick * (1 - _ROUNDING)) if bound \
            else math.ceil(value * self.tick * (1 + _ROUNDING))

    def _add_runs(self, pinned: list[int] | None) -> None:
        """(2) contiguity of runs through the prefix counts ``P``, and (9) pinned
        stages; ``N[k][s]`` (``on_rank``) from them."""
        last, p = self.table.num_layers - 1, self.table.config.virtual_stages
        self.prefix, self.started, self.finished = [], [], []
        for k, seg in enumerate(self.segments):
            prefix, started, finished = [], [], []
            for run in self.runs:
                # (2) Layer l sits in a run between p - 1 - (last - l) and l (every
                # run holds a layer); (9) a pinned one in its stage.
                low = seg.size if run == p - 1 else max(0, min(seg.last, run) - seg.first + 1)
                high = max(0, min(seg.last, run + last - p + 1) - seg.first + 1)
                if pinned is not None:
                    low = high = seg.size if pinned[seg.first] <= run else 0
                count = self._variable(low, high, f"segment{k}_in_runs_to{run}",
                                       boolean=seg.size == 1)
                prefix.append(count)
                if seg.size == 1:
                    started.append(count)
                    finished.append(count)
                    continue
                started.append(self._variable(min(low, 1), min(high, 1),
                                              f"segment{k}_started_by_run{run}", True))
                finished.append(self._variable(int(low == seg.size), int(high == seg.size),
                                               f"segment{k}_finished_by_run{run}", True))
                # (2) started <= P <= n_k started, n_k finished <= P <= n_k - 1 + finished
                self._require(count >= started[-1])
                self._require(count <= seg.size * started[-1])
                self._require(count >= seg.size * finished[-1])
                self._require(count <= seg.size - 1 + finished[-1])
            for run in self.runs[:-1]:                # (2) P is monotone in the run
                self._require(prefix[run] <= prefix[run + 1])
            self.prefix.append(prefix)
            self.started.append(started)
            self.finished.append(finished)
        for k in range(len(self.segments) - 1):    # (2) segment k + 1 starts after k ends
            for run in self.runs:
                self._require(self.started[k + 1][run] <= self.finished[k][run])
        for run in self.runs:                      # (2) every run holds a layer
            self._require(sum(self.in_run(k, run) for k in range(len(self.segments))) >= 1)
        # N[k][s]: how many layers of segment k sit on rank s (in any of its runs)
        self.on_rank = [[sum(self.in_run(k, run) for run in self.table.config.runs_of(rank))
                         for rank in self.ranks] for k in range(len(self.segments))]

    def in_run(self, k: int, run: int):
        """How many layers of segment ``k`` sit in ``run``."""
        return self.prefix[k][run] - (self.prefix[k][run - 1] if run else 0)

    def _add_modes(self) -> None:
        """(1) ``count[s][k, r]`` (``n[k,s,r]``) layers of segment ``k`` on rank ``s``
        use mode ``r``; ``used[s][k, r]`` (``u[k,s,r]``) is 1 when any does (for the
        transient, (7)). A segment with one allowed mode, pinned (9) or not, has no choice.
        A rank holding its runs unequally at its peaks (interleaved 1F1B: the first run's
        warm-up) splits modes per run (``n[k,j,r]``, summed into the rank's), since a
        byte saved in one run is held more often than in another (8); ``mode_units``
        lists the (rank, runs) each split covers."""
        config = self.table.config
        self.mode_units: list[tuple[int, tuple[int, ...]]] = []
        for rank in self.ranks:
            runs = config.runs_of(rank)
            unequal = any(len(set(peak)) > 1 for peak in config.held(rank))
            self.mode_units += [(rank, (run,)) for run in runs] if unequal \
                else [(rank, runs)]
        # Whether some rank splits its modes per run (its memory then weighs each run).
        self.splits_runs = len(self.mode_units) > len(self.ranks)
        self.unit_count: list[dict[tuple[int, str], Any]] = [{} for _ in self.mode_units]
        self._unit_used: dict[tuple[int, int, str], Any] = {}
        self.count: list[dict[tuple[int, str], Any]] = [{} for _ in self.ranks]
        self.used: list[dict[tuple[int, str], Any]] = [{} for _ in self.ranks]
        for k, seg in enumerate(self.segments):
            for u, (rank, runs) in enumerate(self.mode_units):
                count = self.unit_count[u]
                total = self.in_run(k, runs[0]) if len(runs) == 1 and config.chunks > 1 \
                    else self.on_rank[k][rank]
                if len(seg.modes) == 1 or isinstance(total, int) and total == 0:
                    count.update({(k, r): total if r == seg.modes[0] else 0
                                  for r in seg.modes})
                    continue
                name = f"segment{k}_rank{rank}" + (f"_run{runs[0]}" if len(runs) == 1
                                                   and config.chunks > 1 else "")
                split = [self.model.new_int_var(0, seg.size, f"{name}_{r}")
                         for r in seg.modes]
                self.model.add(sum(split) == total)
                count.update({(k, r): c for r, c in zip(seg.modes, split)})
            self._order_runs(k, seg)
            for rank in self.ranks:
                parts = [self.unit_count[u] for u, (owner, _) in enumerate(self.mode_units)
                         if owner == rank]
                for r in seg.modes:
                    count = parts[0][k, r] if len(parts) == 1 \
                        else sum(part[k, r] for part in parts)
                    self.count[rank][k, r] = count
                    self.used[rank][k, r] = self._indicator(
                        count, seg.size, f"segment{k}_rank{rank}_uses_{r}")

    def _order_runs(self, k: int, seg: Segment) -> None:
        """(1) Of two runs of a rank split per run, where one is held at least as often
        as the other at every peak, the first holds segment ``k``'s leaner modes: no
        layer of ``k`` in the other saves less than one in the first. Swapping two such
        layers' modes changes neither a rank's compute nor its modes (nor so its
        transient), and frees ``(h_a - h_b)(A[k,fat] - A[k,lean]) >= 0`` bytes at each
        peak ``h``: an optimum keeps this order, and CP-SAT need not search the
        equivalent splits."""
        saved = self.table.layers[seg.first].saved_bytes
        pairs = [(lean, fat) for lean in seg.modes for fat in seg.modes
                 if saved[lean] < saved[fat]]
        if not pairs:
            return
        for rank in self.ranks:
            units = [(u, runs[0]) for u, (owner, runs) in enumerate(self.mode_units)
                     if owner == rank and len(runs) == 1]
            if len(units) < 2:
                continue
            peaks = self._peaks(rank)
            for a, run_a in units:
                for b, run_b in units:
                    if a == b or not all(h[run_a] >= h[run_b] for h in peaks):
                        continue
                    if all(h[run_a] == h[run_b] for h in peaks) and a > b:
                        continue        # held alike: order them once, the earlier first
                    for lean, fat in pairs:
                        self._require(self._mode_used(b, k, lean, seg)
                                      + self._mode_used(a, k, fat, seg) <= 1)

    def _mode_used(self, u: int, k: int, r: str, seg: Segment):
        """1 when a layer of segment ``k`` in mode split ``u`` uses mode ``r`` (made
        once)."""
        if (u, k, r) not in self._unit_used:
            self._unit_used[u, k, r] = self._indicator(
                self.unit_count[u][k, r], seg.size, f"segment{k}_unit{u}_uses_{r}")
        return self._unit_used[u, k, r]

    def _indicator(self, count, most: int, name: str):
        """1 when ``count`` (of at most ``most``) is not 0: a constant, ``count`` itself
        where it is already 0 or 1, else a boolean ``used`` with ``count <= most
        used``."""
        if isinstance(count, int):
            return int(count > 0)
        if most == 1:
            return count
        used = self.model.new_bool_var(name)
        self.model.add(count <= most * used)
        return used

    def _peaks(self, rank: int) -> list[dict[int, int]]:
        """The schedule's peaks on ``rank`` (:meth:`PipelineConfig.held`), each as the
        microbatches held of each of its runs."""
        config = self.table.config
        return [dict(zip(config.runs_of(rank), peak)) for peak in config.held(rank)]

    def boundary_ps(self, run: int):
        """(3) Either end's share of the transfers at the boundary ``run -> run + 1``
        (:func:`partc.cost.evaluate.boundary_share_ps`), charged to both ``run``'s rank
        (it sends the activation, receives the gradient) and ``run + 1``'s."""
        return self._at_boundary(
            run, lambda cut: self.ticks(boundary_share_ps(self.table, cut, run)))

    def delay_boundary_ps(self, run: int):
        """(3) What of the transfers at the boundary ``run -> run + 1`` neither end pays
        (:func:`partc.cost.evaluate.transfer_delays_ps`): in the fill-and-drain."""
        def delay(cut: int) -> int:
            whole = self.table.cut_ps[cut][run]
            return self.ticks(whole - boundary_share_ps(self.table, cut, run))
        return self._at_boundary(run, delay)

    def boundary_units(self, run: int):
        """(8) The bytes crossing the boundary ``run -> run + 1`` per microbatch, in
        memory units."""
        return self._at_boundary(run, lambda cut: self.memory_units(self.table.cut_bytes[cut]))

    def _at_boundary(self, run: int, value):
        """(3) ``value`` of the cut at the boundary ``run -> run + 1``: the segment's
        inner cut where the boundary falls inside one, its last cut where it falls after
        it (exactly one of the terms is 1 by (2))."""
        total = 0
        for k, seg in enumerate(self.segments):
            if seg.size > 1:
                inside = self.started[k][run] - self.finished[k][run]
                total += value(seg.first) * inside
            if k + 1 < len(self.segments):
                after = self.finished[k][run] - self.started[k + 1][run]
                total += value(seg.last) * after
        return total

    def _add_busy(self) -> list:
        """``busy_s`` of each rank (its compute and the boundaries (3) of its runs) and
        (4) ``peak_busy >= busy_s``."""
        table, busy, ticks = self.table, [], self.ticks
        horizon = sum(max(ticks(row.compute_ps(r)) for r in row.recompute_ps)
                      for row in table.layers)
        horizon += 2 * sum(ticks(max(row, default=0)) for row in table.cut_ps)
        self.peak_busy = self.model.new_int_var(0, horizon, "peak_busy")
        last_run = table.config.virtual_stages - 1
        for rank in self.ranks:
            compute = sum(ticks(table.layers[self.segments[k].first].compute_ps(r)) * count
                          for (k, r), count in self.count[rank].items())
            comm = sum(self.boundary_ps(run) for run in table.config.runs_of(rank)
                       if run < last_run)
            comm += sum(self.boundary_ps(run - 1)
                        for run in table.config.runs_of(rank) if run > 0)
            busy.append(compute + comm)
            self.model.add(self.peak_busy >= compute + comm)
        return busy

    def _add_holders(self) -> list[list]:
        """(5) ``h[g,s]``: stage ``s`` holds shared group ``g`` when it has a layer
        using it."""
        held = []
        for gi in range(len(self.table.shared)):
            row = []
            for rank in self.ranks:
                h = self.model.new_bool_var(f"shared{gi}_on_stage{rank}")
                for k, seg in enumerate(self.segments):
                    if gi in seg.groups:
                        self.model.add(self.on_rank[k][rank] <= seg.size * h)
                row.append(h)
            held.append(row)
        return held

    def _per_rank(self, rank: int, value) -> Any:
        """``sum_k value(row of k) N[k, rank]``: a per-layer number summed over the
        rank's layers."""
        return sum(value(self.table.layers[seg.first]) * self.on_rank[k][rank]
                   for k, seg in enumerate(self.segments))

    def _add_tail(self, held: list[list]):
        """(6) the tail after the last microbatch: the optimizer step of each stage's
        layers and shared groups, the dp all-reduce its backward leaves exposed and
        ZeRO-1's weight all-gather the next forward leaves exposed."""
        table, ticks = self.table, self.ticks
        rows = [*table.layers, *table.shared]
        top = sum(ticks(r.tail_ps) + ticks(r.sync_ps) + ticks(r.gather_ps) for r in rows)
        tail = self.model.new_int_var(0, top, "tail")
        for stage in self.ranks:
            own = self._per_rank(stage, lambda row: ticks(row.tail_ps))
            tied = sum(ticks(g.tail_ps) * held[gi][stage]
                       for gi, g in enumerate(table.shared))
            self.model.add(tail >= own + tied + self._exposed_sync(stage, held)
                           + self._exposed_gather(stage, held))
        return tail

    def _stage_sum(self, stage: int, held: list[list], value) -> Any:
        """``value`` of the stage's layers and of the shared groups it holds, summed."""
        return self._per_rank(stage, value) + sum(
            value(g) * held[gi][stage] for gi, g in enumerate(self.table.shared))

    def _exposed_sync(self, stage: int, held: list[list]) -> Any:
        """(6) ``exposed[s]``: the dp all-reduce beyond the last bucket's ``D_last``
        (a constant of the step: ``CostTable.tail_latency_ps``) left after the rank's
        backwards: for each ``j`` of its ``v`` virtual stages, ``j / v`` of it less the
        hidden share O/1000 of the backward after the ``j``-th from last is done
        (``K_j / (4 v)`` of one microbatch's, ``partc.cost.timeline.overlap_windows``),
        and at least (1 - O/1000) of it (partc.cost.evaluate.exposed_sync_ps)."""
        ticks = self.ticks
        top = sum(ticks(r.sync_ps) for r in (*self.table.layers, *self.table.shared))
        if not top:
            return 0
        exposed = self.model.new_int_var(0, top, f"exposed_sync_stage{stage}")
        sync = self._stage_sum(stage, held, lambda row: ticks(row.sync_ps)) \
            - ticks(self.table.last_sync_ps)
        backward = self._per_rank(stage, lambda row: ticks(row.backward_ps))
        self._exposed_beyond(exposed, sync, backward, stage_windows(self.table.config,
                                                                     stage).sync,
                             f"sync_stage{stage}")
        return exposed

    def _exposed_gather(self, stage: int, held: list[list]) -> Any:
        """(6) ``gathered[s]``: ZeRO-1's weight all-gather beyond the first bucket's,
        ``G_s - G_first``, left exposed by the next step's forwards, as (6) for the
        all-reduce, the windows before each virtual stage's first forward
        (partc.cost.evaluate.exposed_gather_ps)."""
        ticks = self.ticks
        top = sum(ticks(r.gather_ps) for r in (*self.table.layers, *self.table.shared))
        if not top:
            return 0
        exposed = self.model.new_int_var(0, top, f"exposed_gather_stage{stage}")
        rest = self._stage_sum(stage, held, lambda row: ticks(row.gather_ps)) \
            - ticks(self.table.first_gather_ps)
        forward = self._per_rank(stage, lambda row: ticks(row.forward_ps))
        self._exposed_beyond(exposed, rest, forward, stage_windows(self.table.config,
                                                                    stage).gather,
                             f"gather_stage{stage}")
        return exposed

    def _exposed_beyond(self, exposed: Any, collective: Any, hiding: Any,
                        windows: tuple[int, ...], name: str) -> None:
        """``exposed`` at least what ``hiding`` (a phase of the rank, one microbatch's)
        leaves of ``collective`` through each of the rank's ``windows``, and the share it
        never hides (partc.cost.evaluate.exposed_sync_ps, in integers)."""
        hides, v, steps = self.table.overlap_permille, len(windows), WINDOW_STEPS
        if v > 1:
            # The two sums as variables of their own, so that the windows' large
            # coefficients multiply one bounded variable each, not every term of a sum
            # over the rank's runs (CP-SAT refuses a constraint whose terms could pass
            # 2^63; time_unit keeps these below it).
            low, high = _bounds(self.model, collective)
            total = self.model.new_int_var(low, high, f"{name}_collective")
            self.model.add(total == collective)
            low, high = _bounds(self.model, hiding)
            phase = self.model.new_int_var(max(0, low), max(0, high), f"{name}_hiding")
            self.model.add(phase == hiding)
            collective, hiding = total, phase
        for j, k in enumerate(windows, 1):
            self.model.add(1000 * steps * v * exposed
                           >= 1000 * steps * j * collective - hides * k * hiding)
        self.model.add(1000 * exposed >= (1000 - hides) * collective)

    def _add_memory(self, held: list[list], step: bool) -> None:
        """(7) the largest transient of each stage, (8) its memory at each of its
        schedule's peaks and, with ``step``, at the optimizer step (the state and the
        step's temporaries, summed or the largest: ``CostTable.step_sums``), in units of
        :func:`memory_unit` bytes (:meth:`memory_units`).
        (Byte-sized coefficients on GiB limits were seen to make CP-SAT 9.15's presolve
        return a wrong OPTIMAL.)"""
        table, units = self.table, self.memory_units
        top = max(units(max(row.transient_bytes.values())) for row in table.layers)
        for stage in self.ranks:
            transient = self.model.new_int_var(0, top, f"transient_stage{stage}")
            for (k, r), used in self.used[stage].items():
                row = table.layers[self.segments[k].first]
                if row.transient_bytes[r]:              # (7)
                    self.model.add(transient >= units(row.transient_bytes[r]) * used)
            # A[s, runs]: the bytes saved per microbatch by each mode split's layers
            saved = {runs: sum(units(table.layers[self.segments[k].first].saved_bytes[r])
                               * count for (k, r), count in self.unit_count[u].items())
                     for u, (rank, runs) in enumerate(self.mode_units) if rank == stage}
            state = self._per_rank(stage, lambda row: units(row.state_total))
            state += sum(units(g.state_total) * held[gi][stage]
                         for gi, g in enumerate(table.shared))
            limit = units(table.limits[stage], limit=True)
            for count in self._peaks(stage):                                    # (8)
                activations = sum(count[runs[0]] * part for runs, part in saved.items())
                self.model.add(state + transient + activations + self._receive(stage)
                               <= limit)
            if step:
                self.model.add(state + self._step(stage, held) <= limit)        # (8)
        self._add_host(held)                                                    # (10)

    def _add_host(self, held: list[list]) -> None:
        """(10) every node's host: optimizer and parameter offload's bytes of the
        busiest stage's rank for each of its ranks, and the offloaded layers' saved
        bytes of each of its ranks at their stage's worst peak, within the node's host
        memory (none where it is not known)."""
        table, units = self.table, self.memory_units
        if table.host_memory is None:
            return
        limit = units(table.host_memory, limit=True)

        def kept(row) -> int:   # Y: rounded up, as every size in units
            return units(math.ceil(row.param_count * table.host_per_param))

        state: Any = 0
        if table.host_per_param:
            state = self.model.new_int_var(0, limit, "host_state")
            for stage in self.ranks:
                self._require(state >= self._stage_sum(stage, held, kept))
        activations = [self._host_activations(stage, limit) for stage in self.ranks]
        for counts in table.host_nodes:
            self._require(table.ranks_per_node * state + sum(
                count * part for count, part in zip(counts, activations)) <= limit)

    def _host_activations(self, stage: int, limit: int) -> Any:
        """(10) ``host_act[s]``: the offloaded layers' saved bytes a rank of the stage
        keeps on the host at its worst peak (0 where it offloads none)."""
        table, units = self.table, self.memory_units
        host = {runs: sum(units(host_bytes(table.layers[self.segments[k].first], r)) * count
                          for (k, r), count in self.unit_count[u].items() if r == "offload")
                for u, (rank, runs) in enumerate(self.mode_units) if rank == stage}
        if not any(not isinstance(part, int) or part for part in host.values()):
            return 0
        worst = self.model.new_int_var(0, limit, f"host_activations_stage{stage}")
        for count in self._peaks(stage):
            self._require(worst >= sum(count[runs[0]] * part for runs, part in host.items()))
        return worst

    def _step(self, stage: int, held: list[list]) -> Any:
        """(8) the optimizer step's temporaries on the stage: its rows' and shared
        groups' summed, or the largest of them."""
        table, units = self.table, self.memory_units
        if table.step_sums:
            return self._stage_sum(stage, held, lambda row: units(row.step_bytes))
        rows = [*table.layers, *table.shared]
        top = max((units(r.step_bytes) for r in rows), default=0)
        if not top:
            return 0
        step = self.model.new_int_var(0, top, f"step_stage{stage}")
        for (k, _), used in self.used[stage].items():
            size = units(table.layers[self.segments[k].first].step_bytes)
            if size:
                self.model.add(step >= size * used)
        for gi, group in enumerate(table.shared):
            if group.step_bytes:
                self.model.add(step >= units(group.step_bytes) * held[gi][stage])
        return step

    def _receive(self, stage: int):
        """(8) the receive buffers of the stage's runs: one gradient crossing the cut
        after each run."""
        config = self.table.config
        last = config.virtual_stages - 1
        return sum(self.boundary_units(run) for run in config.runs_of(stage) if run < last)

    def add_hint(self, hint: Assignment) -> None:
        """Start the search from ``hint`` (CP-SAT completes the auxiliary variables)."""
        values: dict[int, tuple[Any, int]] = {}   # one hint per variable

        def put(variable, value: int) -> None:
            if isinstance(variable, cp_model.IntVar):   # not a constant or a sum
                values[variable.index] = (variable, value)

        unit_of = self._unit_of_run()
        for k, seg in enumerate(self.segments):
            layers = range(seg.first, seg.last + 1)
            per_run = Counter(hint.stage_of[l] for l in layers)
            inside = 0
            for run in self.runs:
                inside += per_run[run]
                put(self.prefix[k][run], inside)
                put(self.started[k][run], int(inside > 0))
                put(self.finished[k][run], int(inside == seg.size))
            per_unit = self._leanest_first(k, seg, hint, unit_of)
            for u, (rank, _) in enumerate(self.mode_units):
                for r in seg.modes:
                    put(self.unit_count[u][k, r], per_unit[u, r])
            per_mode = Counter((self.table.config.rank_of(hint.stage_of[l]), hint.modes[l])
                               for l in layers)
            for rank in self.ranks:
                for r in seg.modes:
                    put(self.used[rank][k, r], int(per_mode[rank, r] > 0))
        for variable, value in values.values():
            self.model.add_hint(variable, value)

    def _leanest_first(self, k: int, seg: Segment, hint: Assignment,
                       unit_of: dict[int, int]) -> Counter:
        """Per (mode split, mode), the layers of segment ``k`` in ``hint``, its modes
        on each rank dealt leanest first to the runs held most (as :meth:`_order_runs`
        orders them; neither compute nor memory grows)."""
        layers = range(seg.first, seg.last + 1)
        found: Counter = Counter()
        saved = self.table.layers[seg.first].saved_bytes
        config = self.table.config
        for rank in self.ranks:
            mine = [l for l in layers if config.rank_of(hint.stage_of[l]) == rank]
            modes = sorted((hint.modes[l] for l in mine), key=lambda r: saved[r])
            weight = {run: sum(h[run] for h in self._peaks(rank))
                      for run in config.runs_of(rank)}
            runs = sorted((hint.stage_of[l] for l in mine),
                          key=lambda run: (-weight[run], run))
            found.update((unit_of[run], mode) for run, mode in zip(runs, modes))
        return found

    def assignment(self, solver: cp_model.CpSolver) -> Assignment:
        """Each segment's layers fill its runs in order; on each rank they take their
        modes heaviest first (full, selective, none), which is deterministic."""
        def value(v) -> int:
            return v if isinstance(v, int) else int(solver.value(v))

        stage_of: list[int] = []
        modes: list[str] = []
        unit_of = self._unit_of_run()
        for k, seg in enumerate(self.segments):
            counts = [value(self.prefix[k][run]) for run in self.runs]
            stage_of += [sum(1 for c in counts if c <= i) for i in range(seg.size)]
            left = {(u, r): value(self.unit_count[u][k, r])
                    for u in range(len(self.mode_units)) for r in seg.modes}
            for layer in range(seg.first, seg.last + 1):
                u = unit_of[stage_of[layer]]
                mode = next(r for r in reversed(RECOMPUTE_MODES)
                            if r in seg.modes and left[u, r])
                left[u, mode] -= 1
                modes.append(mode)
        return Assignment(stage_of=tuple(stage_of), modes=tuple(modes))

    def _unit_of_run(self) -> dict[int, int]:
        """Each run's mode split (an index into ``mode_units``)."""
        return {run: u for u, (_, runs) in enumerate(self.mode_units) for run in runs}


def memory_unit(table: CostTable) -> int:
    """Bytes per unit of the memory constraints: about 2^20 units in the largest limit
    (one byte below 1 MiB, 4 KiB at 4 GiB), so the rounding costs under a millionth of
    the limit per term."""
    return max(1, max(table.limits) >> 20)


# The objective's largest value in units (CP-SAT reports it as a double, exact to 2^53)
# and the largest of (6)'s constraints, times scaled by 1000 x WINDOW_STEPS x v (CP-SAT's
# integers are 64-bit; it refuses a constraint whose terms could pass 2^63: "Possible
# integer overflow").
_OBJECTIVE_TOP = 2 ** 53
_CONSTRAINT_TOP = 2 ** 62
# What the rounding of times to units may move the objective by, relatively, at most
# (see StageModel.step_ps).
_ROUNDING = 1e-6


def time_unit(table: CostTable) -> int:
    """Picoseconds per unit of the model's times: one, unless the objective could pass
    ``_OBJECTIVE_TOP`` or a constraint ``_CONSTRAINT_TOP`` (Llama-3-8B's pipeline at a
    million tokens: seconds a layer, so 1e16 picoseconds and more a step): then the least
    power of two that keeps both below, so the objective keeps about 2^52 units of
    precision. Bounded from above: every layer's slowest mode and every boundary's
    dearest cut (both ways, in each run) on one rank, ``v m`` times, plus every tail."""
    config = table.config
    busy = sum(max(row.compute_ps(r) for r in row.recompute_ps) for row in table.layers)
    busy += 2 * config.virtual_stages * sum(max(row, default=0) for row in table.cut_ps)
    rows = (*table.layers, *table.shared)
    tail = sum(r.tail_ps + r.sync_ps + r.gather_ps for r in rows) + table.tail_latency_ps
    tail += config.pp * sum(g.tie_sync_ps for g in table.shared)
    objective = (config.fill_divisor * config.num_microbatches + config.pp) * busy \
        + config.fill_divisor * tail
    unit = 1
    # The exposed collectives' constraints scale a rank's sums (each below busy + tail)
    # by 1000 x the most of the window steps x v and of its windows.
    scale = 1000
    if config.chunks > 1:
        scale *= max(WINDOW_STEPS * config.chunks, *(
            max(*rank.sync, *rank.gather) for rank in overlap_windows(
                config.schedule, config.pp, config.chunks, config.num_microbatches)))
    while objective > _OBJECTIVE_TOP * unit or scale * (busy + tail) > _CONSTRAINT_TOP * unit:
        unit *= 2
    return unit



def _bounds(model: cp_model.CpModel, expression: Any) -> tuple[int, int]:
    """The least and most a linear ``expression`` of ``model``'s variables (or an int)
    can be, from their domains."""
    if isinstance(expression, int):
        return expression, expression
    flat = cp_model_helper.FlatIntExpr(expression)
    low = high = flat.offset
    for var, coeff in zip(flat.vars, flat.coeffs):
        # A list first: OR-Tools 9.15's repeated field reads 0 at index -1, not the last.
        domain = list(model.proto.variables[var.index].domain)
        low += min(coeff * domain[0], coeff * domain[-1])
        high += max(coeff * domain[0], coeff * domain[-1])
    return low, high
