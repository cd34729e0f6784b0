"""Program: a validated plan with what it was planned from, ready to report and save."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .plan import Plan
from .problem import PlanningProblem
from .report import render


@dataclass(frozen=True, kw_only=True)
class Program:
    plan: Plan
    problem: PlanningProblem
    graph: torch.fx.GraphModule | None = field(default=None, repr=False)

    def report(self, format: str = "text") -> str:
        return render(self.plan, format)

    def save(self, directory: str | Path) -> Path:
        """Write plan.json and report.md into ``directory`` (created if missing)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(self.plan.to_json() + "\n")
        (out / "report.md").write_text(render(self.plan, "markdown"))
        return out
