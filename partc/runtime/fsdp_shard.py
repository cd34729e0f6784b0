"""ZeRO-2/3 by FSDP2: this rank's stage sharded over its data-parallel group.

Each layer that owns its parameters is an FSDP2 unit (lowering made it a module of its
own) and the stage the root unit, sharded over the dp group; under expert parallelism
each layer's routed experts are a unit of their own, sharded over the
expert-data-parallel group (the ranks holding the same experts). The smallest layers
(norms, position embeddings) join the next unit instead of being units of their own
(:data:`partc.problem.SMALL_UNITS_SHARE`; the cost model charges them no unit's work).
In mixed precision the fp32 shards are the master weights, gathered as compute-dtype
copies, and gradients are reduce-scattered in fp32.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,
                                    fully_shard)

from partc.errors import PartcError
from partc.problem import SMALL_UNITS_SHARE
from partc.runtime import experts
from partc.runtime.topology import Topology


def shard_over_dp(module: fx.GraphModule, unit_paths: tuple[str, ...], topology: Topology,
                   zero_stage: int, compute_dtype: torch.dtype, *,
                   backward_follows: bool, offload_params: bool = False) -> None:
    """ZeRO-2/3 by FSDP2 over the dp group: one unit per layer that owns its parameters
    (``unit_paths``; a small layer shares the next one's, see :func:`unit_groups`), the
    stage itself the root unit for the rest (tied weights, layers without a module of
    their own). ZeRO-3 frees a unit's gathered parameters after its forward, except the
    stage's last unit when ``backward_follows`` (its backward comes next: freed, it
    would be gathered again at once, as torchtitan's ``apply_fsdp`` knows); the root
    keeps its own gathered until backward, as FSDP does. In mixed precision the fp32
    shards are the master weights, gathered as compute-dtype copies, and gradients are
    reduce-scattered in fp32. With context parallelism the units shard over the dp x cp
    ranks, which hold the same parameters (``Topology.grad_mesh``). ``offload_params``
    (ZeRO-3): FSDP2's CPU offload policy, the shards and their gradients on the host,
    copied in for each all-gather and out after each reduce-scatter; the optimizer then
    steps them there."""
    mesh = topology.grad_mesh
    policy = MixedPrecisionPolicy(
        param_dtype=None if compute_dtype == torch.float32 else compute_dtype,
        reduce_dtype=torch.float32)
    offload = (dict(offload_policy=CPUOffloadPolicy(pin_memory=topology.device.type == "cuda"))
               if offload_params else {})
    # Innermost first: the experts (lowering made each call hold its weights).
    for layer in experts.expert_modules(module):
        if layer.owned:
            _shard_experts(layer, topology, zero_stage, policy, offload)
    groups = unit_groups([module.get_submodule(path) for path in unit_paths],
                          sum(p.numel() for p in module.parameters()))
    for index, group in enumerate(groups):
        kept = backward_follows and index == len(groups) - 1
        fully_shard(group if len(group) > 1 else group[0], mesh=mesh, mp_policy=policy,
                    reshard_after_forward=zero_stage >= 3 and not kept, **offload)
    fully_shard(module, mesh=mesh, reshard_after_forward=zero_stage >= 3, mp_policy=policy,
                **offload)


def _shard_experts(layer: experts.ExpertParallel, topology: Topology, zero_stage: int,
                   policy: MixedPrecisionPolicy, offload: dict) -> None:
    """One mixture-of-experts layer's routed experts as an FSDP unit of their own over
    the expert-data-parallel group (the ranks holding the same experts; the dp group
    without expert parallelism). Their gradient is the sum over that group divided by
    dp, as the dense weights' mean over dp: together the group's ranks received every
    replica's tokens routed to these experts."""
    mesh = topology.mesh["dp"] if topology.ep == 1 else DeviceMesh.from_group(
        topology.expert_dp_group, topology.device.type, mesh_dim_names=("expert_dp",))
    if mesh.size() != topology.dp and not hasattr(FSDPModule,
                                                  "set_force_sum_reduction_for_comms"):
        raise PartcError("ZeRO-2/3 with expert parallelism divides the experts' gradients "
                         "by dp, not by the ranks holding them, with FSDP's "
                         "set_gradient_divide_factor and set_force_sum_reduction_for_comms, "
                         f"which torch {torch.__version__} lacks: plan ZeRO-0/1 or use a "
                         "newer torch")
    # Its inputs keep their dtypes: the router's combine weights stay fp32 as on one
    # device under autocast (FSDP would cast them to bf16 and the combine with them);
    # the experts' matmuls cast what they compute with, as autocast does.
    policy = dataclasses.replace(policy, cast_forward_inputs=False)
    fully_shard(layer, mesh=mesh, reshard_after_forward=zero_stage >= 3, mp_policy=policy,
                **offload)
    if mesh.size() != topology.dp:
        layer.set_gradient_divide_factor(topology.dp)
        if mesh.size() > 1:  # a sum then a division (gloo has no pre-multiplied sum)
            layer.set_force_sum_reduction_for_comms(True)


def unit_groups(units: list[nn.Module], stage_params: int) -> list[list[nn.Module]]:
    """The FSDP units of a stage, each a list of the layers' modules it gathers
    together, in order: every layer holding parameters is one, but the smallest, whose
    parameters together stay within ``SMALL_UNITS_SHARE`` of the stage's, join the next
    unit (a final norm the head, as torchtitan groups them), or after the last one the
    root."""
    sizes = {id(unit): sum(p.numel() for p in unit.parameters()) for unit in units}
    units = [unit for unit in units if sizes[id(unit)] > 0]
    allowance = SMALL_UNITS_SHARE * stage_params
    small: set[int] = set()
    for unit in sorted(units, key=lambda u: sizes[id(u)]):
        if sizes[id(unit)] > allowance:
            break
        allowance -= sizes[id(unit)]
        small.add(id(unit))
    groups: list[list[nn.Module]] = []
    waiting: list[nn.Module] = []
    for unit in units:
        waiting.append(unit)
        if id(unit) not in small:
            groups.append(waiting)
            waiting = []
    return groups  # the small layers still waiting are the root's
