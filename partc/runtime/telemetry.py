"""Training telemetry: what each step measured, beside what the plan predicted.

``module.telemetry(jsonl_dir=..., console=True, tensorboard_dir=None, warn_ratio=0.25)``
turns it on for a :class:`partc.runtime.DistributedModule`. From then on every step
yields one :class:`StepRecord` per rank:

- ``loss``: the step's mean loss (``forward_backward``'s result, the same on every rank);
- ``step_time_s``: from the start of ``forward_backward`` to the end of the optimizer's
  ``step`` (an optimizer from ``module.optimizer()``, or a call of ``module.end_step()``);
  without either, to the end of ``forward_backward`` (``timed`` says which). Data loading
  before ``forward_backward`` is not counted, as the plan does not count it;
- ``samples_per_s`` / ``tokens_per_s``: the global batch (in tokens when the plan knows
  the tokens per sample) over the step time;
- ``mfu``: the plan's model FLOPs per step (forward + backward without recompute, as
  ``Predicted.mfu`` counts them) over the step time and the peak FLOP/s of all devices,
  beside ``predicted_mfu``;
- ``memory_bytes``: this rank's peak memory during the step (``memory_measure`` names
  what was measured, :data:`MEMORY_MEASURES` says what that is) beside
  ``predicted_memory_bytes``, the plan's peak for this rank's stage. On a GPU, the
  caching allocator's peak. On CPU, where no allocator keeps one, memory as the plan
  counts it: the peak bytes of live tensors (the rank's parameters, gradients and
  optimizer state, and what the step's ops allocate), counted on the first step this
  telemetry records (``memory_step``; counting runs every op through Python, so that
  step is slower, and it is not judged against the plan) and reported with each later
  step, beside ``rss_bytes``, the step's own peak RSS growth, which also holds allocator
  slack, communication buffers and libraries. A compiled stage runs that step eagerly
  (dynamo traces nothing under the counting's dispatch mode) and compiles on the next;
- ``reserved_bytes``: on a GPU, the caching allocator's peak reserved during the step
  (``torch.cuda.max_memory_reserved``): ``memory_bytes`` and the segments' free pieces,
  what ``DeviceBudget.memory_fragmentation`` reserves for; None on CPU;
- ``host_activation_bytes`` / ``host_traffic_bytes``: with offloaded layers (recompute
  mode "offload", :mod:`partc.runtime.activation_offload`), the most bytes of saved
  activations the rank held on the host during the step and the bytes it copied there,
  beside ``predicted_host_activation_bytes`` / ``predicted_host_traffic_bytes``, the
  plan's (``StageMemory.host``, ``StagePlan.host_traffic_bytes``); None without;
- ``grad_norm``: the global gradient 2-norm (the one the step's non-finite check and
  clipping read; with that check off and no clipping, computed unless
  ``grad_norm=False``);
- ``skipped``: the step was skipped, its loss or gradient norm inf or NaN
  (``TrainSpec.on_nonfinite="skip"``, :mod:`partc.runtime.nonfinite`); the console line
  says so, and ``Telemetry.skipped_steps`` counts them.

Rank 0 prints one line per step; with ``jsonl_dir`` every rank appends its records to
``<jsonl_dir>/rank<k>.jsonl`` (one JSON object a line, ``"event": "step"`` or
``"eval"``); with ``tensorboard_dir`` every rank writes scalars under
``<tensorboard_dir>/rank<k>`` (needs the ``tensorboard`` package: ``pip install
'partc[tensorboard]'``); with ``wandb`` (``wandb.init``'s keyword arguments: ``project``,
``name``, ``dir``, ``config``, ...) rank 0 logs the same scalars to a Weights & Biases run,
as torchtitan does (needs the ``wandb`` package, checked on every rank so that all fail
alike; ``WANDB_MODE=offline`` keeps the run on disk). After the first step (which also learns shapes and allocates
optimizer state; on CPU with a compiled stage, after the second, which compiles it), a
step whose time or memory departs from the prediction by more than ``warn_ratio`` is
logged as a warning naming the stage and the figures, once per stage and kind, by the
stage's first rank.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TextIO

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from partc.errors import PartcError
from partc.plan import Plan
from partc.runtime.activation_offload import OffloadCounters
from partc.units import format_bytes, format_seconds

log = logging.getLogger("partc.runtime.telemetry")

WARMUP_STEPS = 1   # not judged against the plan: shape inference, first allocations
# What ``memory_bytes`` measures, by the name a record carries in ``memory_measure``:
MEMORY_MEASURES = {
    # the caching allocator's peak during the step (tensors only, not its reserve)
    "cuda_max_allocated": "torch.cuda.max_memory_allocated during the step",
    # the process's peak resident set during the step above its resident set when the
    # module was built: tensors, and also allocator slack, communication buffers and
    # libraries loaded late, which the plan does not count
    "host_peak_rss_growth": ("peak RSS during the step (VmHWM, reset each step) above "
                             "the RSS at build"),
    # on CPU, as the plan counts memory: the bytes of the tensors alive at once, at their
    # peak during the step: the rank's parameters, gradients and optimizer state held
    # from step to step, and every tensor the step's ops make while it lives
    "live_tensor_bytes": ("peak bytes of live tensors during the step: the rank's "
                          "parameters, gradients and optimizer state, and every tensor "
                          "the step's ops allocate while it lives"),
}


# -- what the plan predicts -------------------------------------------------------------

def flops_per_step(plan: Plan) -> float:
    """The plan's model FLOPs for one step (what its MFU counts), recovered from the
    predicted MFU, step time and the budget's devices."""
    predicted = plan.predicted
    return (predicted.mfu * predicted.step_time_s * plan.budget.num_devices
            * plan.budget.figures.peak_flops)


def achieved_mfu(plan: Plan, seconds: float) -> float:
    """Model FLOPs utilisation of a step that took ``seconds``."""
    return flops_per_step(plan) / (seconds * plan.budget.num_devices
                                   * plan.budget.figures.peak_flops)


def tokens_per_sample(plan: Plan) -> float | None:
    """Tokens in one sample as the plan counted them; None when a sample is no sequence."""
    predicted = plan.predicted
    if predicted.tokens_per_s is None or not predicted.samples_per_s:
        return None
    return predicted.tokens_per_s / predicted.samples_per_s


def departure(measured: float, predicted: float) -> float:
    """How far ``measured`` is from ``predicted``, as a signed fraction of it."""
    return measured / predicted - 1.0 if predicted > 0 else float("inf")


# -- one step's figures -----------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One rank's figures for one step (see the module's docstring)."""

    step: int
    rank: int
    stage: int
    loss: float
    step_time_s: float
    predicted_step_time_s: float
    timed: str   # "forward_backward + optimizer step" or "forward_backward"
    samples_per_s: float
    tokens_per_s: float | None
    mfu: float
    predicted_mfu: float
    memory_bytes: int
    predicted_memory_bytes: int
    memory_measure: str
    grad_norm: float | None
    # On CPU with live tensors counted: the step they were counted in (memory_bytes is
    # that step's peak), and this step's peak RSS growth beside it.
    memory_step: int | None = None
    rss_bytes: int | None = None
    # On a GPU: the caching allocator's peak reserved during the step (its segments,
    # what it took from the device, the tensors' memory_bytes and its fragmentation).
    reserved_bytes: int | None = None
    skipped: bool = False   # a non-finite step, skipped: the optimizer did not step
    # Offloaded activations on the host (None: the stage offloads none).
    host_activation_bytes: int | None = None
    predicted_host_activation_bytes: int | None = None
    host_traffic_bytes: int | None = None
    predicted_host_traffic_bytes: int | None = None
    notes: dict[str, Any] = field(default_factory=dict)   # e.g. the launcher's lr

    @property
    def time_departure(self) -> float:
        return departure(self.step_time_s, self.predicted_step_time_s)

    @property
    def memory_departure(self) -> float:
        return departure(self.memory_bytes, self.predicted_memory_bytes)

    def to_json(self) -> dict[str, Any]:
        record = {"event": "step", **asdict(self)}
        notes = record.pop("notes")
        return {**record, **notes, "time_departure": round(self.time_departure, 4),
                "memory_departure": round(self.memory_departure, 4)}

    def console_line(self) -> str:
        rate = (f"{self.tokens_per_s:,.0f} tokens/s" if self.tokens_per_s is not None
                else f"{self.samples_per_s:,.1f} samples/s")
        parts = [f"step {self.step}", f"loss {self.loss:.4f}",
                 f"{format_seconds(self.step_time_s)} (plan "
                 f"{format_seconds(self.predicted_step_time_s)}, {self.time_departure:+.0%})",
                 rate,
                 f"MFU {_percent(self.mfu)} (plan {_percent(self.predicted_mfu)})",
                 f"mem {format_bytes(self.memory_bytes)}"
                 + (" tensors" + (f" at step {self.memory_step}"
                                  if self.memory_step != self.step else "")
                    if self.memory_step is not None else "")
                 + f" (plan {format_bytes(self.predicted_memory_bytes)}, stage {self.stage})"
                 + (f", RSS +{format_bytes(self.rss_bytes)}"
                    if self.rss_bytes is not None else "")]
        if self.host_activation_bytes is not None:
            parts.append(f"host {format_bytes(self.host_activation_bytes)} (plan "
                         f"{format_bytes(self.predicted_host_activation_bytes or 0)})")
        if self.grad_norm is not None:
            parts.append(f"grad norm {self.grad_norm:.3g}")
        if self.skipped:
            parts.append("SKIPPED (non-finite)")
        parts += [f"{key} {value:.3g}" if isinstance(value, float) else f"{key} {value}"
                  for key, value in self.notes.items()]
        return "  ".join(parts)


# -- measuring peak memory ----------------------------------------------------------------

class _CudaMemory:
    """Peak bytes the caching allocator handed out during the step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reserved(self) -> int:
        return int(torch.cuda.max_memory_reserved(self.device))


class _HostMemory:
    """Peak resident set size during the step, above ``baseline`` (the RSS when the
    module was built, before it copied its parameters). Linux resets the peak (VmHWM) on
    a write of 5 to /proc/self/clear_refs; elsewhere the process's lifetime peak is read."""

    def __init__(self, baseline: int) -> None:
        self.baseline = baseline

    def reserved(self) -> None:   # no allocator keeps segments beside the tensors
        return None

    def reset(self) -> None:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass   # not Linux: the lifetime peak (ru_maxrss) is what peak() reads

    def sync(self) -> None:
        pass

    def peak(self) -> int:
        return max(0, peak_rss() - self.baseline)


class _LiveTensors(TorchDispatchMode):
    """Counts the bytes of the tensors the ops under it make while they live (each
    storage once, from its op's return to its release), and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if type(value) in (torch.Tensor, torch.nn.Parameter):
                self._track(value)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):   # sparse, nested: no one storage
            return
        if storage in self._seen or storage.device.type == "meta":
            return
        size = storage.nbytes()
        self._seen[storage] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, size)

    def _release(self, size: int) -> None:
        self.live -= size


def held_bytes(tensors) -> int:
    """The bytes of ``tensors``' storages, each storage once. A sharded parameter
    (FSDP's DTensor, ZeRO-2/3) counts its local shard; a tensor subclass with no storage
    of its own is skipped."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            continue
        try:
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except RuntimeError:   # "invalid python storage": a wrapper without one
            continue
    return sum(seen.values())


class _TensorMemory:
    """Peak bytes of live tensors during one step, as the plan counts memory: what the
    rank holds from step to step (``held()``: its parameters, their gradients and the
    optimizer state), read as the step begins, plus every tensor the step's ops allocate
    while it lives (:class:`_LiveTensors`, over the thread that runs the step: forward,
    backward and the optimizer step). Counting runs every op through Python, which slows
    the step: telemetry counts one step, its first (see the module docstring)."""

    def __init__(self, held: Callable[[], Iterable[torch.Tensor]]) -> None:
        self._held = held
        self._mode: _LiveTensors | None = None
        self._stance: Any = None
        self._base = 0

    @property
    def counting(self) -> bool:
        return self._mode is not None

    def start(self) -> None:
        self._base = held_bytes(self._held())
        # Compiled stages run eagerly while counted: dynamo does not trace under a
        # dispatch mode and, once it has skipped a frame, never traces it again, so a
        # counted first call would leave the stage eager for the whole run. Eager, the
        # step's tensors are the ones the plan counts; the next step compiles.
        self._stance = _eager_stance()
        self._stance.__enter__()
        self._mode = _LiveTensors()
        self._mode.__enter__()

    def peak(self) -> int:
        return self._base + (self._mode.peak if self._mode is not None else 0)

    def stop(self) -> int:
        """Stop counting; the step's peak."""
        peak = self.peak()
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
            self._stance.__exit__(None, None, None)
        return peak


def _eager_stance() -> Any:
    """torch.compile's functions run eagerly under it, without being marked skipped
    (``torch.compiler.set_stance``; a no-op on a torch without it)."""
    import contextlib

    stance = getattr(torch.compiler, "set_stance", None)
    return stance("force_eager") if stance is not None else contextlib.nullcontext()


def _status_bytes(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024   # reported in kB
    except OSError:
        pass
    return None


def resident_bytes() -> int:
    """The process's resident set size now (the lifetime peak where /proc is absent)."""
    return _status_bytes("VmRSS") or peak_rss()


def peak_rss() -> int:
    """The process's peak resident set size since the last reset (Linux) or its start."""
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    scale = 1 if sys.platform == "darwin" else 1024   # macOS reports bytes, Linux kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


# -- writers -------------------------------------------------------------------------------

def _tensorboard_writer(directory: Path) -> Any:
    try:   # here: tensorboard is optional, and only --tensorboard needs it
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:   # torch's module imports the tensorboard package
        raise PartcError("TensorBoard logging needs the tensorboard package: pip install "
                         f"'partc[tensorboard]' (or tensorboard) ({error})") from None
    return SummaryWriter(log_dir=str(directory))


def _wandb_run(settings: dict[str, Any], rank: int) -> Any:
    """Rank 0's Weights & Biases run (None on the other ranks)."""
    try:   # here: wandb is optional, and only asking for it needs it
        import wandb
    except ImportError as error:
        raise PartcError("Weights & Biases logging needs the wandb package: pip install "
                         f"wandb (or leave --wandb out) ({error})") from None
    return wandb.init(**settings) if rank == 0 else None


_SCALARS = {"loss": "train/loss", "step_time_s": "time/step_s",
            "predicted_step_time_s": "time/predicted_step_s", "tokens_per_s": "speed/tokens_per_s",
            "samples_per_s": "speed/samples_per_s", "mfu": "speed/mfu",
            "memory_bytes": "memory/peak_bytes",
            "predicted_memory_bytes": "memory/predicted_peak_bytes",
            "grad_norm": "train/grad_norm", "skipped": "train/skipped",
            "rss_bytes": "memory/rss_growth_bytes"}


# -- the telemetry of one rank -------------------------------------------------------------

class Telemetry:
    """One rank's telemetry; made by ``DistributedModule.telemetry``, which calls
    :meth:`begin`, :meth:`measured` and :meth:`end` around each step."""

    def __init__(self, plan: Plan, *, rank: int, stage: int, leads_stage: bool,
                 device: torch.device, memory_baseline: int = 0,
                 jsonl_dir: str | Path | None = None, console: bool = True,
                 tensorboard_dir: str | Path | None = None, warn_ratio: float = 0.25,
                 grad_norm: bool = True, wandb: dict[str, Any] | None = None,
                 held: Callable[[], Iterable[torch.Tensor]] | None = None,
                 offload: Sequence[OffloadCounters] = ()) -> None:
        if not warn_ratio > 0:
            raise ValueError(f"warn_ratio must be positive, got {warn_ratio!r}")
        self.plan, self.rank, self.stage = plan, rank, stage
        self._offload = tuple(offload)   # the counters of the rank's offloaded layers
        self.console = console and rank == 0
        self.warn_ratio = warn_ratio
        self.grad_norm = grad_norm
        self._leads_stage = leads_stage
        self._meter = (_CudaMemory(device) if device.type == "cuda"
                       else _HostMemory(memory_baseline))
        # On CPU, given what the rank holds, live tensors as the plan counts them (RSS
        # beside them).
        self._tensors = (_TensorMemory(held) if device.type != "cuda" and held is not None
                         else None)
        self._tensor_peak: tuple[int, int] | None = None   # (step, bytes)
        self._unjudged = 2 if self._tensors is not None and plan.train.compile else 1
        self._measure = ("cuda_max_allocated" if device.type == "cuda"
                         else "live_tensor_bytes" if self._tensors is not None
                         else "host_peak_rss_growth")
        self._jsonl: TextIO | None = None
        if jsonl_dir is not None:
            Path(jsonl_dir).mkdir(parents=True, exist_ok=True)
            self._jsonl = open(Path(jsonl_dir) / f"rank{rank}.jsonl", "a", encoding="utf-8")
        self._tensorboard = (_tensorboard_writer(Path(tensorboard_dir) / f"rank{rank}")
                             if tensorboard_dir is not None else None)
        self._wandb = _wandb_run(wandb, rank) if wandb is not None else None
        self._warned: set[str] = set()
        self._pending: dict[str, Any] | None = None
        self.records: list[StepRecord] = []
        self.last: StepRecord | None = None
        self.skipped_steps = 0   # steps skipped as non-finite since telemetry began

    # -- the step's phases, called by the module --------------------------------------------

    def begin(self, step: int) -> None:
        """A step starts (``forward_backward`` was called): end the previous one if no
        optimizer step or ``end_step`` did, then start the clock and the memory peak."""
        if self._pending is not None:
            self.end()
        self._meter.sync()
        self._meter.reset()
        if self._tensors is not None and self._tensor_peak is None:
            self._tensors.start()
        for counters in self._offload:
            counters.reset()
        self._pending = {"step": step, "notes": {}, "start": time.perf_counter()}

    def measured(self, loss: torch.Tensor, grad_norm: torch.Tensor | None, *,
                 skipped: bool = False) -> None:
        """``forward_backward`` returned ``loss``; ``grad_norm`` is the step's or None;
        ``skipped``: the step was skipped as non-finite."""
        if self._pending is None:
            return
        self._meter.sync()
        self._pending.update(loss=loss, grad_norm=grad_norm, skipped=skipped,
                             fb_end=time.perf_counter(), fb_peak=self._meter.peak())
        if self._tensors is not None and self._tensors.counting:
            self._pending["fb_tensors"] = self._tensors.peak()

    def note(self, **fields: Any) -> None:
        """Add figures to the step under way's record (the launcher adds ``lr``)."""
        if self._pending is not None:
            self._pending["notes"].update(fields)

    def end(self, *, optimizer_stepped: bool = False) -> StepRecord | None:
        """The step is over: measure, write and return its record (None if none began
        or ``forward_backward`` did not return)."""
        pending, self._pending = self._pending, None
        counted = (self._tensors.stop() if self._tensors is not None
                   and self._tensors.counting else None)
        if pending is None or "loss" not in pending:
            return None
        self._meter.sync()
        if optimizer_stepped:
            seconds = time.perf_counter() - pending["start"]
            memory = max(pending["fb_peak"], self._meter.peak())
        else:
            seconds, memory = pending["fb_end"] - pending["start"], pending["fb_peak"]
            counted = pending.get("fb_tensors", counted)
        if counted is not None:
            self._tensor_peak = (pending["step"], counted)
        record = self._record(pending, seconds, memory, optimizer_stepped)
        self._publish(record)
        return record

    def _record(self, pending: dict[str, Any], seconds: float, memory: int,
                optimizer_stepped: bool) -> StepRecord:
        plan = self.plan
        batch = plan.global_batch_size
        tokens = tokens_per_sample(plan)
        seconds = max(seconds, 1e-9)
        grad_norm = pending["grad_norm"]
        rss, counted = None, self._tensor_peak
        if counted is not None:   # live tensors are the memory, RSS beside them
            rss, memory = memory, counted[1]
        return StepRecord(
            step=pending["step"], rank=self.rank, stage=self.stage,
            loss=float(pending["loss"]), step_time_s=seconds,
            predicted_step_time_s=plan.predicted.step_time_s,
            timed="forward_backward + optimizer step" if optimizer_stepped
            else "forward_backward",
            samples_per_s=batch / seconds,
            tokens_per_s=batch * tokens / seconds if tokens is not None else None,
            mfu=achieved_mfu(plan, seconds), predicted_mfu=plan.predicted.mfu,
            memory_bytes=memory,
            predicted_memory_bytes=plan.stages[self.stage].memory_bytes.peak,
            memory_measure=self._measure,
            grad_norm=float(grad_norm) if grad_norm is not None else None,
            memory_step=counted[0] if counted is not None else None, rss_bytes=rss,
            reserved_bytes=self._meter.reserved(),
            skipped=pending.get("skipped", False), notes=dict(pending["notes"]),
            **self._host_figures())

    def _host_figures(self) -> dict[str, int | None]:
        """The step's offloaded activations on the host, beside the plan's."""
        if not self._offload:
            return {}
        stage = self.plan.stages[self.stage]
        return {"host_activation_bytes": sum(c.peak_resident for c in self._offload),
                "predicted_host_activation_bytes": stage.memory_bytes.host,
                "host_traffic_bytes": sum(c.to_host for c in self._offload),
                "predicted_host_traffic_bytes": stage.host_traffic_bytes}

    # -- output ------------------------------------------------------------------------------

    def _publish(self, record: StepRecord) -> None:
        self.records.append(record)
        self.last = record
        self.skipped_steps += record.skipped
        if self.console:
            print(record.console_line(), flush=True)
        self._write({k: _plain(v) for k, v in record.to_json().items()})
        scalars = {tag: getattr(record, key) for key, tag in _SCALARS.items()
                   if getattr(record, key) is not None}
        if self._tensorboard is not None:
            for tag, value in scalars.items():
                self._tensorboard.add_scalar(tag, value, record.step)
        if self._wandb is not None:
            self._wandb.log({**scalars, **{f"train/{k}": v for k, v in record.notes.items()
                                           if isinstance(v, (int, float))}},
                            step=record.step)
        # The first step this telemetry sees learns shapes, allocates the optimizer's
        # state and, on CPU, counts live tensors (slower): its time is not judged; nor,
        # where that step ran a compiled stage eagerly, the next, which compiles it.
        if record.step > WARMUP_STEPS and len(self.records) > self._unjudged:
            self._warn(record)

    def _warn(self, record: StepRecord) -> None:
        if not self._leads_stage:
            return
        for kind, off, measured, predicted in (
                ("time", record.time_departure, format_seconds(record.step_time_s),
                 format_seconds(record.predicted_step_time_s)),
                ("memory", record.memory_departure, format_bytes(record.memory_bytes),
                 format_bytes(record.predicted_memory_bytes))):
            if abs(off) > self.warn_ratio and kind not in self._warned:
                self._warned.add(kind)
                log.warning("stage %d (rank %d), step %d: %s %s is %.0f%% %s the plan's %s "
                            "(warning threshold %.0f%%; warned once per stage)", self.stage,
                            self.rank, record.step, "measured step time" if kind == "time"
                            else "peak memory", measured, abs(off) * 100,
                            "above" if off > 0 else "below", predicted, self.warn_ratio * 100)

    def log_eval(self, step: int, loss: float) -> None:
        """Record an evaluation's mean loss after optimizer step ``step``."""
        if self.console:
            print(f"step {step}  eval loss {loss:.4f}", flush=True)
        self._write({"event": "eval", "step": step, "rank": self.rank, "stage": self.stage,
                     "eval_loss": loss})
        if self._tensorboard is not None:
            self._tensorboard.add_scalar("eval/loss", loss, step)
        if self._wandb is not None:
            self._wandb.log({"eval/loss": loss}, step=step)

    def _write(self, line: dict[str, Any]) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(line) + "\n")
            self._jsonl.flush()

    def close(self) -> None:
        """End a step still open, then close the files."""
        if self._pending is not None:
            self.end()
        if self._tensors is not None:
            self._tensors.stop()
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _percent(fraction: float) -> str:
    """A percentage with one decimal, or two significant digits below 0.1%."""
    return f"{fraction:.1%}" if fraction >= 1e-3 else f"{fraction * 100:.2g}%"


def _plain(value: Any) -> Any:
    return round(value, 9) if isinstance(value, float) else value
