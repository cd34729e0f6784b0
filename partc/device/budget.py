"""DeviceBudget: how many devices, of what kind, with how much memory, how connected.

Presets carry the vendor's dense peak FLOP/s per dtype, memory, HBM bandwidth and the
usual node shape; every field can be overridden. Bandwidths are per device and per
direction (NVLink 4 on H100: 900 GB/s bidirectional = 450 GB/s each way; one 400 Gb/s NIC
per GPU = 50 GB/s). ``flops_efficiency`` is the fraction of peak that large matmuls reach
in practice; the presets guess it.

A device profile written by ``partc calibrate`` replaces the guesses with what was
measured on the machine (``DeviceBudget(num_devices=8, profile="profile.json")``). Each
number is taken from the first of: the field given to DeviceBudget, the profile, the
preset the profile names (or ``device``). ``docs/calibrate.md`` describes the file.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from partc.device.presets import (DEFAULT_DEVICE, OVERHEAD_FIELDS, PRESETS, RATE_FIELDS, DevicePreset,
                      preset)
from partc.units import format_bytes, parse_bytes, parse_rate

def dtype_key(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16",
            torch.float16: "float16"}.get(dtype, str(dtype).removeprefix("torch."))


# ------------------------------------------------------------------------ device profiles

PROFILE_SCHEMA = "partc-device-profile"
PROFILE_VERSION = 1
# Numbers one machine may be unable to measure (a single GPU has no link; no machine sees
# the network between nodes): the profile holds null and the preset or the user fills in.
_OPTIONAL_NUMBERS = ("intra_node_bandwidth", "inter_node_bandwidth", "link_latency_s",
                     "intra_node_latency_s", "memory")
_REQUIRED_NUMBERS = ("flops_efficiency", "hbm_bandwidth", "devices_per_node")


class ProfileError(ValueError):
    """A device profile that cannot be used; the message says which file and what to do."""


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """The ``budget`` section of a profile file: the numbers DeviceBudget needs."""

    path: str
    name: str
    preset: str | None
    peak_flops: dict[str, float]
    flops_efficiency: float
    flops_efficiency_by_dtype: dict[str, float]
    memory: int | None
    hbm_bandwidth: float
    devices_per_node: int
    intra_node_bandwidth: float | None
    inter_node_bandwidth: float | None
    link_latency_s: float | None
    intra_node_latency_s: float | None = None
    # Each collective kind's own fit inside a node: (kind, latency per step, bandwidth),
    # kinds as partc.cost.collectives names them ("send" for send/recv).
    collective_links: tuple[tuple[str, float, float], ...] = ()
    op_overhead_s: float | None = None
    op_overhead_backward_s: float | None = None
    matmul_overhead_s: float | None = None
    kernel_overhead_s: float | None = None
    comm_overlap: float | None = None
    split_backward_factor: float | None = None
    elementwise_bandwidth: float | None = None
    optimizer_bandwidth: float | None = None
    fsdp_unit_overhead_s: float | None = None
    fsdp_unit_overhead_backward_s: float | None = None
    fsdp_gather_overhead_s: float | None = None
    fsdp_scatter_overhead_s: float | None = None
    fsdp_step_overhead_s: float | None = None
    fsdp_copy_bandwidth: float | None = None


# Calibration's collective names -> the cost model's.
_COLLECTIVE_KINDS = {"all_reduce": "all_reduce", "all_gather": "all_gather",
                     "reduce_scatter": "reduce_scatter", "send_recv": "send"}
# Measured numbers resolved like the overheads (given, else the profile's, else the
# preset's): the overheads and the share of a collective compute hides.
_MEASURED = OVERHEAD_FIELDS + ("comm_overlap", "split_backward_factor")
# The rates (RATE_FIELDS) are resolved the same way, None where neither knows them.


def load_profile(path) -> DeviceProfile:
    """Read and check a profile written by ``partc calibrate``."""
    file = Path(path)
    redo = f"write one with `partc calibrate --out {file}`"
    if not file.is_file():
        raise ProfileError(f"no device profile at {file}; {redo}")
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ProfileError(f"cannot read device profile {file}: {error}") from None
    if not isinstance(data, dict) or data.get("schema") != PROFILE_SCHEMA:
        raise ProfileError(f"{file} is not a partc device profile (no \"schema\": "
                           f"\"{PROFILE_SCHEMA}\"); {redo}")
    if data.get("schema_version") != PROFILE_VERSION:
        raise ProfileError(f"{file} has profile schema version {data.get('schema_version')!r}; "
                           f"this partc reads version {PROFILE_VERSION}: {redo}")
    return _profile_from_dict(data, str(file))


def _profile_from_dict(data: dict, where: str) -> DeviceProfile:
    budget, device = data.get("budget"), data.get("device")
    if not isinstance(budget, dict) or not isinstance(device, dict):
        raise ProfileError(f"{where} has no 'budget' or 'device' section")

    def number(key: str, optional: bool = False) -> float | None:
        if key not in budget:
            raise ProfileError(f"{where} has no budget.{key}; re-run partc calibrate, "
                               f"or edit the file")
        value = budget[key]
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value <= 0:
            raise ProfileError(f"{where}: budget.{key} must be a positive number (and "
                               f"finite), got {value!r}")
        return float(value)

    def table(key: str) -> dict[str, float]:
        value = budget.get(key)
        if not isinstance(value, dict) or not value:
            raise ProfileError(f"{where} has no budget.{key} table (dtype -> number)")
        for dtype, entry in value.items():
            if isinstance(entry, bool) or not isinstance(entry, (int, float)) \
                    or not math.isfinite(entry) or entry <= 0:
                raise ProfileError(f"{where}: budget.{key}.{dtype} must be a positive number "
                                   f"(and finite), got {entry!r}")
        return {dtype: float(entry) for dtype, entry in value.items()}

    def measured(key: str, low: float, high: float, expected: str) -> float | None:
        """Written since profiles measure it; absent (an older profile) or null: None."""
        value = budget.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not low <= value <= high:   # NaN fails the comparison
            raise ProfileError(f"{where}: budget.{key} must be {expected}, got {value!r}")
        return float(value)

    def overhead(key: str) -> float | None:
        return measured(key, 0.0, math.inf, "a number of seconds, 0 or more")

    required = {key: number(key) for key in _REQUIRED_NUMBERS}
    optional = {key: number(key, optional=True) for key in _OPTIONAL_NUMBERS}
    if required["flops_efficiency"] > 1:
        raise ProfileError(f"{where}: budget.flops_efficiency must be in (0, 1]")
    known = device.get("preset")
    if known is not None and known not in PRESETS:
        raise ProfileError(f"{where}: device.preset {known!r} is not one of {', '.join(PRESETS)}")
    return DeviceProfile(
        path=where, name=str(device.get("name") or "unnamed device"), preset=known,
        peak_flops=table("peak_flops"),
        flops_efficiency_by_dtype=table("flops_efficiency_by_dtype"),
        flops_efficiency=required["flops_efficiency"],
        hbm_bandwidth=required["hbm_bandwidth"],
        devices_per_node=int(required["devices_per_node"]),
        memory=None if optional["memory"] is None else int(optional["memory"]),
        intra_node_bandwidth=optional["intra_node_bandwidth"],
        inter_node_bandwidth=optional["inter_node_bandwidth"],
        link_latency_s=optional["link_latency_s"],
        intra_node_latency_s=optional["intra_node_latency_s"],
        collective_links=_collective_links(data, where),
        **{key: overhead(key) for key in OVERHEAD_FIELDS},
        comm_overlap=measured("comm_overlap", 0.0, 1.0, "a number in [0, 1]"),
        split_backward_factor=measured("split_backward_factor", 1.0, math.inf,
                                       "a number of at least 1"),
        **{key: None if budget.get(key) is None else number(key) for key in RATE_FIELDS})


def step_links(collectives: dict) -> dict:
    """The fits of a profile's collective measurements that price a step: on a CPU those
    timed between compute (``partc.calibrate.run``), where they were fitted; else the
    back-to-back ones."""
    return collectives.get("between_compute") or collectives


def _collective_links(data: dict, where: str) -> tuple[tuple[str, float, float], ...]:
    """Each collective's own fit: ``budget.collective_links`` (kind -> {latency_s,
    bandwidth}), or in a profile written before it, the fits among the measurements
    (those timed between compute where there are any, as calibrate chooses). A kind
    without a fit (noise hid its growth with size) is left to the joint fit."""
    links = data["budget"].get("collective_links")
    if links is None:
        measured = step_links((data.get("measurements") or {}).get("collectives") or {})
        links = {kind: (measured.get(kind) or {}).get("fit") for kind in _COLLECTIVE_KINDS}
    if not isinstance(links, dict):
        raise ProfileError(f"{where}: budget.collective_links must map a collective to "
                           f"its fit, got {links!r}")
    found = []
    for kind, fit in links.items():
        if fit is None:
            continue
        if kind not in _COLLECTIVE_KINDS or not isinstance(fit, dict):
            raise ProfileError(f"{where}: collective fit {kind!r}: {fit!r}; kinds are "
                               f"{', '.join(_COLLECTIVE_KINDS)}, each {{latency_s, bandwidth}}")
        latency, bandwidth = fit.get("latency_s"), fit.get("bandwidth")
        for name, value in (("latency_s", latency), ("bandwidth", bandwidth)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0 \
                    or name == "bandwidth" and value == 0:
                raise ProfileError(f"{where}: collective fit {kind}.{name} must be a "
                                   f"{'positive' if name == 'bandwidth' else 'non-negative'}"
                                   f" finite number, got {value!r}")
        found.append((_COLLECTIVE_KINDS[kind], float(latency), float(bandwidth)))
    return tuple(sorted(found))


# ---------------------------------------------------------------------------- the budget

# Every check names the field, the value and what is allowed: a bad number fails here, not
# as a ZeroDivisionError or an overflow deep in the cost model.


def _check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"DeviceBudget.{name} must be a positive int, got {value!r}")


def _check_fraction(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 < value <= 1:  # NaN fails the comparison
        raise ValueError(f"DeviceBudget.{name} must be a number in (0, 1], got {value!r}")


def _check_share(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 <= value <= 1:
        raise ValueError(f"DeviceBudget.{name} must be a number in [0, 1], got {value!r}")


def _check_latency(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"DeviceBudget.{name} must be a finite number of seconds, 0 or "
                         f"more, got {value!r}")


def _check_amount(name: str, value, parse, example: str | None = None) -> float:
    """A size or rate: parses (finite, not negative) and, given ``example``, is above 0."""
    try:
        amount = parse(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"DeviceBudget.{name}: {error}") from None
    if example is not None and amount <= 0:
        raise ValueError(f"DeviceBudget.{name} must be above 0 ({example}), got {value!r}")
    return amount


# A rank's write rate to a checkpoint directory when the budget names none: a local
# NVMe drive, or a parallel file system's share per rank, are of this order.
DEFAULT_DISK_BANDWIDTH = "2GB/s"


@dataclass(frozen=True, kw_only=True)
class DeviceBudget:
    """The devices a job may use. ``memory`` may be one size or one per device.

    ``device`` names a preset (default H100-80GB, or the preset a ``profile`` names);
    ``profile`` is a file written by ``partc calibrate`` (or a loaded DeviceProfile).
    """

    num_devices: int
    device: str | None = None
    profile: str | os.PathLike | DeviceProfile | None = None
    memory: int | str | tuple[int | str, ...] | list[int | str] | None = None
    peak_flops: dict[str, float] | float | None = None
    flops_efficiency: float | None = None
    hbm_bandwidth: float | str | None = None
    devices_per_node: int | None = None
    intra_node_bandwidth: float | str | None = None
    inter_node_bandwidth: float | str | None = None
    link_latency_s: float | None = None
    intra_node_latency_s: float | None = None
    # Each rank's write rate to the checkpoint directory: the plan's report divides a
    # rank's checkpoint bytes by it (the predicted save time, for a grace period).
    disk_bandwidth: float | str | None = None
    # Per collective kind inside a node, {kind: {"latency_s": ..., "bandwidth": ...}}
    # (kinds of partc.cost.collectives.KINDS); and the fixed overheads per op and per matmul
    # (partc.problem.DeviceNumbers). By default the profile's, else the preset's.
    collective_links: dict[str, dict[str, float]] | None = None
    op_overhead_s: float | None = None
    op_overhead_backward_s: float | None = None
    matmul_overhead_s: float | None = None
    # Device time per kernel (DeviceNumbers.kernel_overhead_s): the profile's, else the
    # preset's.
    kernel_overhead_s: float | None = None
    # FSDP2's own work per unit and microbatch under ZeRO-2/3 (DeviceNumbers.
    # fsdp_unit_overhead_s, ...): by default the profile's, else the preset's.
    fsdp_unit_overhead_s: float | None = None
    fsdp_unit_overhead_backward_s: float | None = None
    fsdp_gather_overhead_s: float | None = None
    fsdp_scatter_overhead_s: float | None = None
    fsdp_step_overhead_s: float | None = None
    # The rate FSDP copies a unit's weights and gradients in and out of its collectives
    # at (DeviceNumbers.fsdp_copy_bandwidth): the profile's, else hbm_bandwidth.
    fsdp_copy_bandwidth: float | str | None = None
    # The share of a collective's time that compute beside it hides (DeviceNumbers.
    # comm_overlap): by default the profile's, else the preset's.
    comm_overlap: float | None = None
    # A backward run as input then weight gradients over one pass
    # (DeviceNumbers.split_backward_factor): by default the profile's, else the preset's.
    split_backward_factor: float | None = None
    # The rates memory-bound ops and the optimizer step move their bytes at
    # (DeviceNumbers.elementwise_bandwidth, optimizer_bandwidth): by default the
    # profile's, else the preset's, else hbm_bandwidth.
    elementwise_bandwidth: float | str | None = None
    optimizer_bandwidth: float | str | None = None
    # The share of peak fused attention kernels reach (DeviceNumbers.
    # attention_efficiency): by default the preset's; None there: flops_efficiency.
    attention_efficiency: float | None = None
    _preset: DevicePreset | None = field(init=False, repr=False, compare=False)
    _profile: DeviceProfile | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_count("num_devices", self.num_devices)
        if self.devices_per_node is not None:
            _check_count("devices_per_node", self.devices_per_node)
        self._resolve_device()
        for size in self._memory_fields():
            if _check_amount("memory", size, parse_bytes) <= 0:
                raise ValueError(f"every device needs a positive memory size: "
                                 f"DeviceBudget.memory got {size!r} (write e.g. '80GiB')")
        self._check_flops()
        # Every number resolves now, so a gap in a profile fails here and not in the planner.
        _check_fraction("flops_efficiency", self._pick("flops_efficiency"))
        _check_count("devices_per_node", self._pick("devices_per_node"))
        for name in ("hbm_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth"):
            _check_amount(name, self._pick(name), parse_rate, "a rate like '900GB/s'")
        for name in RATE_FIELDS:
            if getattr(self, name) is not None:
                _check_amount(name, getattr(self, name), parse_rate, "a rate like '8GB/s'")
        _check_amount("disk_bandwidth", DEFAULT_DISK_BANDWIDTH if self.disk_bandwidth is None
                      else self.disk_bandwidth, parse_rate,
                      "a rate like '2GB/s'")
        _check_latency("link_latency_s", self._pick("link_latency_s"))
        if self.intra_node_latency_s is not None:
            _check_latency("intra_node_latency_s", self.intra_node_latency_s)
        for name in OVERHEAD_FIELDS:
            if getattr(self, name) is not None:
                _check_latency(name, getattr(self, name))
        if self.comm_overlap is not None:
            _check_share("comm_overlap", self.comm_overlap)
        if self.attention_efficiency is not None:
            _check_fraction("attention_efficiency", self.attention_efficiency)
        if self.split_backward_factor is not None and (
                isinstance(self.split_backward_factor, bool)
                or not isinstance(self.split_backward_factor, (int, float))
                or not self.split_backward_factor >= 1):
            raise ValueError(f"DeviceBudget.split_backward_factor must be a number of at "
                             f"least 1, got {self.split_backward_factor!r}")
        if self.collective_links is not None:
            self._given_links()

    def _memory_fields(self) -> tuple:
        if isinstance(self.memory, (list, tuple)):
            if len(self.memory) != self.num_devices:
                raise ValueError(f"DeviceBudget.memory: {len(self.memory)} memory sizes "
                                 f"given for {self.num_devices} devices")
            return tuple(self.memory)
        return (self._pick("memory"),)

    def _check_flops(self) -> None:
        if self.peak_flops is None:
            return
        table = self.peak_flops if isinstance(self.peak_flops, dict) else {"": self.peak_flops}
        for dtype, value in table.items():
            name = f"peak_flops[{dtype!r}]" if dtype else "peak_flops"
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value <= 0:
                raise ValueError(f"DeviceBudget.{name} must be a finite number of FLOP/s "
                                 f"above 0, got {value!r}")

    def _resolve_device(self) -> None:
        profile = self.profile
        if profile is not None and not isinstance(profile, DeviceProfile):
            profile = load_profile(profile)
        device = self.device
        if profile is not None and profile.preset is not None:
            if device is not None and preset(device).name != profile.preset:
                raise ValueError(f"device={device!r} but profile {profile.path} was measured "
                                 f"on {profile.name} (preset {profile.preset}); drop device=")
            device = profile.preset
        if device is None and profile is None:
            device = DEFAULT_DEVICE
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "_profile", profile)
        object.__setattr__(self, "_preset", None if device is None else preset(device))

    @property
    def memory_bytes(self) -> tuple[int, ...]:
        sizes = tuple(parse_bytes(m) for m in self._memory_fields())
        return sizes if len(sizes) == self.num_devices else sizes * self.num_devices

    def peak_flops_for(self, dtype: torch.dtype) -> float:
        if isinstance(self.peak_flops, (int, float)):
            return float(self.peak_flops)
        # A profile's table replaces the preset's: a measured device has no vendor figures
        # for the dtypes it was not measured in.
        base = self._profile.peak_flops if self._profile else self._preset.peak_flops
        table = {**base, **(self.peak_flops or {})}
        key = dtype_key(dtype)
        if key not in table:
            raise ValueError(f"device {self.name} has no peak FLOP/s for {key}; "
                             f"pass peak_flops={{'{key}': ...}}")
        return table[key]

    def efficiency_for(self, dtype: torch.dtype) -> float:
        """The fraction of ``peak_flops_for(dtype)`` that matmuls reach in this dtype."""
        if self.flops_efficiency is None and self._profile is not None:
            by_dtype = self._profile.flops_efficiency_by_dtype
            if dtype_key(dtype) in by_dtype:
                return by_dtype[dtype_key(dtype)]
        return self.efficiency

    def _pick(self, name: str):
        value = getattr(self, name)
        if value is not None:
            return value
        if self._profile is not None and getattr(self._profile, name) is not None:
            return getattr(self._profile, name)
        if self._preset is not None:
            return getattr(self._preset, name)
        raise ValueError(f"profile {self._profile.path} has no {name} (not measured) and "
                         f"names no preset; pass {name}=... to DeviceBudget")

    @property
    def device_type(self) -> str:
        """The torch device type the runtime runs on: "cpu" for the CPU preset (or a profile
        measured on a CPU, which names it), "cuda" for the GPUs."""
        return self._preset.device_type if self._preset is not None else "cuda"

    @property
    def name(self) -> str:
        """The device: the profile's (as the driver names it) or the preset's."""
        return self._profile.name if self._profile is not None else self._preset.name

    @property
    def efficiency(self) -> float:
        return self._pick("flops_efficiency")

    @property
    def attention_share(self) -> float | None:
        """The share of peak fused attention kernels reach: the field given, else the
        preset's; None (the matmuls' ``flops_efficiency``) where neither gives one."""
        if self.attention_efficiency is not None:
            return float(self.attention_efficiency)
        return self._preset.attention_efficiency if self._preset is not None else None

    @property
    def hbm_bytes_per_s(self) -> float:
        return parse_rate(self._pick("hbm_bandwidth"))

    @property
    def node_size(self) -> int:
        return self._pick("devices_per_node")

    @property
    def intra_node_bytes_per_s(self) -> float:
        return parse_rate(self._pick("intra_node_bandwidth"))

    @property
    def inter_node_bytes_per_s(self) -> float:
        return parse_rate(self._pick("inter_node_bandwidth"))

    @property
    def disk_bytes_per_s(self) -> float:
        """Checkpoint write rate per rank: ``disk_bandwidth``, else DEFAULT_DISK_BANDWIDTH."""
        return parse_rate(self.disk_bandwidth if self.disk_bandwidth is not None
                          else DEFAULT_DISK_BANDWIDTH)

    @property
    def latency_s(self) -> float:
        """Per collective step between nodes."""
        return self._pick("link_latency_s")

    @property
    def intra_latency_s(self) -> float:
        """Per collective step inside a node (NVLink); where neither the profile nor a
        preset knows it, the one latency there is."""
        try:
            return self._pick("intra_node_latency_s")
        except ValueError:
            return self.latency_s

    def _given_links(self) -> tuple[tuple[str, float, float], ...]:
        from partc.cost.collectives import KINDS

        found = []
        for kind, fit in self.collective_links.items():
            if kind not in KINDS or not isinstance(fit, dict) \
                    or set(fit) != {"latency_s", "bandwidth"}:
                raise ValueError(f"DeviceBudget.collective_links[{kind!r}] must be "
                                 f"{{'latency_s': ..., 'bandwidth': ...}} for a kind of "
                                 f"{KINDS}, got {fit!r}")
            _check_latency(f"collective_links[{kind!r}].latency_s", fit["latency_s"])
            bandwidth = _check_amount(f"collective_links[{kind!r}].bandwidth",
                                      fit["bandwidth"], parse_rate, "a rate")
            if isinstance(fit["bandwidth"], (int, float)):
                bandwidth = fit["bandwidth"]   # as fitted: a profile's and a plan's agree
            found.append((kind, float(fit["latency_s"]), float(bandwidth)))
        return tuple(sorted(found))

    @property
    def link_numbers(self) -> tuple[tuple[str, float, float], ...]:
        """Inside a node, each collective kind's own (kind, latency per step, bandwidth):
        ``collective_links`` where given, else the profile's per-collective fits; none
        where a link number was given to DeviceBudget (it then prices every kind)."""
        if self.collective_links is not None:
            return self._given_links()
        if self._profile is None or self.intra_node_bandwidth is not None \
                or self.intra_node_latency_s is not None:
            return ()
        return self._profile.collective_links

    def overhead(self, name: str) -> float:
        """``op_overhead_s``, ``op_overhead_backward_s``, ``matmul_overhead_s``,
        ``kernel_overhead_s``, the
        ``fsdp_*_overhead_s``, or
        ``comm_overlap`` or ``split_backward_factor``: the field given, else the
        profile's where it measured it, else the preset's (without a preset: 0, a whole
        overlap and a factor of 1, as for a GPU)."""
        if name not in _MEASURED:
            raise ValueError(f"no overhead {name!r}; one of {_MEASURED}")
        if getattr(self, name) is not None:
            return float(getattr(self, name))
        if self._profile is not None and getattr(self._profile, name) is not None:
            return getattr(self._profile, name)
        if self._preset is not None:
            return getattr(self._preset, name)
        return 1.0 if name in ("comm_overlap", "split_backward_factor") else 0.0

    def rate(self, name: str) -> float | None:
        """``elementwise_bandwidth``, ``optimizer_bandwidth`` or ``fsdp_copy_bandwidth``
        in bytes per second: the
        field given, else the profile's, else the preset's; None where none knows it (the
        cost model then uses ``hbm_bandwidth``)."""
        if name not in RATE_FIELDS:
            raise ValueError(f"no rate {name!r}; one of {RATE_FIELDS}")
        for source in (self, self._profile, self._preset):
            value = getattr(source, name, None) if source is not None else None
            if value is not None:
                return parse_rate(value)
        return None

    def to_dict(self, dtype: torch.dtype = torch.float32) -> dict:
        memory = self.memory_bytes
        data = {
            "device": self.name,
            "num_devices": self.num_devices,
            "memory_bytes": memory[0] if len(set(memory)) == 1 else list(memory),
            "memory": format_bytes(min(memory)),
            "peak_flops": self.peak_flops_for(dtype),
            "flops_efficiency": self.efficiency_for(dtype),
            "hbm_bandwidth": self.hbm_bytes_per_s,
            "devices_per_node": self.node_size,
            "intra_node_bandwidth": self.intra_node_bytes_per_s,
            "inter_node_bandwidth": self.inter_node_bytes_per_s,
            "link_latency_s": self.latency_s,
            "intra_node_latency_s": self.intra_latency_s,
            "collective_links": {kind: {"latency_s": latency, "bandwidth": bandwidth}
                                 for kind, latency, bandwidth in self.link_numbers} or None,
            **{name: self.overhead(name) for name in _MEASURED},
            **{name: self.rate(name) for name in RATE_FIELDS},
            "attention_efficiency": self.attention_share,
        }
        if self.disk_bandwidth is not None:  # else plans record none and use the default
            data["disk_bandwidth"] = self.disk_bytes_per_s
        if self._profile is not None:
            # Fields given to DeviceBudget still win over the profile's numbers.
            data.update(source="profile", profile=self._profile.path,
                        preset=self._preset.name if self._preset else None)
        return data
