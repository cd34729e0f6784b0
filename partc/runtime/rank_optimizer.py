"""The optimizer over this rank's parameters, holding its state as the plan does.

With ZeRO-1 (``plan.effective_zero_stage == 1``) each data-parallel rank keeps the state
of its dp shard (rows ``chunk(dp)[rank]`` of each parameter), steps it with the
reduce-scattered gradients and all-gathers the updated shards, bucket by bucket
(:class:`partc.runtime.optimizer.DistributedOptimizer`); otherwise it is the user's
optimizer class over the rank's parameters.

Under ZeRO-1 no other optimizer may step the rank's parameters: their reduced gradients
are shards in the buckets, never in ``.grad``, so a ``torch.optim`` optimizer built over
``module.parameters()`` (the loop people write) would find no gradient and leave the
model as it was, step after step, with no error. Making it train alike instead was
weighed and not done: ``.grad`` would need every rank's reduced shards (an all-gather of
the gradients each step, beyond the plan's collectives), and the optimizer would keep
state for every row of each parameter where the plan priced 1/dp of it, so the plan's
time and memory would no longer hold. Such a step is refused instead, before it changes
anything, naming ``module.optimizer`` (:data:`PLAIN_STEPS`). Under ZeRO 0/2/3 a plain
optimizer is what :func:`make_optimizer` builds anyway, and trains as on one device.

torch offers no hook on an optimizer partc did not make, so the refusal is one
process-wide optimizer step pre-hook (``torch.optim.optimizer.
register_optimizer_step_pre_hook``), installed when the first ZeRO-1 module is built. It
checks an optimizer about to step against the parameters of the ZeRO-1 modules alive;
one over other parameters (the shards :class:`DistributedOptimizer` steps, the
placeholder of a stage without parameters, a model partc never saw) passes, and is
remembered as passed with its parameter count: its later steps cost one dictionary
look-up, and with no ZeRO-1 module alive the hook returns at once.
"""

from __future__ import annotations

import logging
import weakref
from functools import partial
from typing import Any, Iterable, Mapping

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from partc.errors import PlanMismatchError
from partc.runtime.offload import HostOptimizer, host_kernel, local_tensor
from partc.runtime.optimizer import DistributedOptimizer
from partc.runtime.rank_parts import RankParts
from partc.runtime.rank_state import RankState

log = logging.getLogger("partc.runtime")


def make_optimizer(parts: RankParts, state: RankState,
                   optimizer_class: type[torch.optim.Optimizer], defaults: Mapping[str, Any]
                   ) -> torch.optim.Optimizer:
    """``optimizer_class(parameters, **defaults)`` as the plan holds its state.

    A stage may hold no parameters (the planner may put the loss alone on the last
    stage when that is fastest). torch optimizers refuse an empty parameter list, so
    such a rank gets ``optimizer_class`` over one empty placeholder parameter that never
    has a gradient: ``step`` and ``zero_grad`` do nothing, and learning-rate schedulers,
    ``state_dict`` and the README's loop work unchanged on every rank. Torch's fused
    step where the plan chose it (:func:`fused_defaults`)."""
    defaults = fused_defaults(parts, optimizer_class, defaults)
    check_step_temporaries(parts, state, defaults)
    buckets, copies = parts.buckets, parts.copies
    if not any(True for _ in state.parameters()):
        placeholder = nn.Parameter(torch.empty(0, device=parts.topology.device))
        return optimizer_class([placeholder], **defaults)
    if parts.plan.offload_optimizer:
        return _offloaded(parts, state, optimizer_class, defaults)
    if buckets is not None and buckets.sharded:
        return DistributedOptimizer(
            buckets, optimizer_class,
            compute_dtype=copies.dtype if copies is not None else None, **defaults)
    return optimizer_class(state.parameters(), **defaults)


def _offloaded(parts: RankParts, state: RankState,
               optimizer_class: type[torch.optim.Optimizer], defaults: Mapping[str, Any]
               ) -> torch.optim.Optimizer:
    """The step on the host (``partc/runtime/offload.py``): under ZeRO-3 with parameter
    offload, the user's class over the host shards FSDP keeps (torch's fused kernel for
    Adam and AdamW); under ZeRO-1 the distributed optimizer stepping its shards on the
    host; with the gradient buckets on the host (one replica), fp32 host masters of the
    parameters stepped with those buckets, the parameters kept in the compute dtype; else
    host masters of the parameters (FSDP's local shards under ZeRO-2/3) stepped with
    their gradients copied out."""
    buckets, copies, tier = parts.buckets, parts.copies, parts.host
    chunk = parts.plan.train.bucket_elements   # the pipelined host step's chunks
    if parts.plan.offload_params:
        params = list(state.parameters())
        tier.counters.host_resident += 2 * sum(local_tensor(p).numel()
                                               * local_tensor(p).element_size()
                                               for p in params)   # shards and gradients
        return optimizer_class(params, **host_kernel(optimizer_class, dict(defaults)))
    if buckets is not None and buckets.sharded:
        return DistributedOptimizer(
            buckets, partial(HostOptimizer, optimizer_class=optimizer_class, tier=tier,
                             chunk_elements=chunk),
            compute_dtype=copies.dtype if copies is not None else None, **defaults)
    if buckets is not None and buckets.host is not None:
        params = list(state.parameters())
        optimizer = HostOptimizer(params, optimizer_class, tier, grad_of=buckets.grad_of,
                                  grads_on_host=True, on_zero_grad=buckets.zero_,
                                  chunk_elements=chunk, **defaults)
        if copies is not None:   # the host holds the fp32 masters now
            with torch.no_grad():
                for param in params:
                    if param.is_floating_point() and param.dtype != copies.dtype:
                        param.data = param.data.to(copies.dtype)
                        tier.weights[id(param)] = optimizer.master_of(param)
        return optimizer
    return HostOptimizer(state.parameters(), optimizer_class, tier, chunk_elements=chunk,
                         **defaults)


def fused_defaults(parts: RankParts, optimizer_class: type[torch.optim.Optimizer],
                   defaults: Mapping[str, Any]) -> Mapping[str, Any]:
    """``defaults`` with ``fused=True`` where the plan chose torch's fused step
    (``TrainSpec.fused_optimizer``, priced at HBM rate), the optimizer is Adam or AdamW
    and the rank's weights are on a GPU, unless the caller chose ``fused`` or
    ``foreach`` itself."""
    if parts.plan.train.fused_optimizer is not True or parts.topology.device.type == "cpu" \
            or not issubclass(optimizer_class, (torch.optim.Adam, torch.optim.AdamW)) \
            or "fused" in defaults or "foreach" in defaults:
        return defaults
    return {**defaults, "fused": True}


def check_step_temporaries(parts: RankParts, state: RankState,
                           defaults: Mapping[str, Any]) -> None:
    """Warn where ``foreach=True`` makes the optimizer step's fp32 temporaries for all
    of the rank's weights at once although the plan priced torch's default for them,
    one tensor at a time (CPU weights; :func:`partc.cost.state_bytes.step_bytes`): the step then
    needs more than the plan's peak says. ``fused=True`` and ``foreach=False`` need
    less, and ZeRO-1's sharded step was priced whole."""
    plan, topo = parts.plan, parts.topology
    stage = plan.stages[topo.pp_rank]
    precision = plan.train.precision
    if not defaults.get("foreach") or not precision.step_copies \
            or topo.device.type != "cpu" \
            or (parts.buckets is not None and parts.buckets.sharded):
        return
    weights = sum(p.numel() for p in state.parameters())
    whole = int(precision.step_copies * precision.master_bytes * weights)
    priced = stage.memory_bytes.step
    if whole > priced:
        log.warning("rank %d: optimizer foreach=True steps all %s weights at once: its "
                    "temporaries take %.1f MiB where the plan priced %.1f MiB (torch's "
                    "default for CPU weights, one tensor at a time); the stage's peak "
                    "may exceed its planned %.1f MiB. Leave foreach to torch, or plan "
                    "with more memory headroom", topo.rank, f"{weights:,}",
                    whole / 2**20, priced / 2**20, stage.memory_bytes.peak / 2**20)


class PlainStepGuard:
    """Refuses an optimizer's step over parameters of a live ZeRO-1 module (the module's
    doc): one process-wide step pre-hook, installed at the first :meth:`watch`."""

    def __init__(self) -> None:
        # owner (a DistributedModule) -> (its parameters' names by id, where it runs);
        # the owner holds the parameters, so their ids stay theirs while it lives.
        self._watched: weakref.WeakKeyDictionary[Any, tuple[dict[int, str], str]] = \
            weakref.WeakKeyDictionary()
        # optimizer -> (generation, parameter count) when it last passed.
        self._passed: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, int]] = \
            weakref.WeakKeyDictionary()
        self._generation = 0  # a new watch: every optimizer is checked again
        self._handle: Any = None

    def watch(self, owner: Any, named: Iterable[tuple[str, nn.Parameter]],
              where: str) -> None:
        """Refuse any optimizer but ``owner``'s own that steps one of ``named``'s
        parameters, for as long as ``owner`` (which holds them) lives; ``where``: the
        rank and stage, for the message."""
        self._watched[owner] = ({id(p): name for name, p in named}, where)
        self._generation += 1
        if self._handle is None:
            self._handle = register_optimizer_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if not self._watched or isinstance(optimizer, HostOptimizer):   # partc's own
            return
        groups = optimizer.param_groups
        seen = (self._generation, sum(len(group["params"]) for group in groups))
        if self._passed.get(optimizer) == seen:
            return
        for owner, (names, where) in list(self._watched.items()):
            held = [names[id(p)] for group in groups for p in group["params"]
                    if id(p) in names]
            if held:
                raise PlanMismatchError(_refusal(optimizer, held, where,
                                                 getattr(owner, "step", None)))
        self._passed[optimizer] = seen


def _refusal(optimizer: torch.optim.Optimizer, held: list[str], where: str,
             step: int | None) -> str:
    kind = type(optimizer)
    name = (f"torch.optim.{kind.__qualname__}" if kind.__module__.startswith("torch.optim")
            else kind.__qualname__)
    more = f" and {len(held) - 1} more" if len(held) > 1 else ""
    at = f" at step {step}" if step else ""
    if where.endswith(_OFFLOADED):
        return (f"{where.removesuffix(_OFFLOADED)}: {name}.step(){at} would update "
                f"{held[0]!r}{more} of a plan that offloads the optimizer; refused before "
                f"it changed any parameter. The plan keeps the optimizer's state and fp32 "
                f"masters on the host and prices no state on the device: build it with "
                f"module.optimizer({name}, <the same arguments>), which steps on the host, "
                f"or plan with Constraints(offload=())")
    return (f"{where}: {name}.step(){at} would update {held[0]!r}{more} of a ZeRO-1 "
            f"plan; refused before it changed any parameter. Under ZeRO-1 each "
            f"data-parallel rank holds the reduced gradient of its 1/dp shard of every "
            f"parameter in partc's buckets, not in .grad, and the plan prices optimizer "
            f"state for that shard only: an optimizer over module.parameters() finds no "
            f"gradient and would leave the model as it was. Build it with "
            f"module.optimizer({name}, <the same arguments>), which steps this rank's "
            f"shards and all-gathers them, or plan with Constraints(zero_stage=0) or 2, "
            f"under which a plain torch optimizer over module.parameters() trains as on "
            f"one device")


# Marks the place of a watched module whose plan offloads the optimizer.
_OFFLOADED = " (optimizer offloaded)"


# The one guard of the process: see the module's doc.
PLAIN_STEPS = PlainStepGuard()


def refuse_plain_steps(owner: Any, parts: RankParts, state: RankState) -> None:
    """Under ZeRO-1, refuse any optimizer's step over this rank's parameters but that of
    :func:`make_optimizer` (:data:`PLAIN_STEPS`), while ``owner`` lives."""
    buckets, topo, plan = parts.buckets, parts.topology, parts.plan
    offloaded = plan.offload_optimizer and not plan.offload_params
    if not offloaded and (buckets is None or not buckets.sharded):
        return
    where = (f"rank {topo.rank} (stage {topo.pp_rank}, data-parallel rank {topo.dp_rank} "
             f"of {topo.dp})") + (_OFFLOADED if offloaded else "")
    PLAIN_STEPS.watch(owner, state.named_parameters(), where)
