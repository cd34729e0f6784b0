"""DeviceBudget: how many devices, of what kind, with how much memory, how connected.

A budget names a preset (:mod:`partc.device.presets`: the vendor's peak FLOP/s per
dtype, memory, HBM bandwidth, the usual node shape and partc's measurements), and every
figure of :class:`partc.device.figures.DeviceFigures` can be overridden by the keyword of
its name. A device profile written by ``partc calibrate`` replaces the guesses with what
was measured on the machine (``DeviceBudget(num_devices=8, profile="profile.json")``).
Each figure is taken from the first of: the field given to DeviceBudget, the profile, the
preset the profile names (or ``device``) — :func:`partc.device.figures.resolve`.
``docs/calibrate.md`` describes the profile file.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, make_dataclass, replace
from pathlib import Path
from typing import Any

import torch

from partc.device.figures import (COUNT, FIGURES, DeviceFigures, missing, read_figures,
                                  resolve, unit_of, without)
from partc.device.presets import DEFAULT_DEVICE, PRESETS, DevicePreset, preset
from partc.units import format_bytes, parse_rate


def dtype_key(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16",
            torch.float16: "float16"}.get(dtype, str(dtype).removeprefix("torch."))


# ------------------------------------------------------------------------ device profiles

PROFILE_SCHEMA = "partc-device-profile"
PROFILE_VERSION = 1
# The file's form (docs/calibrate.md): these it always holds, positive; these it holds as
# null where one machine cannot measure them (a single GPU has no link; no machine sees
# the network between nodes), and the preset or the user fills in. Other figures are
# absent from older profiles, or null where not measured.
_REQUIRED_NUMBERS = ("flops_efficiency", "hbm_bandwidth", "devices_per_node")
_OPTIONAL_NUMBERS = ("intra_node_bandwidth", "inter_node_bandwidth", "link_latency_s",
                     "intra_node_latency_s", "memory")
# What a profile's measured figure may be, by unit (the others: a positive number).
_MEASURED_RANGES = {"seconds": (0.0, math.inf, "a number of seconds, 0 or more"),
                    "share": (0.0, 1.0, "a number in [0, 1]"),
                    "factor": (1.0, math.inf, "a number of at least 1")}


class ProfileError(ValueError):
    """A device profile that cannot be used; the message says which file and what to do."""


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """A profile file as DeviceBudget uses it: the figures measured (``None``: not
    measured), and the matmuls' share of peak in each dtype measured."""

    path: str
    name: str
    preset: str | None
    figures: DeviceFigures
    flops_efficiency_by_dtype: dict[str, float]


# Calibration's collective names -> the cost model's.
_COLLECTIVE_KINDS = {"all_reduce": "all_reduce", "all_gather": "all_gather",
                     "reduce_scatter": "reduce_scatter", "send_recv": "send"}


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
    known = device.get("preset")
    if known is not None and known not in PRESETS:
        raise ProfileError(f"{where}: device.preset {known!r} is not one of {', '.join(PRESETS)}")
    figures = {spec.name: _profile_figure(budget, spec.name, where) for spec in FIGURES
               if spec.name not in ("peak_flops", "collective_links")}
    return DeviceProfile(path=where, name=str(device.get("name") or "unnamed device"),
                         preset=known, figures=DeviceFigures(
                             **figures, peak_flops=_table(budget, "peak_flops", where),
                             collective_links=_collective_links(data, where) or None),
                         flops_efficiency_by_dtype=_table(budget, "flops_efficiency_by_dtype",
                                                          where))


def _positive(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) \
        and math.isfinite(value) and value > 0


def _profile_figure(budget: dict, key: str, where: str) -> Any:
    """``budget[key]`` checked as the file's form says (see _REQUIRED_NUMBERS)."""
    if key in _REQUIRED_NUMBERS + _OPTIONAL_NUMBERS and key not in budget:
        raise ProfileError(f"{where} has no budget.{key}; re-run partc calibrate, "
                           f"or edit the file")
    value = budget.get(key)
    if value is None and key not in _REQUIRED_NUMBERS:
        return None
    unit = unit_of(key).name
    if unit in _MEASURED_RANGES:
        low, high, expected = _MEASURED_RANGES[unit]
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not low <= value <= high:   # NaN fails the comparison
            raise ProfileError(f"{where}: budget.{key} must be {expected}, got {value!r}")
        return float(value)
    if not _positive(value):
        raise ProfileError(f"{where}: budget.{key} must be a positive number (and "
                           f"finite), got {value!r}")
    if unit == "fraction" and value > 1:
        raise ProfileError(f"{where}: budget.{key} must be in (0, 1]")
    return int(value) if unit in ("count", "bytes") else float(value)


def _table(budget: dict, key: str, where: str) -> dict[str, float]:
    value = budget.get(key)
    if not isinstance(value, dict) or not value:
        raise ProfileError(f"{where} has no budget.{key} table (dtype -> number)")
    for dtype, entry in value.items():
        if not _positive(entry):
            raise ProfileError(f"{where}: budget.{key}.{dtype} must be a positive number "
                               f"(and finite), got {entry!r}")
    return {dtype: float(entry) for dtype, entry in value.items()}


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

# A rank's write rate to a checkpoint directory when the budget names none: a local
# NVMe drive, or a parallel file system's share per rank, are of this order.
DEFAULT_DISK_BANDWIDTH = "2GB/s"
# The storage's aggregate write rate when the budget names none: a parallel file system
# of a few dozen storage servers is of this order; every rank writing at once shares it.
DEFAULT_STORAGE_BANDWIDTH = "100GB/s"

# How a user may write each unit's figure to DeviceBudget (its annotations).
_GIVEN_TYPES = {"bytes": "int | str | tuple[int | str, ...] | list[int | str] | None",
                "bytes/s": "float | str | None", "count": "int | None",
                "reserved bytes": "int | str | None",
                "FLOP/s": "dict[str, float] | float | None",
                "links": "dict[str, dict[str, float]] | None"}

# One keyword per figure, None (not given) by default: DeviceBudget's overrides.
FigureOverrides = make_dataclass(
    "FigureOverrides",
    [(spec.name, _GIVEN_TYPES.get(unit_of(spec.name).name, "float | None"),
      field(default=None, metadata=spec.metadata)) for spec in FIGURES],
    frozen=True, kw_only=True)
FigureOverrides.__doc__ = ("Each figure of DeviceFigures as a user may give it to "
                           "DeviceBudget: a number, or a string like '80GiB' or '900GB/s'.")


@dataclass(frozen=True, kw_only=True)
class DeviceBudget(FigureOverrides):
    """The devices a job may use: ``num_devices`` of the preset ``device`` (default
    H100-80GB, or the preset a ``profile`` names), or as measured by ``partc calibrate``
    (``profile``: its file, or a loaded DeviceProfile); and any figure of DeviceFigures
    given by its name, which wins over the profile's and the preset's. ``memory`` may be
    one size or one per device; ``peak_flops`` one FLOP/s or a table by dtype, whose
    dtypes replace those of the preset's (or the profile's) table.
    """

    num_devices: int
    device: str | None = None
    profile: str | os.PathLike | DeviceProfile | None = None
    _preset: DevicePreset | None = field(init=False, repr=False, compare=False)
    _profile: DeviceProfile | None = field(init=False, repr=False, compare=False)
    _given: DeviceFigures = field(init=False, repr=False, compare=False)
    _figures: DeviceFigures = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        COUNT.read(self.num_devices, "DeviceBudget.num_devices")
        self._resolve_device()
        memory = self._memory_given()
        given = read_figures({spec.name: getattr(self, spec.name) for spec in FIGURES
                              if spec.name != "memory"}, "DeviceBudget")
        # The smallest device's memory stands for a list (memory_bytes keeps each).
        smallest = None if memory is None else min(memory)
        object.__setattr__(self, "_given", replace(given, memory=smallest))
        figures = resolve(*self._layers())
        # Every figure resolves now, so a gap in a profile fails here and not in the planner.
        gaps = missing(figures)
        if gaps:
            raise ValueError(f"profile {self._profile.path} has no {gaps[0]} (not measured) "
                             f"and names no preset; pass {gaps[0]}=... to DeviceBudget")
        object.__setattr__(self, "_figures", figures)

    def __repr__(self) -> str:
        """What was given: the figures left to the profile and the preset are not shown."""
        given = {"num_devices": self.num_devices, "device": self.device,
                 "profile": self.profile, **{spec.name: getattr(self, spec.name)
                                             for spec in FIGURES}}
        return "DeviceBudget(" + ", ".join(f"{name}={value!r}" for name, value in given.items()
                                           if value is not None) + ")"

    def _memory_given(self) -> tuple[int, ...] | None:
        """The memory sizes given, one or one per device."""
        if self.memory is None:
            return None
        sizes = self.memory if isinstance(self.memory, (list, tuple)) else (self.memory,)
        if isinstance(self.memory, (list, tuple)) and len(sizes) != self.num_devices:
            raise ValueError(f"DeviceBudget.memory: {len(sizes)} memory sizes "
                             f"given for {self.num_devices} devices")
        return tuple(unit_of("memory").read(size, "DeviceBudget.memory") for size in sizes)

    def _layers(self) -> tuple[DeviceFigures | None, ...]:
        """The given figures, the profile's, the preset's: first wins."""
        given, measured = self._given, self._profile and self._profile.figures
        base = (measured or self._preset).peak_flops
        if isinstance(given.peak_flops, dict):
            given = replace(given, peak_flops={**base, **given.peak_flops})
        if measured is not None and (given.intra_node_bandwidth is not None
                                     or given.intra_node_latency_s is not None):
            # A link number given prices every collective kind: the profile's per-kind
            # fits were measured with its own.
            measured = without(measured, "collective_links")
        return given, measured, self._preset

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
    def figures(self) -> DeviceFigures:
        """Every figure resolved: given, else the profile's, else the preset's, else its
        ``unset`` value. ``peak_flops`` is the table (or the one number given)."""
        return self._figures

    def figures_for(self, dtype: torch.dtype) -> DeviceFigures:
        """The figures as training in ``dtype`` meets them: its peak FLOP/s and matmul share."""
        return replace(self._figures, peak_flops=self.peak_flops_for(dtype),
                       flops_efficiency=self.efficiency_for(dtype))

    @property
    def memory_bytes(self) -> tuple[int, ...]:
        sizes = self._memory_given() or (self._figures.memory,)
        return sizes if len(sizes) == self.num_devices else sizes * self.num_devices

    def peak_flops_for(self, dtype: torch.dtype) -> float:
        table = self._figures.peak_flops
        if not isinstance(table, dict):
            return table
        key = dtype_key(dtype)
        if key not in table:
            raise ValueError(f"device {self.name} has no peak FLOP/s for {key}; "
                             f"pass peak_flops={{'{key}': ...}}")
        return table[key]

    def efficiency_for(self, dtype: torch.dtype) -> float:
        """The fraction of ``peak_flops_for(dtype)`` that matmuls reach in this dtype: the
        one given, else the profile's for the dtype where it measured it."""
        if self._given.flops_efficiency is None and self._profile is not None:
            by_dtype = self._profile.flops_efficiency_by_dtype
            if dtype_key(dtype) in by_dtype:
                return by_dtype[dtype_key(dtype)]
        return self._figures.flops_efficiency

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
    def disk_bytes_per_s(self) -> float:
        """Checkpoint write rate per rank: ``disk_bandwidth``, else DEFAULT_DISK_BANDWIDTH."""
        return self._figures.disk_bandwidth or parse_rate(DEFAULT_DISK_BANDWIDTH)

    def to_dict(self, dtype: torch.dtype = torch.float32) -> dict:
        """The budget as a plan records it (``partc.plan.BudgetInfo``): the figures for
        ``dtype`` and, from a profile, which file and preset."""
        memory = self.memory_bytes
        data = {
            "device": self.name,
            "num_devices": self.num_devices,
            "memory_bytes": memory[0] if len(set(memory)) == 1 else list(memory),
            "memory": format_bytes(min(memory)),
            **without(self.figures_for(dtype), "memory").to_dict(),
        }
        if self._profile is not None:
            # Fields given to DeviceBudget still win over the profile's numbers.
            data.update(source="profile", profile=self._profile.path,
                        preset=self._preset.name if self._preset else None)
        return data
