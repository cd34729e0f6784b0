"""This rank's parameters and buffers under the model's FQNs: the state of a program.

:class:`RankState` is the public, read-only view of what a rank holds that state dicts
and checkpoints (``partc/runtime/checkpoint.py``, ``checkpoint_chunks.py``) need: the
stage's tensors under their FQNs, each tensor's tensor-parallel placement and canonical
FQN, the whole model's shapes, the routed experts' slices, and under ZeRO-1 in mixed
precision the fp32 masters the optimizer steps. ``DistributedModule.state`` is one.

Under ZeRO-1 the optimizer step leaves the all-gather of the updated parameters in flight
for the next forward (``TrainSpec.overlap_param_gather``): what hands out or reads
parameters outside forward finishes it first (:meth:`RankState.wait_param_gathers`).
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from partc.placement import Placement
from partc.plan import Plan
from partc.runtime import tp as tp_ops
from partc.runtime.parameters import dp_shard, local_part
from partc.runtime.rank_parts import RankParts
from partc.runtime.topology import Topology


class RankState:
    """What this rank holds of the model's state, under the model's own FQNs."""

    def __init__(self, parts: RankParts) -> None:
        self._parts = parts
        self._experts = frozenset(id(p) for p in parts.expert_params)

    # -- what the rank is --------------------------------------------------------------

    @property
    def plan(self) -> Plan:
        return self._parts.plan

    @property
    def topology(self) -> Topology:
        return self._parts.topology

    @property
    def model_tensors(self) -> Mapping[str, tuple[tuple[int, ...], torch.dtype]]:
        """The whole model's ``state_dict()`` entries (shape, dtype): what a checkpoint
        holds."""
        return self._parts.model_tensors

    def is_expert(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is this rank's block of a routed expert weight (dim 0 cut
        over the expert-parallel group)."""
        return id(tensor) in self._experts

    def fqns(self, name: str) -> tuple[str, ...]:
        """Every FQN of the stage's tensor ``name`` in the model (tied weights have
        several)."""
        return self._parts.aliases.get(name, (name,))

    def canonical(self, name: str) -> str:
        """The first FQN of ``name``: the one a checkpoint stores it under, once."""
        return self.fqns(name)[0]

    def placement(self, name: str) -> Placement:
        """The plan's tensor-parallel placement of the stage's tensor ``name``."""
        return self.plan.placement(self.fqns(name))

    # -- tensors -----------------------------------------------------------------------

    def parameters(self) -> Iterator[nn.Parameter]:
        """The stage's parameters (each once), ZeRO-1's all-gathers done."""
        self.wait_param_gathers()
        return self._parts.module.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The stage's parameters under the model's FQNs, ZeRO-1's all-gathers done."""
        self.wait_param_gathers()
        return self._parts.module.named_parameters()

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._parts.module.named_buffers()

    def named_unread(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The parameters the forward never reads, as this rank keeps them (untrained,
        on the host; the first pipeline stage's ranks only)."""
        return iter(self._parts.unread.items())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers under the model's own FQNs: its stage's
        tensors, and of a tensor-parallel parameter only this rank's shard, and on the
        first stage the parameters the forward never reads (:meth:`named_unread`). (Under
        ZeRO-1 in mixed precision the parameters are the compute-dtype ones the stage
        computes with; :meth:`full_state_dict` and checkpoints hold the fp32 masters.)"""
        return {**dict(self.named_parameters()), **dict(self.named_buffers()),
                **dict(self.named_unread())}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters and buffers, whole, on every rank (CPU copies),
        under every FQN ``model.state_dict()`` uses (tied weights under each name).

        Collective: every rank must call it. Shards are gathered over the tensor-parallel
        group, routed experts over the expert-parallel group, and stages over the pipeline
        (as Python objects: meant for exporting and checking models that fit one host's
        memory).
        """
        whole = {name: self._whole(name, tensor).cpu().clone()
                 for name, tensor in self.state_dict().items()}
        topo = self.topology
        if topo.pp > 1:
            stages: list[Any] = [None] * topo.pp
            dist.all_gather_object(stages, whole, group=topo.pp_group)
            whole = {name: t for stage in stages for name, t in stage.items()}
        return {alias: tensor for name, tensor in whole.items() for alias in self.fqns(name)
                if alias in self._parts.state_keys}

    def _whole(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """One of this rank's tensors, whole: its dp masters' or FSDP's shards, its
        experts and its tensor-parallel shards gathered (collective over those groups)."""
        topo = self.topology
        value = tensor.detach()
        if self._host_weight(tensor) is not None:   # fp32, the host's master
            value = self._host_weight(tensor).clone()
        elif self.master_of(tensor) is not None:   # fp32, from the dp ranks' masters
            value = self._parts.buckets.full_master(tensor)
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if self.is_expert(tensor):   # this rank's block of experts: dim 0
            parts = [torch.empty_like(value) for _ in range(topo.ep)]
            dist.all_gather(parts, value.contiguous(), group=topo.ep_group)
            value = torch.cat(parts)
        placement = self.placement(name)
        if topo.tp > 1 and placement.kind == "S":
            parts = [torch.empty_like(value) for _ in range(topo.tp)]
            dist.all_gather(parts, value.contiguous(), group=topo.tp_group)
            value = tp_ops.whole_of(parts, placement.dim, placement.chunks)
        return value

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load this rank's tensors from ``state_dict``: its own (``state_dict()``) or the
        whole model's (``full_state_dict()``, ``model.state_dict()``), sliced to shards."""
        own = self.state_dict()
        sources = {name: self._entry(state_dict, name) for name in own}
        # A non-persistent buffer (not in model.state_dict()) may be absent: it is kept;
        # so is a parameter the forward never reads (a state dict of a program that held
        # none).
        missing = [name for name, source in sources.items()
                   if source is None and name in self._parts.state_keys
                   and name not in self._parts.unread]
        if missing:
            raise KeyError(f"state dict lacks {len(missing)} of this rank's tensors, "
                           f"e.g. {missing[:3]}")
        with torch.no_grad():
            for name, source in sources.items():
                if source is not None:
                    self._load(name, own[name], source)
        if self._parts.host is not None:   # the host's masters from what was loaded
            self._parts.host.after_load()

    def _load(self, name: str, tensor: torch.Tensor, source: torch.Tensor) -> None:
        """``source`` (this rank's own entry, or the whole tensor) into ``tensor``."""
        topo = self.topology
        placement = self.placement(name)
        if isinstance(source, DTensor):  # this rank's own state_dict(), ZeRO-2/3
            local_part(tensor).copy_(source.to_local())
            return
        if self.is_expert(tensor) and source.shape[0] != tensor.shape[0]:
            rows = tensor.shape[0]   # the whole weight: this rank's experts
            source = source[topo.ep_rank * rows:(topo.ep_rank + 1) * rows]
        if source.shape != tensor.shape and placement.kind == "S":
            source = tp_ops.shard_of(source, placement.dim, placement.chunks,
                                     topo.tp_rank, topo.tp)
        if source.shape != tensor.shape:
            raise ValueError(f"{name}: state dict has shape {list(source.shape)}, "
                             f"this rank holds {list(tensor.shape)} ({placement})")
        if isinstance(tensor, DTensor):  # whole over its mesh: this rank's shard
            mesh = tensor.device_mesh
            source = dp_shard(source, mesh.size(), mesh.get_local_rank())
        if self._host_weight(tensor) is not None:
            self._host_weight(tensor).copy_(source)
            tensor.detach().copy_(source)
            return
        if self.master_of(tensor) is not None:
            self._parts.buckets.load_whole(tensor, source)
            return
        local_part(tensor).copy_(source)

    def _entry(self, state_dict: Mapping[str, torch.Tensor], name: str) -> torch.Tensor | None:
        """``state_dict``'s tensor for ``name`` under any of its FQNs, or None."""
        return next((state_dict[a] for a in self.fqns(name) if a in state_dict), None)

    # -- ZeRO-1's masters and all-gathers ------------------------------------------------

    def master_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """In mixed precision, once the module's ``optimizer()`` made it: under ZeRO-1
        this rank's fp32 master of its dp shard of ``param``, with the optimizer
        offloaded and the gradient buckets on the host the fp32 host master of it (the
        parameter itself is then kept in the compute dtype). None otherwise: the
        parameter is its own master."""
        host = self._host_weight(param)
        if host is not None:
            return host
        buckets = self._parts.buckets
        return None if buckets is None else buckets.master_of(param)

    def _host_weight(self, param: torch.Tensor) -> torch.Tensor | None:
        host = self._parts.host
        return None if host is None else host.weights.get(id(param))

    def master_shards(self, param: torch.Tensor) -> tuple[int, int] | None:
        """How ``param``'s master is cut (:meth:`master_of` not None): the size of the
        group sharding it and this rank's place in it (dp, or an expert weight's
        expert-data-parallel group); None for a host master, which is whole."""
        if self._host_weight(param) is not None:
            return None
        return self._parts.buckets.shards_of(param)

    def refresh_from_masters(self) -> None:
        """The parameters again from the masters (after a checkpoint loaded into them):
        ZeRO-1's gathered (collective over the dp group), and with the optimizer
        offloaded the host's masters and the device's tensors made to agree
        (:meth:`partc.runtime.offload.HostTier.after_load`); nothing without masters."""
        buckets = self._parts.buckets
        if buckets is not None and buckets.has_masters:
            buckets.gather_params()
        if self._parts.host is not None:
            self._parts.host.after_load()

    def wait_param_gathers(self) -> None:
        """Finish ZeRO-1's all-gathers of the stepped parameters still in flight (the
        forward pre-hooks of :func:`partc.runtime.optimizer.wait_in_forward` finish
        them bucket by bucket otherwise); nothing when none is."""
        if self._parts.buckets is not None:
            self._parts.buckets.wait_gathers()
