"""Resume parity under torchrun: train under plan A, suspended by SIGTERM after step 3,
resume under plan B.

    torchrun --standalone --nproc-per-node=N tests/runtime/ckpt_worker.py OUT first MOVE ...
    torchrun --standalone --nproc-per-node=M tests/runtime/ckpt_worker.py OUT resume MOVE ...

``first`` (N = plan A's processes) trains MOVE's model under plan A for STEPS steps with
AdamW. After step SAVE_AT the last rank gets a SIGTERM; ``module.stop_requested()``,
asked on every rank every step, is then True on all of them from that step on, and they
save a checkpoint of it into ``OUT/<move>/ckpt`` (the path a suspended job takes), then
keep training instead of exiting: the uninterrupted run. ``resume`` (M = plan B's processes) compiles plan B,
loads that checkpoint and trains the remaining steps. Both also train the model in one
process for STEPS steps (every rank, from the same initial weights and batches) and
report, per rank in ``OUT/<phase>-rank<k>.json``: the losses of their steps, the one-process
losses, the final parameters' worst relative error against one process; ``first``'s
final whole state dict (``OUT/<move>/first.pt``, rank 0) is compared exactly with
``resume``'s (bit-identical when A and B are the same plan).

AdamW runs with eps=1e-6: at its default 1e-8 Adam turns the fp32 rounding noise of a
gradient that is mathematically zero (a key projection's bias under softmax, ~1e-9) into
full-size steps, which no two summation orders take alike: one process stepping on the
whole batch and on 4 accumulated microbatches then differ by 3e-5 (relative, the tiny
GPT after 6 steps), by 4e-7 at eps=1e-6. Parameters and losses are compared in full.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import partc  # noqa: E402
from partc.codec import to_data  # noqa: E402
from partc.runtime import topology  # noqa: E402
from samples import gpt, moe  # noqa: E402
from tests import hf_families, models  # noqa: E402
from tests.runtime.worker import BATCH, Case, batch  # noqa: E402

STEPS, SAVE_AT = 6, 3
ADAMW = dict(lr=1e-3, weight_decay=0.1, eps=1e-6)


def _gpt2() -> torch.nn.Module:
    return models.gpt2(dropout=0.0)  # tied embeddings (GPT2LMHeadModel's default)


def _gpt_vision() -> torch.nn.Module:
    """The sample GPT beside a tower its forward never reads (a vision tower under
    text-only batches): kept untrained on the first stage's ranks, in checkpoints."""
    model = gpt.gpt_tiny()
    model.vision = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    return model


def _mixtral() -> torch.nn.Module:
    return hf_families.FAMILIES["mixtral"].build()


MODELS: dict[str, Case] = {
    "gpt": Case(gpt.gpt_tiny, "tokens", gpt.loss_fn),
    "gpt-vision": Case(_gpt_vision, "tokens", gpt.loss_fn),
    # Mixture-of-experts: the sample's Switch-style layers (with their balance loss) and
    # Mixtral's batched experts, whose weights expert parallelism cuts by experts.
    "moe": Case(moe.moe_tiny, "tokens", moe.loss_fn),
    "mixtral": Case(_mixtral, "tokens", models.causal_lm_loss),
    "llama": Case(models.llama, "tokens", models.causal_lm_loss),
    "gpt2": Case(_gpt2, "tokens", models.causal_lm_loss),
    # Attention as SDPA calls (Hugging Face's default), which context parallelism splits.
    "hf-llama": Case(hf_families.FAMILIES["llama"].build, "tokens", models.causal_lm_loss),
    "hf-gpt2": Case(hf_families.FAMILIES["gpt2"].build, "tokens", models.causal_lm_loss),
}

_TP = dict(tp_objective="memory", recompute="none")
PLANS: dict[str, tuple[int, dict[str, Any]]] = {
    "pp2": (2, dict(pp=2, dp=1, tp=1, schedule="1f1b", recompute="none")),
    "pp2-dp2": (4, dict(pp=2, dp=2, tp=1, schedule="1f1b", recompute="none")),
    "tp2": (2, dict(pp=1, dp=1, tp=2, **_TP)),
    "dp2-zero3": (2, dict(pp=1, dp=2, tp=1, zero_stage=3, recompute="none")),
    "dp2-zero2": (2, dict(pp=1, dp=2, tp=1, zero_stage=2, recompute="none")),
    "dp2-zero1": (2, dict(pp=1, dp=2, tp=1, zero_stage=1, recompute="none")),
    "dp2-tp2-zero3": (4, dict(pp=1, dp=2, tp=2, zero_stage=3, **_TP)),
    "pp2-dp2-zero1": (4, dict(pp=2, dp=2, tp=1, zero_stage=1, schedule="1f1b",
                              recompute="none")),
    # bf16 (a plan name ending in -bf16): under ZeRO-1 the checkpoint holds each rank's
    # fp32 master shard, the module computes with bf16 weights.
    "dp2-zero1-bf16": (2, dict(pp=1, dp=2, tp=1, zero_stage=1, recompute="none")),
    "pp2-bf16": (2, dict(pp=2, dp=1, tp=1, schedule="1f1b", recompute="none")),
    # Expert parallelism (ZeRO-0): experts split over 2 or 4 ranks.
    "dp2-ep2": (2, dict(pp=1, dp=2, tp=1, ep=2, zero_stage=0, recompute="none")),
    "dp4-ep4": (4, dict(pp=1, dp=4, tp=1, ep=4, zero_stage=0, recompute="none")),
    "dp4-ep2": (4, dict(pp=1, dp=4, tp=1, ep=2, zero_stage=0, recompute="none")),
    "pp2-dp2-ep2": (4, dict(pp=2, dp=2, tp=1, ep=2, zero_stage=0, schedule="1f1b",
                            recompute="none")),
    # Expert parallelism under ZeRO: experts sharded over the ranks holding the same
    # ones (dp4-ep2: 2 of them; dp2-ep2: each rank alone).
    "dp2-ep2-zero1": (2, dict(pp=1, dp=2, tp=1, ep=2, zero_stage=1, recompute="none")),
    "dp2-ep2-zero3": (2, dict(pp=1, dp=2, tp=1, ep=2, zero_stage=3, recompute="none")),
    "dp4-ep2-zero1": (4, dict(pp=1, dp=4, tp=1, ep=2, zero_stage=1, recompute="none")),
    "dp4-ep2-zero2": (4, dict(pp=1, dp=4, tp=1, ep=2, zero_stage=2, recompute="none")),
    "dp4-ep2-zero3": (4, dict(pp=1, dp=4, tp=1, ep=2, zero_stage=3, recompute="none")),
    # Optimizer offload: the fp32 masters and AdamW's moments on the host, saved as the
    # optimizer's state (ZeRO-1's shards of them; under ZeRO-3 with the parameters
    # offloaded too, FSDP2's host shards); the host tier of one replica on a pipeline.
    "dp2-zero1-offload": (2, dict(pp=1, dp=2, tp=1, zero_stage=1, recompute="none",
                                  offload=("optimizer",))),
    "dp2-zero3-offload-params": (2, dict(pp=1, dp=2, tp=1, zero_stage=3, recompute="none",
                                         offload=("optimizer", "params"))),
    "pp2-offload": (2, dict(pp=2, dp=1, tp=1, schedule="1f1b", recompute="none",
                            offload=("optimizer",))),
    # Context parallelism: each sequence over 2 ranks, which hold the whole model.
    "cp2-ring": (2, dict(pp=1, dp=1, tp=1, cp=2, cp_kind="ring", recompute="none")),
    "cp2-a2a": (2, dict(pp=1, dp=1, tp=1, cp=2, cp_kind="all-to-all", recompute="none")),
}


@dataclass(frozen=True)
class Move:
    model: str
    before: str
    after: str

    @staticmethod
    def parse(name: str) -> "Move":
        model, plans = name.split(":")
        before, after = plans.split(">")
        if model not in MODELS or before not in PLANS or after not in PLANS:
            raise ValueError(f"not a move: {name!r} (model:plan>plan; models {list(MODELS)}, "
                             f"plans {list(PLANS)})")
        return Move(model, before, after)


def compile_plan(case: Case, model: torch.nn.Module, plan: str) -> partc.Program:
    world, constraints = PLANS[plan]
    constraints = dict(constraints)
    constraints.setdefault("num_microbatches", 4 // constraints["dp"])
    x, y = batch(case, model, 0)
    return partc.compile(model, x, loss_fn=case.loss_fn, example_target=y,
                         budget=partc.DeviceBudget(num_devices=world, device="CPU",
                                                   host_memory="4GiB" if "offload" in
                                                   constraints else None),
                         train=partc.TrainSpec(global_batch_size=BATCH, optimizer="adamw",
                                               dtype=torch.bfloat16 if plan.endswith("-bf16")
                                               else torch.float32),
                         constraints=partc.Constraints(**constraints))


def reference_run(case: Case, model: torch.nn.Module) -> tuple[list[float], dict]:
    """One process, STEPS steps: the losses and the final state dict."""
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for step in range(STEPS):
        x, y = batch(case, model, step)
        loss = case.loss_fn(model(*x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def compare(full: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The worst relative error over tensors (against 1e-3 where a tensor is ~0), and
    its tensor."""
    worst, where = 0.0, ""
    for name, want in ref.items():
        diff = (full[name].to(want.dtype) - want).double().norm().item()
        error = diff / max(want.double().norm().item(), 1e-3)
        if error > worst:
            worst, where = error, name
    return worst, where


def run(out: Path, phase: str, name: str) -> dict[str, Any]:
    move = Move.parse(name)
    case = MODELS[move.model]
    plan = move.before if phase == "first" else move.after
    torch.manual_seed(0)
    model = case.build()
    reference = case.build()
    reference.load_state_dict(model.state_dict())
    ref_losses, ref_state = reference_run(case, reference)
    program = compile_plan(case, model, plan)
    module = program.build()
    opt = module.optimizer(torch.optim.AdamW, **ADAMW)
    directory = out / name.replace(":", "_").replace(">", "_to_") / "ckpt"
    start = 0
    result: dict[str, Any] = {"plan": plan, "mesh": to_data(program.plan.mesh),
                              "zero_stage": program.plan.effective_zero_stage}
    if phase == "resume":
        start, extra = module.load_checkpoint(directory, optimizer=opt)
        result["loaded"] = [start, extra]
    losses = []
    for step in range(start, STEPS):
        x, y = batch(case, model, step)
        losses.append(module.forward_backward(*x, target=y).item())
        opt.step()
        opt.zero_grad()
        if phase != "first":
            continue
        if step + 1 == SAVE_AT and dist.get_rank() == dist.get_world_size() - 1:
            signal.raise_signal(signal.SIGTERM)   # the cluster's signal, to one rank
        if module.stop_requested() and "stopped_at" not in result:
            result["stopped_at"] = step + 1
            module.save_checkpoint(directory, optimizer=opt, step=step + 1,
                                   extra={"plan": plan, "losses": list(losses)})
    full = module.full_state_dict()
    worst, where = compare(full, ref_state)
    first = directory.parent / "first.pt"
    if phase == "first" and dist.get_rank() == 0:
        torch.save(full, first)
    if phase == "resume":
        before = torch.load(first)
        result["max_abs_diff_to_first"] = max((full[k] - before[k]).abs().max().item()
                                              for k in before)
    result.update(losses=losses, ref_losses=ref_losses, start=start, param_error=worst,
                  param_error_at=where)
    return result


def run_faults(out: Path) -> dict[str, Any]:
    """Failures on one rank are errors on every rank, never hangs: rank 1's write fails
    (disk full) and the previous checkpoint stays the latest; rank 1's file of a
    checkpoint is missing and every rank refuses it before any parameter changes."""
    from torch.distributed.checkpoint import FileSystemWriter

    case = MODELS["gpt"]
    torch.manual_seed(0)
    model = case.build()
    module = compile_plan(case, model, "pp2").build()
    opt = module.optimizer(torch.optim.AdamW, **ADAMW)
    x, y = batch(case, model, 0)
    module.forward_backward(*x, target=y)
    opt.step()
    directory = out / "faults"
    module.save_checkpoint(directory, optimizer=opt, step=1)
    result: dict[str, Any] = {}
    write = FileSystemWriter.write_data
    if dist.get_rank() == 1:
        def disk_full(self, plan, planner):
            raise OSError(28, "No space left on device")
        FileSystemWriter.write_data = disk_full
    try:
        module.save_checkpoint(directory, optimizer=opt, step=2)
        result["failed_save"] = "no error"
    except partc.CheckpointError as error:
        result["failed_save"] = str(error)
    finally:
        FileSystemWriter.write_data = write
    result["latest_after_failed_save"] = (directory / "latest").read_text().strip()
    dist.barrier()
    if dist.get_rank() == 0:
        (directory / "step-00000001" / "__1_0.distcp").unlink()
    dist.barrier()
    before = {k: v.detach().clone() for k, v in module.state_dict().items()}
    try:
        module.load_checkpoint(directory, optimizer=opt)
        result["partial_load"] = "no error"
    except partc.CheckpointError as error:
        result["partial_load"] = str(error)
    result["unchanged"] = all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    return result


def main() -> None:
    out, phase, names = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    if phase not in ("first", "resume"):
        raise SystemExit(f"phase is 'first' or 'resume', not {phase!r}")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for name in names:
        try:
            results[name] = run_faults(out) if name == "faults" else run(out, phase, name)
        except Exception as error:  # recorded: the test reports it per move
            results[name] = {"error": f"{type(error).__name__}: {error}",
                             "traceback": traceback.format_exc()}
        dist.barrier()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{phase}-rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    topology.leave()   # no gloo thread left running into shutdown


if __name__ == "__main__":
    os.environ.setdefault("PARTC_TIMEOUT_S", "120")
    main()
