"""Hand-built and random planning problems, and a brute-force oracle for small ones."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

from partc.spec import AUTO_SCHEDULES
from partc.cost.evaluate import evaluate, simulated_step_ps
from partc.cost.pipeline_config import PipelineConfig
from partc.cost.tables import build_cost_table
from partc.cli.choices import SCHEDULES
from partc.cost.schedules import feature_refusal, refusal
from partc.cost.schedules import schedule as schedule_info
from partc.problem import (DeviceNumbers, HeavyOp, LayerCost, ModelAnalysis, ModelSummary,
                           Pins, PlanningProblem, Precision, SharedParam, TrainNumbers)


def layer(name: str, *, flops: float = 1e9, params: int = 1000, saved: float = 1000.0,
          selective: float | None = None, full: float = 100.0, workspace: float = 100.0,
          mem_bytes: float = 0.0, signature: str = "", largest: int = 0) -> LayerCost:
    saved_bytes = {"none": saved, "full": full}
    recompute_flops = {"none": 0.0, "full": flops}
    recompute_mem = {"none": 0.0, "full": mem_bytes}
    if selective is not None:
        saved_bytes["selective"] = selective
        recompute_flops["selective"] = 0.0
        recompute_mem["selective"] = mem_bytes / 2
    return LayerCost(name=name, signature=signature or name, fwd_flops=flops,
                     fwd_mem_bytes=mem_bytes, param_count=params, param_bytes=4 * params,
                     saved_bytes=saved_bytes, recompute_flops=recompute_flops,
                     recompute_mem_bytes=recompute_mem, workspace_bytes=workspace,
                     largest_param=largest,
                     # One compute-bound op: its FLOPs at peak, its bytes not counted.
                     heavy_ops=(HeavyOp(flops=flops, activation_bytes=0.0, weight_bytes=0.0),)
                     if flops else ())


def devices(num: int, memory: int | list[int], *, peak: float = 1e12, bandwidth: float = 1e9,
            node: int = 8, latency: float = 0.0, overlap: float = 1.0) -> DeviceNumbers:
    memories = tuple(memory) if isinstance(memory, list) else (memory,) * num
    return DeviceNumbers(num_devices=num, memory_bytes=memories, peak_flops=peak,
                         flops_efficiency=1.0, hbm_bandwidth=1e12, devices_per_node=node,
                         intra_node_bandwidth=bandwidth, inter_node_bandwidth=bandwidth,
                         link_latency_s=latency, comm_overlap=overlap)


def problem(layers: list[LayerCost], cuts: list[float], device_numbers: DeviceNumbers, *,
            batch: int = 1, micro_batch_sizes: tuple[int, ...] | None = None,
            shared: tuple[SharedParam, ...] = (), pins: Pins = Pins(),
            optimizer_bytes: float = 8.0, step_copies: float = 0.0) -> PlanningProblem:
    summary = ModelSummary(name="hand-built", num_params=sum(l.param_count for l in layers),
                           hash="0", tokens_per_sample=0, traced_batch_size=1,
                           traced_dtype_bytes=4, tracer="none")
    sizes = micro_batch_sizes or tuple(b for b in range(1, batch + 1) if batch % b == 0)
    return PlanningProblem(
        model=ModelAnalysis(summary=summary, layers=tuple(layers), cut_bytes=tuple(cuts),
                            shared=shared),
        devices=device_numbers,
        train=TrainNumbers(global_batch_size=batch, micro_batch_sizes=sizes,
                           activation_scale=1.0,
                           precision=Precision(compute_bytes=4,
                                               optimizer_state_bytes=optimizer_bytes,
                                               step_copies=step_copies)),
        pins=pins,
    )


def random_problem(rng: random.Random, scale: int = 1) -> PlanningProblem:
    """A small random instance; ``scale`` multiplies every size (parameters, activations,
    memory) to reach the byte magnitudes of real models."""
    num_layers = rng.randint(1, 6)
    num_devices = rng.choice([1, 2, 3])
    layers = []
    for index in range(num_layers):
        saved = rng.choice([2e3, 8e3, 3e4, 1e5]) * scale
        layers.append(layer(
            f"layer{index}", flops=rng.choice([1e8, 5e8, 1e9, 3e9]),
            params=rng.choice([0, 1000, 5000, 20000]) * scale,
            saved=saved, full=rng.choice([100.0, 500.0, 1000.0]) * scale,
            selective=saved / rng.choice([2, 4]) if rng.random() < 0.5 else None,
            workspace=rng.choice([100.0, 2000.0, 1e4]) * scale,
            mem_bytes=rng.choice([0.0, 1e5, 1e6])))
    shared: tuple[SharedParam, ...] = ()
    if num_layers >= 2 and rng.random() < 0.3:
        shared = (SharedParam(name="tied", fqns=("a.weight", "b.weight"),
                              param_count=4000 * scale, param_bytes=16000 * scale,
                              layers=(0, num_layers - 1)),)
    total = sum(16 * l.param_count + 4 * l.saved_bytes["none"] for l in layers)
    share = rng.choice([0.3, 0.6, 1.0, 2.0, 4.0]) / num_devices
    factors = [1] * num_devices
    if num_devices > 1 and rng.random() < 0.2:
        factors = [rng.choice([1, 2]) for _ in range(num_devices)]
    cuts = [rng.choice([0.0, 1e3, 1e5, 1e6]) for _ in range(num_layers - 1)]
    bandwidth, node, latency = (rng.choice([1e8, 1e10]), rng.choice([1, 8]),
                                rng.choice([0.0, 1e-6]))
    batch = rng.choice([1, 2, 4])
    # A stage's receive buffers hold the whole batch's activations across the cut
    # before it and their gradients across the cut after it.
    total += 2 * batch * max(cuts, default=0.0)
    memory = int(total * share) + 20000 * scale
    numbers = devices(num_devices, [memory * f for f in factors], bandwidth=bandwidth,
                      node=node, latency=latency)
    # Drawn last, so the instances' other numbers stay as they were before it was drawn.
    numbers = replace(numbers, comm_overlap=rng.choice([0.0, 0.5, 1.0]))
    return problem(layers, cuts, numbers, batch=batch, shared=shared)


def brute_force(prob: PlanningProblem) -> tuple[int, PipelineConfig, list[int], list[str]] | None:
    """The best (step_ps, config, stage_of, modes) by enumerating everything, or None."""
    best = None
    n, num_layers = prob.devices.num_devices, prob.num_layers
    for pp in range(1, min(n, num_layers) + 1):
        if n % pp or prob.train.global_batch_size % (n // pp) or prob.pins.pp not in (None, pp):
            continue
        dp = n // pp
        for b in prob.train.micro_batch_sizes:
            per_replica = prob.train.global_batch_size // dp
            if per_replica % b:
                continue
            m = per_replica // b
            for schedule, zero, chunks, sync in schedule_choices(prob, pp, dp, m):
                config = PipelineConfig(pp=pp, dp=dp, micro_batch_size=b,
                                        zero_stage=zero, num_microbatches=m,
                                        schedule=schedule, chunks=chunks,
                                        zero2_grad_sync=sync)
                best = _best_split(prob, config, best)
    return best


def schedule_choices(prob: PlanningProblem, pp: int, dp: int, m: int):
    """Every (schedule, ZeRO stage, virtual stages per rank v, ZeRO-2 gradient sync)
    brute force tries: v where the schedule runs v, torch takes pp ranks and m
    microbatches, and every run gets a layer; ZeRO only with replicas (or as pinned: it
    then runs as 0); ZeRO-2's reduce-scatter after every microbatch or once per step
    where there are several; as the pins allow."""
    num_layers = prob.num_layers
    schedules = (prob.pins.schedule,) if prob.pins.schedule else AUTO_SCHEDULES
    for schedule, zero, sync in itertools.product(schedules, (0, 1, 2, 3),
                                                  ("microbatch", "step")):
        if zero and dp == 1 and prob.pins.zero_stage is None:
            continue  # ZeRO shards over replicas: with one there is nothing to shard
        if sync == "step" and (zero != 2 or dp == 1 or m == 1):
            continue  # the same as reducing per microbatch
        if prob.pins.zero_stage not in (None, zero) \
                or prob.pins.zero2_grad_sync not in (None, sync):
            continue
        if feature_refusal(schedule, zero if dp > 1 else 0, prob.train.compiled) is not None:
            continue  # the runtime does not run it (e.g. a split backward under FSDP)
        allowed = schedule_info(schedule).virtual_stages or range(2, num_layers + 1)
        for v in allowed:
            if prob.pins.virtual_stages in (None, v) \
                    and (v == 1 or pp > 1 and prob.pins.stages is None) \
                    and pp * v <= num_layers and refusal(schedule, pp, v, m) is None:
                yield schedule, zero, v, sync


def _modes(prob: PlanningProblem, index: int) -> tuple[str, ...]:
    """The modes a layer may take: its own (offload too where the problem allows it),
    or the pinned one ("none" for a pinned "selective" on a layer without a selective
    mode)."""
    cost = prob.layers[index]
    pinned = prob.pins.recompute.get(cost.name)
    if pinned is None:
        return prob.layer_modes(index)
    return (pinned if pinned in cost.modes or pinned == "offload" else "none",)


def with_host(prob: PlanningProblem, rng: random.Random) -> PlanningProblem:
    """``prob`` with a host link that may price offload anywhere between free and
    ruinous (its copy stream beside compute, or not) and a host memory that may bind."""
    bandwidth = rng.choice([1e6, 1e8, 1e9, 1e11])
    saved = sum(l.saved_bytes["none"] for l in prob.layers)
    host = int(saved * rng.choice([0.5, 2.0, 8.0])) + 1
    return replace(prob, devices=replace(
        prob.devices, host_memory=host, host_to_device_bandwidth=bandwidth,
        device_to_host_bandwidth=bandwidth * rng.choice([0.5, 1.0]),
        dispatch_ahead=rng.random() < 0.7))


def _best_split(prob: PlanningProblem, config: PipelineConfig, best):
    """``best`` improved by any split of the layers into the config's runs."""
    table = build_cost_table(prob, config)
    num_layers = prob.num_layers
    for starts in itertools.combinations(range(1, num_layers), config.virtual_stages - 1):
        stage_of = [sum(1 for s in starts if s <= l) for l in range(num_layers)]
        for modes in itertools.product(*(_modes(prob, l) for l in range(num_layers))):
            ev = evaluate(table, stage_of, modes)
            if ev.fits and (best is None or ev.step_ps < best[0]):
                best = (ev.step_ps, config, stage_of, list(modes))
    return best


def least_played(prob: PlanningProblem, config: PipelineConfig) -> int | None:
    """Brute force of the step played out (``simulated_step_ps``, what a plan reports):
    its least over every split of the layers into the config's runs and every recompute
    mode that fits; None when none fits."""
    table = build_cost_table(prob, config)
    best = None
    for starts in itertools.combinations(range(1, prob.num_layers), config.virtual_stages - 1):
        stage_of = [sum(1 for s in starts if s <= l) for l in range(prob.num_layers)]
        for modes in itertools.product(*(_modes(prob, l) for l in range(prob.num_layers))):
            ev = evaluate(table, stage_of, modes)
            if ev.fits:
                step = simulated_step_ps(config, ev)[0]
                best = step if best is None else min(best, step)
    return best


def repeated_problem(rng: random.Random) -> PlanningProblem:
    """A model of equal blocks between an embedding and a head, as the planner's
    segments see real models: sometimes one block differs, one inner cut differs, a
    block's recompute is pinned, the embedding and head are tied, or every block shares
    one parameter (ALBERT's way)."""
    num_blocks = rng.randint(3, 5)
    block = dict(flops=rng.choice([5e8, 1e9]), params=rng.choice([1000, 5000]),
                 saved=rng.choice([8e3, 3e4]), full=500.0,
                 selective=4e3 if num_blocks < 5 and rng.random() < 0.4 else None,
                 workspace=2000.0)
    layers = [layer("emb", flops=1e8, params=8000, saved=2e3, workspace=100.0)]
    layers += [layer(f"block{i}", **block, signature="block") for i in range(num_blocks)]
    if rng.random() < 0.3:   # one block of another size in the middle
        middle = 1 + num_blocks // 2
        layers[middle] = layer(f"block{middle - 1}", **{**block, "flops": 3e9})
    layers.append(layer("head", flops=2e9, params=8000, saved=6e3, workspace=4000.0))
    inner = rng.choice([0.0, 1e5, 1e6])
    cuts = [1e4] + [inner] * (num_blocks - 1) + [3e4]
    if rng.random() < 0.2:   # one cut inside the blocks carries more
        cuts[rng.randint(1, num_blocks - 1)] = 2e6
    shared: tuple[SharedParam, ...] = ()
    draw = rng.random()
    if draw < 0.25:
        shared = (SharedParam(name="wte", fqns=("emb.weight", "head.weight"),
                              param_count=8000, param_bytes=32000,
                              layers=(0, len(layers) - 1)),)
    elif draw < 0.45:
        shared = (SharedParam(name="blocks", fqns=("block.weight",), param_count=4000,
                              param_bytes=16000, layers=tuple(range(1, num_blocks + 1))),)
    recompute = {f"block{rng.randint(0, num_blocks - 1)}": rng.choice(["none", "full"])
                 } if rng.random() < 0.3 else {}
    num_devices = rng.choice([2, 4])
    # Half of them a pure pipeline, where blocks share stages; some interleaved.
    layout = rng.choice([{}, {"pp": num_devices}, {"pp": num_devices},
                         {"pp": 2, "schedule": "interleaved-1f1b"}])
    pins = Pins(recompute=recompute, **layout)
    total = sum(16 * l.param_count + 4 * l.saved_bytes["none"] for l in layers)
    share = rng.choice([0.7, 1.0, 1.5, 3.0]) / num_devices
    bandwidth, node, batch = rng.choice([1e8, 1e10]), rng.choice([2, 8]), rng.choice([2, 4])
    # Receive buffers: the batch's activations in, and their gradients back (a stage
    # inside the pipeline holds both).
    total += 2 * batch * max(cuts)
    memory = int(total * share) + 20000
    return problem(layers, cuts, devices(num_devices, memory, bandwidth=bandwidth, node=node),
                   batch=batch, shared=shared, pins=pins)


def schedule_trials_expected(prob: PlanningProblem, config: PipelineConfig) -> set:
    """The (schedule, v, ZeRO stage) the automatic schedule choice must try on ``config``
    besides it, enumerated apart from the planner: every schedule the closed-form search
    does not weigh, with the virtual-stage counts it takes (2-4 for those taking any, or
    the pinned one), where torch runs it and every run gets a layer, at the ZeRO stage of
    ``config`` or the highest lower one the runtime runs the schedule with; with the
    schedule pinned, it with every other count it takes (or none when that is pinned);
    none when the stages are pinned, or with one stage. Counts go up to a layer per run."""
    if prob.pins.stages is not None or config.pp == 1:
        return set()
    if prob.pins.schedule:
        info = schedule_info(config.schedule)
        counts = [prob.pins.virtual_stages] if prob.pins.virtual_stages is not None \
            else info.virtual_stages or range(2, prob.num_layers // config.pp + 1)
        return {(config.schedule, v, config.zero_stage) for v in counts
                if v != config.chunks and config.pp * v <= prob.num_layers
                and refusal(config.schedule, config.pp, v, config.num_microbatches) is None}
    expected = set()
    for name in SCHEDULES:
        # The configuration's ZeRO stage, or the highest lower one the runtime runs the
        # schedule with (a split backward under FSDP is refused) and the pins allow.
        zeros = [z for z in range(config.zero_stage if config.dp > 1 else 0, -1, -1)
                 if feature_refusal(name, z, prob.train.compiled) is None
                 and (config.dp == 1 or prob.pins.zero_stage in (None, z))]
        if name in AUTO_SCHEDULES or not zeros:
            continue
        counts = schedule_info(name).virtual_stages or range(2, prob.num_layers // config.pp + 1)
        if prob.pins.virtual_stages is not None:
            counts = [v for v in (prob.pins.virtual_stages,)
                      if schedule_info(name).allows_virtual_stages(v)]
        expected |= {(name, v, zeros[0] if config.dp > 1 else config.zero_stage)
                     for v in counts if config.pp * v <= prob.num_layers
                     and refusal(name, config.pp, v, config.num_microbatches) is None}
    return expected


def best_split_of(prob: PlanningProblem, config: PipelineConfig):
    """Brute force's optimum for one configuration: (step_ps, config, stage_of, modes)
    over every split into its runs and every recompute mode, or None when none fits."""
    return _best_split(prob, config, None)
