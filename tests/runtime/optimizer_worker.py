"""Run under torchrun by test_distributed_optimizer.py: train each named case with partc
(Adam through ``module.optimizer``) and on one process, on every rank, and write what
was seen to ``<out>/rank<k>.json``.

    torchrun --standalone --nproc-per-node=2 tests/runtime/optimizer_worker.py OUT CASE ...

A case is ``<model>[-pp<p>][-ep<e>]-zero<k>-<dtype>[-clip][-sgd|-adamw]``: model ``gpt``
(the sample GPT), ``gpt2`` (Hugging Face GPT-2 from a config), ``moe`` (the sample
mixture-of-experts GPT), ``qwen2`` or ``qwen3moe`` (``tests/hf_families.py``'s tiny
configs), pp stages (1F1B), dp = the other ranks, experts split over ``e`` of them.
Without an optimizer named, Adam through ``module.optimizer``; ``sgd`` (with momentum)
or ``adamw`` (with weight decay): a plain ``torch.optim`` optimizer over
``module.parameters()``, the loop people write, which must train the same or be
refused (a typed error at its first ``step()``, no parameter changed: ``refused``).
A case ending ``-nan-<mode>`` or ``-gradnan-<mode>`` (``mode``: raise or skip,
``TrainSpec.on_nonfinite``) poisons the batch of step ``POISONED``: the loss and every
gradient NaN, or (``gradnan``) the gradients alone; ``-rankbatch-raise`` gives the last
rank another target at that step, as a loader seeded by the rank would
(:func:`run_nonfinite_case`).
In fp32 the reference is the same ``torch.optim`` class on one process; in bf16 it runs
the same recipe on one process:
each step, bf16 copies of the fp32 parameters compute every microbatch under autocast
(CUDA's rules, as the runtime's CPU ranks), their gradients summed in fp32 into the fp32
parameters' ``.grad``, Adam stepping the fp32 parameters.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import partc  # noqa: E402
from partc.autocast_policy import cuda_autocast  # noqa: E402
from partc.runtime import topology  # noqa: E402
from samples import gpt, moe  # noqa: E402
from tests import hf_families, models  # noqa: E402

BATCH, SEQ, STEPS, MICROBATCHES = 8, 16, 3, 4
# Gradient buckets of this many elements (TrainSpec.bucket_elements): every model spans
# many, so that buckets are reduced while backward still runs.
BUCKET_ELEMENTS = 4096
# eps well above fp32 rounding noise: a key projection's bias has a gradient that is
# mathematically zero (softmax ignores a shift of every key alike), and Adam would turn
# its noise (~1e-9, different on every mesh) into steps of lr either way.
ADAM = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-3, weight_decay=0.0)
# The plain optimizers: state (momentum), and AdamW's decoupled decay, which changes a
# parameter before its gradient is read.
PLAIN = {"sgd": (torch.optim.SGD, dict(lr=1e-1, momentum=0.9)),
         "adamw": (torch.optim.AdamW, dict(ADAM, weight_decay=0.1))}
PRICED = {"sgd": "sgd-momentum", "adamw": "adamw"}  # TrainSpec.optimizer: its state's bytes


def _gpt2() -> nn.Module:
    return models.gpt2(n_layer=2, dropout=0.0)


MODELS = {"gpt": (gpt.gpt_tiny, gpt.loss_fn), "gpt2": (_gpt2, models.causal_lm_loss),
          "moe": (moe.moe_tiny, moe.loss_fn),
          "qwen2": (hf_families.FAMILIES["qwen2"].build, hf_families.causal_lm_loss),
          "qwen3moe": (hf_families.FAMILIES["qwen3-moe"].build, hf_families.causal_lm_loss)}


def _batch(model: nn.Module, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    vocab = getattr(getattr(model, "config", None), "vocab_size", 128)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _fp32_logits(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.float()
    if isinstance(output, tuple):  # the sample MoE's (logits, balance loss)
        return tuple(_fp32_logits(t) for t in output)
    output.logits = output.logits.float()
    return output


def _reference_step(model: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor,
                    dtype: torch.dtype) -> float:
    """One step's gradients on one process: the whole batch in fp32, or in bf16 the
    runtime's recipe microbatch by microbatch (bf16 copies cast once per step)."""
    if dtype == torch.float32:
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss.item()
    masters = dict(model.named_parameters())
    copies = {name: nn.Parameter(p.detach().to(dtype)) for name, p in masters.items()}
    for name, c in copies.items():
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._parameters[attr] = c
    total = 0.0
    try:
        for xs, ys in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
            with cuda_autocast(dtype):
                output = model(xs)
            loss = loss_fn(_fp32_logits(output), ys)
            loss.backward()
            total += loss.item()
            for name, c in copies.items():  # fp32 accumulation, as the buckets
                if c.grad is not None:
                    master = masters[name]
                    if master.grad is None:
                        master.grad = torch.zeros_like(master)
                    master.grad.add_(c.grad)
                    c.grad = None
    finally:
        for name, p in masters.items():
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._parameters[attr] = p
    for p in masters.values():
        if p.grad is not None:
            p.grad.div_(MICROBATCHES)
    return total / MICROBATCHES


def run_case(name: str) -> dict[str, Any]:
    if name.split("-")[-2] in POISONS:
        return run_nonfinite_case(name)
    parts = name.split("-")
    build, loss_fn = MODELS[parts[0]]
    pp = int(parts.pop(1).removeprefix("pp")) if parts[1].startswith("pp") else 1
    ep = int(parts.pop(1).removeprefix("ep")) if parts[1].startswith("ep") else 1
    zero = int(parts[1].removeprefix("zero"))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[parts[2]]
    clip = 1.0 if "clip" in parts else None
    plain = parts[-1] if parts[-1] in PLAIN else None
    world = dist.get_world_size()
    dp = world // pp
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    x, y = _batch(model, 0)
    program = partc.compile(
        model, (x,), loss_fn=loss_fn, example_target=y,
        budget=partc.DeviceBudget(num_devices=world, device="CPU"),
        train=partc.TrainSpec(global_batch_size=BATCH, optimizer=PRICED.get(plain, "adam"),
                              dtype=dtype,
                              max_grad_norm=clip, bucket_elements=BUCKET_ELEMENTS),
        constraints=partc.Constraints(pp=pp, dp=dp, ep=ep, zero_stage=zero, recompute="none",
                                      schedule="1f1b" if pp > 1 else None,
                                      num_microbatches=MICROBATCHES // dp))
    module = program.build()
    if plain is None:
        opt = module.optimizer(torch.optim.Adam, **ADAM)
        ref_opt = torch.optim.Adam(reference.parameters(), **ADAM)
    else:
        optimizer_class, settings = PLAIN[plain]
        opt = optimizer_class(module.parameters(), **settings)
        ref_opt = optimizer_class(reference.parameters(), **settings)
    losses, ref_losses, norms, ref_norms = [], [], [], []
    for step in range(STEPS):
        x, y = _batch(model, step)
        losses.append(module.forward_backward(x, target=y).item())
        if clip is not None:
            norms.append(module.last_grad_norm.item())
        before = [p.detach().clone() for p in module.parameters()]
        try:
            opt.step()
        except partc.PartcError as error:
            changed = [not torch.equal(b, p.detach())
                       for b, p in zip(before, module.parameters(), strict=True)]
            return {"refused": f"{type(error).__name__}: {error}", "step": step,
                    "changed": sum(changed), "zero_stage": program.plan.effective_zero_stage}
        if step == STEPS - 1:
            measured = _measured_bytes(module, opt)
        opt.zero_grad()
        ref_losses.append(_reference_step(reference, loss_fn, x, y, dtype))
        if clip is not None:
            ref_norms.append(nn.utils.clip_grad_norm_(reference.parameters(), clip).item())
        ref_opt.step()
        ref_opt.zero_grad()
    full = module.full_state_dict()
    ref_state = reference.state_dict()
    errors = {k: ((full[k] - v).norm() / max(v.norm().item(), 1e-3)).item()
              for k, v in ref_state.items() if k in full and v.is_floating_point()}
    stage = program.plan.stages[module.stage_index]
    return {"losses": losses, "ref_losses": ref_losses, "grad_norms": norms,
            "ref_grad_norms": ref_norms, "param_errors": errors,
            "zero_stage": program.plan.effective_zero_stage,
            "measured": measured,
            "planned": {"params": stage.memory_bytes.params, "grads": stage.memory_bytes.grads,
                        "optimizer": stage.memory_bytes.optimizer},
            "param_count": stage.param_count}


# -- non-finite steps -------------------------------------------------------------------

NONFINITE_STEPS = 5
POISONED = 2   # the 0-based data step whose batch is poisoned: module.step 3
# A target row starting with the marker poisons the loss: -1 multiplies it by NaN (the
# loss and every gradient NaN), -2 by sqrt(0 x loss): a finite loss (0) whose gradient
# is NaN (0 x inf). Unpoisoned, the factor is sqrt(1): the loss and gradient exact.
POISONS = {"nan": -1, "gradnan": -2, "rankbatch": None}


def _poisonable(loss_fn: Callable) -> Callable:
    def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
        value = loss_fn(output, target.clamp(min=0))
        value = value * torch.where((target == -1).any(), float("nan"), 1.0)
        flag = (target == -2).any().float()
        return value * torch.sqrt(1 - flag + flag * 0 * value)
    return loss


def _snapshot(module: Any, opt: torch.optim.Optimizer) -> tuple[dict, list[float]]:
    """The whole model (collective) and the optimizer's step counts on this rank."""
    state = getattr(opt, "optim", opt).state
    return module.full_state_dict(), sorted(float(s["step"]) for s in state.values())


def run_nonfinite_case(name: str) -> dict[str, Any]:
    """Train ``NONFINITE_STEPS`` steps with step ``POISONED``'s batch poisoned; record, per
    step, whether the parameters or the optimizer's state changed, and the error or the
    skip. The reference is Adam on one process over the other batches."""
    parts = name.split("-")
    mode, poison = parts[-1], POISONS[parts[-2]]
    build, loss_fn = MODELS[parts[0]]
    pp = int(parts.pop(1).removeprefix("pp")) if parts[1].startswith("pp") else 1
    zero = int(parts[1].removeprefix("zero"))
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    x, y = _batch(model, 0)
    program = partc.compile(
        model, (x,), loss_fn=_poisonable(loss_fn), example_target=y,
        budget=partc.DeviceBudget(num_devices=world, device="CPU"),
        train=partc.TrainSpec(global_batch_size=BATCH, optimizer="adam",
                              bucket_elements=BUCKET_ELEMENTS, on_nonfinite=mode),
        constraints=partc.Constraints(pp=pp, dp=world // pp, zero_stage=zero,
                                      recompute="none",
                                      schedule="1f1b" if pp > 1 else None,
                                      num_microbatches=MICROBATCHES // (world // pp)))
    module = program.build()
    telemetry = module.telemetry(console=False)
    opt = module.optimizer(torch.optim.Adam, **ADAM)
    ref_opt = torch.optim.Adam(reference.parameters(), **ADAM)
    seen: dict[str, Any] = {"losses": [], "ref_losses": [], "changed": [], "stepped": [],
                            "skipped": [], "error": None}
    for step in range(NONFINITE_STEPS):
        x, y = _batch(model, step)
        if step == POISONED and poison is not None:
            y = y.clone()
            y[0, 0] = poison   # the first microbatch, on the first dp replica
        given = y
        if step == POISONED and poison is None and dist.get_rank() == world - 1:
            given = (y + 1) % 128   # the last stage reads another batch's targets
        before, steps_before = _snapshot(module, opt)
        try:
            loss = module.forward_backward(x, target=given)
        except (partc.NonFiniteError, partc.BatchMismatchError) as error:
            after, steps_after = _snapshot(module, opt)
            seen["error"] = {"message": str(error), "step": error.step,
                             "type": type(error).__name__,
                             "what": getattr(error, "what", None),
                             "stages": getattr(error, "stages", None), "ranks": error.ranks,
                             "parameters": getattr(error, "parameters", None),
                             "unchanged": all(torch.equal(before[k], after[k]) for k in before)
                             and steps_before == steps_after}
            break
        opt.step()
        after, steps_after = _snapshot(module, opt)
        opt.zero_grad()
        seen["losses"].append(loss.item())
        seen["skipped"].append(module.last_step_skipped)
        seen["changed"].append(not all(torch.equal(before[k], after[k]) for k in before))
        seen["stepped"].append(steps_before != steps_after)
        if step != POISONED:
            seen["ref_losses"].append(_reference_step(reference, loss_fn, x, y, torch.float32))
            ref_opt.step()
            ref_opt.zero_grad()
    full, ref_state = module.full_state_dict(), reference.state_dict()
    seen["param_errors"] = {k: ((full[k] - v).norm() / max(v.norm().item(), 1e-3)).item()
                            for k, v in ref_state.items()
                            if k in full and v.is_floating_point()}
    seen["skipped_steps"] = module.skipped_steps
    seen["telemetry_skipped"] = telemetry.skipped_steps
    seen["telemetry_flags"] = [r.skipped for r in telemetry.records]
    seen["stage"] = module.stage_index
    module.close()
    return seen


def _measured_bytes(module: Any, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the tensors this rank allocated for weights, gradients and optimizer
    state, after a step: the parameters (and the compute-dtype copies the step made, or
    ZeRO-1's fp32 masters),
    the gradient buckets or FSDP's sharded gradients, the optimizer's state tensors."""
    params = list({id(p): p for p in module.parameters()}.values())
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    weights = sum(p.numel() * p.element_size() for p in local)
    copies = module.parts.copies
    weights += copies.last_bytes if copies is not None else 0
    buckets = module.parts.buckets
    # ZeRO-1 in mixed precision: the fp32 masters of this rank's shards.
    weights += sum(module.master_of(p).numel() * 4 for p in params
                   if module.master_of(p) is not None)
    if buckets is not None:
        grads = sum(b.buffer.numel() * b.buffer.element_size() for b in buckets.buckets)
    else:  # FSDP's sharded gradients
        grads = sum(g.numel() * g.element_size() for p in params if p.grad is not None
                    for g in [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad])
    state = getattr(opt, "optim", opt).state
    optimizer = sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size()
                    for s in state.values() for t in s.values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0)
    return {"params": weights, "grads": grads, "optimizer": optimizer}


def run_cases(run: Callable[[str], dict[str, Any]]) -> None:
    """``worker.py OUT CASE [CASE ...]``: each case run, its result (or its error) in
    ``OUT/rank<k>.json``."""
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    results: dict[str, Any] = {}
    for name in sys.argv[2:]:
        try:
            results[name] = run(name)
        except Exception as error:  # recorded, so one failure does not hide the others
            results[name] = {"error": f"{type(error).__name__}: {error}",
                             "traceback": traceback.format_exc()}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    topology.leave()   # no gloo thread left running into shutdown


def main() -> None:
    run_cases(run_case)


if __name__ == "__main__":
    os.environ.setdefault("PARTC_TIMEOUT_S", "120")
    main()
