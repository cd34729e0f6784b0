"""Plan: the planner's answer as JSON-ready data (DESIGN.md §2, "Plan schema").

A Plan names layers, never fx nodes, so it can be saved, diffed, reviewed and loaded
again without tracing the model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    index: int
    layers: tuple[str, ...]
    recompute: dict[str, str]
    param_count: int
    memory_bytes: dict[str, int]
    limit_bytes: int
    time_s: dict[str, float]
    # Point-to-point messages per step on each rank of this stage (activations forward,
    # their gradients backward): {"sends": n, "recvs": n}.
    p2p: dict[str, int] = field(default_factory=dict)
    # Interleaved 1F1B: the stage's runs of layers (it holds runs index, index + pp, ...);
    # empty otherwise (``layers`` is then one run).
    runs: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True, kw_only=True)
class SolverStats:
    status: str
    objective: float
    bound: float
    gap: float
    solve_time_s: float
    configs_total: int = 0
    configs_solved: int = 0
    configs_pruned: int = 0


@dataclass(frozen=True, kw_only=True)
class Plan:
    mesh: dict[str, int]
    schedule: str
    num_microbatches: int
    micro_batch_size: int
    zero_stage: int
    stages: tuple[StagePlan, ...]
    predicted: dict[str, float]
    solver: SolverStats
    budget: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    tensor_parallel: dict[str, Any] = field(default_factory=dict)
    alternatives: tuple[dict[str, Any], ...] = ()
    # Every (pp, dp, tp) factorisation the planner considered, best first: its fastest
    # configuration and step time, or why it has none (``assemble.mesh_summary``).
    meshes: tuple[dict[str, Any], ...] = ()

    @property
    def pp(self) -> int:
        return self.mesh["pp"]

    @property
    def dp(self) -> int:
        return self.mesh["dp"]

    @property
    def tp(self) -> int:
        return self.mesh.get("tp", 1)

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Every layer once, in model order when the plan is sound."""
        return tuple(name for run in self.runs for name in run)

    @property
    def chunks(self) -> int:
        """Runs of layers per stage: more than one under interleaved 1F1B."""
        return len(self.stages[0].runs) if self.stages and self.stages[0].runs else 1

    @property
    def runs(self) -> tuple[tuple[str, ...], ...]:
        """The contiguous runs of layers in model order (run ``j`` on stage ``j % pp``)."""
        if self.chunks == 1:
            return tuple(stage.layers for stage in self.stages)
        return tuple(self.stages[j % len(self.stages)].runs[j // len(self.stages)]
                     for j in range(len(self.stages) * self.chunks))

    @property
    def recompute(self) -> dict[str, str]:
        return {k: v for stage in self.stages for k, v in stage.recompute.items()}

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["stages"] = [{**s, "layers": list(s["layers"])} for s in data["stages"]]
        return {"schema_version": SCHEMA_VERSION, **data}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    @property
    def hash(self) -> str:
        """Hash of the decisions (not of timings): ranks compare it before running."""
        decisions = {
            "mesh": self.mesh, "schedule": self.schedule,
            "num_microbatches": self.num_microbatches,
            "micro_batch_size": self.micro_batch_size, "zero_stage": self.zero_stage,
            "stages": [[list(s.layers), s.recompute] for s in self.stages],
            **({"runs": [list(r) for r in self.runs]} if self.chunks > 1 else {}),
            "tensor_parallel": self.tensor_parallel, "model": self.model.get("hash"),
        }
        return hashlib.sha256(json.dumps(decisions, sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        version = data.get("schema_version", SCHEMA_VERSION)
        if version != SCHEMA_VERSION:
            raise ValueError(f"plan schema version {version} is not supported "
                             f"(this partc reads version {SCHEMA_VERSION})")
        fields = {k: v for k, v in data.items() if k != "schema_version"}
        fields["stages"] = tuple(
            StagePlan(**{**s, "layers": tuple(s["layers"]),
                         "runs": tuple(tuple(r) for r in s.get("runs", ()))})
            for s in data["stages"])
        fields["solver"] = SolverStats(**data["solver"])
        fields["alternatives"] = tuple(data.get("alternatives", ()))
        fields["meshes"] = tuple(data.get("meshes", ()))
        return cls(**fields)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))
