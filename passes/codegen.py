"""Readable Python source for one stage: a header that summarises the plan, then the code.

The code is the stage's own fx-generated ``forward`` (what the runtime executes), with
each layer introduced by a comment line naming it and its recompute mode, the shapes of
values as trailing comments, and the recomputed layers as nested modules called through
``checkpoint_layer``. Formatting is stable: the same plan and model give the same text,
so the files can be diffed and kept as golden copies. A file stays readable at scale:
the header gives the stage's ranks as ranges (``0-1023``, ``3-1023 step 4``), and an FSDP
unit that runs another unit's code (the like blocks of a transformer under ZeRO-3) is named
under the first such unit instead of printed again.

A stage file imports on its own and names only what it defines or imports (pyflakes
finds no undefined name): lowering dropped export's metadata assertions and made device
literals of the planning machine read the device of the stage's input instead
(``passes/portable.py``, run on every stage the runtime runs); fx's string annotations
(``"f32[2, 16]"``, which are not Python names) become comments, and fx's ``wrap(...)``
registrations (needed only to trace the code again, and refused inside a class body) are
left out. The file defines the stage's class; running it needs the model's parameters at
the FQNs it reads.
"""

from __future__ import annotations

import ast
import re
import textwrap
import types
from typing import Any, Mapping, Sequence

import torch
from torch import fx

from partc import meta
from partc.cost.schedules import rank_of
from partc.names import Phase
from partc.passes.split import StageGraph
from partc.placement import REPLICATE
from partc.errors import PartcError
from partc.plan import Plan
from partc.safe_text import identifier, one_line
from partc.units import format_bytes

_NODE_LINE = re.compile(r"^(\s+)(\w+)(?::| =)")
_NOISE = re.compile(r"^\s*# (No stacktrace found|File: |Stack trace)")
# fx's registration of a wrapped function for retracing: ``torch.fx._symbolic_trace.wrap("f")``
_WRAP = re.compile(r'^\s*(torch\.fx\._symbolic_trace\.)?wrap\("\w+"\)$')
_ANNOTATED = re.compile(r'^(\s+)(\w+): "([^"]*)" = (.*)$')
_DEF = re.compile(r"^(\s*)def forward\(self((?:, \w+(?:: \"[^\"]*\")?)*)\):$")
_PARAM = re.compile(r'(\w+)(?:: "([^"]*)")?')
# fx names a class after the module's attribute (``0`` in an ``nn.Sequential``), which
# need not be a Python identifier.
_CLASS = re.compile(r"^(\s*)class (.+)\(torch\.nn\.Module\):$")
# fx's own names for a few values, and how a file gets them (``torch.fx.graph``'s list)
_FX_BUILTINS = {"inf": "inf = float('inf')", "nan": "nan = float('nan')",
                "NoneType": "NoneType = type(None)", "device": "from torch import device",
                "fx_pytree": "import torch.fx._pytree as fx_pytree",
                "pytree": "import torch.utils._pytree as pytree"}


def codegen(stage: StageGraph, plan: Plan,
            shared: Mapping[str, Sequence[int]] | None = None) -> str:
    """The source of ``stage`` as ``code/stage_<k>.py`` holds it.

    ``shared`` maps a parameter FQN held by several stages to those stages' indices
    (tied weights, whose gradients are summed across them after backward).
    Reads: ``meta.LAYER`` and ``node.meta["val"]`` on the stage's nodes. Requires: the
    stage as lowering left it (``passes.pipeline.stage_passes``). Drops the nodes' stack
    traces, which are not printed.
    """
    module = _tidy(stage.module)
    body = _plain_python(module.print_readable(print_output=False))
    body = _annotate_layers(body, module, plan.recompute)
    # fx prints a unit that is a direct child inside the stage's class; the others
    # (``blocks.3`` of a ModuleList) follow it.
    nested = [path for path in meta.fsdp_units(module) if "." in path]
    body = "\n\n\n".join([body.rstrip(), *_units_source(module, nested)])
    # Names the user chose (the model's, its modules') stay inside their comment lines.
    header = [one_line(line) for line in _header(stage, plan, shared or {})]
    source = "\n".join(header + [""] + _imports(module, body) + ["", ""] + [body.rstrip(), ""])
    _check_only_definitions(source, stage.index)
    return source


def _check_only_definitions(source: str, index: int) -> None:
    """Refuse source that would do anything at import but import and define: the
    file is for reading, and a name that escaped its comment or string must not run."""
    try:
        tree = ast.parse(source)
    except SyntaxError as error:
        raise PartcError(f"the emitted code of stage {index} is not valid Python "
                         f"(line {error.lineno}: {error.msg}); this is a partc bug: "
                         "report it with the model's module names") from None
    allowed = (ast.Import, ast.ImportFrom, ast.ClassDef)
    for statement in tree.body:
        fx_name = (isinstance(statement, ast.Assign) and len(statement.targets) == 1
                   and isinstance(statement.targets[0], ast.Name)
                   and statement.targets[0].id in _FX_BUILTINS)
        if not isinstance(statement, allowed) and not fx_name:
            raise PartcError(f"the emitted code of stage {index} would run line "
                             f"{statement.lineno} at import ({ast.unparse(statement)[:60]!r}), "
                             "not only define its classes; this is a partc bug: report it "
                             "with the model's module names")


def _tidy(module: fx.GraphModule) -> fx.GraphModule:
    """The stage without the stack traces fx would print beside each node."""
    for gm in _graph_modules(module):
        for node in gm.graph.nodes:
            node.meta.pop("stack_trace", None)
        gm.recompile()
    return module


def _graph_modules(module: fx.GraphModule) -> list[fx.GraphModule]:
    """The stage and every GraphModule inside it (recomputed layers, FSDP units)."""
    return [m for m in module.modules() if isinstance(m, fx.GraphModule)]


def _units_source(module: fx.GraphModule, paths: Sequence[str]) -> list[str]:
    """Each distinct FSDP unit's code once: a unit whose code is another's but for its
    values' names (the 79 blocks after a Llama's first) is named under the first unit
    that runs that code, not printed again, so a stage file grows with the kinds of
    layer it holds, not with their number."""
    first_of: dict[str, str] = {}
    same: dict[str, list[str]] = {}
    for path in paths:
        unit = module.get_submodule(path)
        key = _canonical(unit, _plain_python(unit.print_readable(print_output=False)))
        if key in first_of:
            same[first_of[key]].append(path)
        else:
            first_of[key] = path
            same[path] = []
    return [_unit_source(module, path, same[path]) for path in same]


_WORD = re.compile(r"(?<![\w.])[A-Za-z_]\w*")   # a name, not an attribute (".view")


def _canonical(unit: fx.GraphModule, source: str) -> str:
    """A unit's code with its values named by their order of appearance and its class
    line left out: equal for units that run the same code on other parameters."""
    names = {node.name for node in unit.graph.nodes}
    order: dict[str, str] = {}
    body = source.split("\n", 1)[1] if "\n" in source else ""
    return _WORD.sub(lambda found: order.setdefault(found.group(), f"_v{len(order)}")
                     if found.group() in names else found.group(), body)


def _unit_source(module: fx.GraphModule, path: str, same: Sequence[str] = ()) -> str:
    """An FSDP unit's code (the stage calls it as a module at the layer's own path)."""
    unit = module.get_submodule(path)
    also = ""
    if same:
        count = f" ({len(same)})" if len(same) > 1 else ""
        listed = textwrap.wrap(f"The same code runs as FSDP unit{'s' * (len(same) > 1)} "
                               f"{one_line(name_runs(same))}{count}, each with its own "
                               "parameters.", 96, break_long_words=False,
                               break_on_hyphens=False)
        also = "".join(f"# {line}\n" for line in listed)
    return (f"# FSDP unit {one_line(path)}: layer {one_line(path)} with its own parameters, "
            "gathered over the data-parallel group before it runs\n" + also
            + _plain_python(unit.print_readable(print_output=False)).rstrip())


def _plain_python(body: str) -> str:
    """fx's printout as a module pyflakes accepts: shape annotations as comments, no
    stack-trace comments, no ``wrap`` registrations (and the blank line after each)."""
    out: list[str] = []
    for line in body.splitlines():
        if _NOISE.match(line) or _WRAP.match(line):
            continue
        if not line.strip() and out and out[-1].lstrip().startswith("class "):
            continue
        annotated, signature = _ANNOTATED.match(line), _DEF.match(line)
        named = _CLASS.match(line)
        if named:
            line = f"{named.group(1)}class {identifier(named.group(2))}(torch.nn.Module):"
        elif annotated:
            indent, name, shape, value = annotated.groups()
            line = f"{indent}{name} = {value}  # {shape}"
        elif signature:
            indent, params = signature.groups()
            pairs = _PARAM.findall(params)
            line = f"{indent}def forward(self{''.join(f', {name}' for name, _ in pairs)}):"
            shapes = [f"{name}: {shape}" for name, shape in pairs if shape]
            if shapes:
                out += [line, f"{indent}    # {', '.join(shapes)}"]
                continue
        out.append(line.rstrip())
    return "\n".join(out)


def _data_parallel_lines(plan: Plan) -> list[str]:
    """How gradients (and, under ZeRO, the state) are shared among the dp replicas."""
    dp = plan.dp
    if dp == 1:
        return []
    zero = plan.effective_zero_stage
    if zero < 2:
        lines = [f"# Gradients averaged over {dp} data-parallel replicas in fp32 buckets: each",
                 "# bucket's all-reduce starts as the last microbatch's backward fills it."]
        if zero == 1:
            lines = [f"# Gradients averaged over {dp} data-parallel replicas in fp32 buckets: each",
                     "# bucket is reduce-scattered as the last microbatch's backward fills it;",
                     f"# ZeRO-1: each replica steps its 1/{dp} shard of every parameter and its",
                     "# optimizer state, then the shards are all-gathered bucket by bucket."]
        return lines
    kept = "the gathered weights for the step" if zero == 2 else (
        "each layer gathered only while it runs (forward, then again for backward)")
    if plan.reduces_once:
        return [f"# ZeRO-2: FSDP2 over {dp} replicas, one unit per layer that owns "
                "its parameters;",
                f"# weights and optimizer state sharded 1/{dp}; gradients accumulate whole "
                "over the step's",
                "# microbatches and the last microbatch's backward reduce-scatters them; "
                f"{kept}."]
    return [f"# ZeRO-{zero}: FSDP2 over {dp} replicas, one unit per layer that owns "
            "its parameters;",
            f"# weights, gradients and optimizer state sharded 1/{dp}; every microbatch's "
            "backward",
            f"# reduce-scatters gradients; {kept}."]


def _header(stage: StageGraph, plan: Plan, shared: Mapping[str, Sequence[int]]) -> list[str]:
    k, last = stage.index, stage.num_stages - 1
    # With several virtual stages per rank, the schedule places stage k on pp index r.
    r = rank_of(plan.schedule, plan.pp, plan.chunks, k) if plan.chunks > 1 else k
    ranks = [(r * plan.dp + d) * plan.tp + t for d in range(plan.dp) for t in range(plan.tp)]
    b, m = plan.micro_batch_size, plan.num_microbatches
    recomputed = [f"{name} ({mode})" for name, mode in plan.recompute.items()
                  if name in stage.layers and mode != "none"]
    params = list({id(p): p for p in stage.module.parameters()}.values())
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    values = {n.name: n for n in stage.module.graph.nodes}
    lines = [
        f"# Generated by partc from plan {plan.hash} for {plan.model.name}"
        f" (model hash {plan.model.hash}). Do not edit: compile again.",
        "#",
        f"# {'Virtual stage' if plan.chunks > 1 else 'Stage'} {k} of {stage.num_stages} "
        f"(pp index {r}), on rank{'s' * (len(ranks) > 1)} {rank_ranges(ranks)}"
        f"{f' ({len(ranks):,} ranks)' if len(ranks) > 3 else ''}.",
        *_group_lines(ranks, plan.dp, plan.tp),
        f"# Schedule: {plan.schedule}, {m} microbatch{'es' * (m > 1)} of {b} "
        f"(global batch {plan.global_batch_size}"
        f"{f' over {plan.dp} replicas' if plan.dp > 1 else ''}).",
        f"# Layers: {name_runs(stage.layers)}.",
        f"# Recompute: {', '.join(recomputed) if recomputed else 'none'}.",
    ]
    if k == 0:
        lines.append(f"# Inputs: {_describe(stage.receives, values)}.")
    else:
        lines.append(f"# Receives from stage {k - 1}, per microbatch: "
                     f"{_describe(stage.receives, values)}; sends {stage.grad_receives} "
                     "gradient(s) back.")
    if k < last:
        lines.append(f"# Sends to stage {k + 1}, per microbatch: "
                     f"{_describe(stage.sends, _outputs(stage.module, stage.sends))}; receives "
                     f"{stage.grad_sends} gradient(s) back.")
    else:
        lines.append(f"# Returns the model's output for the loss: "
                     f"{_describe(stage.sends, _outputs(stage.module, stage.sends))}.")
    tied = [f"{fqn} with stage{'s' * (len(others) > 2)} "
            f"{', '.join(str(s) for s in others if s != k)}"
            for fqn, others in sorted(shared.items()) if k in others]
    if tied:
        lines.append("# After backward, gradients summed (all-reduce) for tied: "
                     f"{'; '.join(tied)}.")
    if plan.tp > 1:
        section = plan.tensor_parallel
        mine = [f for f, p in section.params.items()
                if p != REPLICATE and any(f.startswith(layer + ".") for layer in stage.layers)]
        moves = [m for layer in stage.layers for m in section.collectives.get(layer, ())]
        lines.append(f"# Tensor parallel: tp={plan.tp}"
                     f"{', sequence parallel' if section.sequence_parallel else ''}; "
                     f"each rank runs this code on its shards ({len(mine)} sharded parameters) "
                     f"and meets the other ranks through its group, self.tp (partc.runtime.tp): "
                     f"{sum(m.phase == Phase.FORWARD for m in moves)} collectives forward and "
                     f"{sum(m.phase == Phase.BACKWARD for m in moves)} backward per microbatch "
                     f"(the backward ones are the autograd conjugates of the calls below).")
        partial = [f for f in section.partial_grad_params
                   if any(f.startswith(layer + ".") for layer in stage.layers)]
        if partial:
            lines.append(f"# After backward, partial gradients of {len(partial)} replicated "
                         f"parameters summed (all-reduce) over the tp group.")
    lines += _data_parallel_lines(plan)
    lines.append(f"# Parameters: {sum(p.numel() for p in params):,} ({format_bytes(param_bytes)}).")
    return lines


def rank_ranges(ranks: Sequence[int]) -> str:
    """Sorted ranks as arithmetic runs, readable at any count: ``0-127`` (consecutive),
    ``3-1023 step 4``, single ranks listed (``0, 1``); a run needs three ranks."""
    parts, i = [], 0
    while i < len(ranks):
        end = i
        if i + 2 < len(ranks):
            stride = ranks[i + 1] - ranks[i]
            while end + 1 < len(ranks) and ranks[end + 1] - ranks[end] == stride:
                end += 1
        if end - i >= 2:
            parts.append(f"{ranks[i]}-{ranks[end]}" + (f" step {stride}" if stride != 1 else ""))
            i = end + 1
        else:
            parts.append(str(ranks[i]))
            i += 1
    return ", ".join(parts)


_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def name_runs(names: Sequence[str]) -> str:
    """Names in order, numbered runs shortened: ``model.layers.0 .. model.layers.79``
    for three or more names that differ only in a number counting up by one."""
    parts, i = [], 0
    while i < len(names):
        found, end = _NUMBERED.match(names[i]), i
        if found:
            prefix, number = found.group(1), int(found.group(2))
            while end + 1 < len(names) and names[end + 1] == f"{prefix}{number + end + 1 - i}":
                end += 1
        parts.append(f"{names[i]} .. {names[end]}" if end - i >= 2 else names[i])
        i = end + 1 if end - i >= 2 else i + 1
    return ", ".join(parts)


def _group_lines(ranks: Sequence[int], dp: int, tp: int) -> list[str]:
    """Which of the stage's ranks meet in which group, when it has both kinds (ranks
    are numbered (pp index x dp + replica) x tp + tp rank)."""
    if dp == 1 or tp == 1:
        return []
    first = ranks[0]
    return [f"# Groups: tensor parallel, {tp} consecutive ranks ({rank_ranges(ranks[:tp])}, "
            f"...); data parallel, the {dp} ranks of one tp rank "
            f"({rank_ranges(range(first, first + dp * tp, tp))}, ...)."]


def _outputs(module: fx.GraphModule, names: Sequence[str]) -> dict[str, fx.Node]:
    """The stage's returned nodes under the names of the values they send (a recomputed
    layer's output is read back through a ``getitem`` of another name)."""
    output = next(n for n in reversed(module.graph.nodes) if n.op == "output")
    return dict(zip(names, output.args[0]))


def _describe(names: Sequence[str], nodes: Mapping[str, fx.Node]) -> str:
    parts = []
    for name in names:
        value = nodes[name].meta.get("val") if name in nodes else None
        parts.append(f"{name} {_shape(value)}" if value is not None else name)
    return ", ".join(parts) if parts else "nothing"


def _shape(value: Any) -> str:
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    dtype = str(value.dtype).removeprefix("torch.")
    return f"{dtype}[{', '.join(str(d) for d in value.shape)}]"


def _annotate_layers(body: str, module: fx.GraphModule, modes: Mapping[str, str]) -> str:
    """Put a comment line before each layer's first node."""
    layer_of = {n.name: meta.layer(n).name for n in module.graph.nodes if meta.LAYER in n.meta}
    out, current, in_stage = [], None, False
    for line in body.splitlines():
        if line.startswith("class "):
            in_stage, current = True, None
        elif re.match(r"^    class ", line):
            in_stage = False  # a recomputed layer's module: its nodes are that layer's
        found = _NODE_LINE.match(line)
        if in_stage and found and found.group(2) in layer_of:
            name = layer_of[found.group(2)]
            if name != current:
                mode = modes.get(name, "none")
                note = f" (recompute: {mode})" if mode != "none" else ""
                out.append(f"{found.group(1)}# layer {one_line(name)}{note}")
                current = name
        out.append(line.rstrip())
    return "\n".join(out)


def _imports(module: fx.GraphModule, body: str) -> list[str]:
    """Import lines for the names ``body`` uses besides ``torch``."""
    names: dict[str, Any] = {}
    for gm in _graph_modules(module):
        names.update(gm.graph.python_code("self").globals)
    used = {n.id for n in ast.walk(ast.parse(body)) if isinstance(n, ast.Name)}
    lines = {"import torch"}
    for name, value in names.items():
        if name == "torch" or name not in used:
            continue
        if name in _FX_BUILTINS:  # fx reserves these names for these values
            lines.add(_FX_BUILTINS[name])
        elif isinstance(value, types.ModuleType):
            lines.add(f"import {value.__name__}" if value.__name__ == name
                      else f"import {value.__name__} as {name}")
        elif getattr(value, "__module__", None) == "builtins":
            continue
        elif callable(value) and getattr(value, "__module__", None):
            qualname = getattr(value, "__qualname__", getattr(value, "__name__", name))
            lines.add(f"from {value.__module__} import {qualname} as {name}"
                      if qualname != name else f"from {value.__module__} import {name}")
    # ``import`` lines, then ``from`` lines, then the assignments
    return sorted(lines, key=lambda line: (line.split()[0] != "import",
                                           line.split()[0] != "from", line))
