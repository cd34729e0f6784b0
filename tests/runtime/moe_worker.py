"""Run under torchrun by tests/runtime/test_moe.py and benchmarks/moe_parity.py: train
mixture-of-experts cases with expert parallelism and on one process, on every rank, and
write what was seen to ``<out>/rank<k>.json``.

    torchrun --standalone --nproc-per-node=4 tests/runtime/moe_worker.py OUT CASE [CASE ...]

The one-process reference trains the model itself on the whole batch (dropless), or,
with a capacity factor, the model lowered for one process with the same capacity (the
experts' rule is per sample, so the reference drops the slots the ranks drop).
"""

from __future__ import annotations

import copy
import dataclasses
import json
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
from torch.distributed.tensor import DTensor  # noqa: E402

import partc  # noqa: E402
from partc.passes.context import Lowering  # noqa: E402
from partc.passes.pipeline import _trace, lowering_passes, run_passes  # noqa: E402
from partc.runtime import topology, tp as tp_ops  # noqa: E402
from partc.runtime.experts import expert_modules  # noqa: E402
from samples import moe  # noqa: E402
from tests import hf_families, models  # noqa: E402

BATCH, SEQ, STEPS, LR = 8, 16, 3, 0.1


@dataclass(frozen=True)
class Case:
    build: Callable[[], torch.nn.Module]
    loss_fn: Callable
    constraints: dict[str, Any] = field(default_factory=dict)
    capacity_factor: float | None = None
    clip: float | None = None  # TrainSpec.max_grad_norm; the reference clips likewise
    # TrainSpec.loss_per_microbatch: the reference's loss is the mean of the plan's
    # dp x microbatches parts' losses (a router loss over the batch couples samples).
    per_microbatch: bool = False


def _family(name: str, **fields: Any) -> Callable[[], torch.nn.Module]:
    family = hf_families.FAMILIES[name]
    return lambda: dataclasses.replace(family, fields={**family.fields, **fields}).build()


AUX_COEF = 0.02


def _hf_aux_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy plus the router's load-balancing loss over the batch,
    weighted as the model's own ``loss`` weights it (``router_aux_loss_coef``)."""
    logits = output.logits
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
    return ce + AUX_COEF * output.aux_loss


def _hf_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy on the logits: the model's output, or the first of the
    flattened outputs of the model lowered for one process (the capacity reference)."""
    logits = output[0] if isinstance(output, (tuple, list)) else output.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


CASES: dict[str, Case] = {
    "moe-dp2-ep2": Case(moe.moe_tiny, moe.loss_fn, dict(pp=1, dp=2, ep=2)),
    "moe-dp4-ep4": Case(moe.moe_tiny, moe.loss_fn, dict(pp=1, dp=4, ep=4)),
    "moe-dp4-ep2": Case(moe.moe_tiny, moe.loss_fn, dict(pp=1, dp=4, ep=2)),
    "moe-pp2-dp2-ep2": Case(moe.moe_tiny, moe.loss_fn, dict(pp=2, dp=2, ep=2)),
    "moe-tp2-ep2": Case(moe.moe_tiny, moe.loss_fn, dict(pp=1, dp=1, tp=2, ep=2)),
    "moe-dp2-tp2-ep2": Case(moe.moe_tiny, moe.loss_fn, dict(pp=1, dp=2, tp=2, ep=2)),
    "moe-dp2-tp2-ep2-clip": Case(moe.moe_tiny, moe.loss_fn, dict(pp=1, dp=2, tp=2, ep=2),
                                 clip=0.05),
    "mixtral-dp2-tp2-ep4-capacity": Case(_family("mixtral"), _hf_loss,
                                         dict(pp=1, dp=2, tp=2, ep=4), capacity_factor=1.0),
    "mixtral-tp2-ep2": Case(_family("mixtral"), _hf_loss, dict(pp=1, dp=1, tp=2, ep=2)),
    "mixtral-dp2-tp2-ep2": Case(_family("mixtral"), _hf_loss, dict(pp=1, dp=2, tp=2, ep=2)),
    "moe-dp2-ep2-zero1": Case(moe.moe_tiny, moe.loss_fn, dict(pp=1, dp=2, ep=2, zero_stage=1)),
    "moe-dp2-ep2-zero2": Case(moe.moe_tiny, moe.loss_fn, dict(pp=1, dp=2, ep=2, zero_stage=2)),
    "moe-dp2-ep2-zero3": Case(moe.moe_tiny, moe.loss_fn, dict(pp=1, dp=2, ep=2, zero_stage=3)),
    "moe-dp4-ep2-zero1": Case(moe.moe_tiny, moe.loss_fn, dict(pp=1, dp=4, ep=2, zero_stage=1),
                              clip=0.05),
    "moe-dp4-ep2-zero3": Case(moe.moe_tiny, moe.loss_fn, dict(pp=1, dp=4, ep=2, zero_stage=3),
                              clip=0.05),
    # ZeRO-2 reducing once per step, the experts' units over their expert-dp group too.
    "moe-dp4-ep2-zero2-step": Case(moe.moe_tiny, moe.loss_fn,
                                   dict(pp=1, dp=4, ep=2, zero_stage=2, zero2_grad_sync="step"),
                                   clip=0.05),
    "moe-dp2-tp2-ep2-zero1": Case(moe.moe_tiny, moe.loss_fn,
                                  dict(pp=1, dp=2, tp=2, ep=2, zero_stage=1), clip=0.05),
    "moe-dp2-tp2-ep2-zero3": Case(moe.moe_tiny, moe.loss_fn,
                                  dict(pp=1, dp=2, tp=2, ep=2, zero_stage=3), clip=0.05),
    "moe-pp2-dp2-ep2-zero2": Case(moe.moe_tiny, moe.loss_fn,
                                  dict(pp=2, dp=2, ep=2, zero_stage=2)),
    "moe-dp2-ep2-zero3-recompute": Case(moe.moe_tiny, moe.loss_fn,
                                        dict(pp=1, dp=2, ep=2, zero_stage=3,
                                             recompute="full")),
    "moe-dp2-ep2-recompute": Case(moe.moe_tiny, moe.loss_fn,
                                  dict(pp=1, dp=2, ep=2, zero_stage=0, recompute="full")),
    "qwen3-moe-dp2-ep2-zero3": Case(_family("qwen3-moe"), _hf_loss,
                                    dict(pp=1, dp=2, ep=2, zero_stage=3)),
    "mixtral-dp4-ep2-zero1": Case(_family("mixtral"), _hf_loss,
                                  dict(pp=1, dp=4, ep=2, zero_stage=1)),
    "moe-dp2-ep2-capacity": Case(lambda: moe.moe_tiny(top_k=2), moe.loss_fn,
                                 dict(pp=1, dp=2, ep=2), capacity_factor=1.0),
    "mixtral-dp2-ep2": Case(_family("mixtral"), _hf_loss, dict(pp=1, dp=2, ep=2)),
    "qwen2-moe-dp4-ep4": Case(_family("qwen2-moe"), _hf_loss, dict(pp=1, dp=4, ep=4)),
    "qwen3-moe-pp2-dp2-ep2": Case(_family("qwen3-moe"), _hf_loss, dict(pp=2, dp=2, ep=2)),
    "deepseek-v3-dp2-ep2": Case(_family("deepseek-v3"), _hf_loss, dict(pp=1, dp=2, ep=2)),
    # The router's load-balancing loss over the batch, each microbatch's its own.
    "mixtral-aux-dp2-ep2": Case(_family("mixtral", output_router_logits=True,
                                        router_aux_loss_coef=AUX_COEF), _hf_aux_loss,
                                dict(pp=1, dp=2, ep=2), per_microbatch=True),
    "qwen2-moe-aux-dp2-ep2": Case(_family("qwen2-moe", output_router_logits=True,
                                          router_aux_loss_coef=AUX_COEF), _hf_aux_loss,
                                  dict(pp=1, dp=2, ep=2), per_microbatch=True),
    # Experts in an nn.ModuleList, which the runtime does not split: the plan keeps ep=1
    # (ep is left to the planner).
    "list-moe-dp2": Case(models.ListMoEModel, models.token_loss, dict(pp=1, dp=2)),
}


def batch(model: torch.nn.Module, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def one_process(case: Case, model: torch.nn.Module) -> torch.nn.Module:
    """What one process trains: the model, or with a capacity the model lowered with it."""
    if case.capacity_factor is None:
        return model
    x, _ = batch(model, 0)
    lowering = Lowering(stages=(), recompute={}, capacity_factor=case.capacity_factor)
    gm, ctx = _trace(model, (x,))
    ctx = dataclasses.replace(ctx, lowering=lowering)
    return run_passes(lowering_passes(lowering), gm, ctx)


def run_case(name: str) -> dict[str, Any]:
    case = CASES[name]
    world = dist.get_world_size() if dist.is_initialized() else int(
        __import__("os").environ["WORLD_SIZE"])
    torch.manual_seed(0)
    model = case.build()
    reference = one_process(case, copy.deepcopy(model))
    x, y = batch(model, 0)
    constraints = dict(case.constraints)
    constraints.setdefault("num_microbatches", 2)
    program = partc.compile(
        model, x, loss_fn=case.loss_fn, example_target=y,
        budget=partc.DeviceBudget(num_devices=world, device="CPU"),
        train=partc.TrainSpec(global_batch_size=BATCH, optimizer="sgd",
                              moe_capacity_factor=case.capacity_factor,
                              max_grad_norm=case.clip,
                              loss_per_microbatch=case.per_microbatch),
        constraints=partc.Constraints(**constraints))
    module = program.build()
    plan = program.plan
    opt = module.optimizer(torch.optim.SGD, lr=LR)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    layers = expert_modules(module.module)
    losses, ref_losses, messages, exchanges, norms, ref_norms = [], [], [], [], [], []
    for step in range(STEPS):
        x, y = batch(model, step)
        before = [sum(m.messages for m in layers), sum(m.count_exchanges for m in layers)]
        losses.append(module.forward_backward(x, target=y).item())
        messages.append(sum(m.messages for m in layers) - before[0])
        exchanges.append(sum(m.count_exchanges for m in layers) - before[1])
        opt.step()
        opt.zero_grad()
        if case.per_microbatch:   # the mean of the plan's parts' losses, in batch order
            parts = plan.dp * plan.num_microbatches
            ref_loss = sum(case.loss_fn(reference(xs), ys) for xs, ys in
                           zip(x.chunk(parts), y.chunk(parts))) / parts
        else:
            ref_loss = case.loss_fn(reference(x), y)
        ref_loss.backward()
        if case.clip is not None:
            ref_norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(),
                                                            case.clip).item())
            norms.append(module.last_grad_norm.item())
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    topo = module.topology
    ref_params = dict(reference.named_parameters())
    errors = {}
    expert_weights = {name for m in layers for name in m.weight_names}
    for fqn, param in module.named_parameters():
        ref = ref_params[fqn].detach()
        if fqn in expert_weights:  # this rank's experts
            rows = param.shape[0]
            ref = ref[topo.ep_rank * rows:(topo.ep_rank + 1) * rows]
        placement = plan.placement((fqn,))
        if placement.kind == "S":  # this rank's tensor-parallel shard
            ref = tp_ops.shard_of(ref, placement.dim, placement.chunks, topo.tp_rank, topo.tp)
        value = param.detach()
        if isinstance(value, DTensor):  # ZeRO-2/3: this rank's shard, over its mesh
            value = value.full_tensor()
        errors[fqn] = ((value - ref).norm() / max(ref.norm().item(), 1e-3)).item()
    ep = plan.mesh.ep
    # Per step, the plan's all-to-alls of this rank's stage (tokens out and back, forward
    # and backward, per expert layer and microbatch), and one exchange of counts before
    # each dispatch.
    section = plan.expert_parallel
    expected = sum(layer.all_to_alls for layer in section.layers
                   if layer.stage == topo.pp_rank) if section is not None else 0
    # A recomputed layer exchanges its counts again in the replayed forward.
    recomputed = {name for stage in plan.stages for name, mode in stage.recompute.items()
                  if mode != "none"}
    expected_exchanges = plan.num_microbatches * sum(
        1 + (layer.name in recomputed) for layer in section.layers
        if layer.stage == topo.pp_rank) if ep > 1 else 0
    return {"losses": losses, "ref_losses": ref_losses, "param_errors": errors,
            "messages": messages, "expected_messages": expected,
            "exchanges": exchanges, "expected_exchanges": expected_exchanges,
            "mesh": {"pp": plan.pp, "dp": plan.dp, "tp": plan.tp, "ep": ep,
                     "zero": plan.effective_zero_stage},
            "expert_layers": len(layers), "stage": module.stage_index,
            "dropped": sum(m.dropped for m in layers),
            "grad_norms": norms, "ref_grad_norms": ref_norms}


def main() -> None:
    out, names = Path(sys.argv[1]), sys.argv[2:]
    results: dict[str, Any] = {}
    for name in names:
        try:
            results[name] = run_case(name)
        except Exception as error:  # recorded, so one case does not hide the others
            results[name] = {"error": repr(error), "traceback": traceback.format_exc()}
    rank = dist.get_rank() if dist.is_initialized() else 0
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    if dist.is_initialized():
        dist.barrier()
        topology.leave()   # no gloo thread left running into shutdown


if __name__ == "__main__":
    main()
