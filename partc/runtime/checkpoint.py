"""Sharded training checkpoints with ``torch.distributed.checkpoint`` (DCP), resharded
on load into whatever plan the module has.

``module.save_checkpoint(root, optimizer=opt, step=n, extra={...})`` on every rank writes
this rank's part of the model and of the optimizer state; ``module.load_checkpoint(root,
optimizer=opt)`` on every rank of any plan (another pp/dp/tp mesh, ZeRO stage or process
count) reads the part it holds now and returns ``(step, extra)``.

What is stored, all under the model's own FQNs (a tied weight under its first FQN, once):

- every parameter and persistent buffer, as the chunks of the whole tensor this rank
  holds: a tensor-parallel shard (``Shard(dim, chunks=k)`` is k chunks per rank), FSDP2's
  data-parallel shard of it under ZeRO-2/3 (and under ZeRO-1 in mixed precision, where
  the fp32 masters are dp shards and the parameters bf16), a pipeline stage's tensors
  only on its ranks.
  Each chunk is named by its offsets in the whole tensor, so DCP reads any other cut of
  it back (resharding by FQN); replicas write one copy (DCP drops duplicates);
- the optimizer state of every parameter this rank steps (all of its own, or under ZeRO-1
  ``DistributedOptimizer``'s dp shard of each; offloaded, the host's state and fp32
  masters, ``partc/runtime/offload.py``), as ``optim.<fqn>.<name>``: state shaped
  like the parameter (Adam's moments, SGD's momentum) is cut as the parameter is, other
  state (Adam's ``step``) is stored whole; the param groups' hyper-parameters go in the
  manifest;
- each rank's RNG states (``rng.cpu.rank<r>``, ``rng.cuda.rank<r>``): restored rank by rank
  when the checkpoint was written by as many processes, otherwise left as they are (the
  ranks of another mesh draw other streams whatever one restored);
- the step, ``extra`` (JSON) and the plan (``plan.json``);
- in the manifest, ``finite``: whether every tensor saved is finite (``state``, agreed
  over the ranks) and whether the last step's loss and gradient norm were (``loss``,
  ``grad_norm``: None where not measured; ``skipped``: that step was skipped as
  non-finite, ``partc/runtime/nonfinite.py``, so the state is the step before's).
  Retention (``keep``) never removes the newest checkpoint that :func:`holds_finite`
  says is finite, even beyond the newest ``keep``: a run that went non-finite keeps the
  state to go back to.

Layout under the root::

    root/step-00000003/     DCP's files, plan.json, manifest.json (written last)
    root/latest             "step-00000003": the checkpoint that loads
    root/.tmp-step-...      a save in progress, or one that died

A save writes everything under a temporary name owned by its process
(partc/runtime/checkpoint_lock.py: a save removes its own and those of saves that died,
never another live job's); when every rank's DCP write succeeded (agreed by a collective),
rank 0 writes the manifest (step, world, plan hash, every tensor with its shape, every
file with its size and SHA-256: partc/runtime/checkpoint_files.py), renames the directory
to its step name and replaces ``latest`` atomically (``os.replace``). A save killed before
that leaves the previous checkpoint as the one that loads; a failed save (disk full,
permission) raises :class:`partc.CheckpointError` on every rank and leaves earlier
checkpoints as they were.

A load checks the checkpoint against the module first (manifest present, every file
present at its size and digest, the ranks sharing the hashing; ``.metadata`` unpickled
admitting only DCP's metadata classes; the same tensors with the same shapes, the same
optimizer class) and agrees on the result across ranks, so a checkpoint of another
model, of other shapes, a partial, damaged or planted one raises
:class:`partc.CheckpointError` on every rank before any tensor changes. Without
``latest`` (deleted, or a save killed between its rename and the pointer) the root's
newest complete ``step-*`` (manifest and digests check) loads, with a warning.

``async_save=True`` copies this rank's tensors to CPU memory (the training pause) and
writes them in a background thread over a gloo process group of its own (DCP's
``async_save`` needs a CPU-capable group; the training collectives keep theirs); rank 0
commits when the write is done. ``module.wait_checkpoint()`` (called by the next save
and by load; call it before the process group ends) waits for it and raises on every
rank if it failed.

Every rank must see the same directory (a shared filesystem): DCP writes one file per
rank and rank 0 the metadata. An optimizer without state yet (before its first step) is
given its state by one step at learning rate 0 with zero gradients, then read into.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from partc.errors import CheckpointError
from partc.runtime.checkpoint_chunks import (ChunkLoadPlanner, Chunks, ChunkSavePlanner,
                                             CpuStaged, held_tensors, hyperparameters,
                                             initialise_state, inner_optimizer,
                                             model_tensors, needs_state, optimizer_class,
                                             optimizer_params, optimizer_state,
                                             restore_hyperparameters, to_cpu)
from partc.runtime.checkpoint_files import (METADATA, SafeReader, check_files, describe,
                                            read_metadata)
from partc.runtime.checkpoint_lock import check_not_foreign, remove_stale, temporary_name
from partc.runtime.rank_state import RankState
from partc.runtime.watchdog import PhaseMarks, at_work

log = logging.getLogger("partc.runtime")

FORMAT = "partc-checkpoint"
VERSION = 2     # files: {name: {"bytes", "sha256"}}; version 1 recorded sizes only
READS = (1, 2)
MANIFEST = "manifest.json"
LATEST = "latest"
PLAN = "plan.json"


def step_name(step: int) -> str:
    return f"step-{step:08d}"


# -- agreement ----------------------------------------------------------------------------


def _agree(problem: str | CheckpointError | None, what: str, *,
           path: Path | None = None, cleanup: Callable[[], None] | None = None) -> None:
    """Raise CheckpointError on every rank if any rank has a problem (collective), after
    rank 0 runs ``cleanup``. The error names every rank's problem; its ``path`` and
    ``tensor`` are this rank's, or the first failing rank's."""
    local = problem if isinstance(problem, CheckpointError) else None
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, None if problem is None else (
        str(problem), getattr(local, "path", None), getattr(local, "tensor", None)))
    failed = [(rank, p) for rank, p in enumerate(everyone) if p is not None]
    if not failed:
        return
    if cleanup is not None and dist.get_rank() == 0:
        cleanup()
    distinct: dict[str, list[int]] = {}
    for rank, (message, _, _) in failed:
        distinct.setdefault(message, []).append(rank)
    detail = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {m}"
                       for m, r in distinct.items())
    _, where, tensor = everyone[dist.get_rank()] or failed[0][1]
    raise CheckpointError(f"{what}: {detail}", path=where or (str(path) if path else None),
                          tensor=tensor)


def _problem(error: BaseException) -> str:
    if isinstance(error, CheckpointException):  # DCP's: every failing rank's exception
        return "; ".join(f"DCP on rank {rank}: {type(exc).__name__}: {exc}"
                         for rank, (exc, _) in sorted(error.failures.items()))
    return f"{type(error).__name__}: {error}"


def _failures() -> tuple[type[BaseException], ...]:
    """What a failed DCP call raises: DCP's CheckpointException is a BaseException."""
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


class BackgroundSave:
    """A module's asynchronous save: the one under way (the next save or load waits for
    it first), and the gloo group of every rank DCP's background collectives run over
    (made once, by all, at the first asynchronous save)."""

    def __init__(self) -> None:
        self.pending: _Pending | None = None
        self.group: dist.ProcessGroup | None = None

    def process_group(self) -> dist.ProcessGroup:
        if self.group is None:
            self.group = dist.new_group(backend="gloo")
        return self.group


def save(rank_state: RankState, saves: BackgroundSave, directory: str | os.PathLike, *,
         optimizer: torch.optim.Optimizer | None, step: int, extra: dict | None,
         async_save: bool, keep: int | None, last_step: dict | None = None,
         marks: PhaseMarks | None = None) -> Path:
    """``module.save_checkpoint``: collect, make the temporary directory, write, commit;
    each step agreed by every rank before the next. ``last_step``: the finiteness of the
    last step's numbers (``loss``, ``grad_norm``, ``skipped``), for the manifest;
    ``marks``: the watchdog hears the storage work (writing, hashing) apart from the
    rest, where the ranks done with theirs wait."""
    wait(saves, marks=marks)
    root = Path(directory)
    state, manifest = _collect(rank_state, optimizer, step, extra, keep, root)
    manifest["finite"] = {"state": _all_finite(state, rank_state),
                          "loss": None, "grad_norm": None, "skipped": False,
                          **(last_step or {})}
    tmp = _temporary(root, step)
    final = root / step_name(step)
    if async_save:
        _write_in_background(
            saves, state, tmp, final, step,
            commit=lambda: _commit(root, tmp, final, rank_state, manifest, keep))
        return final
    _write(state, tmp, step, marks)
    digested = _digest_own_files(tmp, step, marks)
    problem = None
    if dist.get_rank() == 0:
        try:
            with at_work(marks, "writing"):
                _commit(root, tmp, final, rank_state, manifest, keep, digested)
        except Exception as error:
            problem = _problem(error)
            shutil.rmtree(tmp, ignore_errors=True)
    _agree(problem, f"committing the checkpoint of step {step} to {final} failed; "
           f"{root / LATEST} still names the previous one", path=final)
    return final


def _collect(rank_state: RankState, optimizer: torch.optim.Optimizer | None,
             step: int, extra: dict | None, keep: int | None, root: Path
             ) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's state dict for DCP and the manifest, or an error on every rank before
    any file is touched."""
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
        state = {h.fqn: h.chunks() for h in held_tensors(rank_state)}
        if optimizer is not None:
            state.update(optimizer_state(rank_state, optimizer))
        rank = dist.get_rank()
        state[f"rng.cpu.rank{rank}"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state[f"rng.cuda.rank{rank}"] = torch.cuda.get_rng_state()
        manifest = _manifest(rank_state, optimizer, step, extra)
    except Exception as error:
        problem = error if isinstance(error, CheckpointError) else _problem(error)
    _agree(problem, f"cannot save a checkpoint of step {step} under {root}", path=root)
    return state, manifest


def _all_finite(state: dict[str, Any], rank_state: RankState) -> bool:
    """Whether every floating-point tensor every rank saves is finite (collective: one
    small all-reduce; one pass over what the save copies anyway)."""
    tensors = [view for value in state.values()
               for view in (value.parts.values() if isinstance(value, Chunks) else [value])
               if isinstance(view, torch.Tensor) and view.is_floating_point()]
    device = rank_state.topology.device
    flag = torch.zeros((), device=device)
    if tensors:
        flag += ~torch.stack([torch.isfinite(t).all().to(device) for t in tensors]).all()
    dist.all_reduce(flag)
    return not flag.item()


def holds_finite(manifest: dict[str, Any]) -> bool:
    """Whether a checkpoint's manifest says its state is finite: every tensor finite, and
    the last step's loss and gradient norm finite or that step skipped. A manifest
    written before partc recorded it counts as finite."""
    finite = manifest.get("finite")
    if finite is None:
        return True
    numbers_finite = finite.get("loss") is not False and finite.get("grad_norm") is not False
    return finite.get("state") is not False and (bool(finite.get("skipped"))
                                                 or numbers_finite)


def _temporary(root: Path, step: int) -> Path:
    """Rank 0 makes the save's temporary directory (clearing those of saves that died,
    refusing a directory another live job holds) and tells the others its name."""
    made: list[Any] = [(None, None)]
    if dist.get_rank() == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            check_not_foreign(root)
            remove_stale(root)
            tmp = root / temporary_name(step_name(step))
            tmp.mkdir()
            made = [(str(tmp), None)]
        except Exception as error:
            made = [(None, _problem(error))]
    dist.broadcast_object_list(made, src=0)
    _agree(made[0][1], f"cannot create a checkpoint directory under {root}", path=root)
    return Path(made[0][0])


class _WatchedWriter(FileSystemWriter):
    """DCP's file-system writer whose writing of this rank's files the watchdog hears as
    storage work (the rest of ``dcp.save`` is planning and collectives)."""

    def __init__(self, path: str, marks: PhaseMarks | None) -> None:
        super().__init__(path)
        self._marks = marks

    def write_data(self, *args: Any, **kwargs: Any) -> Any:
        with at_work(self._marks, "writing"):
            return super().write_data(*args, **kwargs)


def _write(state: dict[str, Any], tmp: Path, step: int, marks: PhaseMarks | None) -> None:
    """DCP writes every rank's part; on any failure every rank raises and the temporary
    directory goes."""
    problem = None
    try:
        dcp.save(state, storage_writer=_WatchedWriter(str(tmp), marks),
                 planner=ChunkSavePlanner())
    except _failures() as error:
        problem = _problem(error)
    _agree(problem, f"saving the checkpoint of step {step} to {tmp} failed; the previous "
           "checkpoint is unchanged", path=tmp,
           cleanup=lambda: shutil.rmtree(tmp, ignore_errors=True))


def _digest_own_files(tmp: Path, step: int, marks: PhaseMarks | None) -> dict[str, Any]:
    """Every rank hashes the files it wrote (DCP names them ``__<rank>_*``), so the
    save's pause grows by one rank's share, not the whole; rank 0 receives them all."""
    problem, digests = None, {}
    try:
        with at_work(marks, "hashing"):
            digests = describe(tmp, [f.name for f in tmp.iterdir()
                                     if f.name.startswith(f"__{dist.get_rank()}_")])
    except Exception as error:
        problem = _problem(error)
    _agree(problem, f"hashing the files of the checkpoint of step {step} in {tmp} failed",
           path=tmp, cleanup=lambda: shutil.rmtree(tmp, ignore_errors=True))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, digests)
    return {name: info for part in everyone for name, info in part.items()}


def _write_in_background(saves: BackgroundSave, state: dict[str, Any], tmp: Path,
                         final: Path, step: int, commit: Callable[[], None]) -> None:
    """Copy this rank's tensors to CPU memory (the pause), then DCP writes them in a
    thread over the module's gloo group; rank 0 commits when every rank's part is
    written. ``wait`` reports the outcome."""
    group = saves.process_group()
    problem, future = None, None
    try:
        future = dcp.async_save(to_cpu(state), storage_writer=FileSystemWriter(str(tmp)),
                                planner=ChunkSavePlanner(), process_group=group,
                                async_stager=CpuStaged())
    except _failures() as error:
        problem = _problem(error)
    _agree(problem, f"cannot start saving the checkpoint of step {step}", path=tmp)
    pending = _Pending(future, step, final)
    if dist.get_rank() == 0:
        future.add_done_callback(lambda done: _commit_after(done, pending, tmp, commit))
    saves.pending = pending


def _manifest(rank_state: RankState, optimizer: torch.optim.Optimizer | None,
              step: int, extra: dict) -> dict[str, Any]:
    topo = rank_state.topology
    return {
        "format": FORMAT, "version": VERSION, "step": step, "extra": extra,
        "world": {"size": topo.world_size, "pp": topo.pp, "dp": topo.dp, "tp": topo.tp},
        "zero_stage": rank_state.plan.effective_zero_stage,
        "plan_hash": rank_state.plan.hash, "model_hash": rank_state.plan.model.hash,
        "tensors": model_tensors(rank_state),
        "optimizer": None if optimizer is None else {
            "class": optimizer_class(optimizer),
            "param_groups": hyperparameters(optimizer)},
        "rng": {"ranks": topo.world_size,
                "cuda": torch.cuda.is_available() and torch.cuda.is_initialized()},
        "saved_at": time.time(),
    }


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _commit(root: Path, tmp: Path, final: Path, rank_state: RankState,
            manifest: dict[str, Any], keep: int | None,
            digested: dict[str, Any] | None = None) -> None:
    """Rank 0, after every rank's write: manifest (every file's size and digest: those
    the ranks ``digested``, the rest hashed here), rename, ``latest``."""
    _fsync_write(tmp / PLAN, rank_state.plan.to_json() + "\n")
    digested = digested or {}
    files = {**digested, **describe(tmp, [f.name for f in tmp.iterdir()
                                          if f.is_file() and f.name not in digested])}
    manifest = dict(manifest, files=dict(sorted(files.items())))
    _fsync_write(tmp / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    if final.exists():  # the same step saved again: the new one replaces it
        old = root / temporary_name(f"old-{final.name}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    pointer = root / temporary_name(LATEST)
    _fsync_write(pointer, final.name + "\n")
    os.replace(pointer, root / LATEST)
    _fsync_dir(root)
    if keep is not None:
        for old in _retired(root, final, manifest, keep):
            shutil.rmtree(old, ignore_errors=True)


def _retired(root: Path, final: Path, manifest: dict[str, Any], keep: int) -> list[Path]:
    """The checkpoints beyond the newest ``keep`` that a save of ``final`` removes: all
    but the newest whose state is finite (:func:`holds_finite`)."""
    steps = listed(root)
    kept = holds_finite(manifest) and final
    if not kept:
        kept = next((p for p in reversed(steps) if p != final and _finite_at(p)), None)
        log.warning("checkpoint %s holds non-finite values (%s); %s", final,
                    json.dumps(manifest.get("finite")),
                    f"{kept.name}, the newest finite one, is kept whatever keep={keep} says"
                    if kept else "no earlier checkpoint is finite")
    return [p for p in steps[:-keep] if p != final and p != kept]


def _finite_at(path: Path) -> bool:
    try:
        return holds_finite(json.loads((path / MANIFEST).read_text()))
    except (OSError, ValueError):
        return False   # a manifest that does not read holds nothing to go back to


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


def _commit_after(done: Future, pending: _Pending, tmp: Path,
                  commit: Callable[[], None]) -> None:
    """Rank 0's commit of an asynchronous save, once DCP has written every rank's part."""
    try:
        done.result()
        commit()
    except BaseException as error:  # reported on every rank by wait()
        pending.commit_error = _problem(error)
        shutil.rmtree(tmp, ignore_errors=True)
    finally:
        pending.committed.set()


def wait(saves: BackgroundSave, marks: PhaseMarks | None = None) -> Path | None:
    """Finish the asynchronous save under way, if any: on every rank, raising
    CheckpointError on every rank if any rank's write or the commit failed."""
    pending = saves.pending
    if pending is None:
        return None
    saves.pending = None
    problem = None
    with at_work(marks, "writing"):   # this rank's background write, rank 0's commit
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
    directory itself; under a root without ``latest``, its newest complete ``step-*``
    (with a warning)."""
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
    found = newest_complete(root)
    if found is not None:
        return found
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
    if manifest["version"] not in READS:
        raise CheckpointError(f"{file} has format version {manifest['version']}; this partc "
                              f"reads versions {', '.join(map(str, READS))}", path=str(file))
    if manifest["version"] == 1:
        log.warning("%s records file sizes only (a checkpoint of an earlier partc): its "
                    "files' bytes cannot be verified", file)
    return manifest


def _check(rank_state: RankState, path: Path, manifest: dict[str, Any],
           optimizer: torch.optim.Optimizer | None) -> Any:
    """Everything that can be wrong with the checkpoint, before any tensor changes;
    returns DCP's metadata."""
    # Each rank hashes its share of the files; _checked agrees on the outcome.
    check_files(path, manifest["files"], (dist.get_rank(), dist.get_world_size()))
    manifest_file = str(path / MANIFEST)
    ours, theirs = model_tensors(rank_state), manifest["tensors"]
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
                                  "(saved without optimizer=); load without one",
                                  path=manifest_file)
        if saved["class"] != optimizer_class(optimizer):
            raise CheckpointError(f"{manifest_file}: the optimizer state is {saved['class']}'s, "
                                  f"this optimizer is a {optimizer_class(optimizer)}",
                                  path=manifest_file)
        if len(saved["param_groups"]) != len(optimizer.param_groups):
            raise CheckpointError(f"{manifest_file}: the optimizer had "
                                  f"{len(saved['param_groups'])} param groups, this one has "
                                  f"{len(optimizer.param_groups)}", path=manifest_file)
    metadata = read_metadata(path / METADATA)
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


def load(rank_state: RankState, saves: BackgroundSave, directory: str | os.PathLike, *,
         optimizer: torch.optim.Optimizer | None, marks: PhaseMarks | None = None
         ) -> tuple[int, dict]:
    """``module.load_checkpoint``: check, make the optimizer's state, read, restore;
    each step agreed by every rank before the next, every check before any tensor
    changes. Returns the checkpoint's step and ``extra``. ``marks``: the watchdog hears
    the storage work (checking and reading files) apart from the rest."""
    wait(saves, marks=marks)
    path, manifest, metadata = _checked(rank_state, directory, optimizer, marks)
    if optimizer is not None:
        # The optimizer's state must exist to be read into: made by its own first step,
        # on every rank if on any (a ZeRO-1 step is collective).
        need = torch.tensor([int(needs_state(rank_state, optimizer))])
        dist.all_reduce(need, op=dist.ReduceOp.MAX)
        if need.item():
            initialise_state(rank_state, optimizer)
            # Its ZeRO-1 step left the parameters' all-gather in flight, from the rows
            # before loading: finished now, before a tensor is read into.
            rank_state.wait_param_gathers()
    state, stateless = _targets(rank_state, optimizer, path, manifest, metadata)
    _read(state, path, marks)
    # ZeRO-1 in mixed precision read fp32 masters: the compute-dtype parameters follow.
    rank_state.refresh_from_masters()
    if optimizer is not None:
        # A parameter without state in the checkpoint had not been stepped: it has none,
        # as before its first step.
        inner = inner_optimizer(optimizer)
        for param in stateless:
            inner.state.pop(param, None)
        restore_hyperparameters(optimizer, manifest["optimizer"]["param_groups"])
    rank = dist.get_rank()
    if f"rng.cpu.rank{rank}" in state:
        torch.set_rng_state(state[f"rng.cpu.rank{rank}"])
        if f"rng.cuda.rank{rank}" in state:
            torch.cuda.set_rng_state(state[f"rng.cuda.rank{rank}"])
    else:
        log.info("checkpoint %s was written by %d processes, this run has %d: RNG states "
                 "are not restored", path, manifest["world"]["size"], dist.get_world_size())
    return int(manifest["step"]), manifest["extra"]


def _checked(rank_state: RankState, directory: str | os.PathLike,
             optimizer: torch.optim.Optimizer | None, marks: PhaseMarks | None
             ) -> tuple[Path, dict[str, Any], Any]:
    """The checkpoint directory, its manifest and DCP's metadata, checked against the
    module on every rank; any rank's problem raises on all."""
    path = Path(directory)
    problem: str | CheckpointError | None = None
    manifest: dict[str, Any] = {}
    metadata = None
    try:
        with at_work(marks, "reading"):
            path = resolve(directory)
            manifest = read_manifest(path)
            metadata = _check(rank_state, path, manifest, optimizer)
    except CheckpointError as error:
        problem = error
    except Exception as error:
        problem = _problem(error)
    _agree(problem, f"cannot load the checkpoint at {directory}", path=path)
    return path, manifest, metadata


def _targets(rank_state: RankState, optimizer: torch.optim.Optimizer | None,
             path: Path, manifest: dict[str, Any], metadata: Any
             ) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """What DCP reads into on this rank (its chunks of every tensor, its optimizer state,
    its RNG states when the world is the one that saved), checked against the metadata;
    and the parameters the checkpoint has no optimizer state for."""
    problem: str | CheckpointError | None = None
    state: dict[str, Any] = {}
    stateless: list[torch.Tensor] = []
    try:
        state = {h.fqn: h.chunks() for h in held_tensors(rank_state)}
        # A checkpoint written before partc kept the parameters the forward never reads
        # lacks them: they stay as the model has them.
        for name, _ in rank_state.named_unread():
            fqn = rank_state.canonical(name)
            if fqn not in metadata.state_dict_metadata:
                state.pop(fqn, None)
        if optimizer is not None:
            stored = {key.rsplit(".", 1)[0] for key in metadata.state_dict_metadata
                      if key.startswith("optim.")}
            stateless = [p for h, p in optimizer_params(rank_state, optimizer)
                         if f"optim.{h.fqn}" not in stored]
            state.update({key: value
                          for key, value in optimizer_state(rank_state, optimizer).items()
                          if key.rsplit(".", 1)[0] in stored})
        rank = dist.get_rank()
        if manifest["world"]["size"] == dist.get_world_size():
            state[f"rng.cpu.rank{rank}"] = torch.get_rng_state()
            if manifest["rng"].get("cuda") and torch.cuda.is_available():
                state[f"rng.cuda.rank{rank}"] = torch.cuda.get_rng_state()
        _check_state_keys(state, metadata, path)
    except CheckpointError as error:
        problem = error
    except Exception as error:
        problem = _problem(error)
    _agree(problem, f"cannot load the checkpoint at {path}", path=path)
    return state, stateless


class _WatchedReader(SafeReader):
    """partc's DCP reader whose reading of this rank's chunks the watchdog hears as
    storage work (the rest of ``dcp.load`` is planning and collectives)."""

    def __init__(self, path: str, marks: PhaseMarks | None) -> None:
        super().__init__(path)
        self._marks = marks

    def read_data(self, *args: Any, **kwargs: Any) -> Any:
        with at_work(self._marks, "reading"):
            return super().read_data(*args, **kwargs)


def _read(state: dict[str, Any], path: Path, marks: PhaseMarks | None) -> None:
    problem = None
    try:
        with torch.no_grad():
            dcp.load(state, storage_reader=_WatchedReader(str(path), marks),
                     planner=ChunkLoadPlanner())
    except _failures() as error:
        problem = _problem(error)
    _agree(problem, f"reading the checkpoint at {path} failed (this rank's tensors may be "
           "partly loaded: load again)", path=path)


def latest(directory: str | os.PathLike) -> Path | None:
    """The checkpoint ``directory/latest`` names, else the newest complete ``step-*``
    (with a warning), or None when no save has committed there yet (what a ``--resume``
    that may start fresh asks first). Step directories none of which is complete raise
    CheckpointError: starting afresh would overwrite them."""
    pointer = Path(directory) / LATEST
    if not pointer.is_file():
        return newest_complete(Path(directory))
    return resolve(directory)


def newest_complete(root: Path) -> Path | None:
    """Without ``latest``: the newest ``step-*`` whose manifest reads and whose files
    match their sizes and digests, with a warning; None when there is no ``step-*``;
    CheckpointError when there are some and none is complete."""
    if (root / LATEST).is_file() or not root.is_dir():
        return None
    steps = sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")),
                   reverse=True)
    problems = []
    for path in steps:
        try:
            check_files(path, read_manifest(path)["files"])
        except CheckpointError as error:
            problems.append(str(error))
            continue
        log.warning("%s is missing: resuming from %s, the newest complete checkpoint "
                    "there%s", root / LATEST, path.name,
                    f" (newer, incomplete: {'; '.join(problems)})" if problems else "")
        return path
    if steps:
        raise CheckpointError(f"{root / LATEST} is missing and none of the {len(steps)} "
                              f"step directories under {root} is complete "
                              f"({'; '.join(problems[:3])}): refusing to start afresh over "
                              "them; restore one, or give another checkpoint directory",
                              path=str(root / LATEST))
    return None


def listed(directory: str | os.PathLike) -> list[Path]:
    """The committed checkpoints under a root, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and p.name.startswith("step-") and (p / MANIFEST).is_file())


__all__ = ["save", "load", "wait", "resolve", "read_manifest", "latest", "listed",
           "step_name"]
