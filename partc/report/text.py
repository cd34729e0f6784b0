"""The plan report: what a person checks before spending a GPU-hour.

Rendered from the Plan alone (so a saved plan.json renders the same report): the chosen
mesh and schedule, predicted step time, throughput, MFU and bubble; the chosen mesh against
every other (pp, dp, tp) factorisation of the devices; per-stage time by kind and memory
per rank by category against its limit; the step played out per stage
(:mod:`partc.cost.timeline`); the solver's statistics and how the search settled the plan; and
the obvious alternatives under the same cost model with why the plan beats them.

:func:`sections` holds that content as data; :func:`render` lays it out as text or
markdown, writes the plan as JSON, or (``"html"``) hands it to :mod:`partc.report.html`
for one self-contained page with pictures.
"""

from __future__ import annotations

import collections
import json
import re
from dataclasses import dataclass

from partc.cli.choices import REPORT_FORMATS
from partc.codec import dtype_name
from partc.cost.fp8_pricing import fp8_share
from partc.cost.pipeline_config import ranks_of_stage
from partc.cost.timeline import Timeline, simulate, text_lines
from partc.device.usable import Headroom, communicators, headroom
from partc.names import Outcome, Phase
from partc.placement import REPLICATE
from partc.plan import DP_WHEN, MeshOutcome, Plan, TensorParallelPlan
from partc.runtime.padding import PADDING_MASK, POSITION_IDS
from partc.safe_text import one_line
from partc.units import format_bytes, format_count, format_seconds

FORMATS = REPORT_FORMATS


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``1 microbatch``, ``16 microbatches``."""
    return f"{n} {noun if n == 1 else nouns or noun + 's'}"


def _microbatches(n: int) -> str:
    return plural(n, "microbatch", "microbatches")


def readable(n: float) -> str:
    """A rate for people: three significant digits and a K/M/B/T suffix (42.7M)."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size * 0.9995:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}"


# Markdown's inline syntax: ``<`` opens raw HTML and autolinks, ``[`` ``]`` links,
# `` ` `` code, ``*`` ``~`` emphasis, ``|`` a table cell, ``\`` an escape; ``_`` only where
# it can open or close emphasis (not inside a word, as in ``tok_emb``).
_MARKDOWN = re.compile(r"[\\`*~\[\]<|]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")


def markdown_text(text: str) -> str:
    """``text`` as Markdown that renders it literally: on one line, every character of
    Markdown's inline syntax backslash-escaped, so a name such as ``<img src=x>`` or
    ``a|b`` is shown as written, never as raw HTML, a link or a table cell."""
    return _MARKDOWN.sub(lambda found: "\\" + found.group(), one_line(text))


def _table(header: list[str], rows: list[list[str]], markdown: bool) -> list[str]:
    if markdown:
        lines = ["| " + " | ".join(map(markdown_text, header)) + " |",
                 "|" + "---|" * len(header)]
        return lines + ["| " + " | ".join(map(markdown_text, row)) + " |" for row in rows]
    header, rows = list(map(one_line, header)), [list(map(one_line, r)) for r in rows]
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


def _kernels_line(plan: Plan) -> str:
    """The kernel choices the plan runs, and the first step's compile."""
    train = plan.train
    compiled = ("compiled (torch.compile" + (", each FSDP unit" if plan.effective_zero_stage >= 2
                                             else "") + ")") if train.compile else "eager"
    line = f"kernels: {compiled}, attention {train.attention.replace('_', ' ')}, " \
           f"optimizer step {'fused' if train.fused_optimizer else 'unfused'}"
    seconds = plan.predicted.compile_time_s
    if seconds is not None:
        about = f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"
        line += f"; the first step compiles for about {about} (estimated)"
    return line


def _memory_each(memory: tuple[int, ...]) -> str:
    """``79.19 GiB each``, or where devices differ how many have each size, in rank
    order: ``2 x 40.00 GiB, 2 x 80.00 GiB``."""
    counts = collections.Counter(memory)
    if len(counts) == 1:
        return f"{format_bytes(memory[0])} each"
    return ", ".join(f"{n} x {format_bytes(size)}" for size, n in counts.items())


def _headline(plan: Plan) -> list[str]:
    p, model, budget, train = plan.predicted, plan.model, plan.budget, plan.train
    zero = plan.effective_zero_stage
    lines = [
        f"model: {model.name}, {format_count(model.num_params)} parameters"
        + (f" ({format_count(model.unread_params)} of them never read by the forward on "
           "these inputs: kept as they are, not trained)" if model.unread_params else "")
        + f", {model.num_layers} layers (traced with {model.tracer})",
        f"budget: {budget.num_devices} x {budget.device} "
        f"({_memory_each(budget.memory_bytes)}, {budget.figures.devices_per_node} per node)",
        f"training: global batch {train.global_batch_size}, {dtype_name(train.dtype)}, "
        f"{_optimizer(train.optimizer)}, attention {_ATTENTION[train.attention]}",
        f"plan: {plan.mesh}"
        + (f" (ZeRO-{zero}: {_zero_sharding(plan)})" if zero else "") + ", "
        f"{plan.schedule}, {_microbatches(plan.num_microbatches)} of "
        f"{plural(plan.micro_batch_size, 'sample')}",
        f"predicted: step {format_seconds(p.step_time_s)}, "
        f"{p.samples_per_s:.2f} samples/s"
        + (f", {readable(p.tokens_per_s)} tokens/s" if p.tokens_per_s is not None else "")
        + f", MFU {100 * p.mfu:.1f}%, bubble {100 * p.bubble_fraction:.1f}%, "
        f"peak memory {format_bytes(p.peak_memory_bytes)}",
        _mfu_line(plan),
        _checkpoint_line(plan),
        _kernels_line(plan),
    ]
    if plan.fp8 is not None:
        lines.append(_fp8_line(plan))
    if model.left_out:
        lines.append(_left_out_line(model))
    if train.loss_per_microbatch:
        lines.append(f"loss: each microbatch's loss is its own (declared: "
                     f"loss_per_microbatch), the mean of {plan.dp * plan.num_microbatches} "
                     f"microbatches of {plural(plan.micro_batch_size, 'sample')}: a loss "
                     f"that couples the samples of a batch differs from one device's "
                     f"whole-batch loss")
    return lines


def _left_out_line(model) -> str:
    """The inputs the model was traced without, and how each batch's are checked
    (``partc.runtime.padding``)."""
    checks = []
    if PADDING_MASK in model.left_out:
        checks.append("rows padded at their end whose pads count no label train as one "
                      "device does with the mask (the model is causal throughout), other "
                      "padding is refused" if model.pads_at_end else
                      "a batch that pads a row is refused (the example batch's were unpadded)")
    if POSITION_IDS in model.left_out:
        checks.append("position ids other than 0..S-1 (documents packed in a row) are refused")
    return (f"inputs: {' and '.join(model.left_out)} left out (the model traced without "
            f"them: attention causal from the shapes, positions from 0); each batch's are "
            f"checked: " + "; ".join(checks))


def _fp8_line(plan: Plan) -> str:
    """Which linears run FP8 (TrainSpec.fp8), with what scaling, and why the others not."""
    section = plan.fp8
    how = ("emulated (no FP8 matmuls on this device: torchao's emulation, for testing)"
           if section.emulated else
           f"at {plan.budget.figures.fp8_peak_flops / 1e12:.4g} TFLOP/s FP8 peak, matmuls "
           f"at {fp8_share(plan.budget.figures):.2g} of it")
    if not section.linears:
        why = ("none runs under tensor parallelism" if plan.tp > 1 else
               "emulated FP8 never pays (pin Constraints.fp8_linears to run some)"
               if section.emulated else "none pays for its casts at this micro-batch size")
        return f"fp8: on ({section.recipe} scaling), no linear runs FP8: {why}"
    shown = ", ".join(section.linears[:3]) + (", ..." if len(section.linears) > 3 else "")
    return (f"fp8: {len(section.linears)} linears run FP8 ({section.recipe} scaling, "
            f"torchao float8), {how}: {shown}; the rest stay "
            f"{dtype_name(plan.train.dtype)}: the output layer, unless pinned, and those "
            f"whose casts cost more than FP8 saves")


def _dp_busiest(plan: Plan) -> int | None:
    """The stage with the most data-parallel collective time per step; None without."""
    section = plan.data_parallel
    if section is None or not any(section.stages):
        return None
    return max(range(len(section.stages)), key=section.seconds)


def _mfu_line(plan: Plan) -> str:
    """What the MFU above assumes: the FLOPs it counts, the peak, the matmuls' efficiency
    and the data-parallel collectives taken as hidden behind compute."""
    p, figures = plan.predicted, plan.budget.figures
    devices = plan.budget.num_devices
    peak = (f" x {figures.peak_flops / 1e12:.4g} TFLOP/s peak"
            if isinstance(figures.peak_flops, (int, float)) else " x their peak")
    line = (f"MFU: the model's FLOPs per step (forward and backward, recompute not counted) "
            f"over step x {devices} devices{peak}"
            + (f"; the step prices matmuls at {figures.flops_efficiency:g} of peak "
               f"(flops_efficiency)" if figures.flops_efficiency is not None else ""))
    stage = _dp_busiest(plan)
    if stage is None:
        return line + (", with no data-parallel traffic" if plan.grad_dp == 1 else "")
    section = plan.data_parallel
    total, exposed = section.seconds(stage), section.exposed_s(stage)
    hidden = max(0.0, total - exposed)
    line += (f", and assumes {format_seconds(hidden)} of the "
             f"{format_seconds(total)} of data-parallel collectives per step"
             + (f" (stage {stage})" if plan.pp > 1 else "")
             + f" hidden behind compute (comm_overlap {section.overlap:g}; exposed "
             f"{format_seconds(exposed)})")
    if hidden > 0 and p.step_time_s:
        slower = p.step_time_s + hidden
        line += (f"; none hidden: about {format_seconds(slower)} a step, MFU "
                 f"{100 * p.mfu * p.step_time_s / slower:.1f}%")
    return line


def _checkpoint_line(plan: Plan) -> str:
    """The predicted save time, to check against a cluster's grace period on suspend:
    each rank at the smaller of its own write rate and its share of the storage's."""
    size, seconds = plan.checkpoint_bytes_per_rank, plan.predicted_save_s
    ranks = plan.budget.num_devices
    per_rank, storage = plan.write_bandwidths
    if per_rank <= storage / ranks:
        why = (f"{per_rank / 1e9:.3g} GB/s per rank (DeviceBudget.disk_bandwidth; "
               f"{plural(ranks, 'rank')} together under the storage's "
               f"{storage / 1e9:.3g} GB/s, DeviceBudget.storage_bandwidth)")
    else:
        why = (f"{storage / ranks / 1e9:.3g} GB/s per rank: {plural(ranks, 'rank')} "
               f"sharing the storage's {storage / 1e9:.3g} GB/s "
               f"(DeviceBudget.storage_bandwidth; each alone could write "
               f"{per_rank / 1e9:.3g} GB/s, DeviceBudget.disk_bandwidth)")
    return (f"checkpoint: {format_bytes(size)} per rank, saved in {format_seconds(seconds)} "
            f"at {why}")


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


# "step": the optimizer step's temporaries, held after the activations are gone (the
# peak takes the larger of them and activations + transient + receive).
_MEMORY_KINDS = ("params", "grads", "optimizer", "activations", "transient", "receive",
                 "step")


def _memory_rows(plan: Plan) -> list[list[str]]:
    rows = []
    for s in plan.stages:
        mem = s.memory_bytes
        rows.append([str(s.index)] + [format_bytes(getattr(mem, kind)) for kind in _MEMORY_KINDS]
                    + [f"{format_bytes(mem.peak)} / {format_bytes(s.limit_bytes)} "
                       f"({100 * mem.peak / s.limit_bytes:.0f}%)"])
    return rows


def _offload_rows(plan: Plan) -> list[list[str]]:
    """Per stage with offloaded layers: which, the host memory a rank holds for them
    at its peak, and the bytes it copies each way per step."""
    return [[str(s.index), _span(s.offloaded), format_bytes(s.memory_bytes.host),
             format_bytes(s.host_traffic_bytes), format_bytes(s.host_traffic_bytes)]
            for s in plan.stages if s.offloaded]


def _activation_offload_lines(plan: Plan) -> list[str]:
    budget = plan.budget.figures
    link = (f"{budget.device_to_host_bandwidth / 1e9:.3g} GB/s out, "
            f"{budget.host_to_device_bandwidth / 1e9:.3g} GB/s back per device"
            if budget.device_to_host_bandwidth and budget.host_to_device_bandwidth
            else "bandwidth not known")
    return [f"Offloaded layers (recompute mode offload) keep what they save for backward "
            f"in the host's memory: copied out as their forward runs and back before "
            f"their backward, on a copy stream beside the compute ({link}); the stages' "
            f"recompute time holds the part of the copies compute does not hide, and "
            f"their transient memory the copies in flight."]


def _gradient_group(plan: Plan) -> str:
    """The ranks that reduce gradients and shard ZeRO state together, in words."""
    return "dp" if plan.cp == 1 else f"dp x cp = {plan.grad_dp} ranks"


def _zero_sharding(plan: Plan) -> str:
    """What the plan's ZeRO stage shards over dp (x cp), and when ZeRO-2 reduces
    gradients."""
    zero, group = plan.effective_zero_stage, _gradient_group(plan)
    if plan.reduces_once:
        return (f"{_ZERO_SHARDS[1]} sharded over {group}, gradients accumulated whole over "
                f"the {plan.num_microbatches} microbatches and reduce-scattered once per step")
    return f"{_ZERO_SHARDS[zero]} sharded over {group}"


def _memory_lines(plan: Plan) -> list[str]:
    stage = plan.effective_zero_stage
    sharded = _ZERO_SHARDS.get(1 if plan.reduces_once else stage)
    zero = f"; ZeRO-{stage} keeps 1/{plan.grad_dp} of the {sharded}" if sharded else ""
    if plan.reduces_once:
        zero += " and the whole fp32 gradient, accumulated until the step's last backward"
    gathered = {2: " (and the weights gathered for the step beside their shards)",
                3: " (and, as transient, one layer's gathered weights and the next's)"
                }.get(stage, "")
    return [f"Every rank of a stage holds the same: its layers' weights, gradients and "
            f"optimizer state{zero}{gathered}; the activations saved for the microbatches "
            f"in flight; the largest working set of one layer (transient); the pipeline's "
            f"receive buffer for the gradient coming back to the backward being run "
            f"(receive; the activations coming in are the saved inputs). The optimizer "
            f"step's temporaries (step) come once the activations are gone: the peak is "
            f"the state and the larger of the two."] + _offload_lines(plan)


def _offload_lines(plan: Plan) -> list[str]:
    """What the plan keeps on the host, and what that costs a step."""
    if not plan.offload_optimizer:
        return []
    what = ("the parameter shards and their gradients (FSDP's CPU offload), the fp32 "
            "masters and the optimizer state; the step runs on the host's cores"
            if plan.offload_params else
            "the fp32 master weights, a gradient copy and the optimizer state; the step "
            "runs on the host's cores and the updated weights are copied back"
            + (", every gradient streamed out as backward makes it (the host holds "
               "the gradient buckets)" if plan.dp == 1 else ""))
    tail = max(stage.time_s.tail for stage in plan.stages)
    return [f"Offloaded to the host: {what}. The host holds "
            f"{format_bytes(plan.host_bytes_per_node)} per node; the device columns above "
            f"leave it out. The host's step and the copies made once per step are in the "
            f"step's tail ({format_seconds(tail)} on the busiest stage); the copies of each "
            f"microbatch (gradients streamed out, parameter shards in and out) in the layers' "
            f"forward and backward. On a GPU, which copies on a stream of its own, a layer's "
            f"backward pays only what its streamed gradients' copy and the host's adds take "
            f"beyond it, and the host's step runs chunk by chunk with the weights copied "
            f"back behind it (the tail pays the busiest of the three and one chunk's fill); "
            f"FSDP's copies of parameter shards, and every copy on a CPU, are paid whole."]


def plan_headroom(plan: Plan) -> Headroom:
    """The plan's peak against its device's memory, from the vendor's figure down
    (:func:`partc.device.usable.headroom`: the limits the planner planned against): on
    the stage whose peak comes nearest its devices' usable memory, the smallest of its
    ranks' devices (where devices differ, a stage on larger ones may peak higher)."""
    budget, mesh = plan.budget, plan.mesh
    groups = communicators(budget.num_devices, mesh.pp, mesh.dp, mesh.tp, mesh.ep)
    memory = budget.memory_bytes
    per_device = len(memory) == budget.num_devices   # else one size stands for all

    def room(stage) -> Headroom:   # the stages are the pipeline: one block of ranks each
        reported = min(memory[r] for r in ranks_of_stage(budget.num_devices,
                                                          len(plan.stages), stage.index)) \
            if per_device else min(memory)
        return headroom(reported=reported, nominal=budget.figures.nominal_memory,
                        figures=budget.figures, peak=stage.memory_bytes.peak, groups=groups)

    return max((room(stage) for stage in plan.stages),
               key=lambda r: r.peak / max(r.usable, 1))


def _headroom_line(plan: Plan) -> str:
    room = plan_headroom(plan)
    nominal = (f", nominal {format_bytes(room.nominal)}" if room.nominal is not None
               and room.nominal != room.reported else "")
    taken = [f"{format_bytes(room.context)} for the CUDA context and workspaces"
             if room.context else "",
             f"{room.communicators} NCCL communicator{'s' if room.communicators != 1 else ''}"
             f" x {format_bytes(room.per_communicator)}"
             if room.communicators and room.per_communicator else "",
             f"{100 * room.fragmentation:g}% for fragmentation "
             f"({format_bytes(room.fragmentation_bytes)})" if room.fragmentation else ""]
    taken = [t for t in taken if t]
    less = ("; less " + ", ".join(taken) + " (DeviceBudget's context_memory, "
            "communicator_memory, memory_fragmentation)") if taken else ""
    return (f"Headroom: peak {format_bytes(room.peak)} of {format_bytes(room.usable)} usable "
            f"({100 * room.peak / max(room.usable, 1):.1f}%, {format_bytes(room.left)} "
            f"left); the device reports {format_bytes(room.reported)}{nominal}"
            f"{less}.")


_ZERO_SHARDS = {1: "optimizer state", 2: "gradients and optimizer state",
                3: "weights, gradients and optimizer state"}


def _is_chosen(plan: Plan, outcome: MeshOutcome) -> bool:
    # A factorisation (pp, dp, cp, tp) with its cp kind: the expert-parallel degree is
    # one of its choices.
    return (outcome.pp, outcome.dp, outcome.tp, outcome.cp, outcome.cp_kind) == (
        plan.pp, plan.dp, plan.tp, plan.cp, plan.cp_kind)


def _has_cp(plan: Plan) -> bool:
    """Whether the mesh table needs a cp column: some mesh weighed splits sequences."""
    return plan.cp > 1 or any(mesh.cp > 1 for mesh in plan.meshes)


def _mesh_config(mesh: MeshOutcome) -> str:
    return (f"{mesh.micro_batch_size} x {mesh.num_microbatches}, {mesh.schedule}, "
            f"ZeRO-{mesh.zero_stage}"
            + (" (once per step)" if mesh.zero2_grad_sync == "step" else "")
            + (", sequence parallel" if mesh.sequence_parallel else "")
            + (f", ep={mesh.ep}" if mesh.ep and mesh.ep > 1 else ""))


def _plan_config(plan: Plan) -> str:
    """The plan's own configuration as the mesh table writes one."""
    return (f"{plan.micro_batch_size} x {plan.num_microbatches}, {plan.schedule}, "
            f"ZeRO-{plan.zero_stage}" + (" (once per step)" if plan.reduces_once else "")
            + (", sequence parallel" if plan.sequence_parallel else "")
            + (f", ep={plan.mesh.ep}" if plan.mesh.ep > 1 else ""))


def _mesh_chosen(plan: Plan) -> str:
    sp = ", sequence parallel" if plan.sequence_parallel else ""
    once = " (gradients reduce-scattered once per step)" if plan.reduces_once else ""
    offload = (f", offload: {', '.join(plan.offload)}" if plan.offload else "")
    return (f"chosen: {plan.mesh}, ZeRO-{plan.zero_stage}{once}, "
            f"{plan.schedule}, b x m = {plan.micro_batch_size} x {plan.num_microbatches}{sp}"
            f"{offload}")


def _ranking_step(plan: Plan) -> float:
    """The step time meshes were ranked by: each mesh's fastest schedule played out
    (``partc.planner.joint``), the chosen mesh's the plan's own."""
    return plan.predicted.step_time_s


def _ranked_as(plan: Plan) -> str:
    """The configuration the search ranked the chosen mesh by, when the schedule chosen
    afterwards differs from it: `` as 1f1b``."""
    chosen = next((m for m in plan.meshes if _is_chosen(plan, m)
                   and m.outcome == Outcome.SOLVED), None)
    if chosen is None or chosen.schedule in (None, plan.schedule):
        return ""
    return f" as {chosen.schedule}"


def _mesh_why(plan: Plan) -> str:
    """One line: what the chosen mesh beats, by how much, or why it is the only one."""
    step = _ranking_step(plan)
    others = [m for m in plan.meshes if not _is_chosen(plan, m)]
    solved = [m for m in others if m.outcome == Outcome.SOLVED]
    unsettled = [m for m in others if m.outcome in (Outcome.PRUNED, Outcome.WORK_LIMIT)]
    unfit = len(others) - len(solved) - len(unsettled)
    timed_out = sum(m.outcome == Outcome.WORK_LIMIT for m in others)
    low = min(unsettled, key=lambda m: m.bound_s, default=None)
    estimate = f"the chosen plan's {format_seconds(step)}{_ranked_as(plan)}"
    if solved:
        runner = solved[0]
        why = (f"fastest predicted step; the runner-up, {runner.mesh}, takes "
               f"{format_seconds(runner.step_time_s)} with its fastest schedule "
               f"({runner.step_time_s / step:.2f}x {estimate})")
    elif low is not None and low.bound_s >= step:
        why = (f"no other factorisation can beat it: the lowest bound among the rest is "
               f"{low.mesh}'s, {format_seconds(low.bound_s)} "
               f"({low.bound_s / step:.2f}x {estimate})"
               + (f"; {unfit} do not fit" if unfit else ""))
    elif low is not None:
        why = (f"the best found; {low.mesh} was not settled within the solver's "
               f"work limit and might be faster (bound {format_seconds(low.bound_s)})")
        timed_out = 0
    elif others:
        why = f"the only factorisation that fits ({unfit} others do not)"
    else:
        why = "the only factorisation the device count, the pins and the batch allow"
    if timed_out:
        why += f"; {timed_out} not settled within the solver's work limit"
    return "why: " + why


def _mesh_rows(plan: Plan) -> list[list[str]]:
    # Meshes are ranked by their fastest schedule played out, like the plan's own step.
    # The chosen row shows the plan itself: its configuration and its step, the one the
    # report predicts everywhere.
    step = _ranking_step(plan)
    rows = []
    for mesh in plan.meshes:
        axes = [str(mesh.pp), str(mesh.dp)] + (
            [f"{mesh.cp} ({mesh.cp_kind})" if mesh.cp > 1 else "1"] if _has_cp(plan)
            else []) + [str(mesh.tp)]
        if mesh.outcome == Outcome.SOLVED:
            chosen = _is_chosen(plan, mesh)
            shown = plan.predicted.step_time_s if chosen else mesh.step_time_s
            same = (format_seconds(shown) == format_seconds(mesh.step_time_s)
                    and not _ranked_as(plan))
            notes = ([] if not chosen else ["chosen"] if same else
                     [f"chosen; the mesh's fastest plan played "
                      f"{format_seconds(mesh.step_time_s)}{_ranked_as(plan)}"])
            # Its other configurations were pruned against the chosen plan, or cut short.
            if mesh.bound_s < 0.995 * mesh.step_time_s:
                notes.append(f"best found (bound {format_seconds(mesh.bound_s)})")
            rows.append(axes + [_plan_config(plan) if chosen else _mesh_config(mesh),
                                format_seconds(shown), f"{mesh.step_time_s / step:.2f}x",
                                "; ".join(notes)])
            continue
        rows.append(axes + ["-", "-", "-", _no_plan_reason(mesh, step)])
    return rows


def _no_plan_reason(mesh: MeshOutcome, step: float) -> str:
    if mesh.outcome == Outcome.INFEASIBLE:
        if mesh.need_bytes is None:
            return "does not fit under the pins"
        return (f"does not fit: needs {format_bytes(mesh.need_bytes)} of "
                f"{format_bytes(mesh.limit_bytes)} per device")
    bound = f"bound >= {format_seconds(mesh.bound_s)} ({mesh.bound_s / step:.2f}x)"
    return f"pruned: {bound}" if mesh.outcome == Outcome.PRUNED else f"work limit: {bound}"


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


def _dp_rows(plan: Plan) -> list[list[str]]:
    """Per stage and kind of collective: when it runs, its bytes, time, and what of it is
    assumed hidden and exposed, per step on one rank."""
    section = plan.data_parallel
    rows = []
    for stage, collectives in enumerate(section.stages):
        for c in collectives:
            rows.append([str(stage), c.kind.replace("_", "-"), DP_WHEN.get(c.when, c.when),
                         format_bytes(c.nbytes), format_seconds(c.seconds),
                         format_seconds(c.hidden_s), format_seconds(c.exposed_s)])
    return rows


def _dp_lines(plan: Plan) -> list[str]:
    section = plan.data_parallel
    zero = {0: "plain data parallelism: gradients all-reduced",
            1: "ZeRO-1: gradients reduce-scattered, the stepped weights all-gathered",
            2: "ZeRO-2: gradients reduce-scattered, the stepped weights all-gathered",
            3: "ZeRO-3: each layer's weights all-gathered for its forward and again for "
               "its backward, its gradients reduce-scattered, every microbatch"}
    where = ("in the stages' forward and backward above" if section.zero_stage >= 2
             else "in the tail (T in the timeline)")
    group = (f"dp={section.dp}" if section.cp == 1 else
             f"dp={section.dp} x cp={section.cp} (the context-parallel ranks hold the same "
             f"parameters and see other tokens: gradients reduce over all "
             f"{section.replicas})")
    return [f"{group}, {zero[section.zero_stage]}. Per step on one rank of each "
            f"stage: the tensors' bytes and the collectives' time over its "
            f"{section.replicas} replicas. A collective runs beside compute where it can; the cost model "
            f"assumes the share {section.overlap:g} (DeviceBudget.comm_overlap) of the "
            f"shorter of the two hidden, and the step pays the rest (exposed: "
            f"{where}; after the pipeline drains, in the tail)."]


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
            phase = "fwd" if move.phase == Phase.FORWARD else "bwd"
            label = f"{_SHORT.get(move.kind, move.kind)} {phase}"
            counts[label] = counts.get(label, 0) + 1
        tensor_bytes = sum(move.nbytes for move in moves) * steps
        total, exposed = section.step_seconds(layer, steps)
        sent = sum(move.nbytes * (2 if move.kind == "all_reduce" else 1) * (tp - 1) / tp
                   for move in moves) * steps
        key = (tuple(s.split(".", 1)[-1] for s in sharded),
               tuple(sorted(counts.items())), tensor_bytes, total, exposed,
               section.notes.get(layer, ""))
        if key == last_key:
            rows[-1][0].append(layer)
            continue
        last_key = key
        rows.append([[layer], ", ".join(sharded) or "-",
                     ", ".join(f"{n} {label}" for label, n in sorted(counts.items())) or "-",
                     format_bytes(tensor_bytes) if moves else "-",
                     format_bytes(sent) if moves else "-",
                     format_seconds(total) if moves and total is not None else "-",
                     format_seconds(exposed) if moves else "-", key[-1] or ""])
    return [[_span(row[0])] + row[1:] for row in rows]


def _sequence_sharded(section: TensorParallelPlan) -> list[str]:
    """The layers that reduce-scatter a partial sum in forward: what follows runs on
    sequence shards (sequence parallelism, whatever the plan's flag says)."""
    return [layer for layer, moves in section.collectives.items()
            if any(m.kind == "reduce_scatter" and m.phase == "forward" for m in moves)]


def _tp_layout(section: TensorParallelPlan) -> str:
    """The layout in words, from what the layers run, not from the flag alone."""
    if section.sequence_parallel:
        return ("sequence parallelism on (the hidden states between layers on sequence "
                "shards: gathered for each tensor-parallel region, reduce-scattered after)")
    scattered = _sequence_sharded(section)
    if not scattered:
        return ("sequence parallelism off: Megatron's plain tensor parallelism (each "
                "row-parallel output all-reduced; norms, residuals and dropout whole on "
                "every rank)")
    return (f"sequence parallelism off in name only: {_span(scattered)} reduce-scatter "
            f"partial sums and run what follows on sequence shards, gathered again "
            f"(compile again for plain tensor parallelism)")


def _tp_lines(plan: Plan) -> list[str]:
    section = plan.tensor_parallel
    objective = {"time": "fastest", "memory": "fewest parameter bytes" + (
        ", then activation bytes" if section.sequence_parallel else "")}.get(
        section.objective, section.objective)
    partial = section.partial_grad_params
    norms = ", norms on sequence shards" if section.sequence_parallel \
        or _sequence_sharded(section) else ""
    summed = (f"; {len(partial)} replicated parameters (biases after a row-parallel "
              f"split{norms}) get partial gradients, summed across the group "
              f"once per step" if partial else "")
    return [f"tp={section.degree} within a node, {_tp_layout(section)}, sharding chosen "
            f"for {objective} first{summed}. Collectives are per "
            f"microbatch; bytes and time are per step "
            f"({_microbatches(plan.num_microbatches)}): the tensors' size, what each rank "
            f"sends in a ring, the time the collectives take, and what of it the step "
            f"pays (counted in the stages' forward and backward): "
            + (f"a collective run as a ring beside its linears' matmuls "
               f"(TrainSpec.tp_overlap) hides the share{_overlap(plan)} "
               f"(DeviceBudget.comm_overlap) of the shorter of its time and theirs, "
               f"the others are paid whole."
               if plan.train.tp_overlap else "all of it (TrainSpec.tp_overlap off).")]


def _overlap(plan: Plan) -> str:
    """`` 1``: the budget's comm_overlap, where the plan records it."""
    overlap = plan.budget.figures.comm_overlap if plan.budget is not None else None
    return "" if overlap is None else f" {overlap:g}"


def _expert_rows(plan: Plan) -> list[list[str]]:
    """Per mixture-of-experts layer (consecutive layers alike in one row): its stage,
    the experts each rank holds, their parameters per rank, its all-to-alls per step
    and the routing its memory was budgeted for."""
    section = plan.expert_parallel
    rows, last_key = [], None
    for layer in section.layers:
        key = (layer.stage, layer.num_experts, layer.top_k, layer.local_experts,
               layer.expert_params, layer.all_to_alls, layer.all_to_all_bytes,
               layer.all_to_all_s, layer.worst_factor)
        if key == last_key:
            rows[-1][0].append(layer.name)
            continue
        last_key = key
        rows.append([[layer.name], str(layer.stage),
                     f"{layer.local_experts} of {layer.num_experts} (top-{layer.top_k}): "
                     f"rank e holds e*{layer.local_experts}..e*{layer.local_experts}"
                     f"+{layer.local_experts - 1}",
                     format_count(layer.expert_params), str(layer.all_to_alls),
                     format_bytes(layer.all_to_all_bytes), format_seconds(layer.all_to_all_s),
                     f"{layer.worst_factor:g}x"])
    return [[_span(row[0])] + row[1:] for row in rows]


def _expert_lines(plan: Plan) -> list[str]:
    section = plan.expert_parallel
    where = "over the network (a group spans nodes)" if section.crosses_nodes \
        else "over NVLink (each group inside a node)"
    routing = "dropless" if section.capacity_factor is None else (
        f"capacity factor {section.capacity_factor:g} (tokens beyond it dropped)")
    busiest = max(range(len(section.stage_all_to_all_s)),
                  key=lambda s: section.stage_all_to_all_s[s])
    return [f"ep={section.ep}: each stage's dp x tp = {plan.dp * plan.tp} ranks form groups "
            f"of {section.ep} consecutive ranks splitting every mixture-of-experts layer's "
            f"experts; "
            + (f"the {section.expert_dp} ranks holding the same experts reduce their "
               f"gradients." if section.expert_dp > 1 else
               "no other rank holds the same experts (no expert gradient reduction).")
            + f" Tokens move by all-to-all {where}, {routing}.",
            f"All-to-all per step on a rank of stage {busiest} (the busiest): "
            f"{format_bytes(section.stage_all_to_all_bytes[busiest])} in "
            f"{format_seconds(section.stage_all_to_all_s[busiest])} (counted in the "
            f"stages' forward, backward and recompute, not overlapped with compute).",
            f"Time is priced at balanced routing; memory at {section.imbalance:g}x the "
            f"balanced tokens per expert (TrainSpec.moe_imbalance)"
            + (f", at most the capacity factor {section.capacity_factor:g}"
               if section.capacity_factor is not None else "") + "."]


def _module_list_line(plan: Plan) -> str:
    """Why ep stays 1: the model's experts are a module list, which the runtime does not
    split."""
    layers = plan.module_list_experts
    names = ", ".join(layers) if len(layers) <= 4 else f"{layers[0]} .. {layers[-1]}"
    return (f"ep=1: the experts of {plural(len(layers), 'mixture-of-experts layer')} "
            f"({names}) are an nn.ModuleList called one by one, and expert "
            f"parallelism needs batched expert weights (one parameter per projection "
            f"with a leading experts dimension, run over the tokens sorted by expert, as "
            f"Hugging Face's current MoE models hold them). Every rank holds every "
            f"expert; hold the experts as batched weights to let the planner split them.")


def _expert_overflow(plan: Plan) -> list[str]:
    """What happens to memory if routing is worse than budgeted: per stage holding
    experts, its need at twice the budgeted routing, and where it runs out."""
    section = plan.expert_parallel
    if section.capacity_factor is not None and section.capacity_factor <= section.imbalance:
        return [f"Routing cannot exceed the budget: an expert takes at most "
                f"{section.capacity_factor:g}x its balanced share, the rest is dropped."]
    lines = []
    for stage in plan.stages:
        extra = section.stage_expert_activation_bytes[stage.index]
        mine = [l for l in section.layers if l.stage == stage.index]
        if not extra or not mine:
            continue
        factor = max(l.worst_factor for l in mine)
        # The most a rank's experts can receive: every token of the group, each to
        # min(top-k, its experts) of them.
        ceiling = min(section.ep * min(l.top_k, l.local_experts) / l.top_k for l in mine)
        doubled = min(2 * factor, ceiling)
        need = stage.memory_bytes.peak + int(extra * (doubled / factor - 1))
        verdict = "fits" if need <= stage.limit_bytes else "does not fit"
        slack = stage.limit_bytes - stage.memory_bytes.peak
        limit_factor = factor * (1 + slack / extra)
        runs_out = (f"it runs out of memory above {limit_factor:.3g}x balanced routing"
                    if limit_factor < ceiling else
                    f"it fits even when routing sends its experts all it can ({ceiling:g}x)")
        lines.append(f"At 2x the assumed imbalance ({doubled:g}x balanced"
                     + (", the most routing can send" if doubled < 2 * factor else "")
                     + f") stage {stage.index} needs {format_bytes(need)} of "
                     f"{format_bytes(stage.limit_bytes)} ({verdict}); {runs_out}.")
    return lines


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


_STATUS = {
    "OPTIMAL": "no configuration can beat this plan under the cost model: each was solved "
               "or ruled out by a proven bound, and every schedule of every mesh played "
               "out (with CP-SAT's split or the greedy one) or ruled out by a floor of "
               "the step played",
    "FEASIBLE": "the best plan found within the work limit (PlannerOptions.work_limit, "
                "schedule_trial_ops); none can beat the bound",
}


def _solver(plan: Plan) -> list[str]:
    """What the search settled and how: a plan is OPTIMAL when each configuration was
    either solved (CP-SAT to its optimum, or until its proven bound reached the best plan)
    or ruled out by its lower bound without a solve."""
    s = plan.solver
    verdict = _STATUS.get(s.status, s.status)
    lines = [f"solver: {s.status} ({verdict}): closed-form estimate before simulation "
             f"{format_seconds(s.objective)}{_ranked_as(plan)}, bound "
             f"{format_seconds(s.bound)}, gap {100 * s.gap:.2f}%, {s.solve_time_s:.2f} s"]
    if not s.configs_total:   # a plan saved before partc counted configurations
        return lines
    how = (f"search: {plural(s.configs_total, 'configuration')} (mesh, micro-batch size, "
           f"schedule, ZeRO stage); ")
    if s.configs_solved:
        how += (f"{s.configs_solved} searched with CP-SAT (to the optimum, or until the "
                f"bound it proved reached the best plan's step time); the other "
                f"{s.configs_pruned} ruled out without a solve: their lower bound was no "
                f"better than the best plan's step time (or showed they cannot fit)")
    else:
        how += ("none needed CP-SAT: the greedy starting plan meets its own "
                "configuration's lower bound, and no other configuration's bound is lower")
    if s.configs_played:
        how += (f"; {s.configs_played} schedule trials played out with their greedy split "
                "(or shown to have no split that fits)")
    unsettled = s.configs_total - s.configs_solved - s.configs_pruned - s.configs_played
    if unsettled > 0:
        how += f"; {unsettled} not reached within the work limit (PlannerOptions.work_limit)"
    solved = [o for o in plan.schedules if o.how.startswith("solved split")]
    if solved:
        how += (f". The estimate and bound above are the closed form's (1F1B, GPipe), which "
                f"chose the mesh; then {plural(len(solved), 'other schedule')} "
                f"{'was' if len(solved) == 1 else 'were'} solved on it and the one whose "
                f"order plays out fastest kept ({plan.schedule}; see Schedules)")
    return lines + [how]


def _timeline_lines(plan: Plan, timeline: Timeline) -> list[str]:
    virtual = f", {plan.chunks} virtual stages per rank" if plan.chunks > 1 else ""
    closed = plan.predicted.closed_form_step_s
    p = plan.predicted
    return [f"One step per pipeline stage ({plan.schedule}{virtual}, "
            f"{_microbatches(plan.num_microbatches)}), in the schedule's own order, played "
            f"out from the stage times above: F forward, B backward (its input-gradient "
            f"part under a zero-bubble schedule), W weight gradient, R recompute, "
            f"H the copies of offloaded activations to and from the host that compute "
            f"does not hide, "
            f"c communication (sends, tensor-parallel collectives, what ZeRO-2/3's "
            f"collectives leave exposed), T tail (from when the "
            f"pipeline drains: the exposed part of the gradient sync and of ZeRO-1's weight "
            f"all-gather, the optimizer step), . waiting. The step: "
            f"{format_seconds(p.step_time_s)}, bubble {100 * p.bubble_fraction:.1f}% "
            f"(the predicted step above, this simulation)"
            + (f"; the planner's closed-form estimate of it before simulation: "
               f"{format_seconds(closed)}" if closed else "")
            + "."]


def _schedule_rows(plan: Plan) -> list[list[str]]:
    step = plan.predicted.step_time_s
    rows = []
    for option in plan.schedules:
        if option.step_time_s is None:
            rows.append([option.schedule, str(option.virtual_stages), "-", "-", "-", "-",
                         option.how])
            continue
        rows.append([option.schedule, str(option.virtual_stages),
                     format_seconds(option.step_time_s),
                     f"{option.step_time_s / step:.2f}x" if step else "-",
                     f"{100 * (option.bubble_fraction or 0.0):.1f}%",
                     format_bytes(option.peak_memory_bytes or 0), option.how])
    return rows


@dataclass(frozen=True, kw_only=True)
class Section:
    """One part of the report, for every format: its ``title`` (None: none), lines (a
    bullet each in markdown, ``notes`` plain paragraphs), an optional table, a block of
    ``preformatted`` lines, and ``after``: lines after the table."""

    key: str
    title: str | None
    bullets: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    header: tuple[str, ...] = ()
    rows: tuple[tuple[str, ...], ...] = ()
    preformatted: tuple[str, ...] = ()
    after: tuple[str, ...] = ()


def sections(plan: Plan, timeline: Timeline | None = None) -> list[Section]:
    """The report's content, in order; :func:`render` and the HTML report lay it out.
    ``timeline``: the plan's :func:`partc.cost.timeline.simulate`, when the caller has it."""
    timeline = timeline if timeline is not None else simulate(plan)
    out = [Section(key="plan", title=None, bullets=tuple(_headline(plan)))]
    mesh = (_mesh_chosen(plan),) + ((_mesh_why(plan),) if plan.meshes else ())
    out.append(Section(
        key="mesh", title="Mesh", bullets=mesh,
        header=("pp", "dp") + (("cp",) if _has_cp(plan) else ()) + (
            "tp", "best config (b x m, schedule, ZeRO)",
            "step time (fastest schedule, played out)", "vs chosen", "note")
        if plan.meshes else (),
        rows=_rows(_mesh_rows(plan)) if plan.meshes else ()))
    out.append(Section(
        key="stages", title="Stages",
        notes=("Per step on one rank of each stage, every microbatch: forward and "
               "backward count the tensor-parallel collectives, context parallelism's "
               "exchanges, and what ZeRO's collectives and offload's copies leave exposed "
               "(the sections below); p2p: the rank's share of the sends and receives "
               "between stages, and their number. What comes once the pipeline drains "
               "(the tail) is in the timeline.",),
        header=("stage", "layers", "params", "forward", "backward", "recompute",
                "p2p time", "p2p send/recv", "recompute modes"),
        rows=_rows(_stage_rows(plan))))
    out.append(Section(key="timeline", title="Timeline",
                       notes=tuple(_timeline_lines(plan, timeline)),
                       preformatted=tuple(text_lines(timeline))))
    if plan.schedules:
        out.append(Section(
            key="schedules", title="Schedules",
            notes=(f"Every pipeline schedule on this mesh ({plan.pp} stages, "
                   f"{_microbatches(plan.num_microbatches)}), each played out in its own "
                   f"order: the chosen plan first, then each other schedule with the "
                   f"stage split the planner solved for it (when the schedule, or a "
                   f"pinned schedule's virtual stages, were left to it; \"solved split\") "
                   f"or the greedy split of its virtual stages. "
                   f"Export the chosen order in torch's pipelining "
                   f"CSV format with partc.cost.timeline.csv_text (program.save writes "
                   f"schedule.csv).",),
            header=("schedule", "v", "step time", "vs chosen", "bubble", "peak memory",
                    "split"),
            rows=_rows(_schedule_rows(plan))))
    out.append(Section(key="memory", title="Memory per rank",
                       notes=(_headroom_line(plan), *_memory_lines(plan)),
                       header=("stage", *_MEMORY_KINDS, "peak / limit"),
                       rows=_rows(_memory_rows(plan))))
    if any(s.offloaded for s in plan.stages):
        out.append(Section(
            key="activation_offload", title="Activation offload",
            notes=tuple(_activation_offload_lines(plan)),
            header=("stage", "offloaded layers", "host memory per rank",
                    "to host per step", "back per step"), rows=_rows(_offload_rows(plan))))
    if plan.data_parallel is not None:
        out.append(Section(
            key="data_parallel", title="Data parallelism", notes=tuple(_dp_lines(plan)),
            header=("stage", "collective", "when", "bytes per step", "time per step",
                    "assumed hidden", "exposed (in the step)"),
            rows=_rows(_dp_rows(plan))))
    if plan.tp > 1 and plan.tensor_parallel is not None:
        out.append(Section(
            key="tensor_parallel", title="Tensor parallelism", notes=tuple(_tp_lines(plan)),
            header=("layers", "sharded parameters", "collectives per microbatch",
                    "bytes per step", "sent per rank", "time per step",
                    "exposed (in the step)", "why replicated"),
            rows=_rows(_tp_layer_rows(plan))))
    if plan.expert_parallel is not None:
        out.append(Section(
            key="expert_parallel", title="Expert parallelism", notes=tuple(_expert_lines(plan)),
            header=("layers", "stage", "experts per rank", "expert params per rank",
                    "all-to-alls per step", "bytes per step", "time per step",
                    "memory budgeted for"),
            rows=_rows(_expert_rows(plan)), after=tuple(_expert_overflow(plan))))
    elif plan.module_list_experts:
        out.append(Section(key="expert_parallel", title="Expert parallelism",
                           notes=(_module_list_line(plan),)))
    out.append(Section(
        key="alternatives", title="Against the obvious alternatives",
        header=("plan", "step time", "vs plan", "fits", "peak memory", "layers per stage"),
        rows=_rows(_alternative_rows(plan)), after=tuple(_why(plan))))
    out.append(Section(key="solver", title=None, bullets=tuple(_solver(plan))))
    return out


def _rows(rows: list[list[str]]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(row) for row in rows)


_TEXT_TITLES = {"Against the obvious alternatives": "Alternatives"}


def _lay_out(section: Section, md: bool) -> list[str]:
    """One section's lines. Every line may carry a name the user chose (the model's, a
    layer's): in markdown each is escaped (:func:`markdown_text`), in text each is kept
    on its line (:func:`partc.safe_text.one_line`)."""
    out = []
    escape = markdown_text if md else one_line
    if section.title is not None:
        title = section.title if md else _TEXT_TITLES.get(section.title, section.title)
        out += ["", f"## {title}" if md else f"{title}:", ""]
    else:
        out += [""] if section.key != "plan" else []
    out += [("- " if md else "") + escape(line) for line in section.bullets]
    out += [escape(line) for line in section.notes]
    if section.preformatted:
        block = [one_line(line) for line in section.preformatted]
        out += [""] + (["```", *block, "```"] if md else block)
    if section.header:
        out += ([""] if section.bullets or section.notes else [])
        out += _table(list(section.header), [list(r) for r in section.rows], md)
    if section.after:
        # "- " opens a bullet of the alternatives' list: markup of the report's own.
        out += [""] + [("- " + escape(line[2:])) if md and line.startswith("- ")
                       else escape(line) for line in section.after]
    return out


def render(plan: Plan, format: str = "text") -> str:
    """The report as ``format``: one of :data:`FORMATS` ("html": one self-contained page
    with pictures, :mod:`partc.report.html`)."""
    if format not in FORMATS:
        raise ValueError(f"report format must be one of {FORMATS}, got {format!r}")
    if format == "json":
        return json.dumps(plan.to_dict(), indent=2)
    if format == "html":
        # Here, not at the top: html imports this module's sections (a cycle), and
        # matplotlib (half a second) is needed only for the page's pictures.
        from partc.report.html import render_html

        return render_html(plan)
    return lay_out(sections(plan), markdown=format == "markdown")


def lay_out(content: list[Section], *, markdown: bool = False) -> str:
    """The report's sections as text or markdown."""
    out = ["# partc plan", ""] if markdown else ["partc plan", "=========="]
    for section in content:
        out += _lay_out(section, markdown)
    return "\n".join(out + [""])
