"""What expert parallelism costs a mixture-of-experts layer on one rank: the figures its
row is priced from (:func:`moe_layer_figures`; the row is
:func:`partc.cost.tables.moe_layer_table`), the all-to-alls over an expert-parallel group,
and the group the experts' parameters are reduced over (:func:`expert_dp_config`).

Expert parallelism as Megatron folds it (expert tensor parallelism 1): within a pipeline
stage, the dp x tp ranks in rank order (tp fastest) form groups of ``ep`` consecutive
ranks; ep rank e holds experts [e E / ep, (e + 1) E / ep) of every mixture-of-experts
layer, and the ranks at the same position of each group (``dp x tp / ep`` of them, the
expert-data-parallel group) hold the same experts and reduce their gradients. Every token
goes to its top-k experts by an all-to-all (dispatch) and comes back by another (combine),
in forward; backward returns both gradients the same way. With ep = 1 a layer's row is the
ordinary one (the layer's figures include the experts as one process runs them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from partc.cost.collectives import Group
from partc.cost.pipeline_config import PipelineConfig
from partc.problem import DeviceNumbers, LayerCost, MoECost, PlanningProblem


def moe_worst_factor(moe: MoECost, ep: int, imbalance: float,
                     capacity_factor: float | None) -> float:
    """The tokens a rank's experts receive at worst over their balanced share, which the
    plan budgets memory for: the routing imbalance assumed (``TrainSpec.moe_imbalance``),
    at most the capacity factor when tokens beyond it are dropped, and at most what the
    group can send (each of the ``ep`` ranks' tokens to ``min(k, E / ep)`` of the rank's
    experts). With ep = 1 a rank runs its own tokens through all its experts: 1."""
    if ep == 1:
        return 1.0
    factor = imbalance if capacity_factor is None else min(imbalance, capacity_factor)
    ceiling = ep * min(moe.top_k, moe.num_experts // ep) / moe.top_k
    return min(factor, ceiling)


def ep_ranks_cross_nodes(devices: DeviceNumbers, config: PipelineConfig) -> bool:
    """Whether any expert-parallel group (``ep`` consecutive ranks of a stage) spans two
    nodes."""
    node, width, ep = devices.devices_per_node, config.dp * config.tp, config.ep
    return any((first + ep - 1) // node != first // node
               for stage in range(config.pp)
               for first in range(stage * width, (stage + 1) * width, ep))


def all_to_all_seconds(nbytes: float, devices: DeviceNumbers, config: PipelineConfig) -> float:
    """One all-to-all over an expert-parallel group, each rank sending ``nbytes`` (its
    whole buffer, its own share included), by the alpha-beta model of
    :mod:`partc.cost.collectives`: ``ep - 1`` steps (pairwise exchanges) at the link's
    latency; of the buffer, ``(ep - 1) / ep`` leaves the rank. Inside a node it moves over
    NVLink; a group spanning nodes sends the shares of peers in other nodes over the
    network and the others over NVLink at the same time (the slower of the two)."""
    ep = config.ep
    if ep == 1:
        return 0.0
    if not ep_ranks_cross_nodes(devices, config):
        group = Group.over(devices, ep, ep)
        latency, bandwidth = group.latency_s, group.bandwidth
        return (ep - 1) * latency + (ep - 1) / ep * nbytes / bandwidth
    local = min(ep, devices.devices_per_node)   # peers in a rank's own node, itself too
    network = (ep - local) / ep * nbytes / devices.inter_node_bandwidth
    nvlink = (local - 1) / ep * nbytes / devices.intra_node_bandwidth
    return (ep - 1) * devices.link_latency_s + max(network, nvlink)


def expert_dp_config(config: PipelineConfig) -> PipelineConfig:
    """The configuration the experts' parameters see: ``dp x tp / ep`` replicas spanning
    the stage's dp x tp ranks (``dp_group`` of it is the expert-data-parallel group), so
    that ZeRO, the gradient reduction and the optimizer step of the experts are priced by
    the functions that price the other parameters."""
    return replace(config, dp=config.dp * config.tp // config.ep, tp=config.ep)


@dataclass(frozen=True, kw_only=True)
class MoELayerFigures:
    """One mixture-of-experts layer on one rank under expert parallelism, per microbatch:
    what :func:`partc.cost.tables.moe_layer_table` prices and the plan records."""

    num_experts: int
    top_k: int
    local_experts: int            # experts per rank: E / ep
    expert_params: int            # the rank's share of the routed experts' parameters
    dense_params: int             # the layer's other parameters on the rank
    all_to_all_bytes: float       # one all-to-all's buffer per rank (dispatch or combine)
    all_to_all_s: float           # one all-to-all's time
    worst_factor: float           # tokens at worst over the balanced share (memory)
    expert_saved: dict[str, float]   # the experts' saved bytes at worst, by mode
    flops_delta: float            # expert FLOPs beyond the layer's own figures (tp > 1)

    @property
    def all_to_alls(self) -> int:
        """All-to-alls per microbatch without recompute: dispatch and combine, forward and
        backward."""
        return 4


def moe_layer_figures(whole: MoECost, layer: LayerCost, problem: PlanningProblem,
                      config: PipelineConfig) -> MoELayerFigures:
    """The expert-parallel figures of ``layer`` (as one rank of the configuration's
    tensor-parallel variant measures it) whose routed experts ``whole`` describes for the
    whole model. ``layer.moe`` says how the layer's own figures include the experts
    (tokens per sample on the rank, the parameters and FLOPs it counts); a variant layer
    without it is taken to include them split over tp, as sequence parallelism splits
    the tokens. Under expert parallelism the experts are whole (expert tensor
    parallelism 1) and the rank's tokens, balanced, cost it the FLOPs of its share of the
    tokens through whole experts."""
    tp = config.tp
    local = layer.moe if layer.moe is not None else replace(
        whole, tokens_per_sample=whole.tokens_per_sample / tp,
        expert_param_count=whole.expert_param_count // tp,
        expert_fwd_flops=whole.expert_fwd_flops / tp,
        expert_saved_bytes={m: v / tp for m, v in whole.expert_saved_bytes.items()},
        dispatch_bytes=whole.dispatch_bytes / tp)
    ratio = local.tokens_per_sample / whole.tokens_per_sample
    b, scale = config.micro_batch_size, problem.train.measured_scale
    worst = moe_worst_factor(whole, config.ep, problem.train.moe_imbalance,
                             problem.train.moe_capacity_factor)
    buffer = b * whole.dispatch_bytes * ratio * scale
    return MoELayerFigures(
        num_experts=whole.num_experts, top_k=whole.top_k,
        local_experts=whole.num_experts // config.ep,
        expert_params=whole.expert_param_count // config.ep,
        dense_params=layer.param_count - local.expert_param_count,
        all_to_all_bytes=buffer,
        all_to_all_s=all_to_all_seconds(buffer, problem.devices, config),
        worst_factor=worst,
        expert_saved={m: whole.expert_saved_bytes.get(m, 0.0) * ratio * worst
                      for m in layer.saved_bytes},
        flops_delta=whole.expert_fwd_flops * ratio - local.expert_fwd_flops)
