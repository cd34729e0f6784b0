"""Activation offload's price: what a layer whose saved tensors go to the host (recompute
mode ``"offload"``, :mod:`partc.runtime.activation_offload`) costs per microbatch.

- what moves: every storage the layer's own ops save for backward, parameters and
  buffers aside (``LayerCost.offload_bytes``, the row's ``offload_bytes``: the layer's
  inputs too, which its saved bytes charge to the layers that make them);
- device memory: none of its saved bytes stay (``saved_bytes["offload"] = 0``), but a
  bounded window is in flight: while its backward runs, its own tensors are back and the
  next backward's are being fetched, and in forward the last layer's are still being
  copied out beside it: its transient is twice what it moves beside its working set
  (:func:`partc.cost.tables.transient`);
- host memory: its saved bytes, for every microbatch the rank holds in flight
  (:meth:`partc.cost.pipeline_config.PipelineConfig.activations`), within the rank's
  share of its node's host memory (:func:`host_limit`);
- time: the copies out (at ``device_to_host_bandwidth``) run beside the forward, and
  the copies back (``host_to_device_bandwidth``) beside the backward of the layer before
  it; each phase pays what its copy takes beyond the compute it overlaps, ``max(0,
  bytes / bandwidth - compute)``, where the device copies on a stream of its own (a GPU,
  whose host dispatches ahead); on a CPU the host is the device and the copy is the
  compute thread's own work, paid whole. The sum is the mode's ``recompute_ps``.

Without a known host bandwidth the mode has no price, and the rows leave it out.
"""

from __future__ import annotations

from partc.cost.pipeline_config import to_ps
from partc.problem import DeviceNumbers

OFFLOAD = "offload"


def offload_known(devices: DeviceNumbers) -> bool:
    """Whether the devices' host link is known, so that offload can be priced."""
    return bool(devices.host_to_device_bandwidth) and bool(devices.device_to_host_bandwidth)


def exposed_copy_seconds(saved_bytes: float, forward_s: float, backward_s: float,
                         devices: DeviceNumbers) -> float:
    """What one microbatch of a layer saving ``saved_bytes`` pays for offloading them:
    the copy out beyond its forward ``forward_s``, the copy back beyond the backward
    ``backward_s`` it overlaps (whole on a device without a copy stream)."""
    out = saved_bytes / devices.device_to_host_bandwidth
    back = saved_bytes / devices.host_to_device_bandwidth
    if not devices.dispatch_ahead:
        return out + back
    return max(0.0, out - forward_s) + max(0.0, back - backward_s)


def offload_entries(moved: int, forward_s: float, backward_s: float,
                    devices: DeviceNumbers) -> tuple[int, int] | None:
    """The offload mode's ``(recompute_ps, saved_bytes)`` for a row that moves
    ``moved`` bytes; None where the host link is not known."""
    if not offload_known(devices):
        return None
    return to_ps(exposed_copy_seconds(moved, forward_s, backward_s, devices)), 0


def in_flight_bytes(moved: int, mode: str) -> int:
    """What an offloaded layer holds on the device while its backward runs: its own
    tensors back, and the next backward's being fetched (0 for the other modes)."""
    return 2 * moved if mode == OFFLOAD else 0


def host_bytes(row, mode: str) -> int:
    """Bytes a layer's row in ``mode`` keeps on the host per microbatch in flight."""
    return row.offload_bytes if mode == OFFLOAD else 0


def host_limit(devices: DeviceNumbers) -> int | None:
    """A rank's share of its node's host memory for offloaded activations (the node's
    divided among its devices); None where the host memory is not known (no limit)."""
    if devices.host_memory is None:
        return None
    return devices.host_memory // max(1, min(devices.devices_per_node, devices.num_devices))


def stages_per_node(pp: int, devices: DeviceNumbers) -> list[list[int]]:
    """For each node, how many of its ranks hold each of the ``pp`` stages: ranks lie
    ``(pp, dp, tp)`` with tp fastest, so stage ``s`` holds the ranks ``s * n / pp`` to
    ``(s + 1) * n / pp - 1``, and node ``k`` ranks ``k * d`` to ``(k + 1) * d - 1``."""
    n = devices.num_devices
    width, per_node = max(1, n // pp), max(1, min(devices.devices_per_node, n))
    nodes = []
    for first in range(0, n, per_node):
        counts = [0] * pp
        rank, end = first, min(n, first + per_node)
        while rank < end:   # the ranks of one stage on this node at once
            stage = min(pp - 1, rank // width)
            upto = end if stage == pp - 1 else min(end, (stage + 1) * width)
            counts[stage] += upto - rank
            rank = upto
        nodes.append(counts)
    return nodes


def host_per_node(stage_host: list[int], devices: DeviceNumbers) -> list[int]:
    """Offloaded activations on each node's host, in bytes (:func:`stages_per_node`);
    ``stage_host`` holds each stage's bytes per rank."""
    return [sum(count * host for count, host in zip(counts, stage_host))
            for counts in stages_per_node(len(stage_host), devices)]
