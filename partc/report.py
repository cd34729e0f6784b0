"""The plan report: what a person checks before spending a GPU-hour.

Rendered from the Plan alone (so a saved plan.json renders the same report): the chosen
mesh and schedule, predicted step time, throughput, MFU and bubble; the chosen mesh against
every other (pp, dp, tp) factorisation of the devices; per-stage time by kind and memory
per rank by category against its limit; the solver's statistics; and the obvious
alternatives under the same cost model with why the plan beats them.
"""

from __future__ import annotations

import json

from .placement import REPLICATE
from .plan import MeshOutcome, Plan
from .spec import dtype_name
from .units import format_bytes, format_count, format_seconds

FORMATS = ("text", "markdown", "json")


def _table(header: list[str], rows: list[list[str]], markdown: bool) -> list[str]:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return lines + ["| " + " | ".join(row) + " |" for row in rows]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [
        fmt.format(*row) for row in rows]


def _span(layers: tuple[str, ...] | list[str]) -> str:
    return layers[0] if len(layers) == 1 else f"{layers[0]} .. {layers[-1]} ({len(layers)})"


def _recompute_summary(recompute: dict[str, str]) -> str:
    counts = {}
    for mode in recompute.values():
        counts[mode] = counts.get(mode, 0) + 1
    return ", ".join(f"{mode} x{n}" for mode, n in sorted(counts.items()))


_ATTENTION = {"as_written": "as the model writes it",
              "fused": "fused (scaled_dot_product_attention where provably equal)"}


def _headline(plan: Plan) -> list[str]:
    p, model, budget, train = plan.predicted, plan.model, plan.budget, plan.train
    zero = plan.effective_zero_stage
    lines = [
        f"model: {model.name}, {format_count(model.num_params)} parameters, "
        f"{model.num_layers} layers (traced with {model.tracer})",
        f"budget: {budget.num_devices} x {budget.device} "
        f"({budget.memory} each, {budget.devices_per_node} per node)",
        f"training: global batch {train.global_batch_size}, {dtype_name(train.dtype)}, "
        f"{_optimizer(train.optimizer)}, attention {_ATTENTION[train.attention]}",
        f"plan: {plan.mesh}"
        + (f" (ZeRO-{zero}: {_ZERO_SHARDS[zero]} sharded over dp)" if zero else "") + ", "
        f"{plan.schedule}, {plan.num_microbatches} microbatches of {plan.micro_batch_size}",
        f"predicted: step {format_seconds(p.step_time_s)}, "
        f"{p.samples_per_s:.2f} samples/s"
        + (f", {p.tokens_per_s:.0f} tokens/s" if p.tokens_per_s is not None else "")
        + f", MFU {100 * p.mfu:.1f}%, bubble {100 * p.bubble_fraction:.1f}%, "
        f"peak memory {format_bytes(p.peak_memory_bytes)}",
        _checkpoint_line(plan),
    ]
    return lines


def _checkpoint_line(plan: Plan) -> str:
    """The predicted save time, to check against a cluster's grace period on suspend."""
    size, seconds = plan.checkpoint_bytes_per_rank, plan.predicted_save_s
    rate = size / seconds / 1e9 if seconds else 0.0
    return (f"checkpoint: {format_bytes(size)} per rank, saved in {format_seconds(seconds)} "
            f"at {rate:g} GB/s (DeviceBudget.disk_bandwidth)")


def _optimizer(optimizer: str | float) -> str:
    if isinstance(optimizer, str):
        return optimizer
    return f"{optimizer:g} bytes of state per parameter"


def _stage_rows(plan: Plan) -> list[list[str]]:
    rows = []
    for s in plan.stages:
        t = s.time_s
        rows.append([
            str(s.index), " + ".join(_span(run) for run in s.runs) if s.runs else _span(s.layers),
            format_count(s.param_count),
            format_seconds(t.forward), format_seconds(t.backward),
            format_seconds(t.recompute), format_seconds(t.comm),
            f"{s.p2p.sends}/{s.p2p.recvs}" if s.p2p is not None else "-",
            _recompute_summary(s.recompute),
        ])
    return rows


_MEMORY_KINDS = ("params", "grads", "optimizer", "activations", "transient")


def _memory_rows(plan: Plan) -> list[list[str]]:
    rows = []
    for s in plan.stages:
        mem = s.memory_bytes
        rows.append([str(s.index)] + [format_bytes(getattr(mem, kind)) for kind in _MEMORY_KINDS]
                    + [f"{format_bytes(mem.peak)} / {format_bytes(s.limit_bytes)} "
                       f"({100 * mem.peak / s.limit_bytes:.0f}%)"])
    return rows


def _memory_lines(plan: Plan) -> list[str]:
    stage = plan.effective_zero_stage
    sharded = _ZERO_SHARDS.get(stage)
    zero = f"; ZeRO-{stage} keeps 1/{plan.dp} of the {sharded}" if sharded else ""
    gathered = {2: " (and the weights gathered for the step beside their shards)",
                3: " (and, as transient, one layer's gathered weights and the next's)"
                }.get(stage, "")
    return [f"Every rank of a stage holds the same: its layers' weights, gradients and "
            f"optimizer state{zero}{gathered}; the activations saved for the microbatches "
            f"in flight; the largest working set of one layer (transient)."]


_ZERO_SHARDS = {1: "optimizer state", 2: "gradients and optimizer state",
                3: "weights, gradients and optimizer state"}


def _is_chosen(plan: Plan, outcome: MeshOutcome) -> bool:
    return outcome.mesh == plan.mesh


def _mesh_config(mesh: MeshOutcome) -> str:
    return (f"{mesh.micro_batch_size} x {mesh.num_microbatches}, {mesh.schedule}, "
            f"ZeRO-{mesh.zero_stage}" + (", sequence parallel" if mesh.sequence_parallel else ""))


def _mesh_chosen(plan: Plan) -> str:
    sp = ", sequence parallel" if plan.sequence_parallel else ""
    return (f"chosen: {plan.mesh}, ZeRO-{plan.zero_stage}, "
            f"{plan.schedule}, b x m = {plan.micro_batch_size} x {plan.num_microbatches}{sp}")


def _mesh_why(plan: Plan) -> str:
    """One line: what the chosen mesh beats, by how much, or why it is the only one."""
    step = plan.predicted.step_time_s
    others = [m for m in plan.meshes if not _is_chosen(plan, m)]
    solved = [m for m in others if m.outcome == "solved"]
    unsettled = [m for m in others if m.outcome in ("pruned", "time limit")]
    unfit = len(others) - len(solved) - len(unsettled)
    timed_out = sum(m.outcome == "time limit" for m in others)
    low = min(unsettled, key=lambda m: m.bound_s, default=None)
    if solved:
        runner = solved[0]
        why = (f"fastest predicted step; the runner-up, {runner.mesh}, takes "
               f"{format_seconds(runner.step_time_s)} ({runner.step_time_s / step:.2f}x)")
    elif low is not None and low.bound_s >= step:
        why = (f"no other factorisation can beat it: the lowest bound among the rest is "
               f"{low.mesh}'s, {format_seconds(low.bound_s)} "
               f"({low.bound_s / step:.2f}x)" + (f"; {unfit} do not fit" if unfit else ""))
    elif low is not None:
        why = (f"the best found; {low.mesh} was not settled within the solver's "
               f"time limit and might be faster (bound {format_seconds(low.bound_s)})")
        timed_out = 0
    elif others:
        why = f"the only factorisation that fits ({unfit} others do not)"
    else:
        why = "the only factorisation the device count, the pins and the batch allow"
    if timed_out:
        why += f"; {timed_out} not settled within the solver's time limit"
    return "why: " + why


def _mesh_rows(plan: Plan) -> list[list[str]]:
    step = plan.predicted.step_time_s
    rows = []
    for mesh in plan.meshes:
        axes = [str(mesh.pp), str(mesh.dp), str(mesh.tp)]
        if mesh.outcome == "solved":
            notes = ["chosen"] if _is_chosen(plan, mesh) else []
            # Its other configurations were pruned against the chosen plan, or cut short.
            if mesh.bound_s < 0.995 * mesh.step_time_s:
                notes.append(f"best found (bound {format_seconds(mesh.bound_s)})")
            rows.append(axes + [_mesh_config(mesh), format_seconds(mesh.step_time_s),
                                f"{mesh.step_time_s / step:.2f}x", "; ".join(notes)])
            continue
        rows.append(axes + ["-", "-", "-", _no_plan_reason(mesh, step)])
    return rows


def _no_plan_reason(mesh: MeshOutcome, step: float) -> str:
    if mesh.outcome == "infeasible":
        if mesh.need_bytes is None:
            return "does not fit under the pins"
        return (f"does not fit: needs {format_bytes(mesh.need_bytes)} of "
                f"{format_bytes(mesh.limit_bytes)} per device")
    bound = f"bound >= {format_seconds(mesh.bound_s)} ({mesh.bound_s / step:.2f}x)"
    return f"pruned: {bound}" if mesh.outcome == "pruned" else f"time limit: {bound}"


def _mesh_section(plan: Plan, md: bool) -> list[str]:
    out = ["", "## Mesh" if md else "Mesh:", ""]
    out += [("- " if md else "") + _mesh_chosen(plan)]
    if not plan.meshes:       # a plan saved before partc recorded the factorisations
        return out
    out += [("- " if md else "") + _mesh_why(plan), ""]
    return out + _table(["pp", "dp", "tp", "best config (b x m, schedule, ZeRO)",
                         "step time", "vs chosen", "note"], _mesh_rows(plan), md)


def _alternative_rows(plan: Plan) -> list[list[str]]:
    step = plan.predicted.step_time_s
    rows = [["partc plan", format_seconds(step), "1.00x", "yes",
             format_bytes(plan.predicted.peak_memory_bytes),
             " / ".join(str(len(run)) for run in plan.runs)]]
    for alt in plan.alternatives:
        rows.append([
            alt.name, format_seconds(alt.step_time_s), f"{alt.step_time_s / step:.2f}x",
            "yes" if alt.fits else f"no (stage {alt.worst_stage})",
            format_bytes(alt.peak_memory_bytes),
            " / ".join(str(len(s)) for s in alt.stages) + f", recompute {alt.recompute}",
        ])
    return rows


_SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS"}


def _tp_layer_rows(plan: Plan) -> list[list[str]]:
    """Per layer (consecutive layers alike in one row): its sharded parameters, its
    collectives per microbatch, their bytes per step, and why it stays replicated."""
    section, tp = plan.tensor_parallel, plan.tp
    steps = plan.num_microbatches
    rows, last_key = [], None
    for layer in plan.layer_names:
        prefix = layer + "."
        sharded = sorted(f"{fqn[len(prefix):]} {placement}"
                         for fqn, placement in section.params.items()
                         if fqn.startswith(prefix) and placement != REPLICATE)
        moves = section.collectives.get(layer, ())
        counts: dict[str, int] = {}
        for move in moves:
            phase = "fwd" if move.phase == "forward" else "bwd"
            label = f"{_SHORT.get(move.kind, move.kind)} {phase}"
            counts[label] = counts.get(label, 0) + 1
        tensor_bytes = sum(move.nbytes for move in moves) * steps
        seconds = section.collective_seconds.get(layer, 0.0) * steps
        sent = sum(move.nbytes * (2 if move.kind == "all_reduce" else 1) * (tp - 1) / tp
                   for move in moves) * steps
        key = (tuple(s.split(".", 1)[-1] for s in sharded),
               tuple(sorted(counts.items())), tensor_bytes, section.notes.get(layer, ""))
        if key == last_key:
            rows[-1][0].append(layer)
            continue
        last_key = key
        rows.append([[layer], ", ".join(sharded) or "-",
                     ", ".join(f"{n} {label}" for label, n in sorted(counts.items())) or "-",
                     format_bytes(tensor_bytes) if moves else "-",
                     format_bytes(sent) if moves else "-",
                     format_seconds(seconds) if moves else "-", key[3] or ""])
    return [[_span(row[0])] + row[1:] for row in rows]


def _tp_lines(plan: Plan) -> list[str]:
    section = plan.tensor_parallel
    sp = "on" if section.sequence_parallel else "off"
    objective = {"time": "fastest", "memory": "fewest parameter bytes"}.get(
        section.objective, section.objective)
    partial = section.partial_grad_params
    summed = (f"; {len(partial)} replicated parameters (biases after a row-parallel split, "
              f"norms on sequence shards) get partial gradients, summed across the group "
              f"once per step" if partial else "")
    return [f"tp={section.degree} within a node, sequence parallelism {sp}, sharding chosen "
            f"for {objective} first{summed}. Collectives are per "
            f"microbatch; bytes and time are per step ({plan.num_microbatches} "
            f"microbatches): the tensors' size, what each rank sends in a ring, and the "
            f"time the collectives take (counted in the stages' forward and backward)."]


def _why(plan: Plan) -> list[str]:
    step = plan.predicted.step_time_s
    lines = []
    for alt in plan.alternatives:
        if not alt.fits:
            lines.append(f"- {alt.name} ({alt.description}) does not fit: stage "
                         f"{alt.worst_stage} needs {format_bytes(alt.worst_need_bytes)} "
                         f"against {format_bytes(alt.worst_limit_bytes)}.")
            continue
        saving = 100 * (1 - step / alt.step_time_s)
        verdict = (f"the plan is {saving:.1f}% faster" if saving >= 0.05
                   else "the plan ties with it")
        lines.append(
            f"- {alt.name} ({alt.description}, recompute {alt.recompute}): "
            f"{format_seconds(alt.step_time_s)} per step; {verdict} "
            f"(slowest stage {format_seconds(alt.bottleneck_s)} per microbatch vs "
            f"{format_seconds(plan.predicted.bottleneck_s)}).")
    return lines


def _solver(plan: Plan) -> str:
    s = plan.solver
    return (f"solver: {s.status}, objective {format_seconds(s.objective)}, bound "
            f"{format_seconds(s.bound)}, gap {100 * s.gap:.2f}%, {s.solve_time_s:.2f} s; "
            f"{s.configs_total} configurations, {s.configs_solved} solved, "
            f"{s.configs_pruned} pruned by bound")


def render(plan: Plan, format: str = "text") -> str:
    if format not in FORMATS:
        raise ValueError(f"report format must be one of {FORMATS}, got {format!r}")
    if format == "json":
        return json.dumps(plan.to_dict(), indent=2)
    md = format == "markdown"
    out = ["# partc plan", ""] if md else ["partc plan", "=========="]
    out += [("- " if md else "") + line for line in _headline(plan)]
    out += _mesh_section(plan, md)
    out += ["", "## Stages" if md else "Stages:", ""]
    out += _table(["stage", "layers", "params", "forward", "backward", "recompute", "comm",
                   "p2p send/recv", "recompute modes"], _stage_rows(plan), md)
    out += ["", "## Memory per rank" if md else "Memory per rank:", ""]
    out += _memory_lines(plan) + [""]
    out += _table(["stage", *_MEMORY_KINDS, "peak / limit"], _memory_rows(plan), md)
    if plan.tp > 1 and plan.tensor_parallel is not None:
        out += ["", "## Tensor parallelism" if md else "Tensor parallelism:", ""]
        out += _tp_lines(plan) + [""]
        out += _table(["layers", "sharded parameters", "collectives per microbatch",
                       "bytes per step", "sent per rank", "time per step", "why replicated"],
                      _tp_layer_rows(plan), md)
    out += ["", "## Against the obvious alternatives" if md else "Alternatives:", ""]
    out += _table(["plan", "step time", "vs plan", "fits", "peak memory", "layers per stage"],
                  _alternative_rows(plan), md)
    out += [""] + _why(plan)
    out += ["", ("- " if md else "") + _solver(plan), ""]
    return "\n".join(out)
