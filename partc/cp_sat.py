"""CP-SAT solvers whose answer is a function of the model, not of the machine's load.

Every rank plans by itself, and the same command runs again tomorrow on a busier
machine: both must get the same plan. A CP-SAT search stopped by the clock returns
whatever it had reached when the clock struck, which depends on how much CPU the
process was given. So partc never gives CP-SAT a wall-clock limit. Each solve is limited
by ``max_deterministic_time``: CP-SAT's count of the work it has done, in "deterministic
seconds" (a weighted operation count, scaled so that one unit is roughly a second on
the machine OR-Tools calibrated it on; on partc's stage models it runs at about a tenth
of a CPU second per unit and on the sharding chooser's at about a half). One worker
searches alone, in order (``num_workers=1``); more workers search deterministically
only in CP-SAT's interleaved mode, which :func:`deterministic_solver` turns on for
them. The seed is fixed. A solve stopped by its work limit then stops at the same point
on every machine, and its status (FEASIBLE, not OPTIMAL) says so honestly.
"""

from __future__ import annotations

from ortools.sat.python import cp_model


def deterministic_solver(work: float, num_workers: int, seed: int) -> cp_model.CpSolver:
    """A solver limited to ``work`` deterministic seconds and nothing else, searching
    with ``num_workers`` workers (interleaved when more than one) from ``seed``."""
    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = max(work, 0.0)
    solver.parameters.num_workers = num_workers
    # CP-SAT's parallel portfolio otherwise races its workers; interleaved, it runs
    # them in fixed batches, deterministic for a fixed number of workers.
    solver.parameters.interleave_search = num_workers > 1
    solver.parameters.random_seed = seed
    return solver


def set_work(solver: cp_model.CpSolver, work: float) -> None:
    """Give ``solver``'s next solve ``work`` deterministic seconds."""
    solver.parameters.max_deterministic_time = max(work, 0.0)


def work_done(solver: cp_model.CpSolver) -> float:
    """The deterministic seconds ``solver``'s last solve spent."""
    return solver.deterministic_time
