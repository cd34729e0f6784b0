"""Re-planning without redoing the work: measured models and plans, by what they depend on.

Two levels, both keyed by content, never by object identity:

- *measured models*: the ``ModelAnalysis`` of a model with its tensor-parallel variants,
  keyed by the graph signature (module tree, parameter shapes and dtypes, the modules'
  code and attributes and tied tensors, input shapes and dtypes, loss function, name),
  by the autocast dtype the layers were measured in (the training's precision) and
  the device type they run on (a GPU's kernels or a CPU's), and by the links the variants
  were measured for. A change of memory, device count or batch reuses it:
  tracing and measuring are skipped.
- *plans*: keyed by a digest of the whole ``PlanningProblem`` (the measured model, the
  budget's numbers, the training numbers and the pins). A hit returns the stored plan,
  which the caller validates again. Nothing in the problem follows trace order (a layer
  is described by what it computes, ``LayerCost.signature``), so another process, whose
  string hashing iterates a model's sets otherwise, finds the plan too.

Besides, in memory only, the planner's cost-table caches (``partc.cost.tables.TableCache``) of
the few latest problems, keyed by the problem with the devices' memory left out: a
problem that changed only in memory (re-planning after a budget change) reuses the rows
of its tables and starts its search from the plans found before.

A cache lives in memory; with a directory it also persists across processes, as JSON
files: analyses through :mod:`partc.codec` (typed by ``ModelAnalysis``'s annotations, so
a file can hold numbers but never name code to run), plans as ``Plan.to_json`` writes
them. Entries on disk carry a digest of partc's own source, so a new version of partc
never reads what an old one wrote. An entry that cannot be read back (damaged, of
another version, failing the classes' own checks, or a plan that fails validation) is
removed with a warning and computed again.

Processes that share a directory (the ranks of a node, one ``PARTC_CACHE_DIR``) make an
entry once: while one computes it, under a file lock of its own (:meth:`PlanCache.computing`),
the others wait, then read it. Eight ranks of a node trace and plan once, not eight times.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import tempfile
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

import filelock
import torch

from partc.codec import check, from_data, to_data
from partc.cost.tables import TableCache
from partc.errors import PlanValidationError
from partc.plan import Plan
from partc.planner.validate import validate_plan
from partc.problem import ModelAnalysis, PlanningProblem

log = logging.getLogger("partc")

ANALYSIS_VERSION = 1   # of the analysis files' layout: {"version": 1, "analysis": {...}}


class PlanCache:
    """Measured models and plans, in memory (the ``capacity`` latest of each) and, with
    ``directory``, on disk; the cost-table caches of the ``TABLE_CACHES`` latest problems,
    in memory."""

    TABLE_CACHES = 4   # each holds the rows of every configuration family of a problem
    # The longest a process waits for another to make an entry (a wedged peer, storage
    # without locks) before it makes the entry itself.
    WAIT_S = 1800.0

    def __init__(self, directory: str | Path | None = None, capacity: int = 8) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.capacity = capacity
        self._analyses: OrderedDict[str, ModelAnalysis] = OrderedDict()
        self._plans: OrderedDict[str, str] = OrderedDict()
        self._table_caches: OrderedDict[str, TableCache] = OrderedDict()
        self.hits = {"analysis": 0, "plan": 0}

    def analysis(self, key: str) -> ModelAnalysis | None:
        def read(path: Path) -> ModelAnalysis:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or data.get("version") != ANALYSIS_VERSION:
                raise ValueError(f"not an analysis entry of version {ANALYSIS_VERSION}")
            return from_data(ModelAnalysis, data.get("analysis"), "analysis")

        return self._get(self._analyses, key, "analysis", "json", read)

    def put_analysis(self, key: str, analysis: ModelAnalysis) -> None:
        text = json.dumps({"version": ANALYSIS_VERSION, "analysis": to_data(analysis)})
        self._put(self._analyses, key, analysis, "json", text.encode())

    def plan(self, problem: PlanningProblem) -> Plan | None:
        def read(path: Path) -> str:
            text = path.read_text()
            plan = Plan.from_json(text)
            check(plan, Plan)
            validate_plan(problem, plan)   # an entry edited, or made by other numbers
            return text

        text = self._get(self._plans, problem_key(problem), "plan", "json", read)
        return Plan.from_json(text) if text is not None else None

    def put_plan(self, problem: PlanningProblem, plan: Plan) -> None:
        text = plan.to_json()
        self._put(self._plans, problem_key(problem), text, "json", text.encode())

    def table_cache(self, problem: PlanningProblem) -> TableCache:
        """The cost-table cache to solve ``problem`` with (``partc.planner.solve``):
        shared with the latest problem that differed only in the devices' memory (or what
        of it is kept back), else a new one."""
        devices = problem.devices
        key = problem_key(replace(problem, devices=replace(
            devices, memory_bytes=(0,) * devices.num_devices, context_memory=0,
            communicator_memory=0, memory_fragmentation=0.0)))
        cache = self._table_caches.pop(key, None)
        self._table_caches[key] = cache if cache is not None else TableCache()
        while len(self._table_caches) > self.TABLE_CACHES:
            self._table_caches.popitem(last=False)
        return self._table_caches[key]

    @contextlib.contextmanager
    def computing(self, kind: str, key: str) -> Iterator[None]:
        """Hold the lock of entry ``key`` of ``kind`` (``"analysis"`` or ``"plan"``) of
        the directory for the block: look the entry up, make it and store it inside, and
        a process that shares the directory waits, then finds it. In memory only, a
        no-op. The lock goes with its process, should that die."""
        path = self._path(kind, key, "lock")
        if path is None:
            yield
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(str(path))
        try:
            lock.acquire(timeout=self.WAIT_S)
        except filelock.Timeout:
            log.warning("waited %.0f s for another process to make %s; making it here",
                        self.WAIT_S, path.with_suffix(""))
            yield
            return
        try:
            yield
        finally:
            lock.release()

    def _get(self, memory: OrderedDict, key: str, kind: str, suffix: str,
             read: Callable[[Path], Any]) -> Any:
        if key in memory:
            memory.move_to_end(key)
            self.hits[kind] += 1
            return memory[key]
        path = self._path(kind, key, suffix)
        if path is None or not path.exists():
            return None
        try:
            value = read(path)
        except (OSError, ValueError, KeyError, TypeError, RecursionError,
                PlanValidationError) as error:
            # ValueError covers bad JSON, bad UTF-8, CodecError and PlanSchemaError.
            log.warning("discarding unreadable cache entry %s: %s", path, error)
            path.unlink(missing_ok=True)
            return None
        self._remember(memory, key, value)
        self.hits[kind] += 1
        return value

    def _put(self, memory: OrderedDict, key: str, value: Any, suffix: str,
             data: bytes) -> None:
        self._remember(memory, key, value)
        kind = "analysis" if memory is self._analyses else "plan"
        path = self._path(kind, key, suffix)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Readers never see half a file, and writers never each other's: every rank
            # of a node may write the same entry at once (one PARTC_CACHE_DIR per
            # machine), each through a partial file of its own.
            descriptor, partial = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".",
                                                   suffix=".partial")
            try:
                with os.fdopen(descriptor, "wb") as file:
                    file.write(data)
                os.replace(partial, path)
            except BaseException:
                Path(partial).unlink(missing_ok=True)
                raise

    def _remember(self, memory: OrderedDict, key: str, value: Any) -> None:
        memory[key] = value
        memory.move_to_end(key)
        while len(memory) > self.capacity:
            memory.popitem(last=False)

    def _path(self, kind: str, key: str, suffix: str) -> Path | None:
        if self.directory is None:
            return None
        return self.directory / source_digest() / kind / f"{key}.{suffix}"


def model_key(model_identity: str, example_inputs: tuple, example_target: Any,
              loss_fn: Callable | None, name: str | None, measured_for: Any) -> str:
    """The graph signature: the model's structure and behaviour (``model_identity``: its
    ``model_hash``, module tree and parameter shapes and dtypes, and its
    ``behaviour_digest``, the modules' code, attributes and tied tensors), the inputs'
    and target's shapes and dtypes, the loss function and
    the name; with ``measured_for``, what the measurement depends on besides (the
    autocast dtype and policy, the links the tensor-parallel variants were measured for)."""
    def spec(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), str(value.dtype))
        if isinstance(value, (tuple, list)):
            return tuple(spec(v) for v in value)
        if isinstance(value, dict):   # inputs by keyword
            return ("keywords", tuple((key, spec(v)) for key, v in value.items()))
        return repr(value)

    loss = None if loss_fn is None else (getattr(loss_fn, "__module__", ""),
                                         getattr(loss_fn, "__qualname__", repr(loss_fn)))
    text = repr((model_identity, spec(example_inputs), spec(example_target), loss, name,
                 measured_for))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def problem_key(problem: PlanningProblem) -> str:
    """A digest of everything the planner reads (frozen dataclasses of plain numbers)."""
    return hashlib.sha256(repr(problem).encode()).hexdigest()[:32]


@functools.cache
def source_digest() -> str:
    """A digest of partc's own Python source (the package and its passes), read once."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent
    files = sorted(root.rglob("*.py")) + sorted((root.parent / "passes").rglob("*.py"))
    for path in files:
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


DEFAULT = PlanCache(os.environ.get("PARTC_CACHE_DIR") or None)
