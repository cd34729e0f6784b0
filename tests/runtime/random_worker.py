"""Train random models (``tests/random_models.py``) with partc on 2 processes and on one,
many models in one torchrun launch, and judge each.

    torchrun --standalone --nproc-per-node=2 tests/runtime/random_worker.py CASES.json OUT

Each rank compiles, builds and trains every case of ``CASES.json`` (a JSON list of
``Case.to_json()``) in order and rewrites ``OUT/rank<k>.json`` after each, so that a
case that takes the job down (a crash, a hang the watchdog ends) leaves the results of
those before it: ``launch`` then starts torchrun again after it. A case that raises is
recorded with its error. ``failure`` turns the ranks' results of one case into ``None``
(trains like one process) or a line saying what went wrong, its first words the class.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import partc  # noqa: E402
from partc.codec import to_data  # noqa: E402
from partc.runtime import topology  # noqa: E402
from tests import random_models  # noqa: E402
from tests.random_models import BATCH, STEPS, Case  # noqa: E402

NPROC = 2
RTOL = 1e-5
NORM_FLOOR = 1e-3  # as worker.py: a parameter ~0 is compared against this, not its norm
NOISE_FACTOR = 4.0  # see ``failure``
OPTIMIZER = dict(lr=0.1, momentum=0.9)


def compile_case(case: Case, model: torch.nn.Module, devices: int = NPROC) -> partc.Program:
    x, y = random_models.batch(case, 0)
    return partc.compile(model, (x,), loss_fn=F.mse_loss, example_target=y,
                         budget=partc.DeviceBudget(num_devices=devices, device="CPU"),
                         train=partc.TrainSpec(global_batch_size=BATCH, optimizer="sgd"),
                         constraints=partc.Constraints(**case.constraints()))


def reference_step(case: Case, reference: torch.nn.Module, x: torch.Tensor,
                   y: torch.Tensor, microbatches: int) -> float:
    """One process's loss (gradients accumulated). With BatchNorm the batch statistics
    are the microbatch's, so the reference runs the plan's microbatches in order."""
    if not case.model.batchnorm:
        microbatches = 1
    total = 0.0
    for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
        loss = F.mse_loss(reference(xs), ys) / microbatches
        loss.backward()
        total += loss.item()
    return total


def train_reference(case: Case, dtype: torch.dtype, microbatches: int
                    ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The losses and final state of one process training the model in ``dtype``."""
    reference = random_models.build(case.model).to(dtype)
    opt = torch.optim.SGD(reference.parameters(), **OPTIMIZER)
    losses = []
    for step in range(STEPS):
        x, y = (t.to(dtype) if t.is_floating_point() else t
                for t in random_models.batch(case, step))
        losses.append(reference_step(case, reference, x, y, microbatches))
        opt.step()
        opt.zero_grad()
    return losses, reference.state_dict()


def relative(value: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return ((value.double() - expected).norm()
            / max(expected.norm().item(), NORM_FLOOR)).item()


def train(case: Case) -> dict[str, Any]:
    model = random_models.build(case.model)
    program = compile_case(case, model)
    module = program.build()
    try:
        opt = module.optimizer(torch.optim.SGD, **OPTIMIZER)
        losses = []
        for step in range(STEPS):
            x, y = random_models.batch(case, step)
            losses.append(module.forward_backward(x, target=y).item())
            opt.step()
            opt.zero_grad()
        full = module.full_state_dict()
        ring_steps = module.tp.ring_steps   # tp2 linears run as rings, if any
    finally:
        module.close()
    microbatches = program.plan.num_microbatches
    ref_losses, expected = train_reference(case, torch.float32, microbatches)
    exact_losses, exact = train_reference(case, torch.float64, microbatches)
    common = [name for name in expected if name in full]
    plan = program.plan
    return {"losses": losses, "ref_losses": ref_losses, "exact_losses": exact_losses,
            "state_errors": {n: relative(full[n], expected[n]) for n in common},
            "exact_errors": {n: relative(full[n], exact[n]) for n in common},
            "ref_exact_errors": {n: relative(expected[n], exact[n]) for n in common},
            "state_keys_differ": sorted(set(full) ^ set(expected)),
            "mesh": to_data(plan.mesh), "stages": [s.layers for s in plan.stages],
            "num_microbatches": microbatches, "recompute": plan.recompute,
            "schedule": plan.schedule, "ring_steps": ring_steps,
            "sharded": sorted(name for name, placement in (
                plan.tensor_parallel.params if plan.tensor_parallel else {}).items()
                if placement.kind == "S")}


def describe(error: BaseException) -> str:
    """``Type: first line`` of the error that started it all (torch's pipelining wraps
    a stage's error in one whose message is blank)."""
    while error.__cause__ is not None:
        error = error.__cause__
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def run(cases: list[Case], out: Path) -> None:
    rank = dist.get_rank()
    results: list[dict[str, Any]] = []
    for case in cases:
        try:
            result = train(case)
        except Exception as error:  # recorded: judged per case by ``failure``
            result = {"error": describe(error), "traceback": traceback.format_exc()}
        results.append(result)
        (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
        # A case that failed on one rank may have left the other in a collective: the
        # next case starts only when both got here (else the gloo timeout ends the job).
        dist.barrier()


def main() -> None:
    cases_file, out = Path(sys.argv[1]), Path(sys.argv[2])
    cases = [Case.from_json(data) for data in json.loads(cases_file.read_text())]
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    run(cases, out)
    topology.leave()   # no gloo thread left running into shutdown


# -- the parent's side ----------------------------------------------------------------


def launch(cases: list[Case], out: Path, timeout: float = 1800) -> list[list[dict]]:
    """Each case's results, one dict per rank: all cases in one torchrun, launched again
    after a case that ended the job (recorded on every rank as that error)."""
    results: list[list[dict]] = []
    attempt = 0
    while len(results) < len(cases):
        todo = cases[len(results):]
        run_dir = out / f"run{attempt}"
        run_dir.mkdir(parents=True)
        (run_dir / "cases.json").write_text(json.dumps([c.to_json() for c in todo]))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={NPROC}", str(Path(__file__)),
                   str(run_dir / "cases.json"), str(run_dir)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PARTC_TIMEOUT_S": "60",
               "PARTC_WATCHDOG_S": "30"}
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env=env)
        ranks = [_read(run_dir / f"rank{r}.json") for r in range(NPROC)]
        finished = min(len(r) for r in ranks)
        results.extend([ranks[r][i] for r in range(NPROC)] for i in range(finished))
        if finished < len(todo):
            tail = done.stderr.strip().splitlines()[-30:]
            ended = {"error": f"JobEnded: torchrun exited with {done.returncode}",
                     "traceback": "\n".join(tail)}
            results.append([ended] * NPROC)
        attempt += 1
    return results


def _read(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not written yet, or cut short by the job's end
        return []


def failure(ranks: list[dict]) -> str | None:
    """None when every rank trained like one process, else what went wrong: an error's
    first line, or which losses or tensors differ.

    A value agrees when it is within ``RTOL`` of one process's in fp32, or no further
    from exact arithmetic (the same training in fp64) than ``NOISE_FACTOR`` times that
    fp32 run's own distance from it: in an ill-conditioned model (BatchNorm over 4 wide
    features, 8 samples) fp32 rounding alone moves some tensors by 1e-4, and any other
    order of the same sums lands elsewhere in that cloud. A real difference (a running
    statistic updated twice, a gradient lost) is orders of magnitude outside it."""
    for rank, seen in enumerate(ranks):
        if "error" in seen:
            return seen["error"].splitlines()[0] if seen["error"] else "error"
    for rank, seen in enumerate(ranks):
        steps = zip(seen["losses"], seen["ref_losses"], seen["exact_losses"])
        for step, (loss, ref, exact) in enumerate(steps):
            if not _agrees(abs(loss - ref) / abs(ref), abs(loss - exact) / abs(exact),
                           abs(ref - exact) / abs(exact)):
                return (f"losses differ from one process: rank {rank} step {step}: "
                        f"{loss} vs {ref}")
        if seen["state_keys_differ"]:
            return f"state dict keys differ from the model's: {seen['state_keys_differ']}"
        for name, error in seen["state_errors"].items():
            if not _agrees(error, seen["exact_errors"][name], seen["ref_exact_errors"][name]):
                return (f"parameters or buffers differ from one process: rank {rank} {name} "
                        f"by {error:.2e} (relative; fp32 rounding: "
                        f"{seen['ref_exact_errors'][name]:.1e})")
    return None


def _agrees(error: float, exact_error: float, rounding: float) -> bool:
    return error <= RTOL or exact_error <= RTOL + NOISE_FACTOR * rounding


def failure_class(message: str) -> str:
    """What a failure is, without the numbers of one case (shapes, indices, errors)."""
    if message.startswith(("losses", "parameters")):
        return message.split(":")[0]
    return re.sub(r"\d+", "N", message)[:160]

if __name__ == "__main__":
    main()
