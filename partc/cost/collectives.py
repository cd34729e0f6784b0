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
nodes is bounded by the network (``inter_node_*``, each GPU's own NIC), the slowest hop of
every ring step. NCCL runs a collective as several rings (channels) at once, each entering
and leaving every node once, and spreads them over the NICs of the group's members in the
node: with ``k`` members per node (a data-parallel group beside tensor parallelism of
``8 / k`` ranks), a node sends ``(n - 1) / n * S`` over ``k`` NICs, so each rank moves
bytes at ``k`` times its NIC's rate, up to NVLink's. With one member per node (tp = 8)
that is the NIC's rate. Point-to-point sends (pipeline activations) cost one step over
one NIC.

Inside a node each kind may have its own latency and bandwidth (``Group.kinds``, from a
calibrated profile's per-collective fits): backends do not run every kind as the same
ring (gloo's all-gather and reduce-scatter move bytes about 3x slower than its
all-reduce), so one joint fit misprices them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from partc.problem import DeviceNumbers

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send")


@dataclass(frozen=True, kw_only=True)
class Group:
    """A communicator as the cost model sees it: its size and the link it is bound by."""

    ranks: int
    bandwidth: float      # bytes/s per rank, per direction
    latency_s: float      # per step
    # Per collective kind, (kind, latency per step, bandwidth) where the link behaves
    # differently by kind (gloo's all-gather moves bytes slower than its all-reduce);
    # a kind not listed takes ``latency_s`` and ``bandwidth``.
    kinds: tuple[tuple[str, float, float], ...] = ()

    @classmethod
    def over(cls, devices: DeviceNumbers, ranks: int, span: int) -> "Group":
        """A group of ``ranks`` spread evenly over ``span`` consecutive devices (a
        data-parallel group: every tp-th rank of ``dp * tp``)."""
        node = devices.devices_per_node
        if span <= node:
            return cls(ranks=ranks, bandwidth=devices.intra_node_bandwidth,
                       latency_s=devices.intra_latency_s, kinds=devices.intra_node_links)
        return cls(ranks=ranks, latency_s=devices.link_latency_s,
                   bandwidth=min(devices.intra_node_bandwidth,
                                 members_per_node(ranks, span, node)
                                 * devices.inter_node_bandwidth))

    def link(self, kind: str) -> tuple[float, float]:
        """(latency per step, bandwidth) of ``kind`` on this group's link. A broadcast
        (ZeRO-1's weights from their owners) moves what an all-gather does."""
        wanted = "all_gather" if kind == "broadcast" else kind
        for name, latency, bandwidth in self.kinds:
            if name == wanted:
                return latency, bandwidth
        return self.latency_s, self.bandwidth


def members_per_node(ranks: int, span: int, node: int) -> int:
    """How many of a group's ``ranks``, spread evenly over ``span`` consecutive devices
    (every ``span / ranks``-th one), share a node of ``node`` devices: 1 once the stride
    reaches a node."""
    return max(1, min(ranks, ranks * node // span))


def ring_seconds(kind: str, nbytes: float, group: Group) -> float:
    n = group.ranks
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; one of {KINDS}")
    latency, bandwidth = group.link(kind)
    if kind == "send":
        return latency + nbytes / bandwidth
    if n <= 1:
        return 0.0
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return steps * latency + steps / n * nbytes / bandwidth


def tree_seconds(nbytes: float, group: Group) -> float:
    """A double-binary-tree all-reduce."""
    if group.ranks <= 1:
        return 0.0
    latency, bandwidth = group.link("all_reduce")
    return 2 * math.ceil(math.log2(group.ranks)) * latency + 2 * nbytes / bandwidth


def collective_seconds(kind: str, nbytes: float, group: Group) -> float:
    """The time of one collective of ``nbytes`` (the whole tensor) over ``group``."""
    ring = ring_seconds(kind, nbytes, group)
    if kind == "all_reduce" and group.ranks > 2:
        return min(ring, tree_seconds(nbytes, group))
    return ring
