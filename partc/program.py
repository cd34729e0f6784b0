"""Program: a validated plan with what it was planned from, ready to report, save and run."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from partc.codec import CodecError, check
from partc.cost.schedules import stages_of_rank
from partc.cost.timeline import plan_csv
from partc.errors import PartcError, PlanFileError, PlanSchemaError, check_argument
from partc.heap import young_collections_only
from partc.passes.codegen import codegen
from partc.passes.context import Lowering
from partc.passes.pipeline import lower
from partc.plan import Plan, plan_from_data
from partc.planner.validate import field_conflicts
from partc.problem import PlanningProblem
from partc.report.text import render
from partc.runtime import StageProgram, build, connect
from partc.weights import open_weights


@dataclass(frozen=True, kw_only=True)
class Program:
    plan: Plan
    problem: PlanningProblem | None = None
    graph: torch.fx.GraphModule | None = field(default=None, repr=False)
    model: nn.Module | None = field(default=None, repr=False)
    loss_fn: Callable | None = field(default=None, repr=False)

    def report(self, format: str = "text") -> str:
        return render(self.plan, format)

    @young_collections_only()
    def lower(self, only: Sequence[int] | None = None) -> Any:
        """The plan applied to the model (``partc.passes.pipeline.lower``): traced on meta
        tensors of one microbatch's shapes (exported graphs fix their view shapes), cut
        into its ``pp * v`` virtual stages (``plan.runs``, in model order), with
        tensor-parallel collectives, recompute and units in place (each layer a module of
        its own: FSDP's units under ZeRO-2/3, under ZeRO-1 where each layer waits for
        its parameters' overlapped all-gather).
        ``only``: the virtual stages to finish (all by default)."""
        self._need_model("lower the plan")
        plan = self.plan
        args, kwargs, target = plan.model.meta_batch(plan.micro_batch_size)
        tensor_parallel = plan.tensor_parallel
        lowering = Lowering(
            stages=plan.runs,  # one per virtual stage (pp x v), in model order
            recompute=plan.recompute, tp=plan.tp,
            sequence_parallel=plan.sequence_parallel,
            tp_choices=dict(tensor_parallel.choices) if tensor_parallel is not None else {},
            fsdp_units=plan.effective_zero_stage >= 2 or _gathers_wait_in_layers(plan),
            attention=plan.train.attention,
            ep=plan.mesh.ep, capacity_factor=plan.train.moe_capacity_factor,
            mixed=plan.train.dtype != torch.float32,
            cp=plan.cp, cp_kind=str(plan.cp_kind or "ring"),
            fp8_linears=plan.fp8.linears if plan.fp8 is not None else (),
            fp8_recipe=plan.train.fp8_recipe)
        traced = plan.model.traced_batch_size
        return lower(self.model, args, lowering, kwargs=kwargs, loss_fn=self.loss_fn,
                     example_target=target, only=only,
                     planned_inputs=plan.model.meta_batch(traced) if traced else None)

    def stages(self) -> list:
        """One ``partc.passes.split.StageGraph`` per stage, lowered as ``build`` runs
        them."""
        return list(self.lower().stages)

    def code(self) -> dict[str, str]:
        """Readable Python source of each stage, keyed by file name (``stage_<k>.py``)."""
        lowered = self.lower()
        shared = {" = ".join(key): list(indices) for key, indices in lowered.holders.items()
                  if len(indices) > 1}
        return {f"stage_{stage.index}.py": codegen(stage, self.plan, shared)
                for stage in lowered.stages}

    def save(self, directory: str | Path, *, code: bool = True) -> Path:
        """Write plan.json, report.md and (with the model at hand) code/stage_<k>.py, one
        file per stage (per virtual stage, ``k`` in model order, when a rank holds
        several)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(self.plan.to_json() + "\n")
        (out / "report.md").write_text(render(self.plan, "markdown"))
        if code and self.model is not None:
            code_dir = out / "code"
            code_dir.mkdir(exist_ok=True)
            for old in code_dir.glob("stage_*.py"):
                old.unlink()
            for name, source in self.code().items():
                (code_dir / name).write_text(source)
        # schedule.csv: the pipeline order, as torch's pipelining reads it (_load_csv).
        (out / "schedule.csv").write_text(plan_csv(self.plan))
        return out

    def build(self, *, state_dict: Mapping[str, torch.Tensor] | str | Path | None = None,
              device: torch.device | str | None = None) -> Any:
        """This rank's part of the program, ready to train (run under torchrun).

        Checks the world size against the plan, joins the process group (gloo on CPU,
        NCCL on CUDA with the device from ``LOCAL_RANK``), checks that every rank has the
        same plan and model, lowers this rank's virtual stages (one, or the ``v`` that
        ``partc.cost.schedules.stages_of_rank`` gives it), and keeps only this rank's
        parameters: copied from the model, or — for a model on the meta device — loaded
        from ``state_dict``: a mapping such as ``model.state_dict()``, or the path of a
        Hugging Face checkpoint (``*.safetensors``) or a ``torch.distributed.checkpoint``
        directory, of which each rank reads only its own tensors
        (``partc/weights.py``; non-persistent buffers come from the model: build
        it under ``partc.on_meta()``). Returns a ``partc.runtime.DistributedModule``.
        """
        self._need_model("build")
        check_argument("Program.build", "state_dict", state_dict,
                       (Mapping, str, PathLike, type(None)),
                       "a mapping of tensors by FQN, a checkpoint path (str or os.PathLike) "
                       "or None")
        check_argument("Program.build", "device", device, (torch.device, str, type(None)),
                       "a torch.device, a device string ('cuda:0') or None")
        if isinstance(state_dict, (str, PathLike)):
            state_dict = open_weights(state_dict)
        topology = connect(self.plan, self.model, self.loss_fn, device=device)
        plan = self.plan
        mine = stages_of_rank(plan.schedule, plan.pp, plan.chunks, topology.pp_rank)
        lowered = self.lower(only=mine)
        loss, loss_layer = lowered.loss
        programs = [StageProgram(
            index=stage.index, num_stages=stage.num_stages, layers=stage.layers,
            module=stage.module, loss=loss,
            loss_recompute=plan.recompute.get(loss_layer, "none"),
            holders=lowered.holders) for stage in (lowered.stages[j] for j in mine)]
        return build(plan, topology, programs, self.model, state_dict=state_dict)

    def _need_model(self, what: str) -> None:
        if self.model is None:
            raise PartcError(f"this Program has no model to {what} from: use "
                             "partc.compile(model, ...) or partc.load(directory, model)")


def read_plan_file(path: str | Path) -> Plan:
    """The plan in ``path``, its schema checked in full and its fields against each other
    (:func:`partc.planner.validate.field_conflicts`); :class:`PlanFileError` naming the
    file and the field otherwise."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
        raise PlanFileError(f"{path} is not JSON: {error}", path=str(path)) from None
    if not isinstance(data, dict):
        raise PlanFileError(f"{path} holds a {type(data).__name__}, not a plan",
                            path=str(path))
    try:
        plan = plan_from_data(data)
        check(plan, Plan)
    except CodecError as error:
        raise PlanFileError(f"{path}: field {error}", path=str(path),
                            field=error.field) from None
    except (PlanSchemaError, TypeError, ValueError, AttributeError, KeyError) as error:
        section = re.match(r"plan section (\S+?):", str(error))
        raise PlanFileError(f"{path}: {error}", path=str(path),
                            field=section.group(1) if section else None) from None
    conflicts = field_conflicts(plan)
    if conflicts:
        listed = "\n  ".join(f"{field}: {what}" for field, what in conflicts)
        raise PlanFileError(f"{path}: fields that contradict each other (was it edited? "
                            f"compile again rather than edit a plan):\n  {listed}",
                            path=str(path), field=conflicts[0][0])
    return plan


def _gathers_wait_in_layers(plan: Plan) -> bool:
    """ZeRO-1 with its parameter all-gather overlapped (``TrainSpec.overlap_param_gather``):
    each layer becomes a module of its own, whose forward pre-hook waits for the buckets
    of its parameters (:func:`partc.runtime.optimizer.wait_in_forward`). Not under
    ``torch.compile``, which would trace the hooks' waits: a compiled stage waits for
    all its buckets before it runs."""
    return (plan.effective_zero_stage == 1 and plan.train.overlap_param_gather
            and not plan.train.compile)
