"""Sequence-parallel collectives run as rings beside their linears' matmuls
(``TrainSpec.tp_overlap``) cost their exposed part only.

A collective of ``c`` seconds that a ring runs beside matmuls of ``F`` FLOPs
(``LayerCost.tp_overlap_flops``) at tp = 2 hides behind ``t = F / 2 / rate`` of them
(the chunk held first runs alone): it costs ``c - comm_overlap * min(c, t)``. Devices:
1e12 FLOP/s at efficiency 1, 1e9 bytes/s links, no latency (``instances.devices``).
"""

from __future__ import annotations

import dataclasses

import pytest

from partc.cost.collectives import Group, collective_seconds
from partc.compiler import plan_of
from partc.cost.communication import tp_comm_seconds
from partc.cost.pipeline_config import PS_PER_S, PipelineConfig
from partc.cost.tables import build_cost_table
from partc.planner import solve
from partc.problem import LayerCost, Pins, TPOption
from partc.planner.validate import validate_plan
from tests.planner.instances import best_split_of, devices, layer, problem

NBYTES = 4e6
RATE = 1e12


def _seconds(kind: str) -> float:
    return collective_seconds(kind, NBYTES, Group.over(devices(2, 10**12), 2, 2))


def _ring_layer(name: str, hide: float) -> LayerCost:
    """A sequence-parallel block: the gather before its column-parallel linears (and,
    backward, its regather and the input gradient's reduce-scatter) beside matmuls that
    take ``hide`` times the gather's time; the all-reduce of a partial bias stays
    blocking."""
    flops = hide * _seconds("all_gather") * 2 * RATE   # t = flops / 2 / rate
    return dataclasses.replace(
        layer(name, flops=2e9, params=10**6),
        tp_comm=(("all_gather", "forward", NBYTES), ("all_gather", "backward", NBYTES),
                 ("reduce_scatter", "backward", NBYTES), ("all_reduce", "backward", NBYTES)),
        tp_overlap_flops=(flops, flops, flops, 0.0))


def _problem(hides: list[float], *, overlap: float = 1.0, rings: bool = True):
    layers = [_ring_layer(f"block{i}", hide) for i, hide in enumerate(hides)]
    base = problem([layer(f"block{i}", flops=4e9, params=2 * 10**6)
                    for i in range(len(hides))], [1e6] * (len(hides) - 1),
                   devices(4, 10**12, overlap=overlap), batch=4,
                   pins=Pins(tp=2, sequence_parallel=True))
    option = TPOption(tp=2, sequence_parallel=True, choices=(), placements=(),
                      model=dataclasses.replace(base.model, layers=tuple(layers)))
    whole = dataclasses.replace(base.model, tensor_parallel=(option,))
    train = dataclasses.replace(base.train, tp_overlap=rings)
    return dataclasses.replace(base, model=whole, train=train)


CONFIG = PipelineConfig(pp=1, dp=2, tp=2, sequence_parallel=True, micro_batch_size=1,
                        num_microbatches=2, schedule="1f1b")


@pytest.mark.parametrize("hide", [0.5, 3.0])
def test_a_ring_hides_its_collective_up_to_the_matmuls_beside_it(hide):
    prob = _problem([hide])
    comm = tp_comm_seconds(prob, CONFIG, prob.variant(2, True).layers[0])
    gather, scatter = _seconds("all_gather"), _seconds("reduce_scatter")
    matmul = hide * gather
    exposed = [max(0.0, c - matmul) for c in (gather, gather, scatter)]
    assert comm["forward"] == pytest.approx(exposed[0], rel=1e-12)
    assert comm["backward"] == pytest.approx(exposed[1] + exposed[2]
                                             + _seconds("all_reduce"), rel=1e-12)
    if hide > 1:   # the matmuls outlast the gathers: only the blocking all-reduce is left
        assert comm["forward"] == 0.0


@pytest.mark.parametrize("overlap, rings", [(0.0, True), (1.0, False)])
def test_nothing_is_hidden_without_overlap_or_rings(overlap, rings):
    prob = _problem([3.0], overlap=overlap, rings=rings)
    comm = tp_comm_seconds(prob, CONFIG, prob.variant(2, True).layers[0])
    assert comm["forward"] == pytest.approx(_seconds("all_gather"), rel=1e-12)
    assert comm["backward"] == pytest.approx(
        _seconds("all_gather") + _seconds("reduce_scatter") + _seconds("all_reduce"),
        rel=1e-12)


def test_rows_charge_the_exposed_part_in_every_phase():
    """The row's forward and backward (what the CP-SAT model, ``evaluate`` and the
    validator read) lose exactly what the ring hides; a half overlap hides half."""
    blocking = build_cost_table(_problem([0.5], rings=False), CONFIG).layers[0]
    for overlap, hidden in ((1.0, 0.5), (0.5, 0.25)):
        row = build_cost_table(_problem([0.5], overlap=overlap), CONFIG).layers[0]
        gather = _seconds("all_gather")
        assert blocking.forward_ps - row.forward_ps == pytest.approx(
            hidden * gather * PS_PER_S, abs=2)
        assert blocking.backward_ps - row.backward_ps == pytest.approx(
            2 * overlap * min(0.5 * gather, _seconds("reduce_scatter")) * PS_PER_S, abs=2)


def test_planner_validator_and_brute_force_agree_on_rings():
    """With rings the planner's plan is the brute-force optimum of its configuration,
    the validator (no solver) accepts it, and it is faster than the same problem's
    blocking plan."""
    steps = {}
    for rings in (True, False):
        prob = _problem([0.5, 3.0, 0.2], rings=rings)
        result = solve(prob)
        config = result.best.table.config
        assert config.tp == 2 and config.sequence_parallel
        oracle = best_split_of(prob, config)
        assert result.best.evaluation.step_ps == oracle[0]
        validate_plan(prob, plan_of(prob, result))
        steps[rings] = result.best.evaluation.step_ps
    assert steps[True] < steps[False]


def test_the_report_shows_each_layers_collective_time_and_what_the_step_pays():
    """The plan keeps, per layer, the collectives' own time and their exposed part; the
    report's tensor-parallel table shows both, and they agree with the cost model: the
    same total with or without rings, the exposed part what the rows charge."""
    from partc.report.text import render

    plans = {}
    for rings in (True, False):
        prob = _problem([0.5, 3.0, 0.2], rings=rings)
        plans[rings] = plan = plan_of(prob, solve(prob))
        section = plan.tensor_parallel
        for option_layer in prob.variant(2, True).layers:
            total, exposed = section.step_seconds(option_layer.name, plan.num_microbatches)
            charged = sum(tp_comm_seconds(prob, plan_config(plan), option_layer).values())
            assert exposed == pytest.approx(charged * plan.num_microbatches, rel=1e-12)
            group = Group.over(prob.devices, 2, 2)
            assert total == pytest.approx(plan.num_microbatches * sum(
                collective_seconds(kind, nbytes * plan.micro_batch_size, group)
                for kind, _, nbytes in option_layer.tp_comm), rel=1e-12)
            assert exposed <= total * (1 + 1e-12)
        text = render(plan)
        assert "exposed (in the step)" in text and "sent per rank" in text
    hidden, blocking = plans[True].tensor_parallel, plans[False].tensor_parallel
    assert hidden.collective_total_seconds == pytest.approx(blocking.collective_total_seconds)
    assert all(hidden.collective_seconds[name] < blocking.collective_seconds[name]
               for name in hidden.collective_seconds)
    assert blocking.collective_seconds == pytest.approx(blocking.collective_total_seconds)
    assert "the others are paid whole" in render(plans[True])
    assert "all of it (TrainSpec.tp_overlap off)" in render(plans[False])


def plan_config(plan) -> PipelineConfig:
    """The configuration a plan of these problems runs (pp=1: one stage)."""
    return PipelineConfig(pp=plan.pp, dp=plan.dp, tp=plan.tp,
                          sequence_parallel=plan.sequence_parallel,
                          micro_batch_size=plan.micro_batch_size,
                          num_microbatches=plan.num_microbatches, schedule=plan.schedule)


def _with_ring_work(rings: bool = True, **work):
    """``_problem([0.5])`` (rings run or not) whose layers launch 10 kernels forward and
    20 backward, move nothing else, and have the ring ``work`` given (LayerCost fields);
    each kernel costs 1e-5 s."""
    prob = _problem([0.5], rings=rings)
    option = prob.model.tensor_parallel[0]
    layers = tuple(dataclasses.replace(
        each, forward_kernels=10, backward_kernels=20, backward_mem_bytes=0.0,
        recompute_kernels={"none": 0, "full": 10}, **work)
        for each in option.model.layers)
    option = dataclasses.replace(option, model=dataclasses.replace(option.model,
                                                                    layers=layers))
    return dataclasses.replace(
        prob, devices=dataclasses.replace(prob.devices, kernel_overhead_s=1e-5),
        model=dataclasses.replace(prob.model, tensor_parallel=(option,)))


def test_rings_local_work_is_priced_where_the_rings_run():
    """A ring's own kernels and the bytes its backward moves beyond the blocking calls
    (``LayerCost.ring_kernels``, ``ring_bwd_mem_bytes``, as the estimate measures them)
    are charged only where the rings run, forward, backward and in a full recompute:
    each kernel ``kernel_overhead_s``, each byte at the element-wise rate."""
    work = {"ring_kernels": {"forward": 4, "backward": 6}, "ring_bwd_mem_bytes": 1e6}

    def row(rings: bool, ring_work: bool):
        return build_cost_table(_with_ring_work(rings, **(work if ring_work else {})),
                                CONFIG).layers[0]

    ring, bare = row(True, True), row(True, False)
    bandwidth = _with_ring_work().devices.light_op_bandwidth
    assert ring.forward_ps - bare.forward_ps == pytest.approx(4e-5 * PS_PER_S, abs=2)
    assert ring.backward_ps - bare.backward_ps == pytest.approx(
        (6e-5 + CONFIG.micro_batch_size * 1e6 / bandwidth) * PS_PER_S, abs=2)
    assert ring.recompute_ps["full"] - bare.recompute_ps["full"] == pytest.approx(
        4e-5 * PS_PER_S, abs=2)
    assert ring.recompute_ps["none"] == bare.recompute_ps["none"]
    # Blocking (TrainSpec.tp_overlap off), the rings' work is no one's.
    assert row(False, True) == row(False, False)


def test_a_microbatch_of_one_sample_is_charged_its_own_ring_work():
    """One sample's chunks are received and written in place (``ring_kernels_single``,
    ``ring_bwd_mem_bytes_single``); a microbatch of several samples pays the copies."""
    prob = _with_ring_work(ring_kernels={"forward": 4, "backward": 6},
                           ring_bwd_mem_bytes=1e6,
                           ring_kernels_single={"forward": 1, "backward": 2},
                           ring_bwd_mem_bytes_single=1e5)
    layer = prob.variant(2, True).layers[0]
    assert layer.as_rings(1).forward_kernels == 11 and layer.as_rings(2).forward_kernels == 14
    assert layer.as_rings(1).bwd_mem_bytes == 1e5 and layer.as_rings(2).bwd_mem_bytes == 1e6
    two = dataclasses.replace(CONFIG, micro_batch_size=2, num_microbatches=1)
    bare = _with_ring_work()   # the same without the rings' work
    for config, kernels in ((CONFIG, 1), (two, 4)):
        # Each microbatch size pays its own ring kernels forward.
        assert (build_cost_table(prob, config).layers[0].forward_ps
                - build_cost_table(bare, config).layers[0].forward_ps) == pytest.approx(
            kernels * 1e-5 * PS_PER_S, abs=2)
