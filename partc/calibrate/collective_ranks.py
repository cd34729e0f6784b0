"""The ranks calibration spawns: collectives, their overlap with compute, and every rank
computing at once.

N local processes (gloo on CPU, NCCL on CUDA, a FileStore rendezvous) time all-reduce,
all-gather, reduce-scatter and a send/recv ping-pong over the message sizes, fitted by
:mod:`partc.calibrate.collective_fits`. On CPU every collective and size is timed again
as a training step meets it, each call after a burst of compute (``between_compute``:
gloo's threads woken, the ranks arriving apart), and those fits are the budget's: back
to back they ran 2-3x faster than the tensor-parallel runtime's all-reduces of the same
size. The same ranks then time an all-reduce beside compute (``comm_overlap``), the
linear layers, element-wise ops and optimizer step with every rank computing at once
(they share the memory bus), and on CPU FSDP2's own work
(:mod:`partc.calibrate.fsdp_overheads`).
"""

from __future__ import annotations

import logging
import pickle
import tempfile
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from partc.calibrate.calibration_options import CalibrationError, CalibrationOptions, Sizes
from partc.calibrate.collective_fits import (COLLECTIVES, CollectiveSample, LinkFits,
                                             fit_collectives, ring_factor, ring_steps)
from partc.calibrate.fsdp_overheads import FsdpOverheads, measure_fsdp
from partc.calibrate.matmuls import LinearRate, measure_linear
from partc.calibrate.memory_rates import (ElementwiseRate, OptimizerRate, measure_elementwise,
                                          measure_optimizer)
from partc.calibrate.overheads import measure_op_overhead
from partc.calibrate.stopwatch import (BUSY_SAMPLE_S, median_seconds, slowest,
                                       slowest_rank_seconds)
from partc.runtime import topology
from partc.runtime.topology import ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE

log = logging.getLogger(__name__)

# The compute a rank runs before each collective timed "between compute": about what a
# training step runs between two of its collectives (a layer's share of a step).
BETWEEN_COMPUTE_S = 2e-3
# A file each collective rank makes beside the output once every rank is done.
DONE_MARKER = "done-rank"
RING_MODEL = ("t = steps*latency_s + factor*bytes/bandwidth (ring: all_reduce steps 2(n-1), "
              "factor 2(n-1)/n; all_gather/reduce_scatter n-1, (n-1)/n; send_recv 1, 1)")


@dataclass(frozen=True, kw_only=True)
class Overlap:
    """An all-reduce alone, compute alone and both at once; the slowest rank's seconds."""

    nbytes: int                    # of the all-reduced tensor
    all_reduce_s: float            # T_a
    compute_s: float               # T_c: matmuls of about as long
    both_s: float                  # T_b: the all-reduce started, the matmuls beside it

    @property
    def overlap(self) -> float:    # share of the shorter hidden, in [0, 1]
        hidden = (self.all_reduce_s + self.compute_s - self.both_s) / min(
            self.all_reduce_s, self.compute_s)
        return min(1.0, max(0.0, hidden))

    def to_dict(self) -> dict:
        return {"bytes": self.nbytes, "all_reduce_s": self.all_reduce_s,
                "compute_s": self.compute_s, "both_s": self.both_s, "overlap": self.overlap}


@dataclass(frozen=True, kw_only=True)
class BetweenComputeTimes:
    """The collectives timed as a step meets them (:class:`BetweenCompute`)."""

    compute_s: float               # compute before each call, seconds
    calls: int                     # calls timed per collective and size
    samples: Mapping[str, tuple[CollectiveSample, ...]]   # by kind


@dataclass(frozen=True, kw_only=True)
class BetweenComputeFits:
    """The collectives timed between compute, fitted as the back-to-back ones are."""

    compute_s: float
    calls: int
    fits: LinkFits

    def to_dict(self) -> dict:
        return {"compute_s": self.compute_s, "calls": self.calls, **self.fits.to_dict()}


@dataclass(frozen=True, kw_only=True)
class RankTimings:
    """What rank 0 hands the parent; figures timed together are the slowest rank's."""

    back_to_back: Mapping[str, tuple[CollectiveSample, ...]]   # by kind
    between_compute: BetweenComputeTimes | None                # on a CPU only
    overlap: Overlap
    linear_all_busy: dict[str, LinearRate]                     # by dtype
    elementwise_all_busy: ElementwiseRate
    optimizer_all_busy: OptimizerRate
    fsdp: FsdpOverheads | None                                 # on a CPU only


@dataclass(frozen=True, kw_only=True)
class CollectiveMeasurement:
    """Everything the spawned ranks measured, the collectives fitted."""

    processes: int
    backend: str                   # "gloo" or "nccl"
    overlap: Overlap
    linear_all_busy: dict[str, LinearRate]
    elementwise_all_busy: ElementwiseRate
    optimizer_all_busy: OptimizerRate
    fsdp: FsdpOverheads | None
    back_to_back: LinkFits
    between_compute: BetweenComputeFits | None   # None on a GPU, or where noise hid it

    @property
    def step_fits(self) -> LinkFits:
        """The links as a step meets them: on a CPU the collectives timed between
        compute, where they were fitted; else back to back."""
        return self.between_compute.fits if self.between_compute else self.back_to_back

    def to_dict(self) -> dict:
        result = {"processes": self.processes, "backend": self.backend, "model": RING_MODEL,
                  "overlap": self.overlap.to_dict(),
                  "linear_all_busy": {key: rate.to_dict()
                                      for key, rate in self.linear_all_busy.items()},
                  "elementwise_all_busy": self.elementwise_all_busy.to_dict(),
                  "optimizer_all_busy": self.optimizer_all_busy.to_dict()}
        if self.fsdp is not None:
            result["fsdp"] = self.fsdp.to_dict()
        for kind in COLLECTIVES:
            result[kind] = {"steps": ring_steps(kind, self.processes),
                            "factor": ring_factor(kind, self.processes),
                            **self.back_to_back.series[kind].to_dict()}
        result["joint_fit"] = self.back_to_back.joint_fit.to_dict()
        if self.between_compute is not None:
            result["between_compute"] = self.between_compute.to_dict()
        return result


def measure_collectives(options: CalibrationOptions) -> CollectiveMeasurement:
    """Spawn the ranks, time the collectives, fit each one and all of them together."""
    ranks = options.processes
    backend = "nccl" if options.device == "cuda" else "gloo"
    timed = _spawn_ranks(ranks, backend, options.sizes)
    log.info("overlap: %.2f of an all-reduce hidden by compute beside it",
             timed.overlap.overlap)
    return CollectiveMeasurement(
        processes=ranks, backend=backend, overlap=timed.overlap,
        linear_all_busy=timed.linear_all_busy,
        elementwise_all_busy=timed.elementwise_all_busy,
        optimizer_all_busy=timed.optimizer_all_busy, fsdp=timed.fsdp,
        back_to_back=fit_collectives(timed.back_to_back, ranks),
        between_compute=_fit_between(timed.between_compute, ranks))


def _fit_between(between: BetweenComputeTimes | None,
                 ranks: int) -> BetweenComputeFits | None:
    if between is None:   # on a GPU
        return None
    try:
        fits = fit_collectives(between.samples, ranks)
    except CalibrationError as error:   # the budget keeps the back-to-back fits
        log.warning("collectives between compute: no joint fit: %s", error)
        return None
    return BetweenComputeFits(compute_s=between.compute_s, calls=between.calls, fits=fits)


def _spawn_ranks(ranks: int, backend: str, sizes: Sizes) -> RankTimings:
    """Run :func:`_collective_worker` on ``ranks`` processes; rank 0's timings."""
    with tempfile.TemporaryDirectory(prefix="partc-calibrate-") as folder:
        out = Path(folder) / "timings.pickle"
        log.info("collectives: %d %s processes, %d sizes", ranks, backend,
                 len(sizes.message_bytes))
        try:
            mp.spawn(_collective_worker, nprocs=ranks, join=True,
                     args=(ranks, str(Path(folder) / "store"), backend, sizes, str(out)))
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as error:
            # A rank past the last barrier (its marker, ``_collective_worker``) proves
            # every rank measured everything and rank 0 wrote it: a rank killed after
            # that (gloo's threads can abort at interpreter exit) leaves the figures whole.
            if not (out.exists() and any(Path(folder).glob(f"{DONE_MARKER}*"))):
                raise CalibrationError(f"the {backend} collective measurement failed: "
                                       f"{error}") from None
            log.warning("collectives: a rank ended abnormally after the measurements were "
                        "done (%s); the figures stand", error)
        return pickle.loads(out.read_bytes())


def _collective_worker(rank: int, ranks: int, store: str, backend: str, sizes: Sizes,
                       out: str) -> None:
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=dist.FileStore(store, ranks), rank=rank,
                            world_size=ranks, timeout=timedelta(minutes=5))
    try:
        _measure_on_rank(rank, ranks, device, sizes, out)
    finally:
        # The measurement's groups (FSDP's mesh) went with its frame: leaving joins their
        # gloo threads before the interpreter shuts down, where one still finishing its
        # last collective could abort the rank.
        topology.leave()


def _measure_on_rank(rank: int, ranks: int, device: torch.device, sizes: Sizes,
                     out: str) -> None:
    """What :func:`_collective_worker` measures on rank ``rank``, rank 0 writing it to
    ``out``; each rank past the last barrier leaves its marker."""
    # On a CPU each collective again as a step meets it (:class:`BetweenCompute`).
    between = BetweenCompute(device, sizes) if device.type == "cpu" else None
    back_to_back = _time_collectives(rank, ranks, device, sizes, between)
    overlap = _overlap(ranks, device, sizes)
    dist.barrier()   # every rank computes at once, as in training
    busy = replace(sizes, min_sample_s=max(sizes.min_sample_s, BUSY_SAMPLE_S))
    timed = RankTimings(
        back_to_back=back_to_back,
        between_compute=between.times() if between is not None else None,
        overlap=overlap,
        linear_all_busy=measure_linear(device, ("float32", "bfloat16"), busy),
        elementwise_all_busy=measure_elementwise(device, busy,
                                                 measure_op_overhead(device, busy)),
        optimizer_all_busy=measure_optimizer(device, busy),
        fsdp=measure_fsdp(device, sizes) if device.type == "cpu" else None)
    if rank == 0:
        Path(out).write_bytes(pickle.dumps(timed))
    dist.barrier()
    # Every rank is past the barrier, so rank 0 has written everything.
    Path(out).with_name(f"{DONE_MARKER}{rank}").touch()


def _time_collectives(rank: int, ranks: int, device: torch.device, sizes: Sizes,
                      between: BetweenCompute | None) -> dict[str, tuple[CollectiveSample, ...]]:
    """Each collective on each message size, back to back (and, given ``between``, again
    between compute, recorded there)."""
    timed = {kind: [] for kind in COLLECTIVES}
    for nbytes in sizes.message_bytes:
        numel = max(ranks, nbytes // 4 // ranks * ranks)
        for kind in COLLECTIVES:
            op = _collective(kind, numel, rank, ranks, device)
            # A ping-pong call is a round trip: two messages.
            messages = 2 if kind == "send_recv" else 1
            seconds = slowest_rank_seconds(op, device, sizes) / messages
            timed[kind].append(CollectiveSample(nbytes=numel * 4, seconds=seconds))
            if between is not None:
                between.record(kind, numel * 4, op, messages)
    return {kind: tuple(samples) for kind, samples in timed.items()}


class BetweenCompute:
    """Collectives timed as a training step meets them: every call after
    ``BETWEEN_COMPUTE_S`` of compute (a linear layer and a GELU), timed alone by wall
    clock from the call to its end on each rank, waits for the other ranks included.

    Back to back, gloo's threads stay awake and the ranks arrive together; inside a step
    they are woken after each burst of compute and the ranks arrive apart by the noise in
    it. On a 2-core machine an all-reduce of 768 KiB measured 0.6-1.0 ms back to back and
    1.5-3 ms between compute, the time the tensor-parallel runtime's all-reduces took.
    A figure is the slowest rank's mean over the calls (a step pays every call, its
    slow ones included)."""

    def __init__(self, device: torch.device, sizes: Sizes) -> None:
        tokens, d_in, d_out = sizes.linear[0]
        a = torch.randn(tokens, d_in, device=device)
        b = torch.randn(d_in, d_out, device=device)
        self.unit = lambda: F.gelu(a @ b)
        self.unit_s = median_seconds(self.unit, device, sizes)
        self.units = max(1, round(BETWEEN_COMPUTE_S / max(self.unit_s, 1e-9)))
        self.calls, self.device, self.sizes = 4 * sizes.repeats, device, sizes
        self.samples: dict[str, list[CollectiveSample]] = {kind: [] for kind in COLLECTIVES}

    def record(self, kind: str, nbytes: int, op: Callable[[], object], messages: int) -> None:
        """Time ``op``, a ``kind`` collective of ``nbytes`` making ``messages`` messages."""
        seconds = self.seconds(op) / messages
        self.samples[kind].append(CollectiveSample(nbytes=nbytes, seconds=seconds))

    def seconds(self, op: Callable[[], object]) -> float:
        for _ in range(self.sizes.warmup):
            op()
        dist.barrier()
        total = 0.0
        for _ in range(self.calls):
            for _ in range(self.units):
                self.unit()
            start = time.perf_counter()
            op()
            total += time.perf_counter() - start
        return slowest(total / self.calls, self.device)

    def times(self) -> BetweenComputeTimes:
        return BetweenComputeTimes(compute_s=self.units * self.unit_s, calls=self.calls,
                                   samples={kind: tuple(samples)
                                            for kind, samples in self.samples.items()})


def _overlap(ranks: int, device: torch.device, sizes: Sizes) -> Overlap:
    """How much of an all-reduce compute running beside it hides: the all-reduce alone
    (``T_a``), matmuls of about as long alone (``T_c``), and the all-reduce started
    asynchronously with the matmuls run while it goes (``T_b``), each the slowest rank's
    median. ``overlap = (T_a + T_c - T_b) / min(T_a, T_c)``, clamped to [0, 1]: 1 when
    they run side by side, 0 when they take turns (gloo's threads on cores the ranks'
    compute fills)."""
    numel = max(ranks, min(sizes.message_bytes[-1], 16 * 2**20) // 4 // ranks * ranks)
    whole = torch.zeros(numel, device=device)
    tokens, d_in, d_out = sizes.linear[0]
    a = torch.randn(tokens, d_in, device=device)
    b = torch.randn(d_in, d_out, device=device)
    all_reduce_s = slowest_rank_seconds(lambda: dist.all_reduce(whole), device, sizes)
    one = slowest(median_seconds(lambda: a @ b, device, sizes), device)
    calls = max(1, round(all_reduce_s / one))

    def compute() -> None:
        for _ in range(calls):
            a @ b

    def both() -> None:
        work = dist.all_reduce(whole, async_op=True)
        compute()
        work.wait()

    compute_s = slowest_rank_seconds(compute, device, sizes)
    both_s = slowest_rank_seconds(both, device, sizes)
    return Overlap(nbytes=numel * 4, all_reduce_s=all_reduce_s, compute_s=compute_s,
                   both_s=both_s)


def _collective(kind: str, numel: int, rank: int, ranks: int, device: torch.device):
    """A closure running one ``kind`` collective on ``numel`` float32 elements."""
    whole = torch.zeros(numel, device=device)
    part = torch.zeros(numel // ranks, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(whole)
    if kind == "all_gather":
        return lambda: ALL_GATHER_SINGLE(whole, part)
    if kind == "reduce_scatter":
        return lambda: REDUCE_SCATTER_SINGLE(part, whole)
    # send/recv: ranks 0 and 1 play ping-pong, the others wait.
    if rank > 1:
        return lambda: None
    peer = 1 - rank

    def ping_pong():
        if rank == 0:
            dist.send(whole, peer)
            dist.recv(whole, peer)
        else:
            dist.recv(whole, peer)
            dist.send(whole, peer)
    return ping_pong
