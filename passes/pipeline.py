"""The front half of partc as a checklist of passes: model in, ``ModelAnalysis`` out.

Each pass is timed (``partc.meta.pass_times(gm)``); an exception raised inside one
carries a note naming the pass (and the node, where a pass ran one). With
``PARTC_VERIFY=1`` (always on in tests) the invariants each pass ensures are checked
before the next one runs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable, Sequence

import torch
from torch import fx, nn

from partc import meta
from partc.errors import TraceError
from partc.identity import model_hash
from partc.options import ShardingOptions
from partc.placement import REPLICATE
from partc.problem import ModelAnalysis, ModelSummary, SharedParam, TPOption
from partc.runtime import tp as tp_ops

from . import dedupe
from . import shard as shard_pass
from . import tp_chooser
from .estimate import estimate
from .graph import is_dtype_check, param_usage
from .fuse_attention import fuse_attention
from .layers import crossing_bytes, crossing_tensors, layers
from .propagate import propagate
from .tp_chooser import Link
from .context import Context
from .trace import trace

Pass = Callable[[fx.GraphModule, Context], fx.GraphModule]

log = logging.getLogger("partc")


def analyze(model: nn.Module, example_inputs: Any, *, loss_fn: Callable | None = None,
            example_target: Any = None, name: str | None = None,
            kwargs: dict | None = None, full_trace: bool | None = None,
            attention: str = "as_written", autocast: torch.dtype | None = None,
            autocast_device: str = "cuda") -> tuple[fx.GraphModule, ModelAnalysis]:
    """Trace ``model`` and measure it, layer by layer, per sample.

    ``example_inputs`` is a tensor or a tuple of positional inputs (real, meta or fake;
    dim 0 of the first is the batch); ``kwargs`` optional keyword inputs. With
    ``loss_fn(output, target)`` the loss becomes the last layer, ``"loss"``; its target
    is ``example_target`` or, for a (batch, seq, vocab) output, int64 class indices.
    Returns the GraphModule (placeholders: the forward's inputs in order, then
    ``target``) and the :class:`partc.problem.ModelAnalysis` the planner reads.

    Repeated blocks (a ``ModuleList`` or ``Sequential`` of like children) are traced once
    per structure and the analysis expanded to every block (:mod:`partc.passes.dedupe`);
    the GraphModule is then that of the shorter model, for ``tensor_parallel_options``
    (which expands its options the same way). Where the traced blocks cannot stand for
    the rest, the whole model is traced, and the log says why. ``full_trace=True`` (or
    ``PARTC_FULL_TRACE=1`` in the environment) traces every block from the start.
    ``attention="fused"`` measures attention as one fused kernel call wherever
    :mod:`partc.passes.fuse_attention` can put one in its place.

    ``autocast``: the dtype mixed-precision training computes in (the runtime runs each
    stage under ``torch.autocast``); the layers' activations are then measured as
    autocast makes them (``ModelSummary.autocast``), not as traced, under the policy of
    ``autocast_device``: "cuda" (GPUs; CUDA's policy, applied on CPU) or "cpu".
    """
    def front() -> tuple[fx.GraphModule, Context]:
        return _front(model, example_inputs, attention, autocast, autocast_device,
                      kwargs=kwargs, loss_fn=loss_fn, example_target=example_target,
                      name=name)

    if full_trace is None:
        full_trace = os.environ.get("PARTC_FULL_TRACE") == "1"
    repeats = () if full_trace else dedupe.find_repeats(model)
    if repeats:
        try:
            return _analyze_blocks(model, repeats, front)
        except Exception as error:  # any failure: the whole model, as without repeats
            # Under PARTC_VERIFY (tests) an error other than a refused expansion or a
            # failed trace is a bug to see, not to step around.
            if os.environ.get("PARTC_VERIFY") == "1" and not isinstance(
                    error, (dedupe.Mismatch, TraceError)):
                raise
            log.warning("tracing the whole model, every block (%s: %s)",
                        type(error).__name__, error)
    gm, ctx = front()
    return gm, summarize(gm, ctx)


def _front(model: nn.Module, example_inputs: Any, attention: str,
           autocast: torch.dtype | None, autocast_device: str, **trace_args: Any
           ) -> tuple[fx.GraphModule, Context]:
    started = time.perf_counter()
    gm, ctx = _named("trace", lambda: trace(model, example_inputs, **trace_args))
    ctx = dataclasses.replace(ctx, autocast=autocast, autocast_device=autocast_device)
    meta.add_pass_time(gm, "trace", time.perf_counter() - started)
    _verify("trace", gm)
    # Order matters: fusing attention reads the shapes propagate writes, layers reads
    # the graph as it will run, and estimate measures one layer at a time (once per
    # repeated-block signature), so it runs after layers.
    passes: list[tuple[str, Pass]] = [
        ("propagate", propagate),
        *_attention_passes(attention),
        ("layers", layers),
        ("estimate", estimate),
    ]
    for pass_name, run_pass in passes:
        started = time.perf_counter()
        gm = _named(pass_name, lambda: run_pass(gm, ctx))
        meta.add_pass_time(gm, pass_name, time.perf_counter() - started)
        _verify(pass_name, gm)
    gm.meta[meta.CONTEXT] = ctx
    return gm, ctx


def _attention_passes(attention: str) -> list[tuple[str, Pass]]:
    """The passes that ``attention`` (a ``TrainSpec.attention`` value) asks for."""
    return [("fuse_attention", fuse_attention)] if attention == "fused" else []


def _analyze_blocks(model: nn.Module, repeats: tuple[dedupe.Repeat, ...],
                    front: Callable[[], tuple[fx.GraphModule, Context]]
                    ) -> tuple[fx.GraphModule, ModelAnalysis]:
    """Trace the representatives of each repeat, then expand to the whole model."""
    with dedupe.shrunk(model, repeats):
        gm, ctx = front()
    # The containers hold every block again: the summary counts and hashes all of them.
    started = time.perf_counter()
    expansion = dataclasses.replace(dedupe.plan_expansion(gm, ctx, repeats), retrace=front)
    ctx = dataclasses.replace(ctx, expansion=expansion)
    gm.meta[meta.CONTEXT] = ctx
    analysis = dedupe.expand_analysis(summarize(gm, ctx), gm, expansion, 1.0 / ctx.batch_size)
    dedupe.check_param_count(analysis, gm, ctx, expansion)
    meta.add_pass_time(gm, "expand", time.perf_counter() - started)
    log.info("traced %s: %s", ctx.name, ", ".join(
        f"{len(r.kept)} of the {r.size} blocks of {r.container or 'the model'}"
        for r in repeats))
    return gm, analysis


def tensor_parallel_options(gm: fx.GraphModule, links: Sequence[Link],
                            sequence_parallel: Sequence[bool] = (False, True),
                            objectives: Sequence[str] = ("time", "memory"),
                            options: ShardingOptions = ShardingOptions()
                            ) -> tuple[TPOption, ...]:
    """For each group (``links``: one per tp degree), with and without sequence
    parallelism, fastest first and fewest parameter bytes first: choose the sharding,
    rewrite a copy of the graph for one rank, and measure it as ``analyze`` measures the
    whole model. A memory-first sharding equal to the time-first one is not repeated.
    ``options``: the chooser's CP-SAT limits (``PlannerOptions.sharding``).
    ``gm`` is ``analyze``'s graph; where it holds representatives of repeated blocks,
    each option is measured on it and expanded to the whole model.
    """
    ctx = gm.meta[meta.CONTEXT]
    try:
        return _options(gm, ctx, links, sequence_parallel, objectives, options)
    except dedupe.Mismatch as why:
        log.warning("measuring tensor parallelism on the whole model (%s)", why)
        full, full_ctx = ctx.expansion.retrace()
        return _options(full, full_ctx, links, sequence_parallel, objectives, options)


def _options(gm: fx.GraphModule, ctx: Context, links: Sequence[Link],
             sequence_parallel: Sequence[bool], objectives: Sequence[str],
             sharding_options: ShardingOptions) -> tuple[TPOption, ...]:
    base, usage = summarize(gm, ctx), param_usage(gm, ctx)
    options = []
    measured: list[tuple[tuple, TPOption]] = []  # (tp, sp, per-layer choices), option
    for link, sp, objective in [(link, sp, objective) for link in links
                                for sp in sequence_parallel for objective in objectives]:
        if sp and not tp_chooser.sequence_length(gm):
            continue
        started = time.perf_counter()
        chosen = _named("sharding", lambda: tp_chooser.choose(
            gm, link.tp, link, sequence_parallel=sp, prefer=objective,
            options=sharding_options))
        key = (link.tp, sp, tuple((layer.name, layer.choices) for layer in chosen.layers))
        same = [option for seen, option in measured if seen == key]
        if same:  # measured already: the same sharding under the other objective
            options.append(dataclasses.replace(same[0], objective=objective))
            continue
        local, moved = shard_pass.copy_module(gm, chosen)
        _named("shard", lambda: shard_pass.shard(local, moved))
        with tp_ops.simulate(link.tp):
            _named("propagate", lambda: propagate(local, ctx))
            _named("estimate", lambda: estimate(local, ctx))
        option = dataclasses.replace(_tp_option(ctx, base, usage, local, chosen),
                                     objective=objective)
        if ctx.expansion is not None:
            option = dedupe.expand_option(option, local, ctx.expansion, 1.0 / ctx.batch_size)
        measured.append((key, option))
        options.append(option)
        meta.add_pass_time(gm, f"sharding tp={link.tp}{' sp' if sp else ''}",
                           time.perf_counter() - started)
    return tuple(options)


def _tp_option(ctx: Context, base: ModelAnalysis, usage: dict, local: fx.GraphModule,
               chosen: tp_chooser.Sharding) -> TPOption:
    """Per-rank costs: measured FLOPs and bytes, local parameter counts, collectives.
    ``base`` and ``usage`` are the whole model's analysis and parameter usage."""
    tp, per_sample = chosen.tp, 1.0 / ctx.batch_size
    placements = chosen.param_placements()

    def local_count(key: int) -> tuple[int, int]:
        tensor = usage["tensors"][key]
        placement = next((placements[f] for f in ctx.param_fqns[key] if f in placements),
                         REPLICATE)
        divisor = tp if placement.kind == "S" else 1
        return tensor.numel() // divisor, tensor.numel() * tensor.element_size() // divisor

    own: dict[int, list[int]] = {}
    for key, indices in usage["layers"].items():
        if len(indices) == 1:
            count, nbytes = local_count(key)
            totals = own.setdefault(next(iter(indices)), [0, 0])
            totals[0] += count
            totals[1] += nbytes
    layers = []
    for cost, sharded in zip(meta.layer_costs(local), chosen.layers):
        count, nbytes = own.get(len(layers), (0, 0))
        comm = tuple((c.kind, c.phase, c.bytes * per_sample) for c in sharded.collectives)
        layers.append(dataclasses.replace(cost, param_count=count, param_bytes=nbytes,
                                          tp_comm=comm))
    shared = []
    for group in base.shared:
        key = next(k for k, fqns in ctx.param_fqns.items() if fqns[0] == group.fqns[0])
        count, nbytes = local_count(key)
        shared.append(dataclasses.replace(group, param_count=count, param_bytes=nbytes))
    num_layers = len(layers)
    model = dataclasses.replace(
        base, layers=tuple(layers), shared=tuple(shared),
        cut_bytes=tuple(c * per_sample for c in crossing_bytes(local, num_layers)),
        cut_tensors=crossing_tensors(local, num_layers))
    return TPOption(
        tp=tp, sequence_parallel=chosen.sequence_parallel, model=model,
        choices=tuple((layer.name, layer.choices) for layer in chosen.layers),
        placements=tuple(sorted((fqn, str(p)) for fqn, p in placements.items())),
        partial_grad_params=tuple(sorted(chosen.partial_grad_params)),
        notes=tuple((layer.name, layer.note) for layer in chosen.layers if layer.note))


def lower(model: nn.Module, example_inputs: tuple, stages: list[list[str]],
          recompute: dict[str, str], *, loss_fn: Callable | None = None,
          example_target: Any = None, tensor_parallel: dict | None = None,
          local_param: Callable | None = None, attention: str = "as_written"
          ) -> tuple[fx.GraphModule, list]:
    """The back half: the model traced at the micro-batch size, cut into the plan's stages,
    with the plan's layers recomputed. Returns the traced graph and one
    :class:`partc.passes.split.StageGraph` per stage.

    ``example_inputs`` (and ``example_target``) must have the micro-batch size in dim 0:
    the graph's view shapes are those of one microbatch.
    """
    from .recompute import recompute as recompute_pass
    from .split import split

    gm, ctx = _named("trace", lambda: trace(model, example_inputs, loss_fn=loss_fn,
                                            example_target=example_target))
    _drop_dtype_checks(gm)
    _verify("trace", gm)
    for pass_name, run_pass in [("propagate", propagate), *_attention_passes(attention),
                                ("layers", layers)]:
        gm = _named(pass_name, lambda: run_pass(gm, ctx))
        _verify(pass_name, gm)
    tp = int((tensor_parallel or {}).get("degree", 1))
    if tp > 1:
        # The plan's sharding, rebuilt from its per-node choices, then this rank's graph.
        chosen = _named("sharding", lambda: tp_chooser.apply(
            gm, tp, bool(tensor_parallel.get("sequence_parallel")),
            {name: tuple(c) for name, c in tensor_parallel["choices"].items()}))
        _named("shard", lambda: shard_pass.shard(gm, chosen, local_param))
        with tp_ops.simulate(tp):
            gm = _named("propagate", lambda: propagate(gm, ctx))
    stage_graphs = _named("split", lambda: split(gm, stages))
    for stage in stage_graphs:
        modes = {name: recompute.get(name, "none") for name in stage.layers}
        _named("recompute", lambda: recompute_pass(stage.module, modes))
    return gm, stage_graphs


def _drop_dtype_checks(gm: fx.GraphModule) -> None:
    """Exported graphs assert the dtype each tensor was traced with; under mixed
    precision the program runs them in another, so the checks go (they compute nothing)."""
    for node in list(gm.graph.nodes):
        if is_dtype_check(node) and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()


def _named(pass_name: str, thunk: Callable[[], Any]) -> Any:
    try:
        return thunk()
    except Exception as error:
        error.add_note(f"partc: raised in pass {pass_name!r}")
        raise


def summarize(gm: fx.GraphModule, ctx: Context) -> ModelAnalysis:
    """Collect the per-layer costs, cuts and shared parameters into a ModelAnalysis."""
    info = meta.trace_info(gm)
    per_sample = 1.0 / ctx.batch_size
    return ModelAnalysis(
        summary=ModelSummary(
            name=ctx.name, num_params=_num_params(ctx.model), hash=model_hash(ctx.model),
            tokens_per_sample=_tokens_per_sample(ctx), traced_batch_size=ctx.batch_size,
            traced_dtype_bytes=_dtype_bytes(ctx.model), tracer=info.tracer,
            inputs=input_specs(gm),
            autocast=str(ctx.autocast).removeprefix("torch.") if ctx.autocast else ""),
        layers=meta.layer_costs(gm),
        cut_bytes=tuple(c * per_sample for c in meta.cut_bytes(gm)),
        shared=_shared(gm, ctx),
        cut_tensors=meta.cut_tensors(gm),
    )


def input_specs(gm: fx.GraphModule) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """Name, per-sample shape and dtype of each placeholder (the target last)."""
    specs = []
    for node in gm.graph.nodes:
        if node.op != "placeholder" or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        value = node.meta["val"]
        specs.append((node.name, tuple(int(d) for d in value.shape[1:]),
                      str(value.dtype).removeprefix("torch.")))
    return tuple(specs)


def _unique_params(model: nn.Module) -> list[nn.Parameter]:
    return list({id(p): p for p in model.parameters()}.values())


def _num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in _unique_params(model))


def _dtype_bytes(model: nn.Module) -> int:
    floats = [p for p in _unique_params(model) if p.is_floating_point()]
    return floats[0].element_size() if floats else 4


def _tokens_per_sample(ctx: Context) -> int:
    first = ctx.fake_inputs[0] if ctx.fake_inputs else None
    if isinstance(first, torch.Tensor) and first.dim() == 2 and not first.is_floating_point():
        return int(first.shape[1])
    return 0


def _shared(gm: fx.GraphModule, ctx: Context) -> tuple[SharedParam, ...]:
    usage = param_usage(gm, ctx)
    shared = []
    for key, indices in usage["layers"].items():
        if len(indices) < 2:
            continue
        tensor = usage["tensors"][key]
        fqns = ctx.param_fqns[key]
        shared.append(SharedParam(name=fqns[0], fqns=fqns, param_count=tensor.numel(),
                                  param_bytes=tensor.numel() * tensor.element_size(),
                                  layers=tuple(sorted(indices))))
    return tuple(sorted(shared, key=lambda s: s.name))


def _verify(pass_name: str, gm: fx.GraphModule) -> None:
    if os.environ.get("PARTC_VERIFY") != "1":
        return
    checks = {"trace": _verify_trace, "propagate": _verify_propagate,
              "fuse_attention": _verify_propagate, "layers": _verify_layers,
              "estimate": _verify_estimate}
    gm.graph.lint()
    for node in gm.graph.nodes:
        problem = checks[pass_name](node)
        if problem:
            raise AssertionError(f"after pass {pass_name!r}, node {node.name!r} "
                                 f"({node.format_node()}): {problem}")
    if pass_name == "layers" and len(meta.cut_bytes(gm)) != len(meta.layers(gm)) - 1:
        raise AssertionError("after pass 'layers': one cut per pair of adjacent layers")


def _verify_trace(node: fx.Node) -> str:
    if node.op == "placeholder" and node.prev.op not in ("placeholder", "root"):
        return "placeholders must come first"
    if node.op == "get_attr" and not meta.params(node):
        return "get_attr without its parameter FQN"
    if node.op == "get_attr" and node.next not in node.users and node.next.op != "get_attr":
        return "get_attr is not next to its first user"
    return ""


def _verify_propagate(node: fx.Node) -> str:
    if node.op != "output" and "val" not in node.meta:
        return "no fake value"
    return ""


def _verify_layers(node: fx.Node) -> str:
    if meta.LAYER not in node.meta:
        return "no layer"
    if node.op in ("placeholder", "get_attr", "output"):
        return ""
    later = [u for u in node.users if meta.layer(u).index < meta.layer(node).index]
    return f"used by an earlier layer: {later[0].name}" if later else ""


def _verify_estimate(node: fx.Node) -> str:
    if node.op.startswith("call_") and meta.cost(node) is None:
        return "no cost"
    return ""
