"""The plan report as one self-contained HTML page, with pictures.

Everything the text report says (:func:`partc.report.text.sections`, laid out as HTML tables),
a table per layer, and three pictures drawn with matplotlib and inlined as SVG, so the
page needs no network, no script and no font download to be read:

- the step timeline per pipeline stage (:mod:`partc.cost.timeline`): forward, backward,
  recompute, communication and the tail, idle where nothing is drawn;
- memory per rank of each stage by category, against the memory a device leaves the
  plan (after the CUDA context, NCCL and fragmentation);
- the mesh factorisations the planner weighed, with their predicted step times (or the
  bound that ruled them out, or why they do not fit).

matplotlib is imported here only, so ``import partc`` and the text report stay light.
"""

from __future__ import annotations

import html
import io
import re

from matplotlib import rc_context
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from partc.cost.timeline import COMM_KINDS, COMPUTE_KINDS, KINDS, Timeline, simulate
from partc.names import Outcome
from partc.placement import REPLICATE
from partc.plan import Plan
from partc.report.text import Section, lay_out, plural, sections
from partc.units import format_bytes, format_seconds

COLOURS = {"forward": "#4c78a8", "backward": "#f58518", "weight": "#eeca3b",
           "recompute": "#e45756", "host": "#ff9da6",
           "collective": "#54a24b", "p2p": "#2a7a2a", "tail": "#b279a2"}
LABELS = {"forward": "forward", "backward": "backward (input gradient when split)",
          "weight": "weight gradient", "recompute": "recompute",
          "host": "host copies (offloaded activations) not hidden by compute",
          "collective": "collectives (tensor-parallel; data-parallel's exposed part)", "p2p": "send / receive (p2p)",
          "tail": "tail: gradient sync, optimizer step"}
MEMORY_COLOURS = {"params": "#4c78a8", "grads": "#72b7b2", "optimizer": "#54a24b",
                  "activations": "#f58518", "transient": "#e45756", "receive": "#9d755d"}
MEMORY_LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state",
                 "activations": "saved activations", "transient": "transient (one layer)",
                 "receive": "pipeline receive buffers"}

# Deterministic SVG (the same plan renders the same bytes) with text kept as text, in
# the fonts the browser has: small, selectable, and nothing to download.
_RC = {"svg.fonttype": "none", "svg.hashsalt": "partc", "font.size": 10,
       "font.family": "sans-serif",
       "font.sans-serif": ["DejaVu Sans", "Liberation Sans", "Arial", "Helvetica"],
       "axes.spines.top": False, "axes.spines.right": False}
WIDTH_IN = 11.0


def render_html(plan: Plan) -> str:
    timeline = simulate(plan)
    with rc_context(_RC):
        figures = [("timeline", _timeline_caption(plan, timeline), timeline_svg(plan, timeline)),
                   ("memory", _memory_caption(plan), memory_svg(plan))]
        if any(m.step_time_s or m.bound_s for m in plan.meshes):
            figures.append(("meshes", _mesh_caption(plan), mesh_svg(plan)))
    parts = [_head(plan), "<body>", "<h1>partc plan</h1>"]
    content = sections(plan, timeline)
    parts += _section_html(content[0])
    parts += [_figure(key, caption, svg) for key, caption, svg in figures]
    for section in content[1:]:
        parts += _section_html(section)
    parts += _layer_table(plan)
    parts += ["<details><summary>The report as text</summary>",
              f"<pre>{_esc(lay_out(content))}</pre></details>", "</body></html>"]
    return "\n".join(parts) + "\n"


_CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', 'DejaVu Sans', sans-serif;
       margin: 1.5em auto; max-width: 1250px; padding: 0 1em; color: #1d1d1f; }
h1 { font-size: 1.6em; margin-bottom: 0.3em; }
h2 { font-size: 1.25em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
ul.headline { list-style: none; padding-left: 0; line-height: 1.5; }
figure { margin: 1.2em 0; }
figcaption { font-size: 0.95em; color: #444; margin-bottom: 0.3em; }
figure svg { width: 100%; height: auto; }
table { border-collapse: collapse; font-size: 0.9em; margin: 0.6em 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
tr.chosen td { background: #eaf2fb; font-weight: 600; }
pre { background: #f7f7f7; padding: 0.6em; overflow-x: auto; font-size: 0.85em; }
p { line-height: 1.45; }
"""


def _head(plan: Plan) -> str:
    title = (f"partc plan: {plan.model.name} on {plan.budget.num_devices} x "
             f"{plan.budget.device}")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_esc(title)}</title><style>{_CSS}</style></head>")


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _section_html(section: Section) -> list[str]:
    out = [f'<section id="{section.key}">']
    if section.title:
        out.append(f"<h2>{_esc(section.title)}</h2>")
    if section.bullets:
        css = ' class="headline"' if section.key == "plan" else ""
        out.append(f"<ul{css}>" + "".join(f"<li>{_esc(b)}</li>" for b in section.bullets)
                   + "</ul>")
    out += [f"<p>{_esc(note)}</p>" for note in section.notes]
    if section.preformatted:
        out.append("<pre>" + _esc("\n".join(section.preformatted)) + "</pre>")
    if section.header:
        out.append(_table(section.header, section.rows, _chosen_rows(section)))
    if section.after:
        out.append("<ul>" + "".join(f"<li>{_esc(line.removeprefix('- '))}</li>"
                                    for line in section.after) + "</ul>")
    return out + ["</section>"]


def _chosen_rows(section: Section) -> set[int]:
    """The rows about the plan itself: the mesh table's chosen mesh, the alternatives'
    first row."""
    if section.key == "mesh":
        return {i for i, row in enumerate(section.rows) if row[-1].startswith("chosen")}
    return {0} if section.key == "alternatives" else set()


def _table(header, rows, chosen: set[int] = frozenset()) -> str:
    head = "<tr>" + "".join(f"<th>{_esc(h)}</th>" for h in header) + "</tr>"
    body = []
    for i, row in enumerate(rows):
        css = ' class="chosen"' if i in chosen else ""
        body.append(f"<tr{css}>" + "".join(f"<td>{_esc(c)}</td>" for c in row) + "</tr>")
    return "<table>" + head + "".join(body) + "</table>"


def _figure(key: str, caption: str, svg: str) -> str:
    return (f'<figure id="figure-{key}"><figcaption>{caption}</figcaption>\n{svg}\n'
            "</figure>")


def _svg(figure, title: str) -> str:
    """The figure as inline SVG that scales with the page, titled for screen readers."""
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", dpi=150, metadata={"Date": None, "Creator": None})
    text = buffer.getvalue()
    text = text[text.index("<svg"):]            # no XML prolog or doctype inside HTML
    text = re.sub(r"\s*<metadata>.*?</metadata>", "", text, count=1, flags=re.S)
    text = re.sub(r'<svg([^>]*?) width="[^"]*" height="[^"]*"', r"<svg\1", text, count=1)
    opening = text.index(">") + 1
    return f"{text[:opening]}<title>{_esc(title)}</title>{text[opening:]}"


def _legend(figure, handles) -> None:
    """One row of legend under the axes, outside them (constrained layout makes room)."""
    figure.legend(handles=handles, loc="outside lower left",
                  ncol=len(handles) if len(handles) <= 6 else -(-len(handles) // 2),
                  frameon=False, fontsize=9)


def _seconds_axis(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"


# -- the timeline ------------------------------------------------------------------------

def _timeline_caption(plan: Plan, timeline: Timeline) -> str:
    busy = [timeline.seconds(r, COMPUTE_KINDS) for r in range(timeline.num_ranks)]
    comm = [timeline.seconds(r, COMM_KINDS) for r in range(timeline.num_ranks)]
    idle = [timeline.idle_s(r) for r in range(timeline.num_ranks)]
    step = timeline.step_s or 1.0
    ranks = plural(plan.dp * plan.cp * plan.tp, "rank")
    return (f"Schedule {_esc(plan.schedule)}, "
            f"{plural(plan.num_microbatches, 'microbatch', 'microbatches')}; each row "
            f"stands for the {ranks} of a stage. Played out from the cost "
            f"model's stage times: the step, "
            f"{_esc(format_seconds(plan.predicted.step_time_s))} (dashed line), is the "
            f"plan's predicted step. Over the stages: compute {100 * min(busy) / step:.0f}-"
            f"{100 * max(busy) / step:.0f}%, communication {100 * min(comm) / step:.0f}-"
            f"{100 * max(comm) / step:.0f}%, idle {100 * min(idle) / step:.0f}-"
            f"{100 * max(idle) / step:.0f}% of the step.")


def timeline_svg(plan: Plan, timeline: Timeline) -> str:
    ranks = timeline.num_ranks
    scale, unit = _seconds_axis(max(timeline.step_s, plan.predicted.step_time_s))
    row = 0.42 if ranks <= 16 else max(0.16, 6.7 / ranks)
    figure = Figure(figsize=(WIDTH_IN, 1.6 + row * ranks), layout="constrained")
    axes = figure.add_subplot()
    by_row: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for block in timeline.blocks:
        by_row.setdefault((block.rank, block.kind), []).append(
            (block.start_s * scale, block.seconds * scale))
    # Few operations: white edges separate the microbatches. Many: no edges (thin
    # blocks would be all edge), and above a few thousand blocks the bars are embedded
    # as one image (still inline) rather than as thousands of SVG paths.
    separate = plan.num_microbatches * plan.chunks <= 48
    dense = len(timeline.blocks) > 2000
    for (rank, kind), spans in by_row.items():
        axes.broken_barh(spans if separate else _merged(spans), (rank - 0.4, 0.8),
                         facecolors=COLOURS[kind],
                         edgecolors="white" if separate else "none",
                         linewidth=0.4 if separate else 0, rasterized=dense)
    _label_microbatches(axes, timeline, scale)
    axes.set_facecolor("#f4f4f4")   # what shows through is idle time
    axes.axvline(plan.predicted.step_time_s * scale, color="#333", linestyle="--",
                 linewidth=1)
    axes.set_ylim(ranks - 0.5, -0.5)
    step = max(1, ranks // 24)
    axes.set_yticks(range(0, ranks, step), [f"stage {r}" for r in range(0, ranks, step)])
    axes.set_xlim(0, max(timeline.step_s, plan.predicted.step_time_s) * scale * 1.01)
    axes.set_xlabel(f"time in the step ({unit})")
    axes.set_title("Step timeline per pipeline stage", loc="left", fontweight="bold")
    kinds = [k for k in KINDS if any(b.kind == k for b in timeline.blocks)]
    handles = [Patch(facecolor=COLOURS[k], label=LABELS[k]) for k in kinds]
    handles.append(Patch(facecolor="#f4f4f4", edgecolor="#bbb", label="idle"))
    _legend(figure, handles)
    return _svg(figure, "Step timeline per pipeline stage")


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(start, width) spans with touching ones joined."""
    out: list[tuple[float, float]] = []
    for start, width in sorted(spans):
        if out and abs(out[-1][0] + out[-1][1] - start) <= 1e-12 * max(1.0, abs(start)):
            out[-1] = (out[-1][0], out[-1][1] + width)
        else:
            out.append((start, width))
    return out


def _label_microbatches(axes, timeline: Timeline, scale: float) -> None:
    """Microbatch numbers in the forward and backward blocks, when they are wide enough
    to read (about 1/90 of the step)."""
    wide = timeline.step_s / 90
    labelled = [b for b in timeline.blocks if b.kind in ("forward", "backward")
                and b.microbatch is not None and b.seconds >= wide]
    if len(labelled) > 600:
        return
    for block in labelled:
        axes.text((block.start_s + block.seconds / 2) * scale, block.rank,
                  str(block.microbatch), ha="center", va="center", fontsize=7, color="white")


# -- memory --------------------------------------------------------------------------------

def _memory_caption(plan: Plan) -> str:
    worst = max(plan.stages, key=lambda s: s.memory_bytes.peak / s.limit_bytes)
    return (f"By category, against the memory a device leaves the plan (red: what CUDA "
            f"reports, less the reserves the memory section names). The fullest is stage "
            f"{worst.index}: "
            f"{_esc(format_bytes(worst.memory_bytes.peak))} of "
            f"{_esc(format_bytes(worst.limit_bytes))} "
            f"({100 * worst.memory_bytes.peak / worst.limit_bytes:.0f}%).")


def _bytes_axis(n: float) -> tuple[float, str]:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return size, unit
    return 1, "B"


def memory_svg(plan: Plan) -> str:
    stages = plan.stages
    size, unit = _bytes_axis(max(max(s.limit_bytes, s.memory_bytes.peak) for s in stages))
    row = 0.45 if len(stages) <= 16 else max(0.16, 7.2 / len(stages))
    figure = Figure(figsize=(WIDTH_IN, 1.7 + row * len(stages)), layout="constrained")
    axes = figure.add_subplot()
    positions = range(len(stages))
    left = [0.0] * len(stages)
    for kind in MEMORY_LABELS:
        widths = [getattr(s.memory_bytes, kind) / size for s in stages]
        axes.barh(positions, widths, left=left, height=0.7, color=MEMORY_COLOURS[kind],
                  label=MEMORY_LABELS[kind])
        left = [a + b for a, b in zip(left, widths)]
    for i, stage in enumerate(stages):
        limit = stage.limit_bytes / size
        axes.plot([limit, limit], [i - 0.45, i + 0.45], color="#d62728", linewidth=2)
        if len(stages) <= 24:
            # Beside the bar, or past the limit line when the bar reaches it.
            near = left[i] > 0.93 * limit
            axes.text(max(left[i], limit) if near else left[i], i,
                      f" {100 * stage.memory_bytes.peak / stage.limit_bytes:.0f}%",
                      va="center", fontsize=8)
    axes.plot([], [], color="#d62728", linewidth=2, label="usable memory")
    axes.set_ylim(len(stages) - 0.5, -0.5)
    step = max(1, len(stages) // 24)
    axes.set_yticks(range(0, len(stages), step),
                    [f"stage {s.index}" for s in stages[::step]])
    axes.set_xlim(0, max(max(left), max(s.limit_bytes / size for s in stages)) * 1.1)
    axes.set_xlabel(f"memory per rank ({unit})")
    axes.set_title("Memory per rank of each stage, by category", loc="left",
                   fontweight="bold")
    _legend(figure, axes.get_legend_handles_labels()[0])
    return _svg(figure, "Memory per rank of each stage, by category, against the limit")


# -- mesh alternatives ----------------------------------------------------------------------

def _mesh_caption(plan: Plan) -> str:
    return ("Every (pp, dp, tp) factorisation the planner weighed: the chosen one's "
            "predicted step (dark, the plan's), each other one's fastest plan over every "
            "schedule, played out (solid), or the lower bound on any schedule's step that "
            "ruled it out (hatched: it cannot be faster than that), or why it has no plan.")


def mesh_svg(plan: Plan) -> str:
    meshes = plan.meshes
    times = [(plan.predicted.step_time_s if m.mesh == plan.mesh and m.outcome == Outcome.SOLVED
              else m.step_time_s if m.outcome == Outcome.SOLVED else m.bound_s) or None
             for m in meshes]
    known = [t for t in times if t]
    scale, unit = _seconds_axis(max(known))
    row = 0.3 if len(meshes) <= 30 else max(0.14, 9 / len(meshes))
    figure = Figure(figsize=(WIDTH_IN, 1.4 + row * len(meshes)), layout="constrained")
    axes = figure.add_subplot()
    log = max(known) / min(known) > 30
    right = max(known) * scale * (3 if log else 1.3)
    for i, (mesh, seconds) in enumerate(zip(meshes, times)):
        chosen = mesh.mesh == plan.mesh
        if mesh.outcome == Outcome.SOLVED:
            axes.barh(i, seconds * scale, height=0.7,
                      color="#1f4e79" if chosen else "#7aa6d6")
            note = format_seconds(seconds) + (" (chosen)" if chosen else "")
        elif seconds:
            axes.barh(i, seconds * scale, height=0.7, color="white", edgecolor="#999",
                      hatch="///", linewidth=0.6)
            note = f">= {format_seconds(seconds)} ({mesh.outcome})"
        else:
            note = ("does not fit: needs " + format_bytes(mesh.need_bytes) + " of "
                    + format_bytes(mesh.limit_bytes) if mesh.need_bytes else "does not fit")
            seconds = 0.0
        start = seconds * scale if seconds else (min(known) * scale * 0.5 if log else 0)
        axes.text(start, i, " " + note, va="center", fontsize=8,
                  fontweight="bold" if chosen else "normal")
    if log:
        axes.set_xscale("log")
        axes.set_xlim(min(known) * scale * 0.5, right)
    else:
        axes.set_xlim(0, right)
    axes.set_ylim(len(meshes) - 0.5, -0.5)
    axes.set_yticks(range(len(meshes)),
                    [f"pp={m.pp} dp={m.dp} tp={m.tp}"
                     + (f" cp={m.cp} {m.cp_kind}" if m.cp > 1 else "") for m in meshes],
                    fontsize=8)
    axes.set_xlabel(f"predicted step time ({unit})" + (", log scale" if log else ""))
    axes.set_title("Mesh factorisations: predicted step time", loc="left", fontweight="bold")
    outcomes = {m.outcome for m in meshes if m.mesh != plan.mesh}
    _legend(figure, [Patch(facecolor="#1f4e79", label="chosen")]
            + ([Patch(facecolor="#7aa6d6", label="best plan of that mesh")]
               if Outcome.SOLVED in outcomes else [])
            + ([Patch(facecolor="white", edgecolor="#999", hatch="///",
                      label="lower bound (not solved)")]
               if outcomes & {Outcome.PRUNED, Outcome.WORK_LIMIT} else []))
    return _svg(figure, "Mesh factorisations and their predicted step times")


# -- per layer ------------------------------------------------------------------------------

def _layer_table(plan: Plan) -> list[str]:
    """One row per layer: its stage (and run), recompute mode, and under tensor
    parallelism its sharded parameters and collectives."""
    stage_of = {name: (stage.index, run)
                for stage in plan.stages
                for run, layers in enumerate(stage.runs or (stage.layers,))
                for name in layers}
    section, tp = plan.tensor_parallel, plan.tp > 1 and plan.tensor_parallel is not None
    header = ["layer", "stage", "recompute"]
    if plan.chunks > 1:
        header.insert(2, "run on the stage")
    if tp:
        header += ["sharded parameters", "collectives per microbatch (their tensors' bytes)",
                   "collective time per step", "exposed (in the step)", "why replicated"]
    rows = []
    for layer in plan.layer_names:
        stage, run = stage_of.get(layer, ("-", 0))
        row = [layer, str(stage)] + ([str(run)] if plan.chunks > 1 else [])
        row.append(plan.recompute.get(layer, "none"))
        if tp:
            prefix = layer + "."
            sharded = sorted(f"{fqn[len(prefix):]} {p}" for fqn, p in section.params.items()
                             if fqn.startswith(prefix) and p != REPLICATE)
            moves = section.collectives.get(layer, ())
            total, exposed = section.step_seconds(layer, plan.num_microbatches)
            row += [", ".join(sharded) or "-",
                    _collectives(moves),
                    format_seconds(total) if moves and total is not None else "-",
                    format_seconds(exposed) if moves else "-", section.notes.get(layer, "")]
        rows.append(row)
    return ['<section id="layers"><h2>Layers</h2>',
            f"<details open><summary>{len(rows)} layers in model order</summary>",
            _table(header, rows), "</details></section>"]


_SHORT = {"all_reduce": "all-reduce", "all_gather": "all-gather",
          "reduce_scatter": "reduce-scatter"}


def _collectives(moves) -> str:
    """``2 all-gather forward, 2 reduce-scatter backward (2.00 GiB)``: counts by kind and
    phase, and the bytes of the tensors they move."""
    if not moves:
        return "-"
    counts: dict[tuple[str, str], int] = {}
    for move in moves:
        key = (_SHORT.get(move.kind, move.kind), move.phase)
        counts[key] = counts.get(key, 0) + 1
    listed = ", ".join(f"{n} {kind} {phase}" for (kind, phase), n in counts.items())
    return f"{listed} ({format_bytes(sum(move.nbytes for move in moves))})"
