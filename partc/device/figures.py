"""DeviceFigures: every number partc knows about a device, declared once.

A figure is a field of :class:`DeviceFigures` whose metadata says its unit, its help
text, its command-line flag and what it is when nobody knows it (:func:`figure`). Every
holder of device numbers holds one: a preset (the vendor's figures and partc's
measurements, :mod:`partc.device.presets`), a device profile (what ``partc calibrate``
measured, ``None`` for the rest), the user's overrides and the budget that resolves
them (:class:`partc.device.budget.DeviceBudget`), the plan that records them
(``partc.plan.BudgetInfo``). :func:`resolve` merges them field by field, the first that
knows a figure winning; the command line builds its flags from the same metadata
(``partc.cli.main``); the planner's ``partc.problem.DeviceNumbers`` takes the resolved
figures by name.

Units are SI: bytes, bytes per second, seconds, FLOP/s. Bandwidths are per device and
per direction (NVLink 4 on H100: 900 GB/s bidirectional = 450 GB/s each way; one 400 Gb/s
NIC per GPU = 50 GB/s). Torch-free, so that the command line can build its flags before
it imports torch.

A new figure is one field here, its values in the presets (or its ``unset`` value), and
the cost model's use of it: the budget, the profile, the plan, the flags and the
planner's numbers follow from the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

from partc.units import parse_bytes, parse_rate


# ------------------------------------------------------------------------------- units

@dataclass(frozen=True)
class Unit:
    """How a figure is written and checked: its name, the command line's placeholder,
    what values are allowed (in words, for messages), and ``read``, which turns a value a
    user wrote (a number, or a string like "900GB/s") into the figure's value or raises
    a ValueError naming ``where`` (the field), the value and what is allowed."""

    name: str
    metavar: str
    allowed: str
    read: Callable[[Any, str], Any]


def _number(value: Any, where: str, allowed: Callable[[float], bool], words: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or not allowed(value):
        raise ValueError(f"{where} must be {words}, got {value!r}")
    return float(value)


def _amount(value: Any, where: str, parse: Callable[[Any], float], example: str) -> float:
    """A size or rate: parses (finite, not negative) and is above 0."""
    try:
        amount = parse(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None
    if amount <= 0:
        raise ValueError(f"{where} must be above 0 ({example}), got {value!r}")
    return amount


def _memory(value: Any, where: str) -> int:
    try:
        size = parse_bytes(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None
    if size <= 0:
        raise ValueError(f"every device needs a positive memory size: {where} got "
                         f"{value!r} (write e.g. '80GiB')")
    return size


def _reserve(value: Any, where: str) -> int:
    """A size held back from a device's memory: 0 or more bytes."""
    try:
        size = parse_bytes(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None
    if size < 0:
        raise ValueError(f"{where} must be 0 or more bytes (e.g. '512MiB'), got {value!r}")
    return size


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where} must be a positive int, got {value!r}")
    return value


def _flops(value: Any, where: str) -> float | dict[str, float]:
    """One FLOP/s for every dtype, or a table dtype name -> FLOP/s."""
    table = value if isinstance(value, dict) else {"": value}
    for dtype, entry in table.items():
        name = f"{where}[{dtype!r}]" if dtype else where
        _number(entry, name, lambda x: x > 0, "a finite number of FLOP/s above 0")
    if isinstance(value, dict):
        return {dtype: float(entry) for dtype, entry in value.items()}
    return float(value)


def _links(value: Any, where: str) -> tuple[tuple[str, float, float], ...]:
    """``{kind: {"latency_s": ..., "bandwidth": ...}}`` as sorted (kind, latency,
    bandwidth); a tuple of those is read as itself."""
    # A cycle: partc.cost.collectives reads partc.problem, which checks its numbers here.
    from partc.cost.collectives import KINDS

    if isinstance(value, tuple):
        value = {kind: {"latency_s": latency, "bandwidth": bandwidth}
                 for kind, latency, bandwidth in value}
    if not isinstance(value, dict):
        raise ValueError(f"{where} must map collective kinds of {KINDS} to "
                         f"{{'latency_s': ..., 'bandwidth': ...}}, got {value!r}")
    found = []
    for kind, fit in value.items():
        if kind not in KINDS or not isinstance(fit, dict) \
                or set(fit) != {"latency_s", "bandwidth"}:
            raise ValueError(f"{where}[{kind!r}] must be {{'latency_s': ..., "
                             f"'bandwidth': ...}} for a kind of {KINDS}, got {fit!r}")
        latency = SECONDS.read(fit["latency_s"], f"{where}[{kind!r}].latency_s")
        bandwidth = _amount(fit["bandwidth"], f"{where}[{kind!r}].bandwidth", parse_rate,
                            "a rate")
        if isinstance(fit["bandwidth"], (int, float)):
            bandwidth = fit["bandwidth"]   # as fitted: a profile's and a plan's agree
        found.append((kind, latency, float(bandwidth)))
    return tuple(sorted(found))


BYTES = Unit("bytes", "SIZE", "a memory size above 0, e.g. '80GiB'", _memory)
RESERVE = Unit("reserved bytes", "SIZE", "a memory size, 0 or more, e.g. '512MiB'",
               _reserve)
COUNT = Unit("count", "N", "a positive int", _count)
FLOPS = Unit("FLOP/s", "TFLOPS", "FLOP/s above 0, one number or a table by dtype", _flops)
SECONDS = Unit("seconds", "SECONDS", "a finite number of seconds, 0 or more",
               lambda value, where: _number(value, where, lambda x: x >= 0,
                                            "a finite number of seconds, 0 or more"))
FRACTION = Unit("fraction", "FRACTION", "a number in (0, 1]",
                lambda value, where: _number(value, where, lambda x: 0 < x <= 1,
                                             "a number in (0, 1]"))
SHARE = Unit("share", "SHARE", "a number in [0, 1]",
             lambda value, where: _number(value, where, lambda x: 0 <= x <= 1,
                                          "a number in [0, 1]"))
FACTOR = Unit("factor", "FACTOR", "a number of at least 1",
              lambda value, where: _number(value, where, lambda x: x >= 1,
                                           "a number of at least 1"))
UPDATES = Unit("updates/s", "RATE", "parameter updates per second above 0",
               lambda value, where: _number(value, where, lambda x: x > 0,
                                            "parameter updates per second above 0"))
LINKS = Unit("links", "KIND=LATENCY,RATE",
             "{kind: {'latency_s': ..., 'bandwidth': ...}} per collective kind", _links)


def rate(example: str) -> Unit:
    """Bytes per second: a number, or a string like ``example``."""
    return Unit("bytes/s", "RATE", f"a rate above 0, like '{example}'",
                lambda value, where: _amount(value, where, parse_rate,
                                             f"a rate like '{example}'"))


# ----------------------------------------------------------------------------- figures

@dataclass(frozen=True, repr=False)   # a marker: no state, as the architecture test asks
class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


# ``unset`` of a figure every device must have: a preset gives it, else the user must.
REQUIRED = _Required()


@dataclass(frozen=True)
class Like:
    """``unset`` of a figure that, unknown, takes another figure's value."""

    figure: str


def figure(unit: Unit, flag: str, help: str, *, unset: Any = REQUIRED) -> Any:
    """A field of DeviceFigures: its unit, its command-line flag and help, and its value
    where no layer of a budget knows it (``REQUIRED``; a value; ``None``, which the cost
    model reads as the fallback the help names; or ``Like(other)``)."""
    return field(default=None, metadata={"unit": unit, "flag": flag, "help": help,
                                         "unset": unset})


@dataclass(frozen=True, kw_only=True)
class DeviceFigures:
    """A device's numbers; ``None``: this holder does not know it (see the module
    docstring). Every field is a :func:`figure`. Their order is the order plan.json has
    written the budget's figures in since version 2 (a plan written back is the same
    text)."""

    memory: int | None = figure(
        BYTES, "--memory", "memory per device as CUDA reports it (the device's total: the "
        "context, NCCL and fragmentation reserves are taken from it), e.g. 40GiB, or one "
        "size per device, comma-separated (default: the preset's)")
    # Dense peak per dtype name ("float32", "bfloat16", ...), or one for every dtype.
    peak_flops: float | dict[str, float] | None = figure(
        FLOPS, "--peak-tflops", "peak TFLOP/s of one device in the training dtype")
    devices_per_node: int | None = figure(COUNT, "--devices-per-node",
                                          "devices per node (default: the preset's)")
    # The fraction of peak large matmuls reach in practice.
    flops_efficiency: float | None = figure(
        FRACTION, "--flops-efficiency", "the fraction of peak large matmuls reach")
    hbm_bandwidth: float | None = figure(rate("900GB/s"), "--hbm-bandwidth", "e.g. 3350GB/s")
    intra_node_bandwidth: float | None = figure(
        rate("900GB/s"), "--intra-node-bandwidth", "per device and direction, e.g. 450GB/s")
    inter_node_bandwidth: float | None = figure(
        rate("900GB/s"), "--inter-node-bandwidth", "per device and direction, e.g. 50GB/s")
    link_latency_s: float | None = figure(
        SECONDS, "--link-latency", "per collective step between nodes, e.g. 8e-6")
    intra_node_latency_s: float | None = figure(
        SECONDS, "--intra-node-latency", "per collective step inside a node",
        unset=Like("link_latency_s"))
    # Each rank's write rate to the checkpoint directory: the report divides a rank's
    # checkpoint bytes by it (the predicted save time). None: DEFAULT_DISK_BANDWIDTH.
    disk_bandwidth: float | None = figure(
        rate("2GB/s"), "--disk-bandwidth", "checkpoint write rate per rank, e.g. 2GB/s "
        "(the report's predicted save time)", unset=None)
    # The checkpoint storage's aggregate write rate, shared by every rank writing at once
    # (a parallel file system's, or a node's local drives' together): a rank writes at
    # the smaller of disk_bandwidth and its share of this. None:
    # DEFAULT_STORAGE_BANDWIDTH.
    storage_bandwidth: float | None = figure(
        rate("100GB/s"), "--storage-bandwidth", "the checkpoint storage's aggregate write "
        "rate, shared by all ranks, e.g. 100GB/s (the report's predicted save time)",
        unset=None)
    # Inside a node, each collective kind's own link where calibration fitted them:
    # (kind, latency per step, bandwidth per link), kinds of partc.cost.collectives.KINDS.
    # A kind not listed takes intra_node_latency_s and intra_node_bandwidth.
    collective_links: tuple[tuple[str, float, float], ...] | None = figure(
        LINKS, "--collective-link", "one collective's own link inside a node (repeatable), "
        "e.g. all_gather=20e-6,5GB/s (default: the profile's fits)", unset=None)
    # Fixed time per op per microbatch (dispatch, kernel launch), forward and backward
    # (per forward op): eager execution pays it whatever the op's size. On a GPU the host
    # dispatches ahead of the kernels (DeviceNumbers.dispatch_ahead), so it is a floor
    # under a layer's time, not added to it.
    op_overhead_s: float | None = figure(
        SECONDS, "--op-overhead", "fixed time per op and microbatch in forward", unset=0.0)
    op_overhead_backward_s: float | None = figure(
        SECONDS, "--op-overhead-backward", "fixed time per forward op in backward",
        unset=0.0)
    # A compute-heavy op of f FLOPs takes f / (peak * flops_efficiency) +
    # matmul_overhead_s: small matmuls run below the rate.
    matmul_overhead_s: float | None = figure(
        SECONDS, "--matmul-overhead", "time per matmul call beyond its FLOPs", unset=0.0)
    # Device time per kernel beyond its bytes and FLOPs (a GPU's launch, ramp-up and
    # tail), paid for each kernel a layer launches (LayerCost.kernels); unlike
    # op_overhead_s the device's own time, which dispatching ahead does not hide. 0 on a
    # CPU, whose per-op time op_overhead_s holds.
    kernel_overhead_s: float | None = figure(
        SECONDS, "--kernel-overhead", "device time per kernel beyond its bytes and FLOPs "
        "(a GPU's launch, ramp-up and tail)", unset=0.0)
    # ZeRO-2/3 as FSDP2 runs it, per unit (a layer) and microbatch, beyond the
    # collectives (partc.cost.collectives prices those): its forward and backward hooks,
    # and its own work around each all-gather (copy-in, copy-out into the unsharded
    # parameters, bookkeeping, freeing them) and reduce-scatter (the gradients in, the
    # shards out). Host work: hidden behind a GPU's kernels, eager dispatch on a CPU.
    fsdp_unit_overhead_s: float | None = figure(
        SECONDS, "--fsdp-unit-overhead",
        "ZeRO-2/3: FSDP's forward hooks per unit and microbatch", unset=0.0)
    fsdp_unit_overhead_backward_s: float | None = figure(
        SECONDS, "--fsdp-unit-overhead-backward",
        "ZeRO-2/3: FSDP's backward hooks per unit and microbatch", unset=0.0)
    fsdp_gather_overhead_s: float | None = figure(
        SECONDS, "--fsdp-gather-overhead", "ZeRO-2/3: FSDP's own work per unit all-gather "
        "beyond the collective (copies in and out, bookkeeping)", unset=0.0)
    fsdp_scatter_overhead_s: float | None = figure(
        SECONDS, "--fsdp-scatter-overhead", "ZeRO-2/3: FSDP's own work per unit gradient "
        "reduce-scatter beyond the collective", unset=0.0)
    # The optimizer step over sharded parameters (DTensors: dispatch per tensor and op)
    # beyond the step over plain tensors, per parameter tensor and step.
    fsdp_step_overhead_s: float | None = figure(
        SECONDS, "--fsdp-step-overhead", "ZeRO-2/3: the optimizer step's excess per "
        "sharded parameter tensor (a DTensor) over the plain step", unset=0.0)
    # A collective of c seconds overlapping compute of t seconds costs c + t -
    # comm_overlap * min(c, t). 1 where the collective has its own engine (NCCL on a GPU);
    # on a CPU whose cores the ranks' compute fills, gloo's threads compete for them.
    comm_overlap: float | None = figure(
        SHARE, "--comm-overlap", "the share (0 to 1) of a collective's time that compute "
        "running beside it hides (default: the profile's, else 1 on GPUs and 0 on CPUs)",
        unset=1.0)
    # A layer's backward as two autograd passes (input, then weight gradients: the
    # zero-bubble schedules) over one pass: autograd walks the graph twice.
    split_backward_factor: float | None = figure(
        FACTOR, "--split-backward-factor", "a backward run as input then weight gradients "
        "(zero-bubble schedules) over one pass (default: the profile's, else 1 on GPUs, "
        "1.25 on CPUs)", unset=1.0)
    # The rate the memory-bound ops (all but the matmuls and attention) move their bytes
    # at, counted as passes/estimate counts them (inputs read, outputs written; backward
    # as measured). None: hbm_bandwidth.
    elementwise_bandwidth: float | None = figure(
        rate("8GB/s"), "--elementwise-bandwidth", "the rate memory-bound ops (all but "
        "matmuls and attention) move their bytes at (default: the profile's, else the HBM "
        "bandwidth)", unset=None)
    # The optimizer step's rate in the bytes the cost model counts for it (gradients and
    # state read, weights and state written once: Precision.step_bytes). None:
    # hbm_bandwidth, a fused step's.
    optimizer_bandwidth: float | None = figure(
        rate("8GB/s"), "--optimizer-bandwidth", "the rate the optimizer step moves the "
        "bytes it touches (default: the profile's, else the HBM bandwidth)", unset=None)
    # The rate FSDP copies bytes into and out of its collectives' buffers. None:
    # hbm_bandwidth, a GPU's copy kernels'.
    fsdp_copy_bandwidth: float | None = figure(
        rate("8GB/s"), "--fsdp-copy-bandwidth", "ZeRO-2/3: the rate FSDP copies weights "
        "and gradients in and out of its collectives at (default: the profile's, else the "
        "HBM bandwidth)", unset=None)
    # The share of peak a fused attention kernel reaches, forward and backward together
    # (HeavyOp.attention). None: flops_efficiency, the matmuls' share.
    attention_efficiency: float | None = figure(
        FRACTION, "--attention-efficiency", "the share of peak fused attention kernels "
        "reach (default: the preset's, else the matmuls' --flops-efficiency)", unset=None)
    # Dense FP8 (e4m3/e5m2) matmul peak, for TrainSpec(fp8=True)'s float8 linears
    # (partc.cost.fp8_pricing). None: the device has no FP8 matmuls (an A100), and an
    # FP8 plan for it is refused; the CPU emulates them (torchao's emulate=True).
    fp8_peak_flops: float | None = figure(
        FLOPS, "--fp8-peak-tflops", "dense FP8 peak TFLOP/s of one device (FP8 linears, "
        "--fp8; default: the preset's, none on devices without FP8 matmuls)", unset=None)
    # The share of that peak FP8 matmuls (torch._scaled_mm) reach. None:
    # flops_efficiency, the training dtype's matmuls' share.
    fp8_efficiency: float | None = figure(
        FRACTION, "--fp8-efficiency", "the share of the FP8 peak FP8 matmuls reach "
        "(default: the preset's, else the matmuls' --flops-efficiency)", unset=None)

    # The host beside the devices, for offload (ZeRO-Offload: optimizer state, master
    # weights and the step on the host; ZeRO-3's parameters too): its memory per node,
    # which offloaded state of all the node's ranks shares; the link each way per device
    # (PCIe: every device has its own); and the rate the node's cores step Adam/AdamW
    # (parameter updates per second, all the node's ranks' steps sharing the cores).
    # None: not known; the planner then offloads nothing unless the user gives them.
    host_memory: int | None = figure(
        BYTES, "--host-memory", "host memory per node that offloaded optimizer state and "
        "weights may use, e.g. 2TB (default: the preset's; none for a custom device)",
        unset=None)
    host_to_device_bandwidth: float | None = figure(
        rate("50GB/s"), "--host-to-device-bandwidth", "per device, host to device (PCIe "
        "Gen5 x16: about 50GB/s), e.g. 25GB/s", unset=None)
    device_to_host_bandwidth: float | None = figure(
        rate("50GB/s"), "--device-to-host-bandwidth", "per device, device to host "
        "(default: --host-to-device-bandwidth)", unset=Like("host_to_device_bandwidth"))
    host_adam_rate: float | None = figure(
        UPDATES, "--host-adam-rate", "Adam/AdamW parameter updates per second of one "
        "node's host cores (default: the profile's, else the preset's)", unset=None)
    # --- what a device's memory holds beside the plan's tensors. ``memory`` is the total
    # CUDA reports (torch.cuda.get_device_properties(i).total_memory, below the vendor's
    # nominal figure); partc.device.usable takes these from it and plans against the rest
    # (the presets' numbers and their sources: partc.device.presets). 0 on a CPU.
    context_memory: int | None = figure(
        RESERVE, "--context-memory", "memory per device the CUDA context and the "
        "libraries' workspaces take beside the plan's tensors, e.g. 512MiB (default: "
        "the preset's)", unset=0)
    communicator_memory: int | None = figure(
        RESERVE, "--communicator-memory", "memory NCCL's buffers take per communicator a "
        "rank joins, e.g. 656MiB (default: the preset's)", unset=0)
    memory_fragmentation: float | None = figure(
        SHARE, "--memory-fragmentation", "the share (0 to 1) of the memory left after the "
        "context and NCCL that the caching allocator loses to fragmentation (default: the "
        "preset's)", unset=0.0)
    # The vendor's figure ("80 GB"), shown beside the others in the report; None: unknown.
    nominal_memory: int | None = figure(
        BYTES, "--nominal-memory", "the device's memory as its vendor names it, for the "
        "report (default: the preset's)", unset=None)

    def __post_init__(self) -> None:
        # Held as read: rates in whole bytes per second (partc.units.parse_rate), times
        # and shares as floats, so that every holder prices alike.
        for spec in FIGURES:
            value = getattr(self, spec.name)
            if value is not None:
                where = f"{type(self).__name__}.{spec.name}"
                object.__setattr__(self, spec.name, unit_of(spec.name).read(value, where))

    def known(self) -> dict[str, Any]:
        """The figures this holder knows, by name."""
        return {spec.name: getattr(self, spec.name) for spec in FIGURES
                if getattr(self, spec.name) is not None}

    def to_dict(self) -> dict[str, Any]:
        """The known figures as JSON data (collective links as kind -> {latency_s,
        bandwidth}), in the form DeviceBudget accepts them."""
        data = self.known()
        if "collective_links" in data:
            data["collective_links"] = {kind: {"latency_s": latency, "bandwidth": bandwidth}
                                        for kind, latency, bandwidth in data["collective_links"]}
        return data


FIGURES = fields(DeviceFigures)
FIGURE_NAMES = frozenset(spec.name for spec in FIGURES)


def unit_of(name: str) -> Unit:
    return DeviceFigures.__dataclass_fields__[name].metadata["unit"]


def read_figures(given: dict[str, Any], owner: str) -> DeviceFigures:
    """Figures as a user wrote them (numbers, or strings like "900GB/s"), each read by its
    unit; a bad one is a ValueError naming ``owner.field``, the value and what is
    allowed."""
    return DeviceFigures(**{name: unit_of(name).read(value, f"{owner}.{name}")
                            for name, value in given.items() if value is not None})


def resolve(*layers: DeviceFigures | None) -> DeviceFigures:
    """Each figure from the first of ``layers`` that knows it, else its ``unset`` value
    (``REQUIRED`` figures that no layer knows stay ``None``: :func:`missing` names them)."""
    known = [layer for layer in layers if layer is not None]
    found = {}
    for spec in FIGURES:
        found[spec.name] = next((getattr(layer, spec.name) for layer in known
                                 if getattr(layer, spec.name) is not None), None)
    for spec in FIGURES:
        unset = spec.metadata["unset"]
        if found[spec.name] is None and unset is not REQUIRED:
            found[spec.name] = found[unset.figure] if isinstance(unset, Like) else unset
    return DeviceFigures(**found)


def missing(figures: DeviceFigures) -> list[str]:
    """The ``REQUIRED`` figures ``figures`` does not know."""
    return [spec.name for spec in FIGURES
            if spec.metadata["unset"] is REQUIRED and getattr(figures, spec.name) is None]


def without(figures: DeviceFigures, *names: str) -> DeviceFigures:
    """``figures`` knowing nothing of ``names``."""
    return replace(figures, **{name: None for name in names})
