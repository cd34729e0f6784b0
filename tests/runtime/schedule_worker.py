"""Run under torchrun by tests/runtime/test_schedules.py and benchmarks/schedule_parity.py:
train each named case with one of torch's pipeline schedules and on one process, on
every rank, and write what was seen to ``<out>/rank<k>.json``.

    torchrun --standalone --nproc-per-node=2 tests/runtime/schedule_worker.py OUT CASE ...

A case is ``<model>-<schedule>-<combination>``: model ``gpt`` (samples/gpt.py), ``llama``
or ``gpt2`` (Hugging Face, GPT-2's embedding tied to its head); combination ``plain`` and
``recompute`` (some layers recomputed in full, some selectively) and ``full`` (every
layer in full) with pp=2 (2 processes); ``dp2``, ``dp2-recompute``, ``dp2-zero2`` (FSDP),
``dp2-zero2-step`` (ZeRO-2 reducing once per step) and ``tp2`` with pp=2 and dp=2 or tp=2
(4 processes). Schedules with virtual stages hold 2 per rank (pp=2, v=2).

Every case clips the global gradient norm (``CLIP``), compared with one process's
``clip_grad_norm_``. ``checkpoint:<case>`` saves a checkpoint of the case after one step
and loads it into a 1F1B program of the same model instead.

A case the runtime refuses (``partc.PartcError`` from ``build``) is recorded as refused
with its reason; any other error as an error.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import partc  # noqa: E402
from partc.plan import StagePlan  # noqa: E402
from partc.runtime import topology  # noqa: E402
from partc.cost.schedules import SCHEDULE_TABLE, schedule, stages_of_rank  # noqa: E402
from samples import gpt  # noqa: E402
from tests import models  # noqa: E402
from tests.runtime import worker  # noqa: E402
from tests.runtime.worker import Built, Case  # noqa: E402

PP, V, MICROBATCHES = 2, 2, 4
# Global gradient-norm clipping, below the gradients' norm so that it scales them: the
# norm counts a weight that several virtual stages hold once.
CLIP = 0.5
MODELS = {
    "gpt": (gpt.gpt_tiny, gpt.loss_fn, worker.ALL_MODES),
    "llama": (models.llama, models.causal_lm_loss, worker.HF_MODES),
    "gpt2": (lambda: models.gpt2(dropout=0.0), models.causal_lm_loss, worker.GPT2_MODES),
}
# For step times (benchmarks/schedule_parity.py --timing): 8 blocks, 512 wide, so that
# compute, not messages, fills a step.
TIMING_MODELS = {
    "gpt8": (lambda: gpt.gpt_tiny(n_layer=8, n_embd=512, n_head=8), gpt.loss_fn,
             worker.ALL_MODES),
}
COMBINATIONS = {  # combination -> (constraints beside pp, processes)
    "plain": (dict(recompute="none"), 2),
    "recompute": ({}, 2),   # the model's recompute modes: full and selective layers
    "full": (dict(recompute="full"), 2),   # every layer recomputed whole
    "dp2": (dict(dp=2, zero_stage=0, recompute="none"), 4),
    "tp2": (dict(tp=2, tp_objective="memory", recompute="none"), 4),
    "dp2-recompute": (dict(dp=2, zero_stage=0), 4),
    "dp2-zero2": (dict(dp=2, zero_stage=2, recompute="none"), 4),
    # ZeRO-2 reducing once per step: each virtual stage's last backward reduce-scatters
    "dp2-zero2-step": (dict(dp=2, zero_stage=2, zero2_grad_sync="step", recompute="none"), 4),
    # The planner's own plan for the pinned schedule (its split and v), pp=2.
    "planned": (dict(recompute="none"), 2),
}
SCHEDULES = tuple(SCHEDULE_TABLE)


def parse(name: str) -> tuple[str, str, str]:
    """``gpt-zbv-zero-bubble-dp2`` → ("gpt", "zbv-zero-bubble", "dp2")."""
    model, rest = name.split("-", 1)
    for combination in sorted(COMBINATIONS, key=len, reverse=True):
        if rest.endswith("-" + combination):
            return model, rest[:-len(combination) - 1], combination
    raise ValueError(f"no combination in case name {name!r}")


def processes(name: str) -> int:
    return COMBINATIONS[parse(name)[2]][1]


def virtual_stages(name: str) -> int:
    allowed = schedule(name).virtual_stages
    return allowed[0] if allowed else V


def pinned_program(name: str, model: torch.nn.Module, world: int) -> partc.Program:
    """A program for case ``name``: the planner's 1F1B plan over ``PP * v`` stages, its
    runs of layers then placed as the schedule places virtual stages (``stages_of_rank``)
    on ``PP`` ranks (the runtime's test of every schedule, whichever the planner takes);
    for the ``planned`` combination, the planner's own plan with the schedule pinned."""
    model_name, schedule_name, combination = parse(name)
    build, loss_fn, modes = {**MODELS, **TIMING_MODELS}[model_name]
    constraints = dict(COMBINATIONS[combination][0])
    constraints.setdefault("recompute", modes)
    v = virtual_stages(schedule_name)
    case = Case(build, "tokens", loss_fn, clip=CLIP)
    x, y = worker.batch(case, model, 0)
    dp = constraints.get("dp", 1)
    tp = constraints.get("tp", 1)
    assert PP * dp * tp == world, (name, world)
    if combination == "planned":
        return partc.compile(
            model, x, loss_fn=loss_fn, example_target=y,
            budget=partc.DeviceBudget(num_devices=world, device="CPU"),
            train=partc.TrainSpec(global_batch_size=worker.BATCH, optimizer="sgd",
                                  max_grad_norm=CLIP),
            constraints=partc.Constraints(pp=PP, schedule=schedule_name,
                                          num_microbatches=MICROBATCHES, **constraints))
    base = partc.compile(
        model, x, loss_fn=loss_fn, example_target=y,
        budget=partc.DeviceBudget(num_devices=PP * v * dp * tp, device="CPU"),
        train=partc.TrainSpec(global_batch_size=worker.BATCH, optimizer="sgd",
                              max_grad_norm=CLIP),
        constraints=partc.Constraints(pp=PP * v, schedule="1f1b",
                                      num_microbatches=MICROBATCHES, **constraints))
    plan = base.plan
    runs = plan.runs
    stages = []
    for rank in range(PP):
        mine = [plan.stages[j] for j in stages_of_rank(schedule_name, PP, v, rank)]
        stages.append(StagePlan(
            index=rank, layers=tuple(name for s in mine for name in s.layers),
            recompute={k: m for s in mine for k, m in s.recompute.items()},
            param_count=sum(s.param_count for s in mine),
            memory_bytes=mine[0].memory_bytes, limit_bytes=mine[0].limit_bytes,
            time_s=mine[0].time_s, p2p=None,
            runs=tuple(s.layers for s in mine) if v > 1 else ()))
    placed = dataclasses.replace(plan, mesh=dataclasses.replace(plan.mesh, pp=PP),
                                 schedule=schedule_name, stages=tuple(stages))
    assert placed.runs == runs, (placed.runs, runs)
    return dataclasses.replace(base, plan=placed)


def not_planned(name: str) -> str | None:
    """Why the planner cannot make case ``name``'s ``planned`` plan (None if it can)."""
    from partc.cli.choices import SCHEDULES as PLANNED

    _, schedule_name, combination = parse(name)
    if combination == "planned" and schedule_name not in PLANNED:
        return f"the planner takes the schedules {', '.join(PLANNED)}"
    return None


def build_case(name: str) -> Built:
    model_name = parse(name)[0]
    build, loss_fn, _ = {**MODELS, **TIMING_MODELS}[model_name]
    case = Case(build, "tokens", loss_fn, clip=CLIP)
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    program = pinned_program(name, model, dist.get_world_size())
    return Built(case, model, reference, program, program.build())


def run_case(name: str) -> dict[str, Any]:
    if not_planned(name):
        return {"skipped": not_planned(name)}
    try:
        built = build_case(name)
    except partc.PartcError as error:
        if "cannot run" not in str(error) and "cannot shard" not in str(error):
            raise
        return {"refused": str(error)}
    result = worker.train_case(built)
    result["virtual_stages"] = list(built.module.virtual_stages)
    # Forward only, through every virtual stage, after training: as one process's eval.
    x, y = worker.batch(built.case, built.model, worker.STEPS)
    result["eval_loss"] = built.module.evaluate(*x, target=y).item()
    built.reference.eval()
    with torch.no_grad():
        result["ref_eval_loss"] = built.case.loss_fn(built.reference(*x), y).item()
    return result


def checkpoint_case(name: str) -> dict[str, Any]:
    """``checkpoint:<case>``: train case ``name`` one step, save a checkpoint (parameters
    and optimizer state of every virtual stage), load it into the same model under 1F1B
    with one stage per rank, and train both one more step on the same batch: the same
    loss and the same whole model after it."""
    model_name, schedule_name, combination = parse(name)
    built = build_case(name)
    other = build_case(f"{model_name}-1f1b-{combination}")
    root = Path(os.environ["PARTC_WORKER_OUT"]) / f"checkpoint-{name}"
    losses, states = [], []
    first = built.module.optimizer(torch.optim.SGD, **worker.OPTIMIZER)
    x, y = worker.batch(built.case, built.model, 0)
    built.module.forward_backward(*x, target=y)
    first.step()
    first.zero_grad()
    built.module.save_checkpoint(root, optimizer=first, step=1)
    second = other.module.optimizer(torch.optim.SGD, **worker.OPTIMIZER)
    step, _ = other.module.load_checkpoint(root, optimizer=second)
    x, y = worker.batch(built.case, built.model, 1)
    for module, opt in ((built.module, first), (other.module, second)):
        losses.append(module.forward_backward(*x, target=y).item())
        opt.step()
        opt.zero_grad()
        states.append(module.full_state_dict())
    worst = max(((states[0][k] - states[1][k]).norm() / max(states[1][k].norm().item(), 1e-3))
                .item() for k in states[1])
    return {"step": step, "losses": losses, "state_error": worst,
            "keys_differ": sorted(set(states[0]) ^ set(states[1]))}


def time_case(name: str, steps: int) -> dict[str, Any]:
    """Median seconds of ``steps`` training steps (after one warm-up step)."""
    built = build_case(name)
    module, case = built.module, built.case
    opt = module.optimizer(torch.optim.SGD, **worker.OPTIMIZER)
    times = []
    for step in range(steps + 1):
        x, y = worker.batch(case, built.model, step)
        dist.barrier()
        started = time.perf_counter()
        module.forward_backward(*x, target=y)
        opt.step()
        opt.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - started)
    module.close()
    return {"median_s": sorted(times[1:])[len(times[1:]) // 2], "steps": steps}


def run_named(name: str) -> dict[str, Any]:
    """Case ``name``: ``checkpoint:<case>`` or a schedule's case."""
    if name.startswith("checkpoint:"):
        return checkpoint_case(name.split(":", 1)[1])
    return run_case(name)


def main() -> None:
    out, names = Path(sys.argv[1]), sys.argv[2:]
    timing = int(os.environ.get("PARTC_SCHEDULE_TIMING_STEPS", "0"))
    os.environ["PARTC_WORKER_OUT"] = str(out)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for name in names:
        try:
            results[name] = time_case(name, timing) if timing else run_named(name)
        except Exception as error:  # recorded: the test reports it per case
            results[name] = {"error": f"{type(error).__name__}: {error}",
                             "traceback": traceback.format_exc()}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    topology.leave()   # no gloo thread left running into shutdown


if __name__ == "__main__":
    os.environ.setdefault("PARTC_TIMEOUT_S", "120")
    main()
