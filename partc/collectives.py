"""Alpha-beta costs of collectives, as NCCL runs them, over the link a group really uses.

A group of ``n`` ranks moves ``S`` bytes (the whole tensor). Each step costs the link's
latency ``alpha``; bytes cost ``1 / bandwidth`` per rank:

- ring: all-reduce takes ``2 (n - 1)`` steps moving ``2 (n - 1) / n * S`` per rank;
  all-gather, reduce-scatter and broadcast ``n - 1`` steps moving ``(n - 1) / n * S``;
- tree (all-reduce only; NCCL's double binary tree): ``2 ceil(log2 n)`` steps, each rank
  moving about ``2 S`` (reduce up, broadcast down, pipelined);
- an all-reduce takes the faster of the two, as NCCL's tuner picks per message size:
  rings win on bandwidth, trees on latency once groups are large and messages small.

The link: a group inside one node runs over NVLink (``intra_node_*``); a group spanning
nodes is bounded by each GPU's share of the network (``inter_node_*``), the slowest hop of
every ring step. Point-to-point sends (pipeline activations) cost one step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .problem import DeviceNumbers

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send")


@dataclass(frozen=True, kw_only=True)
class Group:
    """A communicator as the cost model sees it: its size and the link it is bound by."""

    ranks: int
    bandwidth: float      # bytes/s per rank, per direction
    latency_s: float      # per step

    @classmethod
    def over(cls, devices: DeviceNumbers, ranks: int, span: int) -> "Group":
        """A group of ``ranks`` whose members lie within ``span`` consecutive devices."""
        inside = span <= devices.devices_per_node
        return cls(ranks=ranks,
                   bandwidth=devices.intra_node_bandwidth if inside
                   else devices.inter_node_bandwidth,
                   latency_s=devices.intra_latency_s if inside else devices.link_latency_s)


def ring_seconds(kind: str, nbytes: float, group: Group) -> float:
    n = group.ranks
    if kind == "send":
        return group.latency_s + nbytes / group.bandwidth
    if n <= 1:
        return 0.0
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; one of {KINDS}")
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return steps * group.latency_s + steps / n * nbytes / group.bandwidth


def tree_seconds(nbytes: float, group: Group) -> float:
    """A double-binary-tree all-reduce."""
    if group.ranks <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(group.ranks)) * group.latency_s + 2 * nbytes / group.bandwidth


def collective_seconds(kind: str, nbytes: float, group: Group) -> float:
    """The time of one collective of ``nbytes`` (the whole tensor) over ``group``."""
    ring = ring_seconds(kind, nbytes, group)
    if kind == "all_reduce" and group.ranks > 2:
        return min(ring, tree_seconds(nbytes, group))
    return ring
