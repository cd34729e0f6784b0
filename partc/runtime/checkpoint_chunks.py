"""What a rank holds of each tensor of a checkpoint, and the DCP planners that write and
read it (partc/runtime/checkpoint.py saves and loads; the module docstring there says
what a checkpoint holds).

Every parameter and persistent buffer is known under its canonical FQN (the first of its
FQNs: a tied weight once). This rank's part of it is a set of :class:`Chunks`: views of
its own tensor with their offsets in the whole tensor, cut exactly as the runtime cuts it
(a routed expert weight's block of experts on this expert-parallel rank, the plan's
tensor-parallel placement, ``Shard(dim, chunks=k)`` being k chunks per rank, then FSDP2's
shard of dim 0 under ZeRO-2/3, over the DTensor's own mesh: dp, or for a routed expert
weight the expert-data-parallel group). Ranks holding the same chunk (replicas, the
expert-data-parallel group) name it alike, and DCP writes it once. DCP names each chunk by
its offsets, so a checkpoint written under one cut reads back under any other (resharding by
FQN); optimizer state shaped like its parameter is cut the same way. An offloaded
optimizer's state is the host's, read through the same keys (``partc/runtime/offload.py``),
and where the device keeps a weight in the compute dtype its fp32 host master is saved.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import (LoadPlan, SavePlan, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import (_create_read_items, _create_write_items,
                                                          create_read_items_for_chunk_list)
from torch.distributed.checkpoint.utils import find_tensor_shard
from torch.distributed.tensor import DTensor

from partc.errors import PartcError
from partc.runtime import tp as tp_ops
from partc.runtime.offload import HostOptimizer
from partc.runtime.parameters import dp_shard
from partc.runtime.rank_state import RankState


# -- what a rank holds of a tensor ------------------------------------------------------


class Chunks:
    """The parts of one whole tensor (``size``) this rank holds: views of its own tensor
    with their offsets in the whole. DCP reads and writes them through
    :class:`ChunkSavePlanner` and :class:`ChunkLoadPlanner`."""

    def __init__(self, size: tuple[int, ...], parts: list[tuple[tuple[int, ...], torch.Tensor]]
                 ) -> None:
        self.whole = torch.Size(size)
        self.parts = {torch.Size(offsets): view for offsets, view in parts}

    def size(self) -> torch.Size:
        return self.whole

    def storage(self) -> list:
        return [ChunkStorageMetadata(offsets=offsets, sizes=view.size())
                for offsets, view in self.parts.items()]

    def write_items(self, fqn: str) -> list:
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=offsets, sizes=view.size()),
                              properties=TensorProperties.create_from_tensor(view),
                              size=self.whole))
                for offsets, view in self.parts.items()]

    def on_cpu(self) -> "Chunks":
        """A copy in CPU memory, each part a tensor of its own (what an async save writes
        while training goes on)."""
        copy = Chunks(self.whole, [])
        copy.parts = {offsets: view.detach().to("cpu", copy=True).contiguous()
                      for offsets, view in self.parts.items()}
        return copy


def _runs(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """Runs of consecutive whole-tensor indices: (local start, whole start, length)."""
    if index.numel() == 0:
        return []
    breaks = (torch.nonzero(index[1:] - index[:-1] != 1).flatten() + 1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, index.numel()]
    return [(s, int(index[s]), e - s) for s, e in zip(starts, ends)]


def _index_maps(rank_state: RankState, name: str, whole: tuple[int, ...],
                local: torch.Tensor, fsdp: tuple[int, int] | None, expert: bool = False
                ) -> list[torch.Tensor]:
    """For each dim of this rank's ``local`` part of tensor ``name``, the whole tensor's
    index of each local index, cut exactly as the runtime cuts it: a routed expert
    weight's experts ``[ep_rank * E/ep, (ep_rank+1) * E/ep)`` (``expert``), the plan's
    tensor-parallel placement (``tp.shard_of``), then FSDP's shard of dim 0 (``fsdp``:
    its mesh's size and this rank's place in it)."""
    topo = rank_state.topology
    maps = [torch.arange(n) for n in whole]
    if expert and whole:
        maps[0] = maps[0].chunk(topo.ep)[topo.ep_rank]
    placement = rank_state.placement(name)
    if placement.kind == "S" and whole:
        dim = placement.dim % len(whole)
        maps[dim] = tp_ops.shard_of(maps[dim], 0, placement.chunks, topo.tp_rank, topo.tp)
    if fsdp is not None and whole:
        maps[0] = dp_shard(maps[0], *fsdp)
    held = tuple(len(m) for m in maps)
    if held != tuple(local.shape):
        raise PartcError(f"{name}: this rank holds shape {list(local.shape)}, but the plan "
                         f"cuts {list(held)} of its whole {list(whole)}")
    return maps


def _chunks(maps: list[torch.Tensor], whole: tuple[int, ...], local: torch.Tensor) -> Chunks:
    parts = []
    for combo in itertools.product(*(_runs(m) for m in maps)):
        view = local
        for dim, (start, _, length) in enumerate(combo):
            view = view.narrow(dim, start, length)
        parts.append((tuple(offset for _, offset, _ in combo), view))
    return Chunks(whole, parts)


def _local(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """This rank's storage of a tensor, and how FSDP shards it (its mesh's size and this
    rank's place in it: dp, or an expert weight's expert-data-parallel group), or None."""
    if isinstance(tensor, DTensor):
        placements = tuple(tensor.placements)
        if len(placements) != 1 or not placements[0].is_shard(0):
            raise PartcError(f"a DTensor placed {placements} is not FSDP's dp shard of dim 0")
        mesh = tensor.device_mesh
        return tensor.to_local().detach(), (mesh.size(), mesh.get_local_rank())
    return tensor.detach(), None


# -- the module's tensors under canonical names ------------------------------------------


@dataclasses.dataclass
class _Held:
    """One tensor this rank holds: its canonical FQN, its name in the stage, the whole
    tensor's shape, and how this rank's part maps into it."""

    fqn: str
    name: str
    tensor: torch.Tensor
    whole: tuple[int, ...]
    maps: list[torch.Tensor]
    local: torch.Tensor

    def chunks(self, local: torch.Tensor | None = None) -> Chunks:
        return _chunks(self.maps, self.whole, self.local if local is None else local)


def model_tensors(rank_state: RankState) -> dict[str, dict[str, Any]]:
    """The whole model's checkpointed tensors (parameters and persistent buffers), each
    once under its canonical FQN: shape and dtype."""
    shapes = rank_state.model_tensors
    return {rank_state.canonical(name): {"shape": list(shape), "dtype": str(dtype)}
            for name, (shape, dtype) in shapes.items()}


def held_tensors(rank_state: RankState) -> list[_Held]:
    """This rank's parameters and persistent buffers, once each, and those the forward
    never reads where it keeps them."""
    whole = model_tensors(rank_state)
    seen: set[int] = set()
    held = []
    named = list(rank_state.named_parameters()) + list(rank_state.named_buffers()) \
        + list(rank_state.named_unread())
    for name, tensor in named:
        fqn = rank_state.canonical(name)
        if id(tensor) in seen or fqn not in whole:  # a non-persistent buffer
            continue
        seen.add(id(tensor))
        local, fsdp = _local(tensor)
        master = (rank_state.master_of(tensor) if isinstance(tensor, torch.nn.Parameter)
                  else None)
        if master is not None:  # in mixed precision the fp32 master (shard) is saved
            local, fsdp = master, rank_state.master_shards(tensor)
        shape = tuple(whole[fqn]["shape"])
        held.append(_Held(fqn, name, tensor, shape,
                          _index_maps(rank_state, name, shape, local, fsdp,
                                      rank_state.is_expert(tensor)), local))
    return held


# -- the optimizer -----------------------------------------------------------------------


def inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding the state: ZeRO-1's local one (``DistributedOptimizer``'s
    ``optim``), or itself."""
    inner = getattr(optimizer, "optim", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def optimizer_params(rank_state: RankState, optimizer: torch.optim.Optimizer
                     ) -> list[tuple[_Held, torch.nn.Parameter]]:
    """The parameters whose state this rank's optimizer keeps, with what this rank holds
    of each (a placeholder parameter of an empty stage is none of the module's)."""
    by_id = {id(h.tensor): h for h in held_tensors(rank_state)}
    # ZeRO-1's distributed optimizer steps dp shards of the parameters (``param_of``).
    param_of = getattr(optimizer, "param_of", {})
    return [(by_id[id(param_of.get(id(p), p))], p)
            for group in inner_optimizer(optimizer).param_groups
            for p in group["params"] if id(param_of.get(id(p), p)) in by_id]


def optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    """The class stepping the state: an offloaded optimizer's is the host's (the user's
    class), so that its checkpoint loads into a plan without offload and back."""
    inner = inner_optimizer(optimizer)
    return type(inner.host if isinstance(inner, HostOptimizer) else inner).__name__


def _json_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (tuple, list)):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return None  # not restorable from JSON: left as the optimizer has it


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{key: _json_value(value) for key, value in group.items() if key != "params"}
            for group in optimizer.param_groups]


def restore_hyperparameters(optimizer: torch.optim.Optimizer,
                            saved: list[dict[str, Any]]) -> None:
    groups = [optimizer.param_groups]
    if inner_optimizer(optimizer) is not optimizer:
        groups.append(inner_optimizer(optimizer).param_groups)
    for param_groups in groups:
        for group, values in zip(param_groups, saved):
            for key, value in values.items():
                if key == "params" or key not in group or value is None:
                    continue
                current = group[key]
                if isinstance(current, torch.Tensor):
                    current.fill_(value)
                elif isinstance(current, tuple):
                    group[key] = tuple(value)
                else:
                    group[key] = value


def needs_state(rank_state: RankState, optimizer: torch.optim.Optimizer) -> bool:
    state = inner_optimizer(optimizer).state
    return any(p.requires_grad and not state.get(p) for _, p in
               optimizer_params(rank_state, optimizer))


_STEP_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")


def initialise_state(rank_state: RankState, optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state the way its own first step does, changing no
    parameter: one step with zero gradients at learning rate 0 (collective under ZeRO-1,
    which broadcasts the stepped parameters). Gradients the user had are kept."""
    made = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
                made.append(p)
    rates = [group["lr"] for group in optimizer.param_groups]
    # It is no training step: the optimizer's step hooks (the watchdog's, a step
    # counter's) do not see it.
    hooks = {name: getattr(optimizer, name) for name in _STEP_HOOKS
             if hasattr(optimizer, name)}
    try:
        for name in hooks:
            setattr(optimizer, name, OrderedDict())
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        optimizer.step()
    finally:
        for group, rate in zip(optimizer.param_groups, rates):
            group["lr"] = rate
        for name, value in hooks.items():
            setattr(optimizer, name, value)
        for p in made:
            p.grad = None


def optimizer_state(rank_state: RankState, optimizer: torch.optim.Optimizer
                    ) -> dict[str, Any]:
    """``optim.<fqn>.<name>`` → this rank's part of each state tensor it keeps."""
    state = inner_optimizer(optimizer).state
    out: dict[str, Any] = {}
    sharding = getattr(optimizer, "sharding", lambda _: None)
    for held, param in optimizer_params(rank_state, optimizer):
        maps = held.maps
        # ZeRO-1's: this rank's shard of the parameter, over dp or an expert weight's
        # expert-data-parallel group (already so when the held tensor is the fp32 master
        # shard, in mixed precision).
        cut = sharding(param)
        if cut is not None and rank_state.master_of(held.tensor) is None:
            maps = [dp_shard(maps[0], *cut), *maps[1:]]
        for key, value in state.get(param, {}).items():
            if not isinstance(value, torch.Tensor):
                continue
            local, _ = _local(value)
            if tuple(local.shape) == tuple(len(m) for m in maps) and value.dim() > 0:
                out[f"optim.{held.fqn}.{key}"] = _chunks(maps, held.whole, local)
            else:
                out[f"optim.{held.fqn}.{key}"] = local
    return out


# -- DCP planners --------------------------------------------------------------------------


class ChunkSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, which also writes :class:`Chunks`."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, obj in self.state_dict.items():
            items += (obj.write_items(fqn) if isinstance(obj, Chunks)
                      else _create_write_items(fqn, obj))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: Any) -> Any:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Chunks):
            view = obj.parts[index.offset]
            # torch.save writes a view's whole storage: write the part alone.
            if view.untyped_storage().nbytes() != view.numel() * view.element_size():
                view = view.clone()
            return view.contiguous()
        return find_tensor_shard(obj, index)


class ChunkLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, which also reads into :class:`Chunks`."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict, metadata: Any = None,
                       is_coordinator: bool = False) -> None:
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, obj in self.state_dict.items():
            stored = self.metadata.state_dict_metadata[fqn]
            items += (create_read_items_for_chunk_list(fqn, stored, obj.storage())
                      if isinstance(obj, Chunks) else _create_read_items(fqn, stored, obj))
        return LoadPlan(items)

    def lookup_tensor(self, index: Any) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Chunks):
            return obj.parts[index.offset]
        return find_tensor_shard(obj, index)


class CpuStaged:
    """DCP's async stager for a state dict already copied to CPU by :func:`to_cpu`."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: dict) -> dict:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def to_cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {key: value.on_cpu() if isinstance(value, Chunks)
            else value.detach().to("cpu", copy=True) for key, value in state.items()}


