"""Expert parallelism in the planner: mixture-of-experts layers priced per expert-parallel
degree, the degree chosen with the rest against brute force, pins, the plan's expert
section and the validator. Hand-built models (``LayerCost.moe`` filled), so the planner
is tested without tracing; and experts held as a module list, which the runtime does not
split, kept at ep = 1 (hand-built, and one traced model against its batched twin)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from partc.compiler import plan_problem
from partc.cost.experts_cost import all_to_all_seconds, moe_worst_factor
from partc.cost.pipeline_config import PipelineConfig
from partc.cost.tables import build_cost_table
from partc.errors import PlanInfeasibleError, PlanValidationError
from partc.plan import Plan
from partc.planner import solve
from partc.planner.expert_parallel import ep_choices
from partc.problem import MoECost, Pins
from partc.planner.validate import validate_plan

from .instances import _best_split, devices, layer, problem, schedule_choices


def moe_layer(name: str, *, experts: int = 8, top_k: int = 2, flops: float = 4e9,
              params: int = 40000, expert_share: float = 0.9, saved: float = 4e4,
              tokens: int = 8, hidden: int = 16, signature: str = "moe",
              form: str = "batched"):
    """A block whose routed experts hold ``expert_share`` of its parameters, 70% of its
    FLOPs and 60% of its saved bytes (the rest: attention, router, shared expert)."""
    base = layer(name, flops=flops, params=params, saved=saved, full=500.0,
                 selective=saved / 2, workspace=1000.0, signature=signature)
    expert_params = int(params * expert_share)
    return dataclasses.replace(base, moe=MoECost(
        num_experts=experts, top_k=top_k, hidden=hidden, tokens_per_sample=tokens,
        expert_param_count=expert_params, expert_param_bytes=4 * expert_params,
        expert_fwd_flops=0.7 * flops,
        expert_saved_bytes={"none": 0.6 * saved, "selective": 0.3 * saved, "full": 0.0},
        dispatch_bytes=tokens * top_k * hidden * 4, expert_form=form))


def moe_problem(num_devices: int = 4, memory: int = 1_000_000, *, blocks: int = 3,
                node: int = 2, batch: int = 4, pins: Pins = Pins(), imbalance: float = 2.0,
                capacity: float | None = None, bandwidth: float = 1e9, **block):
    layers = [layer("emb", flops=1e8, params=5000, saved=2e3)]
    layers += [moe_layer(f"block{i}", **block) for i in range(blocks)]
    layers.append(layer("head", flops=1e9, params=5000, saved=3e3))
    prob = problem(layers, [1e4] * (len(layers) - 1),
                   devices(num_devices, memory, bandwidth=bandwidth, node=node, latency=1e-6),
                   batch=batch, pins=pins)
    return dataclasses.replace(prob, train=dataclasses.replace(
        prob.train, moe_imbalance=imbalance, moe_capacity_factor=capacity))


def brute_force(prob):
    """The best (step_ps, config, stage_of, modes) over every pp, dp, expert-parallel
    degree, micro-batch size, schedule, ZeRO stage, split and mode, or None (tp = 1)."""
    best = None
    n, num_layers = prob.devices.num_devices, prob.num_layers
    experts = [l.moe.num_experts for l in prob.layers if l.moe is not None]
    # The runtime splits batched experts only.
    splittable = all(l.moe.expert_form == "batched" for l in prob.layers if l.moe is not None)
    for pp in range(1, min(n, num_layers) + 1):
        if n % pp or prob.train.global_batch_size % (n // pp):
            continue
        dp = n // pp
        for ep in range(1, dp + 1):
            if dp % ep or any(e % ep for e in experts) or prob.pins.ep not in (None, ep) \
                    or (ep > 1 and not splittable):
                continue
            for b in prob.train.micro_batch_sizes:
                per_replica = prob.train.global_batch_size // dp
                if per_replica % b:
                    continue
                m = per_replica // b
                for schedule, zero, v, sync in schedule_choices(prob, pp, dp, m):
                    config = PipelineConfig(pp=pp, dp=dp, micro_batch_size=b, ep=ep,
                                            num_microbatches=m, chunks=v,
                                            schedule=schedule, zero_stage=zero,
                                            zero2_grad_sync=sync)
                    best = _best_split(prob, config, best)
    return best


def _random_moe_problem(rng: random.Random):
    return moe_problem(
        num_devices=rng.choice([2, 4]), memory=rng.choice([300_000, 450_000, 600_000, 1_500_000]),
        blocks=rng.randint(1, 3), node=rng.choice([1, 2, 4]), batch=rng.choice([2, 4]),
        imbalance=rng.choice([1.0, 2.0, 3.0]), capacity=rng.choice([None, 1.25]),
        bandwidth=rng.choice([1e8, 1e10]), experts=rng.choice([4, 8]),
        top_k=rng.choice([1, 2]), params=rng.choice([20000, 60000]))


@pytest.mark.parametrize("seed", range(12))
def test_plan_with_experts_equals_brute_force(seed):
    """The planner's step time is brute force's optimum over every expert-parallel degree
    with everything else; the plan's ep is one brute force reaches that time with."""
    prob = _random_moe_problem(random.Random(seed))
    oracle = brute_force(prob)
    if oracle is None:
        with pytest.raises(PlanInfeasibleError):
            solve(prob)
        return
    result = solve(prob)
    assert result.searched.evaluation.step_ps == oracle[0]
    plan = plan_problem(prob)
    assert plan.mesh.ep == result.best.table.config.ep
    assert (plan.expert_parallel is None) == (plan.mesh.ep == 1)


def test_brute_force_optima_include_expert_parallelism_under_zero():
    """ZeRO with ep > 1 is searched (the runtime shards experts over expert-dp): among
    the instances above, some are fastest with both, and the planner plans them so."""
    found = []
    for seed in range(12):
        prob = _random_moe_problem(random.Random(seed))
        oracle = brute_force(prob)
        if oracle is not None and oracle[1].ep > 1 and oracle[1].effective_zero_stage:
            found.append(prob)
    assert found
    plan = plan_problem(found[0])
    assert plan.mesh.ep > 1 and plan.effective_zero_stage > 0
    assert plan.expert_parallel.expert_dp * plan.mesh.ep == plan.dp * plan.tp


def test_expert_state_is_split_over_ep_and_reduced_over_expert_dp():
    """A block's expert parameters are 1/ep per rank; under ZeRO-1 their optimizer state
    is sharded over the dp / ep ranks holding the same experts, the rest over dp; under
    ZeRO-3 their weights and gradients too."""
    prob = moe_problem(num_devices=8, node=8, blocks=1)
    block = prob.layers[1]
    experts, dense = block.moe.expert_param_count, block.param_count - block.moe.expert_param_count
    for ep, zero in [(2, 0), (2, 1), (4, 1), (8, 1)]:
        config = PipelineConfig(pp=1, dp=8, micro_batch_size=1, num_microbatches=1,
                                schedule="1f1b", zero_stage=zero, ep=ep)
        row = build_cost_table(prob, config).layers[1]
        edp = 8 // ep
        assert row.param_count == dense + experts // ep
        assert row.state_bytes["params"] == 4 * (dense + experts // ep)
        assert row.state_bytes["grads"] == 4 * (dense + experts // ep)
        dense_opt = 8 * dense / (8 if zero else 1)
        expert_opt = 8 * (experts // ep) / (edp if zero and edp > 1 else 1)
        assert row.state_bytes["optimizer"] == round(dense_opt) + round(expert_opt)
    one = build_cost_table(prob, dataclasses.replace(config, ep=1)).layers[1]
    assert one.param_count == block.param_count   # ep = 1: the layer as measured
    # ZeRO-3: weights, gradients and optimizer state of the experts over expert-dp (FSDP
    # units of their own on that group), whole where a rank alone holds its experts.
    for ep in (2, 8):
        config = PipelineConfig(pp=1, dp=8, micro_batch_size=1, num_microbatches=1,
                                schedule="1f1b", zero_stage=3, ep=ep)
        row = build_cost_table(prob, config).layers[1]
        edp, local = 8 // ep, experts // ep
        for kind, per_param in (("params", 4), ("grads", 4), ("optimizer", 8)):
            assert row.state_bytes[kind] == round(per_param * dense / 8) + \
                round(per_param * local / edp)


def test_all_to_all_over_nvlink_inside_a_node_and_the_network_across():
    dev = devices(8, 10**9, node=4, latency=1e-6)
    dev = dataclasses.replace(dev, intra_node_bandwidth=4e11, inter_node_bandwidth=5e10)
    config = PipelineConfig(pp=1, dp=8, micro_batch_size=1, num_microbatches=1,
                            schedule="1f1b", ep=4)
    nbytes = 1e8
    assert all_to_all_seconds(nbytes, dev, config) == pytest.approx(
        3 * 1e-6 + 3 / 4 * nbytes / 4e11)
    across = dataclasses.replace(config, ep=8)
    # 4 of 8 peers in another node over the network, 3 over NVLink: the network bounds it.
    assert all_to_all_seconds(nbytes, dev, across) == pytest.approx(
        7 * 1e-6 + 4 / 8 * nbytes / 5e10)
    assert all_to_all_seconds(nbytes, dev, dataclasses.replace(config, ep=1)) == 0.0


def test_worst_routing_bounded_by_imbalance_capacity_and_group():
    moe = moe_layer("b", experts=8, top_k=2).moe
    assert moe_worst_factor(moe, 1, 3.0, None) == 1.0   # all experts local
    assert moe_worst_factor(moe, 4, 3.0, None) == 3.0
    assert moe_worst_factor(moe, 4, 3.0, 1.25) == 1.25  # dropped beyond capacity
    # ep=2: a rank's 4 experts get at most every token of both ranks, twice (top-2).
    assert moe_worst_factor(moe, 2, 3.0, None) == 2.0


def test_imbalance_grows_the_expert_activations_only_under_expert_parallelism():
    config = PipelineConfig(pp=1, dp=4, micro_batch_size=2, num_microbatches=1,
                            schedule="1f1b", ep=4)
    saved = {}
    for imbalance in (1.0, 2.0):
        prob = moe_problem(imbalance=imbalance)
        saved[imbalance] = build_cost_table(prob, config).layers[1].saved_bytes["none"]
    block = moe_problem().layers[1]
    assert saved[2.0] - saved[1.0] == round(2 * block.moe.expert_saved_bytes["none"])
    at_ep1 = {imb: build_cost_table(moe_problem(imbalance=imb), dataclasses.replace(
        config, ep=1)).layers[1].saved_bytes["none"] for imb in (1.0, 2.0)}
    assert at_ep1[1.0] == at_ep1[2.0] == round(2 * block.saved_bytes["none"])


def test_ep_choices_divide_dp_tp_and_the_experts_and_need_sequence_parallelism():
    prob = moe_problem(num_devices=8, experts=4)
    base = PipelineConfig(pp=1, dp=8, micro_batch_size=1, num_microbatches=1,
                          schedule="1f1b")
    assert ep_choices(prob, base) == [1, 2, 4]
    assert ep_choices(prob, dataclasses.replace(base, dp=4, tp=2)) == [1]
    assert ep_choices(prob, dataclasses.replace(base, dp=4, tp=2,
                                                sequence_parallel=True)) == [1, 2, 4]
    # Not beside context parallelism, which the runtime does not run with it.
    assert ep_choices(prob, dataclasses.replace(base, dp=4, cp=2, cp_kind="ring")) == [1]
    dense = problem([layer("a"), layer("b")], [1e3], devices(4, 10**9))
    assert ep_choices(dense, base) == [1]


def test_ep_pin_is_kept_or_refused_with_the_reason():
    prob = moe_problem(pins=Pins(ep=2))
    plan = plan_problem(prob)
    assert plan.mesh.ep == 2 and plan.expert_parallel.ep == 2
    assert [layer.experts_of(1) for layer in plan.expert_parallel.layers] == [range(4, 8)] * 3
    with pytest.raises(PlanInfeasibleError, match="does not divide the expert counts"):
        solve(moe_problem(pins=Pins(ep=3), num_devices=6, batch=6))
    dense = problem([layer("a"), layer("b")], [1e3], devices(2, 10**9), batch=2,
                    pins=Pins(ep=2))
    with pytest.raises(PlanInfeasibleError, match="the model has none"):
        solve(dense)
    with pytest.raises(PlanInfeasibleError, match="must divide each stage's dp x tp"):
        solve(moe_problem(pins=Pins(ep=4, pp=2)))


def test_expert_section_round_trips_and_the_validator_checks_it():
    prob = moe_problem(pins=Pins(ep=4))
    plan = plan_problem(prob)
    section = plan.expert_parallel
    assert Plan.from_json(plan.to_json()) == plan
    layer0 = section.layers[0]
    block = prob.layers[1]
    calls = plan.num_microbatches * (4 + 2 * (plan.recompute[layer0.name] != "none"))
    assert layer0.all_to_alls == calls
    assert layer0.all_to_all_bytes == round(calls * plan.micro_batch_size
                                            * block.moe.dispatch_bytes)
    assert sum(section.stage_all_to_all_bytes) == sum(l.all_to_all_bytes for l in section.layers)
    tampered = dataclasses.replace(plan, expert_parallel=dataclasses.replace(
        section, layers=(dataclasses.replace(layer0, all_to_all_bytes=1),) + section.layers[1:]))
    with pytest.raises(PlanValidationError, match="all-to-alls"):
        validate_plan(prob, tampered)
    with pytest.raises(PlanValidationError, match="no expert_parallel section"):
        validate_plan(prob, dataclasses.replace(plan, expert_parallel=None))
    # A plan written without expert parallelism reads ep=1 (the key is left out).
    dense = plan_problem(moe_problem(pins=Pins(ep=1)))
    assert "ep" not in dense.to_dict()["mesh"] and dense.expert_parallel is None
    assert Plan.from_json(dense.to_json()).mesh.ep == 1


def test_report_shows_placement_all_to_alls_and_memory_past_the_imbalance():
    from partc.report.text import render

    plan = plan_problem(moe_problem(pins=Pins(ep=2, pp=2), num_devices=4, memory=1_500_000,
                                    experts=8, imbalance=1.5))
    text = render(plan)
    assert "Expert parallelism:" in text and "4 of 8 (top-2)" in text
    stage = plan.stages[plan.expert_parallel.layers[0].stage]
    extra = plan.expert_parallel.stage_expert_activation_bytes[stage.index]
    assert extra > 0
    # Doubling a 1.5x budget (3x) adds the budgeted expert activations once more.
    from partc.units import format_bytes
    assert (f"At 2x the assumed imbalance (2x balanced, the most routing can send) stage "
            f"{stage.index} needs {format_bytes(stage.memory_bytes.peak + int(extra / 3))}"
            in text)
    assert "All-to-all per step on a rank of stage" in render(plan, "markdown")


def test_flags_reach_the_ep_pin_and_the_routing_assumptions():
    import partc
    from partc.cli.main import _constraints, _parser, _train

    args = _parser().parse_args(["plan", "x.py:f", "--devices", "8", "--ep", "4",
                                 "--moe-imbalance", "1.5", "--moe-capacity-factor", "1.25"])
    assert _constraints(args).ep == 4
    train = _train(args, {"example_inputs": (torch.zeros(8, 2),),
                         "train": partc.TrainSpec(global_batch_size=8)}, "cuda")
    assert (train.moe_imbalance, train.moe_capacity_factor) == (1.5, 1.25)
    with pytest.raises(ValueError, match="moe_imbalance must be a finite number of at least 1"):
        partc.TrainSpec(global_batch_size=8, moe_imbalance=0.5)
    with pytest.raises(ValueError, match="Constraints.ep must be None or a positive int"):
        partc.Constraints(ep=0)


# ------------------------------------------------------------------ experts in a module list

def _as_module_list(prob):
    """``prob`` with every MoE layer's experts held as a module list (same figures)."""
    layers = tuple(dataclasses.replace(l, moe=dataclasses.replace(l.moe, expert_form="module-list"))
                   if l.moe is not None else l for l in prob.layers)
    return dataclasses.replace(prob, model=dataclasses.replace(prob.model, layers=layers))


def _ep_wins(**block):
    """A problem whose batched experts plan at ep > 1 (a slow link: the expert gradients'
    all-reduce costs more than the all-to-alls)."""
    prob = moe_problem(num_devices=4, memory=2_500_000, bandwidth=1e7, **block)
    assert plan_problem(prob).mesh.ep > 1
    return prob


def split_config(plan):
    return PipelineConfig(pp=plan.pp, dp=plan.dp, micro_batch_size=plan.micro_batch_size,
                          num_microbatches=plan.num_microbatches, schedule=plan.schedule)


def test_module_list_experts_keep_ep_1_and_the_validator_refuses_more():
    batched = _ep_wins()
    split = plan_problem(batched)
    listed = _as_module_list(batched)
    assert ep_choices(batched, split_config(split)) != [1]
    assert ep_choices(listed, split_config(split)) == [1]
    plan = plan_problem(listed)
    assert plan.mesh.ep == 1 and plan.expert_parallel is None
    assert plan.module_list_experts == ("block0", "block1", "block2")
    assert Plan.from_json(plan.to_json()) == plan
    assert "module_list_experts" not in split.to_dict()
    # The batched twin's ep > 1 plan, offered for the module-list model.
    offered = dataclasses.replace(split, module_list_experts=plan.module_list_experts)
    with pytest.raises(PlanValidationError, match="module list, which the runtime does not split"):
        validate_plan(listed, offered)
    with pytest.raises(PlanValidationError, match="as layers whose experts are a module list"):
        validate_plan(listed, dataclasses.replace(plan, module_list_experts=()))


def test_module_list_ep_pin_is_refused_with_the_reason():
    with pytest.raises(PlanInfeasibleError, match="nn.ModuleList called one by one "
                       r"\(layers block0, block1, block2\); expert parallelism needs "
                       "batched expert weights") as refused:
        solve(_as_module_list(moe_problem(pins=Pins(ep=2))))
    assert refused.value.pin == "ep" and "Drop the ep pin" in str(refused.value)
    assert plan_problem(_as_module_list(moe_problem(pins=Pins(ep=1)))).mesh.ep == 1
    # The runtime caps batched experts only: a capacity factor is refused too.
    with pytest.raises(PlanInfeasibleError, match="moe_capacity_factor=1.25 drops the tokens "
                       "beyond each expert's capacity, which partc does for experts held "
                       "as batched weights only"):
        solve(_as_module_list(moe_problem(capacity=1.25)))
    assert plan_problem(moe_problem(capacity=1.25)).train.moe_capacity_factor == 1.25


# Instances that fit; at seeds 6 and 8 the same layers with batched experts plan ep=2.
@pytest.mark.parametrize("seed", [0, 6, 8])
def test_module_list_plan_equals_brute_force(seed):
    prob = _as_module_list(_random_moe_problem(random.Random(seed)))
    prob = dataclasses.replace(prob, train=dataclasses.replace(prob.train,
                                                               moe_capacity_factor=None))
    oracle = brute_force(prob)
    result = solve(prob)
    assert result.searched.evaluation.step_ps == oracle[0]
    assert result.best.table.config.ep == 1


def test_report_says_why_ep_stays_1():
    from partc.report.text import render

    plan = plan_problem(_as_module_list(_ep_wins()))
    text = render(plan)
    assert ("ep=1: the experts of 3 mixture-of-experts layers (block0, block1, block2) are "
            "an nn.ModuleList called one by one, and expert parallelism needs batched "
            "expert weights") in text
    assert "Expert parallelism:" in text
    assert "nn.ModuleList" not in render(plan_problem(moe_problem()))


def test_traced_module_list_model_plans_ep_1_where_its_batched_twin_splits():
    """A traced model whose experts are an nn.ModuleList run densely: on two replicas
    over a slow link the same figures with batched experts plan ep=2 (no expert
    gradient all-reduce); the model keeps ep=1, and an ep=2 pin is refused."""
    import partc
    from tests import models

    torch.manual_seed(0)
    ids = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(0))

    def compile(**pins):
        return partc.compile(
            models.ListMoEModel(), ids, loss_fn=models.token_loss, example_target=ids,
            budget=partc.DeviceBudget(num_devices=2, device="CPU", memory="100MiB",
                                      intra_node_bandwidth="100MB/s",
                                      intra_node_latency_s=1e-6, link_latency_s=1e-6),
            train=partc.TrainSpec(global_batch_size=8, optimizer="adam"),
            constraints=partc.Constraints(dp=2, **pins))

    program = compile()
    twin = dataclasses.replace(program.problem, model=dataclasses.replace(
        program.problem.model, layers=tuple(
            dataclasses.replace(l, moe=dataclasses.replace(l.moe, expert_form="batched"))
            if l.moe is not None else l for l in program.problem.layers)))
    assert program.problem.module_list_experts == ("moes.0", "moes.1")
    assert plan_problem(twin).mesh.ep == 2
    assert program.plan.mesh.ep == 1 and program.plan.module_list_experts == ("moes.0", "moes.1")
    with pytest.raises(PlanInfeasibleError, match="cannot hold the pin ep: ep=2 splits the "
                       "routed experts over ranks, and this model's experts are an "
                       "nn.ModuleList called one by one"):
        compile(ep=2)
