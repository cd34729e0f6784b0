"""Whether a model's loss couples the samples of a batch, and what the plan may then do.

partc splits each step's batch over data-parallel replicas and microbatches and averages
their losses: that equals one process's loss only if the loss is a mean over samples.
A load-balancing loss over the whole batch (Mixtral's, Qwen-MoE's and OLMoE's router
losses: the fraction of the batch's tokens each expert takes times its mean router
probability, a product of batch means) is not. For a model whose mixture-of-experts
layers feed such a loss (``partc.passes.moe`` recognises it), :func:`couples_samples`
compares the loss of the example batch with the mean of its halves' losses, on the real
weights (a float64 copy of a small model), without changing them. Where the loss couples
samples, :func:`restrict` plans one replica and one microbatch, or refuses pins that
split the batch, unless ``TrainSpec(loss_per_microbatch=True)`` declares each
microbatch's loss its own.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from typing import Any, Callable

import torch
from torch import nn

from partc.errors import PartcError

log = logging.getLogger("partc.batch_coupling")

# The relative difference between the batch's loss and its halves' mean above which the
# loss couples samples: in float64 reductions in another order differ by ~1e-15, in
# float32 by ~1e-7. A model of up to FLOAT64_PARAMS parameters is probed on a float64
# copy, so that a load-balancing loss weighted 1e-3 against the rest still shows.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-6}
FLOAT64_PARAMS = 50_000_000


def couples_samples(model: nn.Module, example_inputs: tuple, loss_fn: Callable | None,
                    example_target: Any) -> bool | None:
    """Whether ``loss_fn(model(*inputs), target)`` (or the model's own output when
    ``loss_fn`` is None) of the example batch differs from the mean of its two halves'
    losses, weighted by their sizes: True or False, or None when it cannot be told (a
    batch of one, weights on the meta device, a loss that is not reproducible run to
    run, such as functional dropout). A model of up to ``FLOAT64_PARAMS`` parameters is
    probed on a float64 copy where its ops take float64 (grouped expert matmuls do not),
    otherwise as it is. The model runs in its own mode with its dropout modules off and
    under ``no_grad``; its parameters and buffers (running statistics) are as they were
    afterwards."""
    batch = _batch_size(example_inputs)
    if batch is None or batch < 2:
        return None
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        log.info("the loss's coupling of samples is not checked: the weights are on meta")
        return None
    if sum(p.numel() for p in model.parameters()) <= FLOAT64_PARAMS:
        try:
            return _probe(copy.deepcopy(model).double(),
                          tuple(_double(t) for t in example_inputs), loss_fn,
                          _double(example_target), batch, TOLERANCE[torch.float64])
        except RuntimeError as error:   # an op without float64 (torch._grouped_mm)
            log.info("probing the loss in float64 failed (%s); probing as the model is",
                     str(error).splitlines()[0])
    return _probe(model, example_inputs, loss_fn, example_target, batch,
                  TOLERANCE[torch.float32])


def _probe(model: nn.Module, example_inputs: tuple, loss_fn: Callable | None,
           example_target: Any, batch: int, tolerance: float) -> bool | None:
    half = batch // 2
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    dropouts = [(m, m.p) for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd)]
    try:
        for module, _ in dropouts:
            module.p = 0.0
        with torch.no_grad():
            whole = _loss(model, example_inputs, loss_fn, example_target, slice(None), batch)
            again = _loss(model, example_inputs, loss_fn, example_target, slice(None), batch)
            if whole is None or not math.isclose(whole, again, rel_tol=tolerance, abs_tol=0.0):
                return None
            first = _loss(model, example_inputs, loss_fn, example_target, slice(0, half), batch)
            second = _loss(model, example_inputs, loss_fn, example_target,
                           slice(half, batch), batch)
    finally:
        for module, p in dropouts:
            module.p = p
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(saved[name])
    if first is None or second is None:
        return None
    mean = (half * first + (batch - half) * second) / batch
    return not math.isclose(whole, mean, rel_tol=tolerance, abs_tol=1e-12)


def restrict(constraints: Any, train: Any, name: str) -> Any:
    """The constraints a model whose loss couples samples plans under: one replica and
    one microbatch, unless ``train.loss_per_microbatch``; pins that split the batch are
    refused, naming ``name`` (what couples) and the way out."""
    if train.loss_per_microbatch:
        return constraints
    splits = [f"{field}={value}" for field, value in (("dp", constraints.dp),
                                                      ("num_microbatches",
                                                       constraints.num_microbatches))
              if value is not None and value > 1]
    if splits:
        raise PartcError(
            f"the loss couples the samples of a batch ({name}): with {', '.join(splits)} "
            "each part of the batch would compute its own, and training would differ from "
            "one device's. Leave dp and the microbatches to the planner (it then plans one "
            "replica and one microbatch), or declare each microbatch's loss its own, as "
            "Megatron and gradient accumulation compute it: "
            "TrainSpec(loss_per_microbatch=True), --loss-per-microbatch")
    log.warning("the loss couples the samples of a batch (%s): planning one replica and one "
                "microbatch (TrainSpec(loss_per_microbatch=True) allows more)", name)
    return dataclasses.replace(constraints, dp=1, num_microbatches=1)


def _double(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.double()
    return value


def _batch_size(inputs: tuple) -> int | None:
    first = next((t for t in inputs if isinstance(t, torch.Tensor) and t.dim()), None)
    return None if first is None else int(first.shape[0])


def _part(value: Any, rows: slice, batch: int) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch:
        return value[rows]
    return value


def _loss(model: nn.Module, inputs: tuple, loss_fn: Callable | None, target: Any,
          rows: slice, batch: int) -> float | None:
    output = model(*(_part(t, rows, batch) for t in inputs))
    value = loss_fn(output, _part(target, rows, batch)) if loss_fn is not None else output
    value = getattr(value, "loss", value)
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        return None
    return float(value.double())
