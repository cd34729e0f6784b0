"""The closed sets of names a plan holds, as string enums (torch-free).

Each member *is* its string (``Schedule.ONE_F_ONE_B == "1f1b"``), so plan.json, the
command line's choices, ``Constraints(schedule="1f1b")`` and code comparing with strings
keep working, while the plan's own fields say which set a name belongs to. The codec
writes a member as its value and reads the value back as the member.
"""

from __future__ import annotations

import enum


class Name(str, enum.Enum):
    """A string enum that prints and formats as its value (as ``enum.StrEnum`` does from
    Python 3.11; partc runs on 3.10 too)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Schedule(Name):
    """The pipeline schedules (:mod:`partc.cost.schedules` holds what each needs of a
    plan; a test holds the two together)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    LOOPED_BFS = "looped-bfs"
    INTERLEAVED_ZERO_BUBBLE = "interleaved-zero-bubble"
    ZBV_ZERO_BUBBLE = "zbv-zero-bubble"
    DUALPIPEV = "dualpipev"


class Recompute(Name):
    """What a layer keeps for backward: everything, its cheap-to-recompute part
    recomputed ("selective"), only its input ("full"), or everything on the host,
    copied out in forward and back before backward needs it ("offload")."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"
    OFFLOAD = "offload"


class Outcome(Name):
    """What became of one (pp, dp, tp) factorisation the planner weighed
    (:class:`partc.planner.results.MeshResult` says what each means)."""

    SOLVED = "solved"
    WORK_LIMIT = "work limit"
    PRUNED = "pruned"
    INFEASIBLE = "infeasible"

    @classmethod
    def _missing_(cls, value: object) -> "Outcome | None":
        # Plans written while the search's limit was wall-clock time say "time limit".
        return cls.WORK_LIMIT if value == "time limit" else None


class CpKind(Name):
    """How context-parallel attention exchanges the sequence shards of a cp group: a
    ring passing key/value blocks from rank to rank, each step beside the attention of
    the block it holds (any head count), or all-to-alls re-sharding queries, keys,
    values and output from the sequence to the heads around the attention core
    (DeepSpeed-Ulysses: the heads and key/value heads must divide by cp x tp)."""

    RING = "ring"
    ALL_TO_ALL = "all-to-all"


class Phase(Name):
    """Where in a microbatch's pass an operation runs: its forward or its backward (a
    tensor-parallel collective, a pipeline operation), or one of the two parts of a
    split backward (input gradient, then weight gradient)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    INPUT = "input"
    WEIGHT = "weight"


class Offload(Name):
    """What may live on the host instead of the device: the optimizer's state, master
    weights and step ("optimizer", ZeRO-Offload), the parameters between uses ("params",
    under ZeRO-3), and a layer's saved activations between forward and backward
    ("activations")."""

    OPTIMIZER = "optimizer"
    PARAMS = "params"
    ACTIVATIONS = "activations"
