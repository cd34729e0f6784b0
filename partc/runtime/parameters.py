"""A rank's own parameters: copied from the model or a state dict, cut to this rank's
tensor-parallel shard, and FSDP's data-parallel shard of a tensor."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx, nn
from torch.distributed.tensor import DTensor

from partc.errors import PartcError
from partc.identity import param_fqns
from partc.plan import Plan
from partc.runtime import tp as tp_ops
from partc.runtime.topology import Topology


_HALF = (torch.bfloat16, torch.float16)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor FSDP shards over dp (the tensor itself otherwise)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def dp_shard(tensor: torch.Tensor, dp: int, dp_rank: int) -> torch.Tensor:
    """FSDP2's shard of ``tensor`` on ``dp_rank``: its ``torch.chunk`` of dim 0 (empty
    when dim 0 has fewer rows than ranks)."""
    pieces = tensor.chunk(dp)
    return pieces[dp_rank] if dp_rank < len(pieces) else tensor[:0]


class TensorParallelCut:
    """This rank's tensor-parallel shard of a whole tensor, as the plan places it:
    ``cut(names, tensor)``; ``layout(names)`` is ``(dim, chunks)`` for a sharded one
    (None when replicated), for readers that read the shard alone from a file."""

    def __init__(self, plan: Plan, tp_rank: int, tp: int) -> None:
        self.plan, self.tp_rank, self.tp = plan, tp_rank, tp

    def layout(self, names: tuple[str, ...]) -> tuple[int, int] | None:
        placement = self.plan.placement(names)
        return (placement.dim, placement.chunks) if placement.kind == "S" else None

    def __call__(self, names: tuple[str, ...], tensor: torch.Tensor) -> torch.Tensor:
        layout = self.layout(names)
        if layout is None:
            return tensor
        return tp_ops.shard_of(tensor, *layout, self.tp_rank, self.tp)


def shard_plan(plan: Plan, topology: Topology) -> TensorParallelCut:
    """This rank's shard of a whole tensor named ``fqn``, as the plan places it."""
    return TensorParallelCut(plan, topology.tp_rank, topology.tp)


def own_parameters(module: fx.GraphModule, model: nn.Module,
                   state_dict: Mapping[str, torch.Tensor] | None,
                   device: torch.device, shard: Callable | None = None) -> None:
    """Give the stage its own copies of its tensors (this rank's shards of them), from
    the state dict or the model. Only the stage's own entries of ``state_dict`` are
    read (a lazy mapping such as ``weights.open_weights`` reads no others); a
    non-persistent buffer comes from the model, as its own code computed it."""
    aliases = aliases_of(model)
    persistent = set(model.state_dict(keep_vars=True))
    copies: dict[int, torch.Tensor] = {}
    entries = [(name, t, True) for name, t in module.named_parameters(remove_duplicate=False)]
    entries += [(name, t, False) for name, t in module.named_buffers(remove_duplicate=False)]
    cut_already: set[str] = set()  # read from files as this rank's shards
    if state_dict is not None and hasattr(state_dict, "read_tensors"):
        state_dict, cut_already = _read_files(state_dict, entries, aliases, shard)
    for name, tensor, is_param in entries:
        if id(tensor) not in copies:
            source = _source_tensor(name, aliases, model, state_dict, persistent)
            whole = tuple(source.shape)
            names = aliases.get(name, (name,))
            if shard is not None and not cut_already & set(names):
                source = shard(names, source)
            if source.shape != tensor.shape:
                cut = f" (this rank's shard: {list(source.shape)})" \
                    if tuple(source.shape) != whole else ""
                raise PartcError(f"{name}: the weights given have shape {list(whole)}{cut}, "
                                 f"the model's is {list(tensor.shape)}: weights of "
                                 "another model or configuration?")
            # A parameter the model keeps in 16 bits (loaded in bfloat16) is the fp32
            # master the runtime trains (partc.problem.Precision); buffers stay as they are.
            dtype = torch.float32 if is_param and tensor.dtype in _HALF else tensor.dtype
            value = source.detach().to(device=device, dtype=dtype, copy=True)
            copies[id(tensor)] = nn.Parameter(value, tensor.requires_grad) if is_param \
                else value
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        if is_param:
            owner._parameters[attr] = copies[id(tensor)]
        else:
            owner._buffers[attr] = copies[id(tensor)]


def _read_files(files: Any, entries: list, aliases: dict[str, tuple[str, ...]],
                shard: Callable | None) -> tuple[dict[str, torch.Tensor], set[str]]:
    """This stage's tensors from files (``partc.weights``), read at once and no others;
    a tensor-parallel shard read alone where the plan cuts it (``layout``)."""
    wanted = {}
    for name, _, _ in entries:
        names = aliases.get(name, (name,))
        found = next((a for a in names if a in files), None)
        if found is not None:
            layout = shard.layout(names) if isinstance(shard, TensorParallelCut) else None
            wanted[found] = None if layout is None else (*layout, shard.tp_rank, shard.tp)
    values = files.read_tensors(wanted)
    return values, {name for name, cut in wanted.items() if cut is not None}


def aliases_of(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Every FQN of a tensor → all FQNs of that tensor (tied weights have several)."""
    return {name: names for names in param_fqns(model).values() for name in names}


def unread_parameters(model: nn.Module, holders: Mapping[tuple[str, ...], Any]
                      ) -> list[tuple[str, int]]:
    """The parameters no stage holds (``holders``: ``Lowered.holders``): those the
    forward never reads on the traced inputs (a vision tower under text-only batches),
    which the program does not train (it keeps them as they are, :func:`unread_tensors`).
    Their first FQN and element count, in
    the model's order."""
    held = {name for names in holders for name in names}
    aliases = aliases_of(model)
    return [(name, tensor.numel()) for name, tensor in model.named_parameters()
            if held.isdisjoint(aliases.get(name, (name,)))]


def unread_tensors(model: nn.Module, unread: Sequence[tuple[str, int]],
                   state_dict: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Host copies of the ``unread`` parameters (:func:`unread_parameters`), as they are:
    from ``state_dict`` where it has them (under any of their FQNs), else from the model;
    one on the meta device with no entry there has no value to keep and is left out. The
    program holds them untrained so that its state dicts and checkpoints lose nothing."""
    aliases = aliases_of(model)
    params = dict(model.named_parameters())
    kept = {}
    for name, _ in unread:
        source = None
        if state_dict is not None:
            source = next((state_dict[alias] for alias in aliases.get(name, (name,))
                           if alias in state_dict), None)
        if source is None:
            source = params[name]
        if source.is_meta:
            continue
        kept[name] = source.detach().to("cpu", copy=True)
    return kept


def unread_warning(model: nn.Module, unread: Sequence[tuple[str, int]]) -> str:
    """One line naming ``unread`` parameters (:func:`unread_parameters`) by their
    modules, for the log."""
    total = sum(p.numel() for p in model.parameters())
    modules = sorted({name.rpartition(".")[0] or name for name, _ in unread})
    shown = ", ".join(modules[:4]) + (f" and {len(modules) - 4} more" if len(modules) > 4 else "")
    count = sum(n for _, n in unread)
    return (f"{len(unread)} parameter tensors ({count:,} of the model's {total:,} "
            f"elements: {shown}) are never read by the forward on these inputs: the "
            "program does not train them; the first pipeline stage's ranks keep them as "
            "they are, on the host, so that state dicts and checkpoints hold them")


def _source_tensor(name: str, aliases: dict[str, tuple[str, ...]], model: nn.Module,
                   state_dict: Mapping[str, torch.Tensor] | None,
                   persistent: set[str]) -> torch.Tensor:
    names = aliases.get(name, (name,))
    if state_dict is not None:
        for alias in names:
            if alias in state_dict:
                return state_dict[alias]
        if any(alias in persistent for alias in names):
            raise KeyError(f"the state dict has no entry for {name} (nor its aliases "
                           f"{names})")
        # A non-persistent buffer: no state dict holds it; the model computed it.
    tensor = _get_tensor(model, names[0])
    if tensor.is_meta and state_dict is not None:
        raise PartcError(
            f"{name} is a non-persistent buffer (not in model.state_dict()) and the model "
            "holds it on the meta device, so its value was never computed: build the "
            "model under `with partc.on_meta():` (parameters on meta, buffers computed by "
            f"the model's own code), or give {name} in state_dict")
    if tensor.is_meta:
        raise PartcError(f"{name} is on the meta device: pass state_dict= to build() so "
                         "each rank loads its own parameters")
    return tensor


def _get_tensor(model: nn.Module, name: str) -> torch.Tensor:
    owner_name, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(owner_name), attr)
