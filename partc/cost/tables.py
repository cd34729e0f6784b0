"""The integer tables the planner, the brute-force oracle, the validator and the report
read (:mod:`partc.cost` says what they price): per layer a :class:`LayerTable` row (a
mixture-of-experts layer's under expert parallelism: :func:`moe_layer_table`), per tied
weight a :class:`SharedTable`, the sends across each cut and each stage's memory limit, in
the :class:`CostTable` :func:`build_cost_table` makes; and the :class:`TableCache` that
shares rows between the configurations of one problem."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from partc.cost.collectives import Group, collective_seconds
from partc.cost.communication import (bucket_latency_seconds, cut_bytes, cut_table,
                                      first_gather_ps, gather_ps, last_sync_ps,
                                      shared_tail_ps, sync_ps, tail_ps,
                                      tp_comm_seconds, zero_comm_seconds,
                                      zero_overhead_seconds)
from partc.cost.cp_attention import cp_seconds
from partc.cost.experts_cost import expert_dp_config, moe_layer_figures
from partc.cost.fp8_pricing import pricing
from partc.cost.host_offload import (host_bytes_per_param, host_fill_seconds,
                                     microbatch_seconds, ranks_per_node)
from partc.cost.layer_compute import layer_work, run_layer
from partc.cost.offload_time import (host_limit, in_flight_bytes, offload_entries,
                                     stages_per_node)
from partc.cost.pipeline_config import (PS_PER_S, PipelineConfig, grad_config, overlapped,
                                        permille, split_factor, stage_limits, to_ps)
from partc.cost.row_parts import compute_part, moved_bytes, param_part
from partc.cost.schedules import runs_compiled, schedule as schedule_info
from partc.cost.state_bytes import (state_bytes, step_bytes, step_total, steps_whole_list,
                                    zero_transient)
from partc.problem import MoECost, PlanningProblem


@dataclass(frozen=True, kw_only=True)
class LayerTable:
    """One layer's integer costs per microbatch, per recompute mode (``"offload"`` among
    them where the host link is known: :mod:`partc.cost.offload_time`)."""

    forward_ps: int
    backward_ps: int
    recompute_ps: dict[str, int]
    saved_bytes: dict[str, int]
    transient_bytes: dict[str, int]
    param_count: int
    state_bytes: dict[str, int]   # params / grads / optimizer of the layer's own parameters
    tail_ps: int                  # optimizer step (ZeRO-1: and the weight gather), per step
    sync_ps: int = 0              # dp gradient all-reduce (ZeRO 0/1), overlapping backward
    # ZeRO-1's weight all-gather when it overlaps the next forward (then not in tail_ps)
    gather_ps: int = 0
    step_bytes: int = 0           # the optimizer step's temporaries (:func:`step_bytes`)
    # What offloading the layer moves to the host per microbatch (each way), and holds
    # there (LayerCost.offload_bytes); 0 where offload is not priced.
    offload_bytes: int = 0

    def compute_ps(self, mode: str) -> int:
        return self.forward_ps + self.backward_ps + self.recompute_ps[mode]

    @property
    def state_total(self) -> int:
        return sum(self.state_bytes.values())


@dataclass(frozen=True, kw_only=True)
class SharedTable:
    layers: tuple[int, ...]
    param_count: int
    state_bytes: dict[str, int]
    tail_ps: int
    tie_sync_ps: int              # per extra stage holding it
    sync_ps: int = 0
    gather_ps: int = 0
    step_bytes: int = 0

    @property
    def state_total(self) -> int:
        return sum(self.state_bytes.values())


@dataclass(frozen=True, kw_only=True)
class CostTable:
    config: PipelineConfig
    layers: tuple[LayerTable, ...]
    shared: tuple[SharedTable, ...]
    cut_ps: tuple[tuple[int, ...], ...]   # [cut l][run j]: cut l as the boundary j -> j+1
    cut_bytes: tuple[int, ...]   # [cut l]: bytes crossing it per microbatch (each way)
    limits: tuple[int, ...]               # per stage
    tail_latency_ps: int
    # DeviceNumbers.comm_overlap in thousandths: how much of the dp gradient reduction
    # the backwards hide (:func:`partc.cost.evaluate.exposed_sync_ps`).
    overlap_permille: int = 1000
    # ZeRO-1 with its weight all-gather overlapped: one bucket's all-gather, which the
    # first layer waits for before any forward runs: in tail_latency_ps, and taken off
    # what forward may hide (:func:`partc.cost.evaluate.exposed_gather_ps`).
    first_gather_ps: int = 0
    # ZeRO 0/1 over dp: the last bucket's gradient reduction, which starts as the step's
    # backward ends and so overlaps none of it: in tail_latency_ps, and taken off what
    # backward may hide (:func:`partc.cost.evaluate.exposed_sync_ps`).
    last_sync_ps: int = 0
    # Whether a rank's step temporaries are the sum of its rows' step_bytes (torch's
    # foreach step, over the whole list) or the largest of them (one tensor at a time).
    step_sums: bool = True
    # A rank's share of its node's host memory for offloaded activations
    # (:func:`partc.cost.offload_time.host_limit`); None: not known, no limit.
    host_limit: int | None = None
    # A node's host memory (None: not known, no limit), the host bytes per parameter a
    # rank keeps for optimizer and parameter offload
    # (:func:`partc.cost.host_offload.host_bytes_per_param`), the ranks of a node, and
    # per node how many of its ranks hold each stage
    # (:func:`partc.cost.offload_time.stages_per_node`): what the solve holds every
    # node's host to, as the validator counts it.
    host_memory: int | None = None
    host_per_param: float = 0.0
    ranks_per_node: int = 1
    host_nodes: tuple[tuple[int, ...], ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.layers)


@dataclass(frozen=True, kw_only=True)
class LayerPhases:
    """A layer's forward and backward per microbatch in seconds before its ZeRO-2/3
    collectives (compute, tensor-parallel collectives, the runtime's own work), and those
    collectives by when they run (:func:`partc.cost.communication.zero_comm_seconds`'s
    keys); the row's times are each phase with its collectives beside it
    (:func:`partc.cost.pipeline_config.overlapped`)."""

    forward_s: float
    backward_s: float
    zero: dict[str, float]


def layer_phases(problem: PlanningProblem, config: PipelineConfig, index: int,
                 layer=None, work=None, comm=None) -> LayerPhases:
    """:class:`LayerPhases` of layer ``index`` of ``problem`` (a tensor-parallel variant,
    as :func:`build_cost_table` makes it); ``layer``, ``work`` and ``comm`` where the caller
    has them."""
    devices, train = problem.devices, problem.train
    if layer is None:
        layer = run_layer(problem, index, config.micro_batch_size)
    if work is None:
        work = layer_work(layer, devices, config.micro_batch_size * config.tokens_share,
                          train.measured_scale, runs_compiled(config.schedule, train.compiled),
                          pricing(problem, config.tp))
    if comm is None:
        comm = tp_comm_seconds(problem, config, layer)
    params = grad_config(config)   # the parameters' replicas: dp x cp
    zero = zero_comm_seconds(problem, params, layer.param_count)
    own = zero_overhead_seconds(problem, params, layer.param_count, layer.param_tensors)
    context = cp_seconds(problem, config, layer)
    forward = sum(work["forward"]) + comm["forward"] + own["forward"] + context["forward"]
    backward = (split_factor(problem, config) * sum(work["backward"]) + comm["backward"]
                + own["backward"] + context["backward"])
    return LayerPhases(forward_s=forward, backward_s=backward, zero=zero)


def _layer_table(problem: PlanningProblem, config: PipelineConfig, index: int,
                 parts: dict | None = None) -> LayerTable:
    """Layer ``index``'s row under ``config``: its compute (:func:`~partc.cost.row_parts.compute_part`) beside
    its parameters' state and collectives (:func:`~partc.cost.row_parts.param_part`), each kept in ``parts``
    (a :class:`TableCache`'s) for the other configurations that share it."""
    parts = {} if parts is None else parts
    compute = compute_part(problem, config, index, parts)
    layer, devices = compute.layer, problem.devices
    state = param_part(problem, config, layer, parts)
    zero = state.zero
    forward = compute.forward_s + state.own["forward"] + compute.context["forward"]
    backward = compute.backward_s + state.own["backward"] + compute.context["backward"]
    backward = overlapped(backward, zero["backward"], devices.comm_overlap)
    # Offload's copies of each microbatch (partc.cost.host_offload): what the backward
    # they stream beside leaves exposed.
    copy_forward, copy_backward = microbatch_seconds(problem, config, layer.param_count,
                                                     backward)
    forward_ps = to_ps(overlapped(forward, zero["forward"], devices.comm_overlap)
                       + copy_forward)
    backward_ps = to_ps(backward + copy_backward)
    recompute_ps, saved = dict(compute.recompute_ps), dict(compute.saved)
    moved = compute.moved
    with_offload(recompute_ps, saved, moved, forward_ps, backward_ps, devices)
    return LayerTable(
        offload_bytes=moved if "offload" in saved else 0,
        forward_ps=forward_ps,
        backward_ps=backward_ps,
        recompute_ps=recompute_ps,
        saved_bytes=saved,
        transient_bytes=transient(saved, moved, compute.workspace, *state.transient),
        param_count=layer.param_count,
        state_bytes=dict(state.state_bytes),
        tail_ps=state.tail_ps,
        sync_ps=state.sync_ps,
        gather_ps=state.gather_ps,
        step_bytes=state.step_bytes,
    )


def with_offload(recompute_ps: dict[str, int], saved: dict[str, int], moved: int,
                 forward_ps: int, backward_ps: int, devices) -> None:
    """Add the offload mode to a row's recompute times and saved bytes, where the host
    link is known (:func:`partc.cost.offload_time.offload_entries`)."""
    entries = offload_entries(moved, forward_ps / PS_PER_S, backward_ps / PS_PER_S, devices)
    if entries is not None:
        recompute_ps["offload"], saved["offload"] = entries


def transient(saved: dict[str, int], moved: int, workspace: int, gathered: int,
              gradient: int) -> dict[str, int]:
    """A row's largest working set per mode: what its backward rematerialises (or, for
    offload, brings back, ``moved``, beside the next one's prefetch) and its workspace,
    or under ZeRO-2/3 the unit's whole gradient, made as its backward ends, when the
    backward's working set and this microbatch's saved tensors of it are freed; and the
    layer's ZeRO-3 gathered weights."""
    back = {m: in_flight_bytes(moved, m) or saved["none"] - saved[m] for m in saved}
    return {m: gathered + max(back[m] + workspace, gradient - saved[m]) for m in saved}


def _shared_tables(problem: PlanningProblem, config: PipelineConfig) -> tuple[SharedTable, ...]:
    devices = problem.devices
    config = grad_config(config)   # tied weights reduce over dp x cp too
    return tuple(
        SharedTable(
            layers=group.layers,
            param_count=group.param_count,
            state_bytes=state_bytes(problem, config, group.param_count, gathered=True),
            # Offload's copies of each microbatch too (no layer's phase holds them).
            tail_ps=shared_tail_ps(problem, config, group.param_count) + to_ps(
                config.num_microbatches
                * sum(microbatch_seconds(problem, config, group.param_count))),
            # ZeRO-2's once-per-step reduce-scatter of the root unit is in its tail.
            sync_ps=0 if config.reduces_once else sync_ps(problem, config,
                                                          group.param_count),
            gather_ps=gather_ps(problem, config, group.param_count),
            step_bytes=step_bytes(problem, config, group.param_count, group.param_count),
            # fp32 gradients between the stages holding it (first and last, usually):
            # over the network unless the whole pipeline fits in one node.
            tie_sync_ps=to_ps(collective_seconds(
                "send", group.param_count * problem.train.precision.master_bytes,
                Group.over(devices, 2, devices.num_devices))),
        )
        for group in problem.model.shared
    )


class TableCache:
    """Rows of cost tables shared between the configurations of one problem.

    A layer's row depends on the layer's numbers and on the configuration's micro-batch
    size, dp, tensor-parallel variant and ZeRO stage, never on its name, pp or schedule;
    the 80 identical blocks of a 70B model thus share one row per configuration family,
    and the many configurations of a search share rows and cut tables. Rows of other
    families share their parts: a layer's compute (:func:`~partc.cost.row_parts.compute_part`) whatever dp,
    pp, ZeRO stage or offload, its parameters' figures (:func:`~partc.cost.row_parts.param_part`) whatever the
    schedule or the layer's compute. Nothing but the
    limits depends on the devices' memory, so problems that differ only in memory
    (re-planning after a budget change) may share a cache too.

    The caller owns it: ``partc.planner.solve`` takes one (a fresh one by default) and
    ``partc.PlanCache.table_cache`` keeps one per problem, memory aside.
    """

    def __init__(self) -> None:
        self._tables: dict[tuple, tuple] = {}   # rows, cut and shared tables, limits
        self.distinct: dict[int, tuple] = {}   # per rows tuple: planner's row summary
        self.splits: dict[tuple, int] = {}     # planner's min-max splits of layer costs
        # What the planner learnt from earlier problems (memory aside, the same): the
        # assignment it chose for each configuration it solved, and the best configuration.
        self.solutions: dict[PipelineConfig, Any] = {}
        # The planner's greedy plan of each table of the solve under way, by the table's
        # and its problem's identity (partc.planner.bounds.greedy_plan).
        self.greedy: dict[tuple[int, int], tuple] = {}
        self.best_config: PipelineConfig | None = None
        self._groups: dict[int, tuple[Any, list[int], list[int]]] = {}
        # A row's parts (partc.cost.row_parts), shared by the rows
        # of configurations that differ elsewhere.
        self._parts: dict[tuple, tuple] = {}

    def rows(self, problem: PlanningProblem, config: PipelineConfig) -> tuple[LayerTable, ...]:
        """One row per layer; layers with equal numbers share one row object."""
        family = (config.micro_batch_size, config.dp, config.tp, config.sequence_parallel,
                  config.tp_objective, config.zero_stage, config.reduces_once,
                  schedule_info(config.schedule).split_backward, config.cp, config.cp_kind,
                  _offload_key(config))
        known = self._tables.get(("rows", family, id(problem.model)))
        if known is not None:
            return known
        group_of, representatives = self._layer_groups(problem)
        built = [_layer_table(problem, config, index, self._parts)
                 for index in representatives]
        rows = self._tables["rows", family, id(problem.model)] = tuple(
            built[group] for group in group_of)
        return rows

    def _layer_groups(self, problem: PlanningProblem) -> tuple[list[int], list[int]]:
        """Per layer, the index of its group of equal layers; each group's first layer."""
        model = problem.model
        known = self._groups.get(id(model))
        if known is None or known[0] is not model:
            keys: dict[tuple, int] = {}
            group_of, representatives = [], []
            for index, layer in enumerate(model.layers):
                group = keys.setdefault(_layer_key(layer, problem.pins.fp8_linears,
                                                   problem.train.fp8_kept), len(keys))
                if group == len(representatives):
                    representatives.append(index)
                group_of.append(group)
            known = self._groups[id(model)] = (model, group_of, representatives)
        return known[1], known[2]

    def shared(self, problem: PlanningProblem,
               config: PipelineConfig) -> tuple[SharedTable, ...]:
        key = ("shared", config.micro_batch_size, config.num_microbatches, config.dp,
               config.tp, config.sequence_parallel, config.tp_objective, config.zero_stage,
               config.reduces_once, config.cp, _offload_key(config))
        if key not in self._tables:
            self._tables[key] = _shared_tables(problem, config)
        return self._tables[key]

    def limits(self, problem: PlanningProblem, config: PipelineConfig) -> tuple[int, ...]:
        """Each stage's memory limit: what its smallest device leaves the plan
        (:func:`stage_limits`)."""
        devices = problem.devices
        # The devices' memory by identity (a tuple per device: hashing it for every
        # configuration costs more than the lookup), the tuple kept to check it.
        key = ("limits", config.pp, config.dp, config.tp, config.ep,
               id(devices.memory_bytes), devices.context_memory,
               devices.communicator_memory, devices.memory_fragmentation)
        known = self._tables.get(key)
        if known is None or known[0] is not devices.memory_bytes:
            known = self._tables[key] = (devices.memory_bytes, stage_limits(problem, config))
        return known[1]

    def host_nodes(self, pp: int, devices) -> tuple[tuple[int, ...], ...]:
        """:func:`partc.cost.offload_time.stages_per_node`, once per pipeline depth: a
        list per node, which thousands of configurations share."""
        key = ("host nodes", pp, devices.num_devices, devices.devices_per_node)
        if key not in self._tables:
            self._tables[key] = tuple(tuple(counts) for counts in stages_per_node(pp, devices))
        return self._tables[key]

    def cut_bytes(self, problem: PlanningProblem, config: PipelineConfig) -> tuple[int, ...]:
        """:func:`partc.cost.communication.cut_bytes`, once per micro-batch size, cp and
        tensor-parallel variant."""
        key = ("cut bytes", config.micro_batch_size, config.cp, id(problem.model))
        known = self._tables.get(key)
        if known is None or known[0] is not problem.model:
            known = self._tables[key] = (problem.model, cut_bytes(problem, config))
        return known[1]

    def cuts(self, problem: PlanningProblem,
             config: PipelineConfig) -> tuple[tuple[int, ...], ...]:
        placement = config.chunks > 1 and schedule_info(config.schedule).placement
        key = ("cuts", config.micro_batch_size, config.pp, config.chunks, placement,
               config.tp, config.sequence_parallel, config.tp_objective, config.cp)
        cuts = self._tables.get(key)
        if cuts is None:
            cuts = self._tables[key] = cut_table(problem, config)
        return cuts


def _offload_key(config: PipelineConfig) -> tuple:
    """What of ``config`` offload's rows depend on."""
    return (config.offload_optimizer, config.offload_params) if config.offload_optimizer \
        else ()


def _layer_key(layer, fp8_pins: Any = None, fp8_kept: tuple[str, ...] = ()) -> tuple:
    """Every number of a LayerCost a row depends on (not its name or signature, nor its
    linears' names: only which of them FP8 pins name, and which it keeps)."""
    pinned = fp8_pins if isinstance(fp8_pins, tuple) else ()
    ops = tuple(replace(op, linear_names=tuple((name in pinned, name in fp8_kept)
                                               for name in op.linear_names))
                for op in layer.heavy_ops)
    return (layer.fwd_flops, ops, layer.fwd_mem_bytes, layer.param_count,
            layer.param_bytes, tuple(sorted(layer.saved_bytes.items())),
            tuple(sorted(layer.recompute_flops.items())),
            tuple(sorted(layer.recompute_mem_bytes.items())), layer.workspace_bytes,
            layer.tp_comm, layer.tp_overlap_flops, layer.num_nodes, layer.fused_mem_bytes,
            layer.fused_kernels, tuple(sorted(layer.recompute_nodes.items())),
            layer.param_tensors, layer.largest_param, layer.backward_mem_bytes,
            layer.forward_kernels, layer.backward_kernels,
            tuple(sorted(layer.recompute_kernels.items())),
            tuple(sorted(layer.ring_kernels.items())), layer.ring_bwd_mem_bytes,
            layer.ring_kernels_single and tuple(sorted(layer.ring_kernels_single.items())),
            layer.ring_bwd_mem_bytes_single, layer.attention,
            layer.offload_bytes)


def build_cost_table(problem: PlanningProblem, config: PipelineConfig,
                     cache: TableCache | None = None) -> CostTable:
    """The integer tables of ``config``; ``cache`` shares rows with other configurations
    of the same problem (a cache must not outlive its problem: rows are keyed by layer
    numbers, not by the devices and training numbers they were computed with)."""
    cache = cache or TableCache()
    whole, problem = problem, problem.variant(config.tp, config.sequence_parallel,
                                              config.tp_objective)
    devices = problem.devices
    if devices.num_devices != config.pp * config.dp * config.cp * config.tp:
        raise ValueError(f"pp={config.pp} x dp={config.dp} x cp={config.cp} x tp={config.tp} "
                         f"does not use {devices.num_devices} devices")
    shared = cache.shared(problem, config)
    limits = cache.limits(problem, config)
    params = grad_config(config)   # gradients reduce over dp x cp
    latency = bucket_latency_seconds(problem, params)
    first_gather = first_gather_ps(problem, params)
    last_sync = last_sync_ps(whole, problem, params)
    return CostTable(
        config=config,
        layers=moe_rows(whole, problem, config, cache.rows(problem, config), cache),
        shared=shared,
        cut_ps=cache.cuts(problem, config),
        limits=limits,
        tail_latency_ps=to_ps(latency + host_fill_seconds(problem, config)) + first_gather
        + last_sync,
        overlap_permille=permille(devices.comm_overlap),
        first_gather_ps=first_gather, last_sync_ps=last_sync,
        cut_bytes=cache.cut_bytes(problem, config),
        step_sums=steps_whole_list(problem, params),
        host_limit=host_limit(devices),
        host_memory=devices.host_memory,
        host_per_param=host_bytes_per_param(problem, config),
        ranks_per_node=ranks_per_node(problem),
        host_nodes=cache.host_nodes(config.pp, devices),
    )


def moe_layer_table(whole: MoECost, problem: PlanningProblem, config: PipelineConfig,
                    index: int) -> LayerTable:
    """A mixture-of-experts layer's row under expert parallelism (``config.ep > 1``):

    - compute: the layer's own figures (experts included as one process runs them: at
      balanced routing a rank's experts do the FLOPs of its own tokens, whatever ep),
      plus the FLOPs whole experts add where the variant split them over tp, at the
      device's matmul rate; plus two all-to-alls forward (dispatch, combine), two
      backward, and two more in a recomputed forward;
    - memory: the experts' saved activations at the worst routing the plan allows
      (:func:`partc.cost.experts_cost.moe_worst_factor`) instead of the balanced ones, for
      every microbatch in flight;
    - parameters: the layer's other parameters as usual (over dp), the rank's ``1 / ep``
      of the experts over the expert-data-parallel group (:func:`expert_dp_config`):
      their ZeRO sharding, gradient reduction, gather and optimizer step.
    """
    layer = run_layer(problem, index, config.micro_batch_size)
    devices, train = problem.devices, problem.train
    figures = moe_layer_figures(whole, layer, problem, config)
    expert_config = expert_dp_config(config)
    b, scale = config.micro_batch_size, train.measured_scale
    rate = devices.peak_flops * devices.flops_efficiency
    work = layer_work(layer, devices, b, scale)
    comm = tp_comm_seconds(problem, config, layer)
    extra = b * figures.flops_delta / rate
    a2a = 2 * figures.all_to_all_s
    dense, experts = figures.dense_params, figures.expert_params
    phases = moe_layer_phases(whole, problem, config, index, layer, work, comm)
    forward, backward = phases.forward_s, phases.backward_s
    zero_dense = zero_comm_seconds(problem, config, dense)
    zero_experts = zero_comm_seconds(problem, expert_config, experts)
    replayed = {m: layer.recompute_flops[m] / layer.fwd_flops if layer.fwd_flops else 0.0
                for m in layer.modes}
    # Selective recompute reruns the attention cores: no expert, no collective.
    recompute = {m: sum(work["recompute"][m]) + (
        comm["forward"] + replayed[m] * extra + a2a if m == "full" else 0.0)
        for m in layer.modes}
    expert_share = dict(layer.moe.expert_saved_bytes) if layer.moe is not None else {
        m: v / config.tp for m, v in whole.expert_saved_bytes.items()}
    saved = {m: int(round(b * scale * (v - expert_share.get(m, 0.0)
                                       + figures.expert_saved[m])))
             for m, v in layer.saved_bytes.items()}
    # In mixed precision the compute-dtype weights are state, made once per step
    # (state_bytes), not copies kept per microbatch.
    workspace = int(round(2 * b * scale * layer.workspace_bytes))
    gathered_d, gradient_d = zero_transient(problem, config, dense)
    gathered_e, gradient_e = zero_transient(problem, expert_config, experts)
    gathered, gradient = gathered_d + gathered_e, gradient_d + gradient_e
    state_d = state_bytes(problem, config, dense)
    state_e = state_bytes(problem, expert_config, experts)
    copies = [sum(pair) for pair in zip(microbatch_seconds(problem, config, dense),
                                        microbatch_seconds(problem, expert_config, experts))]
    forward_ps = to_ps(overlapped(forward, zero_dense["forward"] + zero_experts["forward"],
                                  problem.devices.comm_overlap) + copies[0])
    backward_ps = to_ps(overlapped(backward, zero_dense["backward"] + zero_experts["backward"],
                                   problem.devices.comm_overlap) + copies[1])
    recompute_ps = {m: to_ps(v) for m, v in recompute.items()}
    # The experts' saved bytes at the worst routing beside the rest as measured.
    moved = moved_bytes(layer, b * scale, saved) + saved["none"] - int(round(
        b * scale * layer.saved_bytes["none"]))
    with_offload(recompute_ps, saved, moved, forward_ps, backward_ps, devices)
    return LayerTable(
        offload_bytes=moved if "offload" in saved else 0,
        forward_ps=forward_ps,
        backward_ps=backward_ps,
        recompute_ps=recompute_ps,
        saved_bytes=saved,
        transient_bytes=transient(saved, moved, workspace, gathered, gradient),
        param_count=dense + experts,
        state_bytes={k: state_d[k] + state_e[k] for k in state_d},
        tail_ps=tail_ps(problem, config, dense, max(1, layer.param_tensors))
        + tail_ps(problem, expert_config, experts),
        sync_ps=sync_ps(problem, config, dense) + sync_ps(problem, expert_config, experts),
        gather_ps=gather_ps(problem, config, dense)
        + gather_ps(problem, expert_config, experts),
        # The experts as one grouped tensor, the rank's share of them.
        step_bytes=step_total((step_bytes(problem, config, dense, layer.largest_param),
                               step_bytes(problem, expert_config, experts, experts)),
                              steps_whole_list(problem, config)),
    )


def moe_layer_phases(whole: MoECost, problem: PlanningProblem, config: PipelineConfig,
                     index: int, layer=None, work=None, comm=None) -> LayerPhases:
    """:class:`LayerPhases` of a mixture-of-experts layer under expert parallelism
    (:func:`moe_layer_table`): its dense parameters' ZeRO collectives over dp and its
    experts' over the expert-data-parallel group, summed by when they run."""
    devices = problem.devices
    if layer is None:
        layer = run_layer(problem, index, config.micro_batch_size)
    if work is None:
        work = layer_work(layer, devices, config.micro_batch_size,
                          problem.train.measured_scale)
    if comm is None:
        comm = tp_comm_seconds(problem, config, layer)
    figures = moe_layer_figures(whole, layer, problem, config)
    expert_config = expert_dp_config(config)
    extra = config.micro_batch_size * figures.flops_delta / (
        devices.peak_flops * devices.flops_efficiency)
    a2a = 2 * figures.all_to_all_s
    dense, experts = figures.dense_params, figures.expert_params
    zero_dense = zero_comm_seconds(problem, config, dense)
    zero_experts = zero_comm_seconds(problem, expert_config, experts)
    own = {phase: zero_overhead_seconds(problem, config, dense)[phase]
           + zero_overhead_seconds(problem, expert_config, experts)[phase]
           for phase in ("forward", "backward")}
    forward = sum(work["forward"]) + comm["forward"] + extra + a2a + own["forward"]
    backward = (split_factor(problem, config) * (sum(work["backward"]) + 2 * extra)
                + comm["backward"] + a2a + own["backward"])
    return LayerPhases(forward_s=forward, backward_s=backward,
                       zero={key: zero_dense[key] + zero_experts[key] for key in zero_dense})


def moe_rows(whole: PlanningProblem, problem: PlanningProblem, config: PipelineConfig,
             rows: tuple[LayerTable, ...], cache: "TableCache") -> tuple[LayerTable, ...]:
    """``rows`` with each mixture-of-experts layer's row priced under the configuration's
    expert parallelism (:func:`moe_layer_table`); ``rows`` themselves when ``ep`` is 1 or
    the model has no such layer. ``whole`` is the problem before its tensor-parallel
    variant (the experts' whole figures); equal layers share one row, and the tuple is
    kept in ``cache`` (the planner's bounds key rows by identity)."""
    if config.ep == 1 or not any(layer.moe for layer in whole.layers):
        return rows
    key = ("moe rows", config.micro_batch_size, config.dp, config.tp,
           config.sequence_parallel, config.tp_objective, config.zero_stage, config.ep,
           config.reduces_once, schedule_info(config.schedule).split_backward,
           config.cp, _offload_key(config), id(problem.model))
    known = cache._tables.get(key)
    if known is not None and known[0] is problem.model:
        return known[1]
    built: dict[tuple, LayerTable] = {}
    result = []
    for index, row in enumerate(rows):
        moe = whole.layers[index].moe
        if moe is None:
            result.append(row)
            continue
        same = (id(row), _moe_key(moe), _moe_key(problem.layers[index].moe))
        if same not in built:
            built[same] = moe_layer_table(moe, problem, config, index)
        result.append(built[same])
    cache._tables[key] = (problem.model, tuple(result))
    return cache._tables[key][1]


def _moe_key(moe: MoECost | None) -> tuple | None:
    """Every field of a MoECost (its dict of saved bytes as sorted items)."""
    if moe is None:
        return None
    return (moe.num_experts, moe.top_k, moe.hidden, moe.tokens_per_sample,
            moe.expert_param_count, moe.expert_param_bytes, moe.expert_fwd_flops,
            tuple(sorted(moe.expert_saved_bytes.items())), moe.dispatch_bytes,
            moe.capacity_factor, moe.aux_loss, moe.expert_form)
