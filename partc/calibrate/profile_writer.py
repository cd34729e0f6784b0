"""The device profile: what was measured, the numbers DeviceBudget needs, and where each
came from, written as the JSON file ``DeviceBudget(profile=...)`` loads
(``docs/calibrate.md`` describes it; ``partc.device.budget.load_profile`` reads it).

Nominal peak FLOP/s are the preset's where the device is a known preset (the GPUs in
``partc.device.budget.PRESETS``), otherwise the measured best, and ``flops_efficiency``
is achieved / nominal. A single machine cannot measure the network between nodes:
``inter_node_bandwidth`` is the preset's, or null for the user to give
(``DeviceBudget(..., inter_node_bandwidth=...)``).
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from partc.calibrate.calibration_options import CalibrationOptions
from partc.calibrate.collective_fits import COLLECTIVES
from partc.calibrate.collective_ranks import BETWEEN_COMPUTE_S, CollectiveMeasurement
from partc.calibrate.fsdp_overheads import FSDP_FIGURES, FSDP_UNITS
from partc.calibrate.host_rates import HostAdamRate, HostLink
from partc.calibrate.machine import Host, cores, device_memory, known_preset
from partc.calibrate.matmuls import AttentionRates, LinearRate, MatmulRate, SplitBackward
from partc.calibrate.memory_rates import ElementwiseRate, MemoryBandwidth, OptimizerRate
from partc.calibrate.overheads import KernelOverhead, OpOverhead
from partc.device.budget import PRESETS, PROFILE_SCHEMA, PROFILE_VERSION


@dataclass(frozen=True, kw_only=True)
class Measurements:
    """Everything one calibration run measured (its order is the profile's)."""

    matmul: dict[str, MatmulRate]            # by dtype
    linear: dict[str, LinearRate]            # by dtype, tf32 left out
    split_backward: SplitBackward
    attention: AttentionRates
    memory: MemoryBandwidth
    op_overhead: OpOverhead
    kernel_overhead: KernelOverhead | None   # a GPU's, where it could be measured
    elementwise: ElementwiseRate
    optimizer: OptimizerRate
    collectives: CollectiveMeasurement | None = None   # with more than one process
    host_adam: HostAdamRate | None = None    # the host's AdamW step (offload)
    host_link: HostLink | None = None        # beside a GPU: pinned copies each way

    def to_dict(self) -> dict:
        measured = {"matmul": {key: rate.to_dict() for key, rate in self.matmul.items()},
                    "linear": {key: rate.to_dict() for key, rate in self.linear.items()},
                    "split_backward": self.split_backward.to_dict(),
                    "attention": self.attention.to_dict(), "memory": self.memory.to_dict(),
                    "op_overhead": self.op_overhead.to_dict()}
        if self.kernel_overhead is not None:
            measured["kernel_overhead"] = self.kernel_overhead.to_dict()
        measured |= {"elementwise": self.elementwise.to_dict(),
                     "optimizer": self.optimizer.to_dict()}
        if self.collectives is not None:
            measured["collectives"] = self.collectives.to_dict()
        for name in ("host_adam", "host_link"):
            if getattr(self, name) is not None:
                measured[name] = getattr(self, name).to_dict()
        return measured


def write_profile(profile: dict, path: str | os.PathLike) -> None:
    Path(path).write_text(json.dumps(profile, indent=1) + "\n")


def build_profile(options: CalibrationOptions, measured: Measurements, *, name: str,
                  threads: int, host: Host) -> dict:
    """The profile file's content: what was measured and the numbers DeviceBudget needs."""
    preset_name = known_preset(options.device, name)
    vendor = PRESETS[preset_name] if preset_name and options.device == "cuda" else None
    achieved = {key: rate.best_flops_per_s for key, rate in measured.matmul.items()}
    peak = {key: vendor.peak_flops.get(key, flops) if vendor else flops
            for key, flops in achieved.items()}
    training = "bfloat16" if options.device == "cuda" else "float32"
    collectives = measured.collectives
    return {
        "schema": PROFILE_SCHEMA,
        "schema_version": PROFILE_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "mode": "quick" if options.quick else "full",
        "device": {"kind": options.device, "name": name, "preset": preset_name,
                   "processes": options.processes, "threads_per_process": threads},
        "software": {"torch": torch.__version__, "python": platform.python_version(),
                     "cuda": torch.version.cuda},
        "host": host.to_dict(),
        "budget": _budget(options, measured, achieved=achieved, peak=peak,
                          training=training),
        "sources": _sources(options, preset_name, vendor is not None, training,
                            linked=collectives is not None,
                            between=collectives is not None
                            and collectives.between_compute is not None),
        "measurements": measured.to_dict(),
        "notes": _notes(options, threads, achieved, peak, host),
    }


def _budget(options: CalibrationOptions, measured: Measurements, *,
            achieved: dict[str, float], peak: dict[str, float], training: str) -> dict:
    """The numbers DeviceBudget reads; null where not measured (the preset's then)."""
    collectives = measured.collectives
    # A model's layers run at the rate of training's linear-layer matmuls (forward and
    # both backward products), measured with every rank computing at once where the
    # ranks were spawned; tf32 (a matmul mode, no linear measured) by its square matmul.
    linear = collectives.linear_all_busy if collectives else measured.linear
    efficiency = {key: min(1.0, (linear[key].flops_per_s if key in linear
                                 else achieved[key]) / peak[key]) for key in achieved}
    # The links as a step meets them: on a CPU the collectives timed between compute
    # (collective_ranks.BetweenCompute) where they were fitted, else back to back.
    links = collectives.step_fits if collectives else None
    link = links.joint_fit if links else None
    # Element-wise ops and the optimizer step likewise, every rank at once where spawned
    # (they share the memory bus). A GPU runs its element-wise kernels somewhat below its
    # copy rate, and torch's AdamW (foreach) passes over the state several times: an
    # H100 stepped 0.3 of its copy rate in the cost model's bytes.
    elementwise = collectives.elementwise_all_busy if collectives else measured.elementwise
    optimizer = collectives.optimizer_all_busy if collectives else measured.optimizer
    # Dispatch per op: on a CPU it adds to every op's time, on a GPU it is the floor
    # under a layer's kernels (DeviceNumbers.dispatch_ahead); either way the measured
    # figure. The matmul overhead only on a CPU: a GPU's small matmuls are launch-bound,
    # which the dispatch floor already prices.
    cpu = options.device == "cpu"
    fsdp = collectives.fsdp if collectives else None
    return {
        "peak_flops": peak,
        "achieved_flops": achieved,
        "flops_efficiency_by_dtype": efficiency,
        "training_dtype": training,
        "flops_efficiency": efficiency[training],
        "memory": device_memory(options),
        "hbm_bandwidth": measured.memory.best_bytes_per_s,
        "devices_per_node": (torch.cuda.device_count() if options.device == "cuda"
                             else options.processes),
        "intra_node_bandwidth": link.bandwidth if link else None,
        "intra_node_latency_s": link.latency_s if link else None,
        "link_latency_s": None,      # between nodes: not measurable from one machine
        "inter_node_bandwidth": None,
        "collective_links": {
            kind: ({"latency_s": fit.latency_s, "bandwidth": fit.bandwidth}
                   if (fit := links.series[kind].fit) else None)
            for kind in COLLECTIVES} if links else {},
        "op_overhead_s": measured.op_overhead.forward_s,
        "op_overhead_backward_s": measured.op_overhead.backward_s,
        "matmul_overhead_s": measured.matmul[training].overhead_s if cpu else None,
        "kernel_overhead_s": (measured.kernel_overhead.per_kernel_s
                              if measured.kernel_overhead else None),
        "comm_overlap": collectives.overlap.overlap if collectives else None,
        "split_backward_factor": measured.split_backward.factor,
        "elementwise_bandwidth": elementwise.bytes_per_s,
        "optimizer_bandwidth": optimizer.bytes_per_s,
        "host_memory": None,   # the node's: not what one process may use
        "host_to_device_bandwidth": (measured.host_link.to_device_bytes_per_s
                                     if measured.host_link else None),
        "device_to_host_bandwidth": (measured.host_link.to_host_bytes_per_s
                                     if measured.host_link else None),
        "host_adam_rate": measured.host_adam.updates_per_s if measured.host_adam else None,
        # FSDP's host work: measured on a CPU only, where ranks were spawned.
        **{name: getattr(fsdp, key) if cpu and fsdp else None
           for name, key in FSDP_FIGURES.items()},
    }


def _sources(options: CalibrationOptions, preset_name: str | None, vendor: bool,
             training: str, *, linked: bool, between: bool) -> dict[str, str]:
    """Where each budget number came from; null numbers fall back as said here.
    ``linked``: ranks were spawned and their links timed; ``between``: the links that
    price a step were timed between compute."""
    fallback = (f"not measured: DeviceBudget uses preset {preset_name}'s" if preset_name
                else "not measured: give it to DeviceBudget")
    ranks = f"{options.processes} {'NCCL' if options.device == 'cuda' else 'gloo'} processes"
    timed = ranks + (f", each call after {BETWEEN_COMPUTE_S * 1e3:g} ms of compute as in "
                     f"a step" if between else ", back to back")
    return {
        "peak_flops": (f"vendor figures of preset {preset_name}" if vendor else
                       "measured: best matmul throughput per dtype (no vendor figures)"),
        "flops_efficiency": (f"measured: {training} linear layers' forward and backward "
                             f"matmuls" + (f", every one of {ranks} computing at once,"
                                           if linked else "")
                             + f" / peak_flops.{training}"),
        "memory": ("total memory of GPU 0" if options.device == "cuda" else
                   f"physical memory / {options.processes} processes"),
        "hbm_bandwidth": "measured: best of copy and add, bytes read + written per second",
        "devices_per_node": ("GPUs torch sees" if options.device == "cuda" else
                             "processes calibrated: a CPU device is one process"),
        "intra_node_bandwidth": (f"measured: joint ring fit of the collectives over {timed}"
                                 if linked else f"{fallback} (one process: no link to time)"),
        "intra_node_latency_s": (f"measured: joint ring fit, latency per ring step over "
                                 f"{timed}" if linked else
                                 f"{fallback} (one process: no link to time)"),
        "link_latency_s": f"{fallback} (one machine cannot measure the network between "
                          f"nodes)",
        "collective_links": (f"measured: each collective's own ring fit over {timed}, "
                             f"inside a node (a kind without a fit takes the joint one)"
                             if linked else f"{fallback} (one process: no link to time)"),
        "op_overhead_s": "measured: a chain of tiny element-wise ops, forward, per op" + (
            "" if options.device == "cpu" else
            " (on a GPU the floor under a layer's kernels: launches run ahead of them)"),
        "op_overhead_backward_s": "measured: the same chain's backward, per forward op",
        "matmul_overhead_s": (f"measured: fit t = flops / best rate + overhead over the "
                              f"{training} matmul sizes" if options.device == "cpu"
                              else f"not used on GPUs (the dispatch floor prices small "
                                   f"matmuls): {preset_name or 'the'} preset's 0"),
        "inter_node_bandwidth": f"{fallback} (one machine cannot measure the network "
                                f"between nodes)",
        "kernel_overhead_s": ("measured: tiny kernels queued behind a long one, their span "
                              "per kernel" if options.device == "cuda" else
                              f"not measured on a CPU (its per-op time is op_overhead_s): "
                              f"{preset_name or 'the'} preset's 0"),
        "comm_overlap": (f"measured: an all-reduce over {ranks} alone, matmuls alone, "
                         f"and both at once" if linked else
                         f"{fallback} (one process: no collective to overlap)"),
        "split_backward_factor": "measured: two linear blocks' backward as input then "
                                 "weight gradients (two autograd passes) over one pass",
        "elementwise_bandwidth": (f"measured: add, layer norm, scale, mask, softmax and "
                                  f"GELU forward and backward, bytes as partc counts "
                                  f"them" + (f", every one of {ranks} computing at once"
                                             if linked else "")),
        "optimizer_bandwidth": (f"measured: torch.optim.AdamW's step over a transformer "
                                f"block's parameters, in the bytes the cost model counts"
                                + (f", every one of {ranks} computing at once"
                                   if linked else "")),
        "host_memory": f"{fallback} (the node's host memory offload may use: give it)",
        **{name: ("measured: pinned copies between the host and GPU 0"
                  if options.device == "cuda" else
                  f"{fallback} (a CPU's host is its own memory)")
           for name in ("host_to_device_bandwidth", "device_to_host_bandwidth")},
        "host_adam_rate": ("measured: torch's fused AdamW on the host's cores over fp32 "
                           "tensors of a transformer block's shapes, parameters per second"),
        **{name: (f"measured: FSDP2 over {ranks} on {FSDP_UNITS} units of a transformer "
                  f"block's 12 tensors, ZeRO-2 accumulating, reducing and ZeRO-3, against "
                  f"the same modules without it, by the rank thread's CPU time, per unit "
                  f"and microbatch ({key}; the copies' rate from a tiny and a wide "
                  f"width)" if options.device == "cpu" and linked else
                  f"{fallback} (one process: no process group to shard over)"
                  if options.device == "cpu" else
                  ("not used on GPUs: hbm_bandwidth" if name == "fsdp_copy_bandwidth" else
                   f"not used on GPUs (host work ahead of the kernels): "
                   f"{preset_name or 'the'} preset's 0"))
           for name, key in FSDP_FIGURES.items()},
    }


def _notes(options: CalibrationOptions, threads: int, achieved: dict[str, float],
           peak: dict[str, float], host: Host) -> list[str]:
    notes = []
    if host.busy:
        notes.append(f"the machine was busy when the run started (load average "
                     f"{host.load_average_before:.1f} on {host.cores} cores): figures "
                     f"are likely low and noisy; calibrate on an idle machine")
    if options.device == "cpu":
        notes.append(f"compute and memory were measured in one process with {threads} "
                     f"thread(s), the others idle; {options.processes} ranks running at "
                     f"once share memory bandwidth")
        if options.processes > cores():
            notes.append("more processes than cores: collective times include waiting "
                         "for a core")
    for key in achieved:
        if achieved[key] > peak[key]:
            notes.append(f"{key} matmul measured above the vendor peak; efficiency set to 1")
    if options.quick:
        notes.append("quick run: small sizes and few repeats; figures are rough")
    return notes
