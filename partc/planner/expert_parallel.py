"""The expert-parallel dimension: which degrees ``ep`` the search tries, and what the plan
records of the one it chose.

Mixture-of-experts layers (``LayerCost.moe``) may split their routed experts over groups of
``ep`` ranks folded over each stage's dp x tp ranks (Megatron's "parallel folding", expert
tensor parallelism 1; :mod:`partc.cost.experts_cost` prices it,
:func:`partc.cost.tables.moe_layer_table`). The search enumerates ``ep`` jointly with the
rest of a pipeline configuration (:func:`expand`): every ``ep`` dividing dp x tp and every
MoE layer's expert count, the pinned one only when ``Constraints.ep`` is given. The runtime
splits only experts held as batched weights (``MoECost.expert_form``): a model with a layer
whose experts are a module list keeps ep = 1, and an ep > 1 pin on it is refused (so is a
capacity factor, which the runtime applies to batched experts only). With tensor
parallelism, expert parallelism needs sequence parallelism (each tensor-parallel rank then
dispatches its own share of the tokens; without it the ranks of a group hold the same tokens
and would send them twice), as Megatron requires.
"""

from __future__ import annotations

import dataclasses

from partc.cost.evaluate import Evaluation
from partc.cost.experts_cost import ep_ranks_cross_nodes, moe_layer_figures
from partc.cost.pipeline_config import PipelineConfig
from partc.errors import PlanInfeasibleError
from partc.plan import ExpertLayer, ExpertParallelPlan
from partc.problem import PlanningProblem


def expert_counts(problem: PlanningProblem) -> tuple[int, ...]:
    """The expert count of every mixture-of-experts layer (empty: a dense model)."""
    return tuple(layer.moe.num_experts for layer in problem.layers if layer.moe is not None)


def ep_choices(problem: PlanningProblem, config: PipelineConfig) -> list[int]:
    """The expert-parallel degrees ``config`` allows: 1, and every ``ep`` dividing its dp x
    tp ranks of a stage and every MoE layer's expert count (with tp > 1, only under
    sequence parallelism; only when every MoE layer's experts are batched weights, the
    form the runtime splits); the pinned one alone when ``ep`` is pinned. Under ZeRO the
    experts' weights, gradients and optimizer state are sharded over the
    expert-data-parallel group (:func:`partc.cost.experts_cost.expert_dp_config`)."""
    counts = expert_counts(problem)
    width = config.dp * config.tp
    # The runtime does not run expert parallelism beside context parallelism (a pinned
    # ep refuses cp: partc.cost.cp_attention.context_parallel_refusal).
    allowed = [1] + ([ep for ep in range(2, width + 1)
                      if width % ep == 0 and all(e % ep == 0 for e in counts)]
                     if counts and (config.tp == 1 or config.sequence_parallel)
                     and not problem.module_list_experts and config.cp == 1 else [])
    pinned = problem.pins.ep
    return [ep for ep in allowed if pinned is None or ep == pinned]


def check_ep_pin(problem: PlanningProblem) -> None:
    """Refuse an ``ep`` pin no configuration can hold, naming why."""
    pinned = problem.pins.ep
    if pinned is None or pinned == 1:
        return
    counts = expert_counts(problem)
    if not counts:
        raise _refuse(f"ep={pinned} splits the experts of mixture-of-experts layers, and "
                      f"the model has none")
    listed = problem.module_list_experts
    if listed:
        raise _refuse(f"ep={pinned} splits the routed experts over ranks, and this "
                      f"model's experts are an nn.ModuleList called one by one (layers "
                      f"{', '.join(listed)}); expert parallelism needs batched expert "
                      f"weights (one parameter per projection with a leading experts "
                      f"dimension, run over the tokens sorted by expert, as Hugging "
                      f"Face's current MoE models hold them). Drop the ep pin (the plan "
                      f"keeps ep=1) or hold the experts as batched weights",
                      suggestion="drop the ep pin, or hold the experts as batched weights")
    wrong = sorted({e for e in counts if e % pinned})
    if wrong:
        raise _refuse(f"ep={pinned} does not divide the expert counts {wrong} of the "
                      f"model's mixture-of-experts layers")


def check_capacity(problem: PlanningProblem) -> None:
    """Refuse a capacity factor for experts held as a module list: the runtime's expert
    module, which drops the tokens beyond capacity, runs batched experts only."""
    factor, listed = problem.train.moe_capacity_factor, problem.module_list_experts
    if factor is None or not listed:
        return
    raise PlanInfeasibleError(
        f"TrainSpec.moe_capacity_factor={factor:g} drops the tokens beyond each expert's "
        f"capacity, which partc does for experts held as batched weights only; this "
        f"model's experts are an nn.ModuleList called one by one (layers "
        f"{', '.join(listed)}). Leave moe_capacity_factor None (dropless) or hold the "
        f"experts as batched weights", resource="moe_capacity_factor",
        suggestion="leave moe_capacity_factor None")


def _refuse(message: str, suggestion: str = "change or drop the ep pin"
            ) -> PlanInfeasibleError:
    return PlanInfeasibleError(f"cannot hold the pin ep: {message}", resource="pin",
                               pin="ep", suggestion=suggestion)


def expand(problem: PlanningProblem, configs: list[PipelineConfig]) -> list[PipelineConfig]:
    """Each configuration once per expert-parallel degree it allows (:func:`ep_choices`);
    a pinned ``ep`` that none allows is refused with the meshes it met, and a capacity
    factor for experts the runtime cannot cap (:func:`check_capacity`)."""
    check_ep_pin(problem)
    check_capacity(problem)
    expanded = [dataclasses.replace(config, ep=ep) if ep != config.ep else config
                for config in configs for ep in ep_choices(problem, config)]
    if configs and not expanded:
        widths = sorted({(c.dp * c.tp, c.tp, c.sequence_parallel) for c in configs})
        seen = ", ".join(f"dp x tp = {w}" + (" (tp without sequence parallelism)"
                                               if tp > 1 and not sp else "")
                         for w, tp, sp in widths)
        raise _refuse(f"ep={problem.pins.ep} must divide each stage's dp x tp ranks, and "
                      f"with tp > 1 needs sequence parallelism; the configurations "
                      f"allowed have {seen}")
    return expanded


def expert_parallel_section(problem: PlanningProblem, config: PipelineConfig,
                            evaluation: Evaluation,
                            modes: tuple[str, ...]) -> ExpertParallelPlan | None:
    """The plan's ``expert_parallel``: per MoE layer its placement, all-to-alls and
    budgeted routing; per stage the all-to-all bytes and seconds per step on one rank and
    the saved expert activations in flight. None without expert parallelism."""
    if config.ep == 1 or not expert_counts(problem):
        return None
    local = problem.variant(config.tp, config.sequence_parallel, config.tp_objective)
    m = config.num_microbatches
    stage_of_layer = {layer: s for s, stage in enumerate(evaluation.stages)
                      for layer in stage.layers}
    layers, a2a_bytes, a2a_s, activations = [], [0] * config.pp, [0.0] * config.pp, \
        [0] * config.pp
    for index, whole in enumerate(problem.layers):
        if whole.moe is None:
            continue
        figures = moe_layer_figures(whole.moe, local.layers[index], local, config)
        stage = stage_of_layer[index]
        count = figures.all_to_alls + (2 if modes[index] != "none" else 0)
        scale, b = problem.train.measured_scale, config.micro_batch_size
        saved = int(round(b * scale * figures.expert_saved[modes[index]]))
        layers.append(ExpertLayer(
            name=whole.name, stage=stage, num_experts=figures.num_experts,
            top_k=figures.top_k, local_experts=figures.local_experts,
            expert_params=figures.expert_params, all_to_alls=m * count,
            all_to_all_bytes=int(round(m * count * figures.all_to_all_bytes)),
            all_to_all_s=m * count * figures.all_to_all_s, worst_factor=figures.worst_factor,
            expert_activation_bytes=saved))
        a2a_bytes[stage] += layers[-1].all_to_all_bytes
        a2a_s[stage] += layers[-1].all_to_all_s
    by_name = {whole.name: index for index, whole in enumerate(problem.layers)}
    for s, stage in enumerate(evaluation.stages):
        runs = stage.runs or (stage.layers,)
        saved = [sum(layer.expert_activation_bytes for layer in layers
                     if by_name[layer.name] in run) for run in runs]
        activations[s] = config.activations(s, saved)
    return ExpertParallelPlan(
        ep=config.ep, expert_dp=config.dp * config.tp // config.ep,
        imbalance=problem.train.moe_imbalance,
        capacity_factor=problem.train.moe_capacity_factor, layers=tuple(layers),
        stage_all_to_all_bytes=tuple(a2a_bytes),
        stage_all_to_all_s=tuple(round(t, 12) for t in a2a_s),
        stage_expert_activation_bytes=tuple(activations),
        crosses_nodes=ep_ranks_cross_nodes(problem.devices, config))
