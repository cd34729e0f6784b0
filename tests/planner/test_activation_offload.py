"""Activation offload as the planner weighs it (:mod:`partc.cost.offload_time`): per
layer beside keep and recompute, priced by the copies' bytes over the host link against
the compute they overlap, within the host's memory; and against brute force."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from partc.compiler import plan_problem
from partc.cost.timeline import simulate, text_lines
from partc.report.text import render
from partc.errors import PlanInfeasibleError
from partc.problem import Pins

from .instances import devices, layer, problem, random_problem, with_host
from .test_search import _matches_oracle

MB = 1e6


def _short_of_memory(bandwidth: float, host_memory: int = 10**12, **pins):
    """Three equal layers (1 ms forward, 2 ms backward, 1 MB saved per sample), GPipe
    over 4 microbatches of one sample: keeping all holds 12 MB, the limit is 8 MB, so
    two layers must give up theirs (two recomputed: 4 + 1 MB in backward; two
    offloaded: 4 MB + their window of 2 MB). Recompute reruns a 1 ms forward per
    microbatch; offload costs what its 1 MB copies take beyond the 1 ms forward and the
    2 ms backward they overlap."""
    layers = [layer(name, params=0, saved=MB, full=0.0, workspace=0.0) for name in "abc"]
    numbers = replace(devices(1, 8 * 10**6), host_memory=host_memory, dispatch_ahead=True,
                      host_to_device_bandwidth=bandwidth, device_to_host_bandwidth=bandwidth)
    return problem(layers, [0.0, 0.0], numbers, batch=4, micro_batch_sizes=(1,),
                   pins=Pins(schedule="gpipe", **pins))


@pytest.mark.parametrize("bandwidth, chosen", [(1e8, "full"), (1e9, "offload")])
def test_offload_or_recompute_as_the_host_link_allows(bandwidth, chosen):
    """At 1 GB/s the copies (1 ms each way) hide behind the compute: offload is free,
    recompute costs 1 ms a microbatch. At 100 MB/s they take 10 ms each way, 17 ms
    exposed: recompute is cheaper."""
    plan = plan_problem(_short_of_memory(bandwidth))
    assert sorted(plan.recompute.values()) == sorted(["none", chosen, chosen])
    stage = plan.stages[0]
    offloaded = 2 * 4 * MB if chosen == "offload" else 0
    assert stage.memory_bytes.host == stage.host_traffic_bytes == offloaded
    assert plan.host_bytes_per_node == offloaded
    assert stage.time_s.recompute == pytest.approx(0.0 if chosen == "offload" else 8e-3)


def test_the_hosts_memory_bounds_what_is_offloaded():
    """Host memory for one offloaded layer's 4 microbatches only: one is offloaded and
    one recomputed (4 + 4 MB would not fit the host)."""
    plan = plan_problem(_short_of_memory(1e9, host_memory=6 * 10**6))
    assert sorted(plan.recompute.values()) == ["full", "none", "offload"]
    assert plan.stages[0].memory_bytes.host == 4 * MB


def test_offload_pinned_off_or_on():
    """Constraints(offload=()) leaves activations on the device; a layer pinned to
    offload needs the host link's bandwidth."""
    plan = plan_problem(_short_of_memory(1e9, offload=()))
    assert "offload" not in plan.recompute.values()
    pinned = _short_of_memory(1e9, recompute={"a": "offload"})
    assert plan_problem(pinned).recompute["a"] == "offload"
    unknown = replace(pinned, devices=replace(pinned.devices, host_to_device_bandwidth=None))
    with pytest.raises(PlanInfeasibleError, match="needs the host link's bandwidth"):
        plan_problem(unknown)
    unknown = replace(pinned, devices=replace(pinned.devices, host_memory=None))
    with pytest.raises(PlanInfeasibleError, match="needs the host's memory"):
        plan_problem(unknown)


# A few instances in the default profile (brute force over four modes is slow); -m slow
# draws more.
@pytest.mark.parametrize("seed, count", [(336, 4), pytest.param(1, 24, marks=pytest.mark.slow)])
def test_plan_with_offload_equals_brute_force(seed, count):
    """Random instances (<= 6 layers, <= 3 devices) with a host link from ruinous to
    free and a host memory that may bind: the plan is brute force's optimum over every
    split and every layer's keep / selective / full / offload."""
    rng = random.Random(seed)
    feasible = sum(_matches_oracle(with_host(random_problem(rng), rng)) for _ in range(count))
    assert feasible >= count // 3


def test_the_timeline_and_report_show_the_host_traffic():
    """At 700 MB/s the copies out take 1.43 ms beside a 1 ms forward: 0.43 ms a layer and
    microbatch left exposed, under the 1 ms recompute would cost, drawn as the host's
    (H) in each backward; the report names the offloaded layers and the traffic."""
    plan = plan_problem(_short_of_memory(7e8))
    assert plan.stages[0].run_host_s == (pytest.approx(2 * (MB / 7e8 - 1e-3)),)
    line = text_lines(simulate(plan))[0]
    assert line.count("H") >= 4 and "R" not in line
    report = render(plan)
    assert "Activation offload" in report and "a .. b (2)" in report
    assert "7.63 MiB" in report   # 2 layers x 4 microbatches x 1 MB, each way
    # The section says how (optimizer offload's lines once hid these under one name).
    assert "Offloaded layers (recompute mode offload)" in report


def test_the_hosts_memory_holds_the_optimizer_beside_offloaded_activations():
    """With the optimizer offloaded too, its masters, gradients and state take the host
    first: 6 MB would hold one offloaded layer's 4 microbatches (4 MB) alone, but not
    beside the optimizer's 3 MB, so no layer is offloaded (two are recomputed); with 8 MB
    one is. The solve counts every host byte per node as the validator does."""
    kept = {}
    for host, offloaded in ((6 * 10**6, 0), (8 * 10**6, 1)):
        base = _short_of_memory(1e9, host_memory=host,
                                offload=("optimizer", "activations"))
        per_param = base.train.precision.master_bytes * 2 \
            + base.train.precision.optimizer_state_bytes
        params = int(MB / per_param)   # 1 MB on the host per layer
        prob = replace(base, model=replace(base.model, layers=tuple(
            replace(l, param_count=params, param_bytes=4 * params) for l in base.layers)),
            devices=replace(base.devices, host_adam_rate=1e12))
        plan = plan_problem(prob)   # validated: the host holds all it is given
        assert plan.offload_optimizer
        assert list(plan.recompute.values()).count("offload") == offloaded, host
        assert plan.host_bytes_per_node <= host
        kept[host] = plan.host_bytes_per_node
    assert kept[8 * 10**6] - kept[6 * 10**6] == 4 * MB
