"""DeviceBudget: how many devices, of what kind, with how much memory, how connected.

Presets carry the vendor's dense peak FLOP/s per dtype, memory, HBM bandwidth and the
usual node shape; every field can be overridden. Bandwidths are per device and per
direction (NVLink 4 on H100: 900 GB/s bidirectional = 450 GB/s each way; one 400 Gb/s NIC
per GPU = 50 GB/s). ``flops_efficiency`` is the fraction of peak that large matmuls reach
in practice; ``partc calibrate`` (later) measures it, until then it is the preset's guess.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .units import format_bytes, parse_bytes, parse_rate

TFLOPS = 1e12
GB = 1e9


@dataclass(frozen=True, kw_only=True)
class DevicePreset:
    name: str
    peak_flops: dict[str, float]
    memory: int
    hbm_bandwidth: float
    devices_per_node: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    link_latency_s: float
    flops_efficiency: float


PRESETS: dict[str, DevicePreset] = {
    preset.name: preset
    for preset in (
        DevicePreset(
            name="A100-40GB",
            peak_flops={"float32": 19.5 * TFLOPS, "tf32": 156 * TFLOPS,
                        "bfloat16": 312 * TFLOPS, "float16": 312 * TFLOPS},
            memory=40 * 2**30, hbm_bandwidth=1555 * GB, devices_per_node=8,
            intra_node_bandwidth=300 * GB, inter_node_bandwidth=25 * GB,
            link_latency_s=10e-6, flops_efficiency=0.6),
        DevicePreset(
            name="A100-80GB",
            peak_flops={"float32": 19.5 * TFLOPS, "tf32": 156 * TFLOPS,
                        "bfloat16": 312 * TFLOPS, "float16": 312 * TFLOPS},
            memory=80 * 2**30, hbm_bandwidth=2039 * GB, devices_per_node=8,
            intra_node_bandwidth=300 * GB, inter_node_bandwidth=25 * GB,
            link_latency_s=10e-6, flops_efficiency=0.6),
        DevicePreset(
            name="H100-80GB",
            peak_flops={"float32": 67 * TFLOPS, "tf32": 494.7 * TFLOPS,
                        "bfloat16": 989.4 * TFLOPS, "float16": 989.4 * TFLOPS},
            memory=80 * 2**30, hbm_bandwidth=3350 * GB, devices_per_node=8,
            intra_node_bandwidth=450 * GB, inter_node_bandwidth=50 * GB,
            link_latency_s=8e-6, flops_efficiency=0.55),
        DevicePreset(
            name="H200",
            peak_flops={"float32": 67 * TFLOPS, "tf32": 494.7 * TFLOPS,
                        "bfloat16": 989.4 * TFLOPS, "float16": 989.4 * TFLOPS},
            memory=141 * 10**9, hbm_bandwidth=4800 * GB, devices_per_node=8,
            intra_node_bandwidth=450 * GB, inter_node_bandwidth=50 * GB,
            link_latency_s=8e-6, flops_efficiency=0.55),
        DevicePreset(
            name="CPU",
            peak_flops={"float32": 0.2 * TFLOPS, "bfloat16": 0.2 * TFLOPS,
                        "float16": 0.1 * TFLOPS},
            memory=16 * 2**30, hbm_bandwidth=20 * GB, devices_per_node=64,
            intra_node_bandwidth=5 * GB, inter_node_bandwidth=1.25 * GB,
            link_latency_s=50e-6, flops_efficiency=0.5),
    )
}
_ALIASES = {"A100": "A100-80GB", "H100": "H100-80GB", "H200-141GB": "H200", "cpu": "CPU"}


def preset(name: str) -> DevicePreset:
    key = _ALIASES.get(name, name)
    matches = [p for n, p in PRESETS.items() if n.lower() == key.lower()]
    if not matches:
        raise ValueError(f"unknown device {name!r}; presets: {', '.join(PRESETS)}")
    return matches[0]


def dtype_key(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16",
            torch.float16: "float16"}.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True, kw_only=True)
class DeviceBudget:
    """The devices a job may use. ``memory`` may be one size or one per device."""

    num_devices: int
    device: str = "H100-80GB"
    memory: int | str | tuple[int | str, ...] | list[int | str] | None = None
    peak_flops: dict[str, float] | float | None = None
    flops_efficiency: float | None = None
    hbm_bandwidth: float | str | None = None
    devices_per_node: int | None = None
    intra_node_bandwidth: float | str | None = None
    inter_node_bandwidth: float | str | None = None
    link_latency_s: float | None = None
    _preset: DevicePreset = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.num_devices, int) or self.num_devices < 1:
            raise ValueError(f"num_devices must be a positive int, got {self.num_devices!r}")
        object.__setattr__(self, "_preset", preset(self.device))
        per_device = self.memory_bytes  # parses and checks the memory field
        if min(per_device) <= 0:
            raise ValueError("every device needs a positive memory size")
        if self.flops_efficiency is not None and not 0 < self.flops_efficiency <= 1:
            raise ValueError(f"flops_efficiency must be in (0, 1], got {self.flops_efficiency}")
        if self.devices_per_node is not None and self.devices_per_node < 1:
            raise ValueError("devices_per_node must be positive")

    @property
    def memory_bytes(self) -> tuple[int, ...]:
        if self.memory is None:
            return (self._preset.memory,) * self.num_devices
        if isinstance(self.memory, (list, tuple)):
            if len(self.memory) != self.num_devices:
                raise ValueError(
                    f"{len(self.memory)} memory sizes given for {self.num_devices} devices"
                )
            return tuple(parse_bytes(m) for m in self.memory)
        return (parse_bytes(self.memory),) * self.num_devices

    def peak_flops_for(self, dtype: torch.dtype) -> float:
        if isinstance(self.peak_flops, (int, float)):
            return float(self.peak_flops)
        table = {**self._preset.peak_flops, **(self.peak_flops or {})}
        key = dtype_key(dtype)
        if key not in table:
            raise ValueError(f"device {self.device} has no peak FLOP/s for {key}; "
                             f"pass peak_flops={{'{key}': ...}}")
        return table[key]

    def _pick(self, name: str):
        value = getattr(self, name)
        return getattr(self._preset, name) if value is None else value

    @property
    def efficiency(self) -> float:
        return self._pick("flops_efficiency")

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
    def latency_s(self) -> float:
        return self._pick("link_latency_s")

    def to_dict(self, dtype: torch.dtype = torch.float32) -> dict:
        memory = self.memory_bytes
        return {
            "device": self._preset.name,
            "num_devices": self.num_devices,
            "memory_bytes": memory[0] if len(set(memory)) == 1 else list(memory),
            "memory": format_bytes(min(memory)),
            "peak_flops": self.peak_flops_for(dtype),
            "flops_efficiency": self.efficiency,
            "hbm_bandwidth": self.hbm_bytes_per_s,
            "devices_per_node": self.node_size,
            "intra_node_bandwidth": self.intra_node_bytes_per_s,
            "inter_node_bandwidth": self.inter_node_bytes_per_s,
            "link_latency_s": self.latency_s,
        }
