"""Run under torchrun by the runtime tests: train each named case with partc and on one
process, on every rank, and write what was seen to ``<out>/rank<k>.json``.

    torchrun --standalone --nproc-per-node=2 tests/runtime/worker.py OUT CASE [CASE ...]

A case that raises is recorded with its error rather than ending the run, so one
failure does not hide the others (every rank raises alike: checks come before
collectives).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import partc  # noqa: E402
from samples import gpt  # noqa: E402
from tests import models  # noqa: E402

BATCH, SEQ, STEPS = 8, 16, 3


@dataclass(frozen=True)
class Case:
    build: Callable[[], torch.nn.Module]
    data: str  # "tokens" or "floats"
    loss_fn: Callable
    constraints: dict[str, Any] = field(default_factory=dict)


def _tokens(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    return getattr(config, "vocab_size", 128)


def _gpt2(n_layer: int = 2) -> torch.nn.Module:
    # Dropout draws different masks when a batch is cut into microbatches: parity with
    # one process needs it off. (Recompute replays the forward's masks: test_recompute.)
    return models.gpt2(n_layer=n_layer, dropout=0.0)


def _skip() -> torch.nn.Module:
    # stem, 4 blocks, head: in 4 stages the stem's output crosses every boundary.
    return models.LongSkip(width=16, depth=4)


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


ALL_MODES = {"blocks.0": "full", "blocks.1": "selective"}
HF_MODES = {"model.layers.0": "full", "model.layers.1": "selective"}
GPT2_MODES = {"transformer.h.0": "selective", "transformer.h.1": "full"}

CASES: dict[str, Case] = {
    # 2 processes
    "gpt-pp2-1f1b": Case(gpt.gpt_tiny, "tokens", gpt.loss_fn, dict(pp=2, schedule="1f1b")),
    "gpt-pp2-gpipe-recompute": Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                                    dict(pp=2, schedule="gpipe", recompute=ALL_MODES)),
    "gpt2-pp2-1f1b-recompute": Case(_gpt2, "tokens", models.causal_lm_loss,
                                    dict(pp=2, schedule="1f1b", recompute=GPT2_MODES)),
    "gpt2-pp2-gpipe": Case(_gpt2, "tokens", models.causal_lm_loss,
                           dict(pp=2, schedule="gpipe", recompute="none")),
    "llama-pp2-gpipe-recompute": Case(models.llama, "tokens", models.causal_lm_loss,
                                      dict(pp=2, schedule="gpipe", recompute=HF_MODES)),
    "llama-pp2-1f1b": Case(models.llama, "tokens", models.causal_lm_loss,
                           dict(pp=2, schedule="1f1b", recompute="none")),
    "skip-pp2-1f1b": Case(_skip, "floats", _mse, dict(pp=2, schedule="1f1b")),
    "llama-pp2-1f1b-loaded": Case(models.llama, "tokens", models.causal_lm_loss,
                                  dict(pp=2, schedule="1f1b", recompute=HF_MODES)),
    "gpt-dp2": Case(gpt.gpt_tiny, "tokens", gpt.loss_fn, dict(pp=1, dp=2)),
    # 4 processes
    "gpt-pp4-1f1b-recompute": Case(lambda: gpt.gpt_tiny(n_layer=4), "tokens", gpt.loss_fn,
                                   dict(pp=4, schedule="1f1b", recompute="full")),
    "gpt-pp4-gpipe": Case(lambda: gpt.gpt_tiny(n_layer=4), "tokens", gpt.loss_fn,
                          dict(pp=4, schedule="gpipe", recompute="none")),
    "gpt2-pp4-gpipe-recompute": Case(lambda: _gpt2(n_layer=4), "tokens",
                                     models.causal_lm_loss,
                                     dict(pp=4, schedule="gpipe", recompute="selective")),
    "llama-pp4-1f1b": Case(lambda: models.llama(n_layer=4), "tokens", models.causal_lm_loss,
                           dict(pp=4, schedule="1f1b", recompute=HF_MODES)),
    "skip-pp4-gpipe": Case(_skip, "floats", _mse, dict(pp=4, schedule="gpipe")),
    "gpt-pp2-dp2": Case(gpt.gpt_tiny, "tokens", gpt.loss_fn,
                        dict(pp=2, dp=2, schedule="1f1b", recompute=ALL_MODES)),
}


def batch(case: Case, model: torch.nn.Module, step: int,
          seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    if case.data == "tokens":
        vocab = _tokens(model)
        tokens = torch.randint(0, vocab, (BATCH, seq + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 16, generator=g)


def optimizer(params: Any) -> torch.optim.Optimizer:
    # SGD with momentum: Adam divides each gradient by its own size, which turns the
    # rounding noise of gradients that are mathematically zero (a key projection's
    # bias under softmax) into full-size steps, in one process as in many.
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def compile_case(case: Case, model: torch.nn.Module, world: int) -> partc.Program:
    x, y = batch(case, model, 0)
    constraints = dict(case.constraints)
    constraints.setdefault("dp", world // constraints["pp"])
    constraints.setdefault("num_microbatches", 4 // constraints["dp"])
    return partc.compile(model, (x,), loss_fn=case.loss_fn, example_target=y,
                         budget=partc.DeviceBudget(num_devices=world, device="CPU"),
                         train=partc.TrainSpec(global_batch_size=BATCH, optimizer="sgd"),
                         constraints=partc.Constraints(**constraints))


def run_case(name: str) -> dict[str, Any]:
    case = CASES[name]
    torch.manual_seed(0)
    model = case.build()
    reference = copy.deepcopy(model)
    program = compile_case(case, model, dist.get_world_size())
    if name.endswith("-loaded"):
        # Rank 0 saves the program; every rank loads plan.json and builds from it.
        directory = Path(os.environ["PARTC_WORKER_OUT"]) / name
        if dist.get_rank() == 0:
            program.save(directory)
        dist.barrier()
        program = partc.load(directory, model, loss_fn=case.loss_fn)
    module = program.build()
    opt = optimizer(module.parameters())
    ref_opt = optimizer(reference.parameters())
    losses, ref_losses, messages = [], [], []
    for step in range(STEPS):
        x, y = batch(case, model, step)
        losses.append(module.forward_backward(x, target=y).item())
        messages.append(dict(module.last_messages))
        opt.step()
        opt.zero_grad()
        ref_loss = case.loss_fn(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    errors = {fqn: ((p.detach() - ref_params[fqn]).norm() / ref_params[fqn].norm()).item()
              for fqn, p in module.named_parameters()}
    plan = program.plan
    return {"losses": losses, "ref_losses": ref_losses, "param_errors": errors,
            "messages": messages, "predicted": plan.stages[module.stage_index].p2p,
            "stage": module.stage_index, "mesh": plan.mesh, "schedule": plan.schedule,
            "recompute": plan.stages[module.stage_index].recompute,
            "num_params": len(errors)}


def run_mismatch_cases() -> dict[str, Any]:
    """Ranks with different plans, and a batch of the wrong shape: errors, not hangs."""
    case = CASES["gpt-pp2-1f1b"]
    results: dict[str, Any] = {}
    torch.manual_seed(0)
    model = case.build()
    world = dist.get_world_size()
    pinned = dict(case.constraints, recompute="full" if dist.get_rank() == 1 else "none")
    program = compile_case(Case(case.build, case.data, case.loss_fn, pinned), model, world)
    try:
        program.build()
        results["different-plans"] = "no error"
    except partc.PlanMismatchError as error:
        results["different-plans"] = str(error)
    module = compile_case(case, model, world).build()
    for label, seq in (("shorter-sequence", SEQ // 2),):
        x, y = batch(case, model, 0, seq=seq)
        try:
            module.forward_backward(x, target=y)
            results[label] = "no error"
        except partc.PlanMismatchError as error:
            results[label] = str(error)
    x, y = batch(case, model, 0)
    try:
        module.forward_backward(x[:4], target=y[:4])
        results["smaller-batch"] = "no error"
    except partc.PlanMismatchError as error:
        results["smaller-batch"] = str(error)
    # After the refused batches the program still trains on the planned shapes.
    results["loss-after"] = module.forward_backward(x, target=y).item()
    return results


def main() -> None:
    out, names = Path(sys.argv[1]), sys.argv[2:]
    os.environ["PARTC_WORKER_OUT"] = str(out)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for name in names:
        try:
            results[name] = run_mismatch_cases() if name == "mismatch" else run_case(name)
        except Exception as error:  # recorded: the test reports it per case
            results[name] = {"error": f"{type(error).__name__}: {error}",
                             "traceback": traceback.format_exc()}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("PARTC_TIMEOUT_S", "120")
    main()
