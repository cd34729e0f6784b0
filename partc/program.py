"""Program: a validated plan with what it was planned from, ready to report, save and run."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from .errors import PartcError
from .plan import Plan
from .problem import PlanningProblem
from .report import render


@dataclass(frozen=True, kw_only=True)
class Program:
    plan: Plan
    problem: PlanningProblem | None = None
    graph: torch.fx.GraphModule | None = field(default=None, repr=False)
    model: nn.Module | None = field(default=None, repr=False)
    loss_fn: Callable | None = field(default=None, repr=False)

    def report(self, format: str = "text") -> str:
        return render(self.plan, format)

    def stages(self) -> list:
        """The plan applied: one ``partc.passes.split.StageGraph`` per stage, traced at
        the micro-batch size, with recompute in place (what ``build`` runs)."""
        from .runtime.module import lower_plan

        self._need_model("emit the stages")
        return lower_plan(self.plan, self.model, self.loss_fn)[1]

    def code(self) -> dict[str, str]:
        """Readable Python source of each stage, keyed by file name (``stage_<k>.py``)."""
        from .passes.codegen import codegen
        from .runtime.module import shared_parameters

        stages = self.stages()
        shared = shared_parameters(stages, self.model)
        return {f"stage_{stage.index}.py": codegen(stage, self.plan, shared)
                for stage in stages}

    def save(self, directory: str | Path, *, code: bool = True) -> Path:
        """Write plan.json, report.md and (with the model at hand, one run of layers per
        stage) code/stage_<k>.py."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(self.plan.to_json() + "\n")
        (out / "report.md").write_text(render(self.plan, "markdown"))
        # Interleaved plans are planned and reported, but not lowered to stage code yet.
        if code and self.model is not None and self.plan.chunks == 1:
            code_dir = out / "code"
            code_dir.mkdir(exist_ok=True)
            for old in code_dir.glob("stage_*.py"):
                old.unlink()
            for name, source in self.code().items():
                (code_dir / name).write_text(source)
        return out

    def build(self, *, state_dict: Mapping[str, torch.Tensor] | None = None,
              device: torch.device | str | None = None) -> Any:
        """This rank's part of the program, ready to train (run under torchrun).

        Checks the world size against the plan, joins the process group (gloo on CPU,
        NCCL on CUDA with the device from ``LOCAL_RANK``), checks that every rank has the
        same plan and model, and keeps only this rank's parameters: copied from the
        model, or — for a model on the meta device — loaded from ``state_dict``.
        Returns a ``partc.runtime.DistributedModule``.
        """
        from .runtime import build

        self._need_model("build")
        return build(self.plan, self.model, self.loss_fn, state_dict=state_dict,
                     device=device)

    def _need_model(self, what: str) -> None:
        if self.model is None:
            raise PartcError(f"this Program has no model to {what} from: use "
                             "partc.compile(model, ...) or partc.load(directory, model)")


def load(directory: str | Path, model: nn.Module, *, loss_fn: Callable | None = None) -> Program:
    """The program saved in ``directory`` for ``model``, without planning again."""
    path = Path(directory) / "plan.json"
    if not path.exists():
        raise FileNotFoundError(f"no plan.json in {directory}: save a program there first "
                                "(program.save(directory) or `partc plan ... --out`)")
    plan = Plan.from_json(path.read_text())
    return Program(plan=plan, model=model, loss_fn=loss_fn)
