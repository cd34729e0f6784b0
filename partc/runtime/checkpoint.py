"""Sharded training checkpoints with ``torch.distributed.checkpoint`` (DCP), resharded
on load into whatever plan the module has.

``module.save_checkpoint(root, optimizer=opt, step=n, extra={...})`` on every rank writes
this rank's part of the model and of the optimizer state; ``module.load_checkpoint(root,
optimizer=opt)`` on every rank of any plan (another pp/dp/tp mesh, ZeRO stage or process
count) reads the part it holds now and returns ``(step, extra)``.

What is stored, all under the model's own FQNs (a tied weight under its first FQN, once):

- every parameter and persistent buffer, as the chunks of the whole tensor this rank
  holds: a tensor-parallel shard (``Shard(dim, chunks=k)`` is k chunks per rank), FSDP2's
  data-parallel shard of it under ZeRO-2/3, a pipeline stage's tensors only on its ranks.
  Each chunk is named by its offsets in the whole tensor, so DCP reads any other cut of
  it back (resharding by FQN); replicas write one copy (DCP drops duplicates);
- the optimizer state of every parameter this rank steps (all of its own, or under ZeRO-1
  the 1/dp ``ZeroRedundancyOptimizer`` gives it), as ``optim.<fqn>.<name>``: state shaped
  like the parameter (Adam's moments, SGD's momentum) is cut as the parameter is, other
  state (Adam's ``step``) is stored whole; the param groups' hyper-parameters go in the
  manifest;
- each rank's RNG states (``rng.cpu.rank<r>``, ``rng.cuda.rank<r>``): restored rank by rank
  when the checkpoint was written by as many processes, otherwise left as they are (the
  ranks of another mesh draw other streams whatever one restored);
- the step, ``extra`` (JSON) and the plan (``plan.json``).

Layout under the root::

    root/step-00000003/     DCP's files, plan.json, manifest.json (written last)
    root/latest             "step-00000003": the checkpoint that loads
    root/.tmp-step-...      a save in progress, or one that died

A save writes everything under a temporary name; when every rank's DCP write succeeded
(agreed by a collective), rank 0 writes the manifest (step, world, plan hash, every tensor
with its shape, every file with its size), renames the directory to its step name and
replaces ``latest`` atomically (``os.replace``). A save killed before that leaves the
previous checkpoint as the one that loads; a failed save (disk full, permission) raises
:class:`partc.CheckpointError` on every rank and leaves earlier checkpoints as they were.

A load checks the checkpoint against the module first (manifest present, every file
present at its size, the same tensors with the same shapes, the same optimizer class) and
agrees on the result across ranks, so a checkpoint of another model, of other shapes, or
a partial one raises :class:`partc.CheckpointError` on every rank before any tensor changes.

``async_save=True`` copies this rank's tensors to CPU memory (the training pause) and
writes them in a background thread over a gloo process group of its own (DCP's
``async_save`` needs a CPU-capable group; the training collectives keep theirs); rank 0
commits when the write is done. ``module.wait_checkpoint()`` (called by the next save
and by load) waits for it and raises on every rank if it failed.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import shutil
import threading
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from partc.errors import CheckpointError, PartcError

from . import tp as tp_ops
from .parameters import dp_shard

if TYPE_CHECKING:
    from .module import DistributedModule

log = logging.getLogger("partc.runtime")

FORMAT = "partc-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
PLAN = "plan.json"
_TMP = ".tmp-"


def step_name(step: int) -> str:
    return f"step-{step:08d}"


# -- what a rank holds of a tensor ------------------------------------------------------


class Chunks:
    """The parts of one whole tensor (``size``) this rank holds: views of its own tensor
    with their offsets in the whole. DCP reads and writes them through
    :class:`_SavePlanner` and :class:`_LoadPlanner`."""

    def __init__(self, size: tuple[int, ...], parts: list[tuple[tuple[int, ...], torch.Tensor]]
                 ) -> None:
        self.whole = torch.Size(size)
        self.parts = {torch.Size(offsets): view for offsets, view in parts}

    def size(self) -> torch.Size:
        return self.whole

    def storage(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return [ChunkStorageMetadata(offsets=offsets, sizes=view.size())
                for offsets, view in self.parts.items()]

    def write_items(self, fqn: str) -> list:
        from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata,
                                                           MetadataIndex, TensorProperties)
        from torch.distributed.checkpoint.planner import (TensorWriteData, WriteItem,
                                                          WriteItemType)
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


def _index_maps(module: "DistributedModule", name: str, whole: tuple[int, ...],
                local: torch.Tensor, dp_sharded: bool) -> list[torch.Tensor]:
    """For each dim of this rank's ``local`` part of tensor ``name``, the whole tensor's
    index of each local index, cut exactly as the runtime cuts it: the plan's
    tensor-parallel placement (``tp.shard_of``), then FSDP's dp shard of dim 0."""
    topo = module.topology
    maps = [torch.arange(n) for n in whole]
    placement = module._placement(name)
    if placement.kind == "S" and whole:
        dim = placement.dim % len(whole)
        maps[dim] = tp_ops.shard_of(maps[dim], 0, placement.chunks, topo.tp_rank, topo.tp)
    if dp_sharded and whole:
        maps[0] = dp_shard(maps[0], topo.dp, topo.dp_rank)
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


def _local(tensor: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """This rank's storage of a tensor, and whether FSDP shards it over dp."""
    if isinstance(tensor, DTensor):
        placements = tuple(tensor.placements)
        if len(placements) != 1 or not placements[0].is_shard(0):
            raise PartcError(f"a DTensor placed {placements} is not FSDP's dp shard of dim 0")
        return tensor.to_local().detach(), True
    return tensor.detach(), False


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


def canonical(module: "DistributedModule", name: str) -> str:
    return module._aliases.get(name, (name,))[0]


def model_tensors(module: "DistributedModule") -> dict[str, dict[str, Any]]:
    """The whole model's checkpointed tensors (parameters and persistent buffers), each
    once under its canonical FQN: shape and dtype."""
    shapes = module._model_tensors
    return {canonical(module, name): {"shape": list(shape), "dtype": str(dtype)}
            for name, (shape, dtype) in shapes.items()}


def held_tensors(module: "DistributedModule") -> list[_Held]:
    """This rank's parameters and persistent buffers, once each."""
    whole = model_tensors(module)
    seen: set[int] = set()
    held = []
    named = list(module.module.named_parameters()) + list(module.module.named_buffers())
    for name, tensor in named:
        fqn = canonical(module, name)
        if id(tensor) in seen or fqn not in whole:  # a non-persistent buffer
            continue
        seen.add(id(tensor))
        local, sharded = _local(tensor)
        shape = tuple(whole[fqn]["shape"])
        held.append(_Held(fqn, name, tensor, shape,
                          _index_maps(module, name, shape, local, sharded), local))
    return held


# -- the optimizer -----------------------------------------------------------------------


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer holding the state: ZeroRedundancyOptimizer's local one, or itself."""
    inner = getattr(optimizer, "optim", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _optimizer_params(module: "DistributedModule", optimizer: torch.optim.Optimizer
                      ) -> list[tuple[_Held, torch.nn.Parameter]]:
    """The parameters whose state this rank's optimizer keeps, with what this rank holds
    of each (a placeholder parameter of an empty stage is none of the module's)."""
    by_id = {id(h.tensor): h for h in held_tensors(module)}
    return [(by_id[id(p)], p) for group in _inner(optimizer).param_groups
            for p in group["params"] if id(p) in by_id]


def _optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    return type(_inner(optimizer)).__name__


def _json_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (tuple, list)):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return None  # not restorable from JSON: left as the optimizer has it


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{key: _json_value(value) for key, value in group.items() if key != "params"}
            for group in optimizer.param_groups]


def _restore_hyperparameters(optimizer: torch.optim.Optimizer,
                             saved: list[dict[str, Any]]) -> None:
    groups = [optimizer.param_groups]
    if _inner(optimizer) is not optimizer:
        groups.append(_inner(optimizer).param_groups)
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


def _needs_state(module: "DistributedModule", optimizer: torch.optim.Optimizer) -> bool:
    state = _inner(optimizer).state
    return any(p.requires_grad and not state.get(p) for _, p in
               _optimizer_params(module, optimizer))


def _initialise_state(module: "DistributedModule", optimizer: torch.optim.Optimizer) -> None:
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
    try:
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        optimizer.step()
    finally:
        for group, rate in zip(optimizer.param_groups, rates):
            group["lr"] = rate
        for p in made:
            p.grad = None


def optimizer_state(module: "DistributedModule", optimizer: torch.optim.Optimizer
                    ) -> dict[str, Any]:
    """``optim.<fqn>.<name>`` → this rank's part of each state tensor it keeps."""
    state = _inner(optimizer).state
    out: dict[str, Any] = {}
    for held, param in _optimizer_params(module, optimizer):
        for key, value in state.get(param, {}).items():
            if not isinstance(value, torch.Tensor):
                continue
            local, sharded = _local(value)
            if tuple(local.shape) == tuple(held.local.shape) and value.dim() > 0:
                out[f"optim.{held.fqn}.{key}"] = held.chunks(local)
            else:
                out[f"optim.{held.fqn}.{key}"] = local
    return out


# -- DCP planners --------------------------------------------------------------------------


def _planners() -> tuple[type, type]:
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.planner import LoadPlan, SavePlan
    from torch.distributed.checkpoint.planner_helpers import (
        _create_read_items, _create_write_items, create_read_items_for_chunk_list)
    from torch.distributed.checkpoint.utils import find_tensor_shard

    class SavePlanner(DefaultSavePlanner):
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

    class LoadPlanner(DefaultLoadPlanner):
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

    return SavePlanner, LoadPlanner


class _Staged:
    """DCP's async stager for a state dict already copied to CPU by :func:`_to_cpu`."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: dict) -> dict:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _to_cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {key: value.on_cpu() if isinstance(value, Chunks)
            else value.detach().to("cpu", copy=True) for key, value in state.items()}


# -- agreement ----------------------------------------------------------------------------


def _agree(problem: str | CheckpointError | None, what: str, *,
           path: Path | None = None) -> None:
    """Raise CheckpointError on every rank if any rank has a problem (collective). The
    error names every rank's problem; its ``path`` and ``tensor`` are this rank's, or
    the first failing rank's."""
    local = problem if isinstance(problem, CheckpointError) else None
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, None if problem is None else (
        str(problem), getattr(local, "path", None), getattr(local, "tensor", None)))
    failed = [(rank, p) for rank, p in enumerate(everyone) if p is not None]
    if not failed:
        return
    distinct: dict[str, list[int]] = {}
    for rank, (message, _, _) in failed:
        distinct.setdefault(message, []).append(rank)
    detail = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {m}"
                       for m, r in distinct.items())
    _, where, tensor = everyone[dist.get_rank()] or failed[0][1]
    raise CheckpointError(f"{what}: {detail}", path=where or (str(path) if path else None),
                          tensor=tensor)


def _problem(error: BaseException) -> str:
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(error, CheckpointException):  # DCP's: every failing rank's exception
        return "; ".join(f"DCP on rank {rank}: {type(exc).__name__}: {exc}"
                         for rank, (exc, _) in sorted(error.failures.items()))
    return f"{type(error).__name__}: {error}"


def _failures() -> tuple[type[BaseException], ...]:
    """What a failed DCP call raises: DCP's CheckpointException is a BaseException."""
    from torch.distributed.checkpoint.api import CheckpointException
    return (Exception, CheckpointException)


# -- save ----------------------------------------------------------------------------------


@dataclasses.dataclass
class _Pending:
    """An asynchronous save under way: DCP's future and, on rank 0, the commit."""

    future: Any
    step: int
    final: Path
    committed: threading.Event = dataclasses.field(default_factory=threading.Event)
    commit_error: str | None = None


def save(module: "DistributedModule", directory: str | os.PathLike, *,
         optimizer: torch.optim.Optimizer | None, step: int, extra: dict | None,
         async_save: bool, keep: int | None) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    wait(module)
    root = Path(directory)
    rank = dist.get_rank()
    problem = None
    state: dict[str, Any] = {}
    manifest: dict[str, Any] = {}
    try:
        if not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be a non-negative int, got {step!r}")
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise CheckpointError(f"keep must be a positive int or None, got {keep!r}")
        extra = {} if extra is None else extra
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as error:
            raise CheckpointError(f"extra must be JSON (dicts, lists, numbers, strings): "
                                  f"{error}") from None
        state = {h.fqn: h.chunks() for h in held_tensors(module)}
        if optimizer is not None:
            state.update(optimizer_state(module, optimizer))
        state[f"rng.cpu.rank{rank}"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state[f"rng.cuda.rank{rank}"] = torch.cuda.get_rng_state()
        manifest = _manifest(module, optimizer, step, extra)
    except Exception as error:  # every rank learns of it before any collective of DCP
        problem = error if isinstance(error, CheckpointError) else _problem(error)
    _agree(problem, f"cannot save a checkpoint of step {step} under {root}", path=root)

    # Rank 0 makes the temporary directory and tells the others its name.
    made: list[Any] = [(None, None)]
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _remove_stale(root)
            tmp = root / f"{_TMP}{step_name(step)}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            made = [(str(tmp), None)]
        except Exception as error:
            made = [(None, _problem(error))]
    dist.broadcast_object_list(made, src=0)
    _agree(made[0][1], f"cannot create a checkpoint directory under {root}", path=root)
    tmp = Path(made[0][0])
    final = root / step_name(step)
    writer = FileSystemWriter(str(tmp))
    save_planner, _ = _planners()
    if async_save:
        group = _async_group(module)
        started = time.perf_counter()
        problem, future = None, None
        try:
            future = dcp.async_save(_to_cpu(state), storage_writer=writer,
                                    planner=save_planner(), process_group=group,
                                    async_stager=_Staged())
        except _failures() as error:
            problem = _problem(error)
        _agree(problem, f"cannot start saving the checkpoint of step {step}", path=tmp)
        pending = _Pending(future, step, final)
        if rank == 0:
            future.add_done_callback(lambda done: _commit_after(done, pending, root, tmp,
                                                                module, manifest, keep))
        module._checkpoint_pending = pending
        log.info("rank %d: checkpoint of step %d staged in %.3f s, writing in the background",
                 rank, step, time.perf_counter() - started)
        return final
    problem = None
    try:
        dcp.save(state, storage_writer=writer, planner=save_planner())
    except _failures() as error:
        problem = _problem(error)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problem)
    if any(p is not None for p in everyone):
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _agree(problem, f"saving the checkpoint of step {step} to {tmp} failed; the "
               f"previous checkpoint is unchanged", path=tmp)
    problem = None
    if rank == 0:
        try:
            _commit(root, tmp, final, module, manifest, keep)
        except Exception as error:
            problem = _problem(error)
            shutil.rmtree(tmp, ignore_errors=True)
    _agree(problem, f"committing the checkpoint of step {step} to {final} failed; "
           f"{root / LATEST} still names the previous one", path=final)
    return final


def _async_group(module: "DistributedModule") -> Any:
    """A gloo group of every rank for DCP's background collectives (made once, by all)."""
    if module._checkpoint_group is None:
        module._checkpoint_group = dist.new_group(backend="gloo")
    return module._checkpoint_group


def _manifest(module: "DistributedModule", optimizer: torch.optim.Optimizer | None,
              step: int, extra: dict) -> dict[str, Any]:
    topo = module.topology
    return {
        "format": FORMAT, "version": VERSION, "step": step, "extra": extra,
        "world": {"size": topo.world_size, "pp": topo.pp, "dp": topo.dp, "tp": topo.tp},
        "zero_stage": module.plan.effective_zero_stage,
        "plan_hash": module.plan.hash, "model_hash": module.plan.model.hash,
        "tensors": model_tensors(module),
        "optimizer": None if optimizer is None else {
            "class": _optimizer_class(optimizer),
            "param_groups": _hyperparameters(optimizer)},
        "rng": {"ranks": topo.world_size,
                "cuda": torch.cuda.is_available() and torch.cuda.is_initialized()},
        "saved_at": time.time(),
    }


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _commit(root: Path, tmp: Path, final: Path, module: "DistributedModule",
            manifest: dict[str, Any], keep: int | None) -> None:
    """Rank 0, after every rank's write: manifest, rename, ``latest``."""
    _fsync_write(tmp / PLAN, module.plan.to_json() + "\n")
    manifest = dict(manifest, files={f.name: f.stat().st_size for f in sorted(tmp.iterdir())
                                     if f.is_file()})
    _fsync_write(tmp / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    if final.exists():  # the same step saved again: the new one replaces it
        old = root / f"{_TMP}old-{final.name}-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    pointer = root / f"{_TMP}{LATEST}-{uuid.uuid4().hex[:8]}"
    _fsync_write(pointer, final.name + "\n")
    os.replace(pointer, root / LATEST)
    _fsync_dir(root)
    if keep is not None:
        steps = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")
                       and (p / MANIFEST).exists())
        for old in steps[:-keep]:
            if old.name != final.name:
                shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _commit_after(done: Future, pending: _Pending, root: Path, tmp: Path,
                  module: "DistributedModule", manifest: dict[str, Any],
                  keep: int | None) -> None:
    """Rank 0's commit of an asynchronous save, once DCP has written every rank's part."""
    try:
        done.result()
        _commit(root, tmp, pending.final, module, manifest, keep)
    except BaseException as error:  # reported on every rank by wait()
        pending.commit_error = _problem(error)
        shutil.rmtree(tmp, ignore_errors=True)
    finally:
        pending.committed.set()


def _remove_stale(root: Path) -> None:
    """Temporary directories of saves that died (only one save runs at a time)."""
    for path in root.iterdir():
        if path.name.startswith(_TMP):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def wait(module: "DistributedModule") -> Path | None:
    """Finish the asynchronous save under way, if any: on every rank, raising
    CheckpointError on every rank if any rank's write or the commit failed."""
    pending = module._checkpoint_pending
    if pending is None:
        return None
    module._checkpoint_pending = None
    problem = None
    try:
        pending.future.result()
    except _failures() as error:
        problem = _problem(error)
    if dist.get_rank() == 0:
        pending.committed.wait()
        problem = problem or pending.commit_error
    _agree(problem, f"the asynchronous save of step {pending.step} to {pending.final} failed; "
           f"the previous checkpoint is unchanged", path=pending.final)
    return pending.final


# -- load ----------------------------------------------------------------------------------


def resolve(directory: str | os.PathLike) -> Path:
    """The committed checkpoint ``directory`` names: ``latest`` under a root, or a step
    directory itself."""
    root = Path(directory)
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        if not name or "/" in name or name.startswith("."):
            raise CheckpointError(f"{pointer} names {name!r}, not a checkpoint directory",
                                  path=str(pointer))
        return root / name
    if (root / MANIFEST).is_file():
        return root
    if (root / ".metadata").is_file():
        raise CheckpointError(f"{root / MANIFEST} is missing: {root} is a partial checkpoint "
                              "(its save did not finish)", path=str(root / MANIFEST))
    if not root.exists():
        raise CheckpointError(f"no checkpoint at {root}: the directory does not exist",
                              path=str(root))
    raise CheckpointError(f"no checkpoint at {root}: neither {pointer} nor "
                          f"{root / MANIFEST} exists (a save that did not finish leaves none)",
                          path=str(root))


def read_manifest(path: Path) -> dict[str, Any]:
    file = path / MANIFEST
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: {path} is a partial checkpoint (its save "
                              "did not finish)", path=str(file))
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{file} does not read as JSON: {error}", path=str(file)) from None
    missing = [key for key in ("format", "version", "step", "extra", "world", "tensors",
                               "optimizer", "files") if key not in manifest]
    if manifest.get("format") != FORMAT or missing:
        raise CheckpointError(f"{file} is not a partc checkpoint manifest"
                              + (f" (it lacks {', '.join(missing)})" if missing else ""),
                              path=str(file))
    if manifest["version"] != VERSION:
        raise CheckpointError(f"{file} has format version {manifest['version']}; this partc "
                              f"reads version {VERSION}", path=str(file))
    return manifest


def _check(module: "DistributedModule", path: Path, manifest: dict[str, Any],
           optimizer: torch.optim.Optimizer | None) -> Any:
    """Everything that can be wrong with the checkpoint, before any tensor changes;
    returns DCP's metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    for name, size in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing: {path} is a partial checkpoint",
                                  path=str(file))
        if file.stat().st_size != size:
            raise CheckpointError(f"{file} has {file.stat().st_size} bytes, the manifest "
                                  f"says {size}: the file is truncated or was changed",
                                  path=str(file))
    manifest_file = str(path / MANIFEST)
    ours, theirs = model_tensors(module), manifest["tensors"]
    missing = sorted(set(ours) - set(theirs))
    unknown = sorted(set(theirs) - set(ours))
    if missing or unknown:
        raise CheckpointError(
            f"{manifest_file}: the checkpoint is of another model: "
            + "; ".join(part for part in (
                f"it lacks {len(missing)} of this model's tensors ({', '.join(missing[:4])}"
                f"{', ...' if len(missing) > 4 else ''})" if missing else "",
                f"it has {len(unknown)} tensors this model does not ({', '.join(unknown[:4])}"
                f"{', ...' if len(unknown) > 4 else ''})" if unknown else "") if part),
            path=manifest_file, tensor=(missing or unknown)[0])
    differ = [fqn for fqn, info in ours.items() if list(theirs[fqn]["shape"]) != info["shape"]]
    if differ:
        raise CheckpointError(
            f"{manifest_file}: {len(differ)} tensor{'s' if len(differ) > 1 else ''} of "
            "other shapes: " + "; ".join(
                f"{fqn} has shape {theirs[fqn]['shape']} in the checkpoint, "
                f"{ours[fqn]['shape']} in this model" for fqn in differ[:4])
            + ("; ..." if len(differ) > 4 else ""), path=manifest_file, tensor=differ[0])
    if optimizer is not None:
        saved = manifest["optimizer"]
        if saved is None:
            raise CheckpointError(f"{manifest_file}: the checkpoint holds no optimizer state "
                                  "(saved without optimizer=); load without one", path=manifest_file)
        if saved["class"] != _optimizer_class(optimizer):
            raise CheckpointError(f"{manifest_file}: the optimizer state is {saved['class']}'s, "
                                  f"this optimizer is a {_optimizer_class(optimizer)}",
                                  path=manifest_file)
        if len(saved["param_groups"]) != len(optimizer.param_groups):
            raise CheckpointError(f"{manifest_file}: the optimizer had "
                                  f"{len(saved['param_groups'])} param groups, this one has "
                                  f"{len(optimizer.param_groups)}", path=manifest_file)
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as error:
        raise CheckpointError(f"{path / '.metadata'} does not read: {_problem(error)}",
                              path=str(path / ".metadata")) from None
    stored = metadata.state_dict_metadata
    for fqn, info in ours.items():
        md = stored.get(fqn)
        if md is None or list(getattr(md, "size", [])) != info["shape"]:
            raise CheckpointError(f"{path / '.metadata'}: tensor {fqn} is "
                                  f"{'missing' if md is None else f'of shape {list(md.size)}'}"
                                  f", the manifest says {info['shape']}",
                                  path=str(path / ".metadata"), tensor=fqn)
    return metadata


def _check_state_keys(state: dict[str, Any], metadata: Any, path: Path) -> None:
    stored = metadata.state_dict_metadata
    for key, obj in state.items():
        md = stored.get(key)
        if md is None:
            raise CheckpointError(f"{path / '.metadata'}: the checkpoint has no {key} "
                                  "(another optimizer's state, or saved under other settings)",
                                  path=str(path / ".metadata"), tensor=key)
        size = obj.size() if isinstance(obj, (Chunks, torch.Tensor)) else None
        if size is not None and torch.Size(md.size) != torch.Size(size):
            raise CheckpointError(f"{path / '.metadata'}: {key} has shape {list(md.size)} in "
                                  f"the checkpoint, {list(size)} here",
                                  path=str(path / ".metadata"), tensor=key)


def load(module: "DistributedModule", directory: str | os.PathLike, *,
         optimizer: torch.optim.Optimizer | None) -> tuple[int, dict]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    wait(module)
    rank = dist.get_rank()
    path = Path(directory)
    problem = None
    manifest: dict[str, Any] = {}
    metadata = None
    try:
        path = resolve(directory)
        manifest = read_manifest(path)
        metadata = _check(module, path, manifest, optimizer)
    except CheckpointError as error:
        problem = error
    except Exception as error:
        problem = _problem(error)
    _agree(problem, f"cannot load the checkpoint at {directory}", path=path)

    # The optimizer's state must exist to be read into; made by its own first step.
    if optimizer is not None:
        need = torch.tensor([int(_needs_state(module, optimizer))])
        dist.all_reduce(need, op=dist.ReduceOp.MAX)
        if need.item():
            _initialise_state(module, optimizer)

    problem = None
    state: dict[str, Any] = {}
    opt_state: dict[str, Any] = {}
    try:
        held = held_tensors(module)
        state = {h.fqn: h.chunks() for h in held}
        if optimizer is not None:
            prefixes = {f"optim.{h.fqn}." for h, _ in _optimizer_params(module, optimizer)}
            stored = {key for key in metadata.state_dict_metadata if key.startswith("optim.")}
            opt_state = optimizer_state(module, optimizer)
            # A parameter without state in the checkpoint had not been stepped: its state
            # is dropped after the load, as before its first step.
            without = {p for p in prefixes if not any(k.startswith(p) for k in stored)}
            opt_state = {k: v for k, v in opt_state.items()
                         if not any(k.startswith(p) for p in without)}
            state.update(opt_state)
        same_world = manifest["world"]["size"] == dist.get_world_size()
        rng_keys = []
        if same_world:
            rng_keys.append(f"rng.cpu.rank{rank}")
            state[rng_keys[-1]] = torch.get_rng_state()
            if manifest["rng"].get("cuda") and torch.cuda.is_available():
                rng_keys.append(f"rng.cuda.rank{rank}")
                state[rng_keys[-1]] = torch.cuda.get_rng_state()
        _check_state_keys(state, metadata, path)
    except CheckpointError as error:
        problem = error
    except Exception as error:
        problem = _problem(error)
    _agree(problem, f"cannot load the checkpoint at {path}", path=path)

    _, load_planner = _planners()
    problem = None
    try:
        with torch.no_grad():
            dcp.load(state, storage_reader=FileSystemReader(str(path)), planner=load_planner())
    except _failures() as error:
        problem = _problem(error)
    _agree(problem, f"reading the checkpoint at {path} failed (this rank's tensors may be "
           "partly loaded: load again)", path=path)

    if optimizer is not None:
        inner = _inner(optimizer)
        loaded = {key.rsplit(".", 1)[0] for key in opt_state}
        for held_tensor, param in _optimizer_params(module, optimizer):
            if f"optim.{held_tensor.fqn}" not in loaded:
                inner.state.pop(param, None)
        _restore_hyperparameters(optimizer, manifest["optimizer"]["param_groups"])
    if same_world:
        torch.set_rng_state(state[f"rng.cpu.rank{rank}"])
        if f"rng.cuda.rank{rank}" in state:
            torch.cuda.set_rng_state(state[f"rng.cuda.rank{rank}"])
    else:
        log.info("checkpoint %s was written by %d processes, this run has %d: RNG states "
                 "are not restored", path, manifest["world"]["size"], dist.get_world_size())
    module.step = int(manifest["step"])
    return int(manifest["step"]), manifest["extra"]


def listed(directory: str | os.PathLike) -> list[Path]:
    """The committed checkpoints under a root, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and p.name.startswith("step-") and (p / MANIFEST).is_file())


__all__: Iterable[str] = ["save", "load", "wait", "resolve", "read_manifest", "listed",
                          "step_name", "Chunks"]
