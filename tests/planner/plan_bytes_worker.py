"""Plan the hand-built instance of ``test_plan_determinism`` and print the plan's JSON
without its timings: ``python -m tests.planner.plan_bytes_worker``. The test runs it in
processes of their own (each with its own string-hash seed), on an idle and on a loaded
CPU, and compares the bytes."""

from __future__ import annotations

import json

from partc.compiler import plan_problem
from partc.options import PlannerOptions
from partc.plan import Plan
from partc.problem import Pins, PlanningProblem
from tests.planner import instances

# Small enough that CP-SAT is stopped before it has solved every schedule it solves
# unlimited: the limit binds, and where it stops must not depend on the machine.
BINDING = PlannerOptions(work_limit=0.05, config_work_limit=0.05)


def hard_problem() -> PlanningProblem:
    """Twelve unlike layers on two devices at pp=2, memory tight enough for recompute:
    CP-SAT takes about 0.7 deterministic seconds to prove the best plan."""
    layers = [instances.layer(f"l{i}", flops=(1 + i % 3) * 1e9, params=1000 * (1 + i % 4),
                              saved=3e5 * (1 + (i * 7) % 5), selective=1e5 * (1 + i % 2),
                              full=2e4, workspace=1e3) for i in range(12)]
    return instances.problem(layers, [1e4] * 11, instances.devices(2, 3_000_000), batch=8,
                             pins=Pins(pp=2))


def plan_bytes(plan: Plan) -> str:
    """``plan.to_json()`` less the one wall-clock figure, the solve time."""
    data = plan.to_dict()
    del data["solver"]["solve_time_s"]
    return json.dumps(data, indent=1)


def main() -> None:
    print(plan_bytes(plan_problem(hard_problem(), options=BINDING)))


if __name__ == "__main__":
    main()
