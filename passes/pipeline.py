"""partc's compiler as one checklist: the pass lists, and the one runner that runs them.

Three lists, each read top to bottom (see ``docs/architecture.md``):

- :func:`analysis_passes` measure a traced model for the planner (``analyze``);
- :func:`tp_measurement_passes` measure one rank of a tensor-parallel variant of it
  (``tensor_parallel_options``);
- :func:`lowering_passes` and :func:`stage_passes` apply a plan: the whole graph, then
  each pipeline stage after ``split`` (``lower``; ``partc.Program`` calls it, and the
  runtime gets the stage it runs).

A transforming pass is ``def name(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule``.
:func:`run_pass` times every pass (``partc.meta.pass_times``), adds a note naming the
pass and the node it was at to any exception raised inside, and with ``PARTC_VERIFY=1``
(always on in tests) checks the invariants the pass ensures (:mod:`.verify`) before the
next one runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from partc import meta, progress
from partc.errors import ContextParallelError, TraceError
from partc.options import ShardingOptions
from partc.passes.attention_softmax import attention_softmax
from partc.passes.context import Context, Lowering
from partc.passes.context_parallel import attention_masks, context_parallel, reduced_shapes
from partc.passes.estimate import estimate
from partc.passes.fp8_linears import fp8_linears
from partc.passes.fsdp_units import fsdp_units
from partc.passes.fuse_attention import fuse_attention
from partc.passes.helpers import dedupe, verify
from partc.passes.helpers.graph import param_usage
from partc.passes.helpers.sequence_facts import context_parallel_blocker, input_shapes
from partc.passes.helpers.summarize import sequence_length, summarize, tp_option
from partc.passes.layers import layers
from partc.passes.moe import lower_experts
from partc.passes.norm_dtype import norm_dtype
from partc.passes.portable import device_from_inputs, drop_assertions, unpin_dtypes
from partc.passes.propagate import propagate
from partc.passes.recompute_layers import recompute
from partc.passes.split import StageGraph, parameter_holders, split
from partc.passes.tp import chooser as tp_chooser
from partc.passes.tp.chooser import Link
from partc.passes.tp.rewrite import copy_module, tp_rewrite
from partc.passes.trace import trace
from partc.problem import ModelAnalysis, TPOption

log = logging.getLogger("partc")
# The logger of torch's fake tensors (torch/_subclasses/fake_tensor.py)
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"

Transform = Callable[[fx.GraphModule, Context], fx.GraphModule]


@dataclass(frozen=True)
class Pass:
    """A named graph transform; its name selects the invariants checked after it."""

    name: str
    run: Transform


# --------------------------------------------------------------------------- the lists

def analysis_passes(attention: str, mixed: bool = False) -> tuple[Pass, ...]:
    """After ``trace``: what the planner needs to know of each layer (``mixed``: measured
    for mixed-precision training)."""
    return (
        # Estimate runs the graph under the training's autocast: an exported graph's
        # assertions of the dtypes it was traced in would fail there (and compute nothing).
        Pass("drop_assertions", drop_assertions),
        Pass("propagate", propagate),
        # In mixed precision the device moves the trace saw do nothing go (as lowering
        # drops them): they would cast values the model keeps in bf16 to fp32.
        *((Pass("unpin_dtypes", unpin_dtypes),) if mixed else ()),
        # Fusing attention reads the shapes propagate writes, and changes the graph
        # that layers then groups.
        *_attention_passes(attention),
        # After fusing: a softmax left written out is measured as the runtime keeps it.
        Pass("attention_softmax", attention_softmax),
        # A LayerNorm only matmuls read is measured in bf16, as it runs.
        *((Pass("norm_dtype", norm_dtype),) if mixed else ()),
        # Layers reads the graph as it will run.
        Pass("layers", layers),
        # Estimate measures one layer at a time (once per repeated-block signature).
        Pass("estimate", estimate),
    )


def tp_measurement_passes() -> tuple[Pass, ...]:
    """On a copy of the analysed graph: one rank's share of ``ctx.sharding``, measured
    again as ``analysis_passes`` measured the whole model."""
    return (
        Pass("tp_rewrite", tp_rewrite),
        # The rewrite dropped the fake values of everything whose shape changed; its
        # stand-in group (no data moves) gives one rank's shapes.
        Pass("propagate", propagate),
        Pass("estimate", estimate),
    )


def lowering_passes(lowering: Lowering) -> tuple[Pass, ...]:
    """The whole model, traced at the micro-batch size, up to where ``split`` cuts it."""
    return (
        # Exported graphs assert the dtype (and device) each tensor was traced with;
        # under mixed precision the program runs them in another, and they compute
        # nothing.
        Pass("drop_assertions", drop_assertions),
        Pass("propagate", propagate),
        *((Pass("unpin_dtypes", unpin_dtypes),) if lowering.mixed else ()),
        *_attention_passes(lowering.attention),
        Pass("attention_softmax", attention_softmax),
        # Before tp_rewrite: a sequence-parallel all-gather after the norm moves bf16.
        *((Pass("norm_dtype", norm_dtype),) if lowering.mixed else ()),
        # The plan names layers: the graph must be grouped exactly as it was planned.
        Pass("layers", layers),
        # FP8 linears are found by their weights, as layers grouped the graph planned.
        *((Pass("fp8_linears", fp8_linears),) if lowering.fp8_linears else ()),
        # Tensor parallelism rewrites the whole graph before the cut, so that a stage's
        # sends and receives are the shapes one rank holds.
        *((Pass("tp_rewrite", _plan_sharding), Pass("propagate", propagate))
          if lowering.tp > 1 else ()),
        # After tensor parallelism: the attention's heads are this rank's, which the
        # all-to-all splits again over cp.
        *((Pass("context_parallel", context_parallel),) if lowering.cp > 1 else ()),
        # Last before the cut: the expert-parallel call's shapes depend on the routing,
        # so no pass propagates fake values through it.
        *((Pass("lower_experts", lower_experts),)
          if lowering.ep > 1 or lowering.capacity_factor is not None else ()),
    )


def stage_passes(lowering: Lowering) -> tuple[Pass, ...]:
    """Each stage after ``split``."""
    return (
        Pass("recompute", recompute),
        # FSDP units wrap whole layers, recomputed ones included: after recompute.
        *((Pass("fsdp_units", fsdp_units),) if lowering.fsdp_units else ()),
        # Per stage, once every nested module exists: a device read off the stage's own
        # input would be a traced constant if a whole-graph pass made it and split sent
        # it to later stages.
        Pass("device_from_inputs", device_from_inputs),
    )


def _attention_passes(attention: str) -> tuple[Pass, ...]:
    """The passes that ``attention`` (a ``TrainSpec.attention`` value) asks for."""
    return (Pass("fuse_attention", fuse_attention),) if attention == "fused" else ()


# -------------------------------------------------------------------------- the runner

def run_pass(graph_pass: Pass, gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    """Run one pass: timed, named in errors, its invariants checked under PARTC_VERIFY."""
    started = time.perf_counter()
    gm = named(graph_pass.name, lambda: graph_pass.run(gm, ctx))
    meta.add_pass_time(gm, graph_pass.name, time.perf_counter() - started)
    if verify.enabled():
        verify.check(graph_pass.name, gm)
    return gm


def run_passes(passes: Sequence[Pass], gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    for graph_pass in passes:
        gm = run_pass(graph_pass, gm, ctx)
    return gm


def named(pass_name: str, thunk: Callable[[], Any]) -> Any:
    """``thunk()``, with a note on any exception naming the pass and the node it was at;
    torch's fake-tensor error logs held to debug meanwhile (:func:`fake_errors_at_debug`)."""
    try:
        with fake_errors_at_debug():
            return thunk()
    except Exception as error:
        node = _failing_node(error)
        where = f" at node {node.name!r} ({node.format_node()})" if node is not None else ""
        error.add_note(f"partc: raised in pass {pass_name!r}{where}")
        raise


class _FakeErrorsAtDebug(logging.Filter):
    """Drops torch's fake-tensor error records, logging each at debug under partc's
    logger instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        failure = record.exc_info[1] if record.exc_info else None
        log.debug("torch's fake tensors: %s%s", record.getMessage(),
                  f" ({type(failure).__name__}: {failure})" if failure is not None else "")
        return False


@contextlib.contextmanager
def fake_errors_at_debug() -> Iterator[None]:
    """Within: torch's fake tensors log a meta kernel's failure at debug, not as an error.

    An op that fails on fake tensors (``torch._grouped_mm`` on float32: "Expected inputs
    of BF16 type") is logged by torch at error level with its traceback, and raised. A
    model may catch that and run another way, and partc's passes turn what they do not
    handle into an error of their own: either way the log line, which a user reads as
    the run failing, says nothing the run does not. Scoped to partc's passes (the
    filter is removed on the way out), so the user's own fake-tensor work logs as
    torch does."""
    fake_log = logging.getLogger(FAKE_TENSOR_LOGGER)
    quiet = _FakeErrorsAtDebug()
    fake_log.addFilter(quiet)
    try:
        yield
    finally:
        fake_log.removeFilter(quiet)


def _failing_node(error: BaseException) -> fx.Node | None:
    """The innermost ``node`` a frame of the traceback was working on, if any."""
    found = None
    frame = error.__traceback__
    while frame is not None:
        value = frame.tb_frame.f_locals.get("node")
        if isinstance(value, fx.Node):
            found = value
        frame = frame.tb_next
    return found


def _trace(model: nn.Module, example_inputs: Any, **trace_args: Any
           ) -> tuple[fx.GraphModule, Context]:
    """``trace`` under the runner's rules: it makes the graph, so it is not a Pass."""
    started = time.perf_counter()
    gm, ctx = named("trace", lambda: trace(model, example_inputs, **trace_args))
    meta.add_pass_time(gm, "trace", time.perf_counter() - started)
    if verify.enabled():
        verify.check("trace", gm)
    return gm, ctx


# ------------------------------------------------------------------------------ analyse

def analyze(model: nn.Module, example_inputs: Any, *, loss_fn: Callable | None = None,
            example_target: Any = None, name: str | None = None,
            kwargs: dict | None = None, full_trace: bool | None = None,
            attention: str = "as_written", autocast: torch.dtype | None = None,
            autocast_device: str = "cuda", shift_labels: bool = False
            ) -> tuple[fx.GraphModule, ModelAnalysis]:
    """Trace ``model`` and measure it, layer by layer, per sample.

    ``example_inputs`` is a tensor or a tuple of positional inputs (real, meta or fake;
    dim 0 of the first is the batch); ``kwargs`` optional keyword inputs. With
    ``loss_fn(output, target)`` the loss becomes the last layer, ``"loss"``; its target
    is ``example_target`` or, for a (batch, seq, vocab) output, int64 class indices.
    Returns the GraphModule (placeholders: the forward's inputs in order, then
    ``target``) and the :class:`partc.problem.ModelAnalysis` the planner reads.

    Repeated blocks (a ``ModuleList`` or ``Sequential`` of like children) are traced once
    per structure and the analysis expanded to every block (:mod:`partc.passes.helpers.dedupe`);
    the GraphModule is then that of the shorter model, for ``tensor_parallel_options``
    (which expands its options the same way). Where the traced blocks cannot stand for
    the rest, the whole model is traced, and the log says why. ``full_trace=True`` (or
    ``PARTC_FULL_TRACE=1`` in the environment) traces every block from the start.
    ``attention="fused"`` measures attention as one fused kernel call wherever
    :mod:`partc.passes.fuse_attention` can put one in its place.

    ``autocast``: the dtype mixed-precision training computes in (the runtime runs each
    stage with compute-dtype parameters under ``torch.autocast``, CUDA's policy); the
    layers' activations are then measured as the runtime makes them
    (``ModelSummary.autocast``), not as traced. ``autocast_device``: the device type the
    runtime trains on, "cuda" or "cpu" (its dropout and attention kernels).
    ``shift_labels``: a causal LM's own loss is given its labels shifted where it takes
    them (``partc.passes.trace.shifted_labels``): ``partc.compile``'s, not a plan's.
    """
    passes = analysis_passes(attention, mixed=autocast is not None)
    steps = len(passes) + 2   # find the repeated blocks, trace, then each pass

    def front() -> tuple[fx.GraphModule, Context]:
        progress.update("trace", 1, steps, "trace")
        gm, ctx = _trace(model, example_inputs, kwargs=kwargs, loss_fn=loss_fn,
                         example_target=example_target, name=name,
                         shift_labels=shift_labels)
        ctx = dataclasses.replace(ctx, autocast=autocast, autocast_device=autocast_device)
        for done, graph_pass in enumerate(passes, 2):
            progress.update("trace", done, steps, graph_pass.name)
            gm = run_pass(graph_pass, gm, ctx)
        progress.update("trace", steps, steps)
        gm.meta[meta.CONTEXT] = ctx
        return gm, ctx

    progress.update("trace", 0, steps, "finding repeated blocks")

    def on_block(container: str, position: int, size: int, calls: int) -> None:
        progress.update("trace", 0, steps, f"finding repeated blocks: {container}.{position} "
                        f"of {size}, {calls:,} calls recorded")

    if full_trace is None:
        full_trace = os.environ.get("PARTC_FULL_TRACE") == "1"
    example = (example_inputs if isinstance(example_inputs, tuple) else (example_inputs,),
               dict(kwargs or {}))
    try:
        with fake_errors_at_debug():
            repeats = () if full_trace else dedupe.find_repeats(model, example, on_block)
    except Exception as error:  # the forward did not run eagerly on fakes: trace it all
        log.warning("tracing the whole model, every block (recording its forward: %s: %s)",
                    type(error).__name__, error)
        repeats = ()
    again = dict(example_inputs=example[0], kwargs=kwargs, loss_fn=loss_fn,
                 example_target=example_target, name=name, attention=attention,
                 shift_labels=shift_labels)
    if repeats:
        try:
            dedupe.prove(model, repeats, example)
            gm, analysis = _analyze_blocks(model, repeats, front)
            with dedupe.shrunk(model, repeats):
                return gm, _judged_blocker(model, gm, analysis, **again)
        except Exception as error:  # any failure: the whole model, as without repeats
            # Under PARTC_VERIFY (tests) an error other than a refused expansion or a
            # failed trace is a bug to see, not to step around.
            if verify.enabled() and not isinstance(error, (dedupe.Mismatch, TraceError)):
                raise
            log.warning("tracing the whole model, every block (%s: %s)",
                        type(error).__name__, error)
    gm, ctx = front()
    return gm, _judged_blocker(model, gm, summarize(gm, ctx), **again)


def _judged_blocker(model: nn.Module, gm: fx.GraphModule, analysis: ModelAnalysis, *,
                    example_inputs: tuple, kwargs: dict | None, attention: str,
                    **trace_args: Any) -> ModelAnalysis:
    """``analysis`` with its context-parallel blocker judged as lowering judges one: the
    sequence's dims are those whose size differs on a trace at half its length
    (:func:`~partc.passes.helpers.sequence_facts.context_parallel_blocker`). The summary
    guessed by size; only a guess that found an op costs this second trace (``model``
    as ``gm`` was traced: its representatives alone when blocks were deduplicated)."""
    summary = analysis.summary
    tokens = sequence_length(gm, gm.meta[meta.CONTEXT])
    if not summary.context_parallel_blocker or tokens % 2:
        return analysis
    try:
        halves = {key: sequence_shard(value, 2) for key, value in trace_args.items()
                  if key == "example_target"}
        other, ctx = _trace(model, sequence_shard(example_inputs, 2),
                            kwargs=sequence_shard(kwargs, 2),
                            **{**trace_args, **halves})
    except (ContextParallelError, TraceError) as error:   # the guess stands
        log.info("the sequence check keeps its guess: no trace at half the length (%s)",
                 error)
        return analysis
    for graph_pass in (Pass("drop_assertions", drop_assertions),
                       Pass("propagate", propagate), *_attention_passes(attention)):
        other = run_pass(graph_pass, other, ctx)
    blocker = context_parallel_blocker(gm, tokens, input_shapes(other))
    return dataclasses.replace(analysis, summary=dataclasses.replace(
        summary, context_parallel_blocker=blocker))


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


# ---------------------------------------------------------------- tensor-parallel options

def tensor_parallel_options(gm: fx.GraphModule, links: Sequence[Link],
                            sequence_parallel: Sequence[bool] = (False, True),
                            objectives: Sequence[str] = ("time", "memory"),
                            options: ShardingOptions = ShardingOptions()
                            ) -> tuple[TPOption, ...]:
    """For each group (``links``: one per tp degree), with and without sequence
    parallelism, fastest first and fewest bytes first (tp_chooser's objectives): choose
    the sharding, rewrite a copy of the graph for one rank, and measure it as
    ``analyze`` measures the whole model. A memory-first sharding equal to the
    time-first one is not repeated. ``options``: the chooser's CP-SAT limits
    (``PlannerOptions.sharding``). ``gm`` is ``analyze``'s graph; where it holds
    representatives of repeated blocks, each option is measured on it and expanded to
    the whole model.
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
    combinations = [(link, sp, objective) for link in links
                    for sp in sequence_parallel for objective in objectives
                    if not sp or tp_chooser.sequence_length(gm)]
    problems: dict[tuple[Link, bool], tp_chooser.LayerProblems] = {}

    def problems_of(link: Link, sp: bool) -> tp_chooser.LayerProblems:
        """The chooser's problems for a group, made once for both objectives."""
        if (link, sp) not in problems:
            problems[link, sp] = tp_chooser.layer_problems(gm, link.tp, link, sp)
        return problems[link, sp]

    for done, (link, sp, objective) in enumerate(combinations):
        label = f"tp={link.tp}{' sp' if sp else ''}, {objective} first"
        progress.update("tensor parallelism", done, len(combinations), f"{label}: choosing")
        started = time.perf_counter()
        chosen = named("sharding", lambda: tp_chooser.choose(
            gm, link.tp, link, sequence_parallel=sp, prefer=objective,
            options=sharding_options, problems=problems_of(link, sp)))
        key = (link.tp, sp, tuple((layer.name, layer.choices) for layer in chosen.layers))
        same = [option for seen, option in measured if seen == key]
        if same:  # measured already: the same sharding under the other objective
            options.append(dataclasses.replace(same[0], objective=objective))
            continue
        progress.update("tensor parallelism", done, len(combinations), f"{label}: measuring")
        local, moved = copy_module(gm, chosen)
        local = run_passes(tp_measurement_passes(), local,
                           dataclasses.replace(ctx, sharding=moved))
        option = dataclasses.replace(tp_option(ctx, base, usage, local, moved),
                                     objective=objective)
        if ctx.expansion is not None:
            option = dedupe.expand_option(option, local, ctx.expansion, 1.0 / ctx.batch_size)
        measured.append((key, option))
        options.append(option)
        meta.add_pass_time(gm, f"sharding tp={link.tp}{' sp' if sp else ''}",
                           time.perf_counter() - started)
    progress.update("tensor parallelism", len(combinations), len(combinations))
    return tuple(options)


# ------------------------------------------------------------------------------- lower

@dataclass(frozen=True)
class Lowered:
    """A plan applied to a model: the traced graph and one stage graph per stage."""

    graph: fx.GraphModule
    stages: tuple[StageGraph, ...]
    # Each parameter (all its FQNs) → the stages holding it, in order (tied weights: more
    # than one).
    holders: dict[tuple[str, ...], tuple[int, ...]]

    @property
    def loss(self) -> tuple[nn.Module, str] | None:
        """The loss call and the name of its layer (None without a loss)."""
        node = next((n for n in self.graph.graph.nodes if meta.role(n) == meta.ROLE_LOSS),
                    None)
        if node is None:
            return None
        return self.graph.get_submodule(str(node.target)), meta.layer(node).name


def lower(model: nn.Module, example_inputs: tuple, lowering: Lowering, *,
          kwargs: dict | None = None, loss_fn: Callable | None = None,
          example_target: Any = None, only: Sequence[int] | None = None,
          planned_inputs: tuple[tuple, dict, Any] | None = None) -> Lowered:
    """The back half: ``model`` traced at the micro-batch size, cut into the plan's
    stages; ``stage_passes`` run on the stages in ``only`` (all by default: a rank
    needs its own stage, the emitted code every stage).

    ``example_inputs`` (and ``kwargs``, ``example_target``) must have the micro-batch
    size in dim 0: the graph's view shapes are those of one microbatch. With context
    parallelism (``lowering.cp > 1``) dim 1 of each is the sequence: the attention
    masks are read on a trace at its whole length, and the graph traced at one rank's
    share of it (:mod:`partc.passes.context_parallel`).
    ``planned_inputs``: (inputs, keyword inputs, target) at the batch the plan's
    tensor-parallel choices were made at, traced only where the model's code takes
    another branch at the micro-batch size (``partc.passes.tp.carry``).
    """
    if lowering.cp > 1:
        masks, shapes = _whole_length_facts(model, example_inputs, lowering.attention,
                                            kwargs=kwargs, loss_fn=loss_fn,
                                            example_target=example_target)
        lowering = dataclasses.replace(lowering, attention_masks=masks,
                                       whole_length_shapes=shapes)
        example_inputs, kwargs, example_target = (
            sequence_shard(example_inputs, lowering.cp), sequence_shard(kwargs, lowering.cp),
            sequence_shard(example_target, lowering.cp))
    gm, ctx = _trace(model, example_inputs, kwargs=kwargs, loss_fn=loss_fn,
                     example_target=example_target)
    ctx = dataclasses.replace(ctx, lowering=lowering, sharding_graph=planned_inputs and (
        lambda: _planned_graph(model, planned_inputs, lowering, loss_fn)))
    gm = run_passes(lowering_passes(lowering), gm, ctx)
    stages = _split(gm, lowering.stages)
    wanted = range(len(stages)) if only is None else only
    for index in wanted:
        run_passes(stage_passes(lowering), stages[index].module, ctx)
    return Lowered(graph=gm, stages=tuple(stages),
                   holders=parameter_holders(stages, ctx.param_fqns))


def _whole_length_facts(model: nn.Module, example_inputs: tuple, attention: str,
                        **trace_args: Any) -> tuple[tuple, dict[str, tuple]]:
    """On a trace at the whole sequence's length, attention fused as lowering fuses it
    (``attention``): each attention call's mask (a sliding window longer than a shard
    shows only there), and what each op that reduces along a dim reads
    (:func:`partc.passes.context_parallel.reduced_shapes`)."""
    gm, ctx = _trace(model, example_inputs, **trace_args)
    for graph_pass in (Pass("drop_assertions", drop_assertions),
                       Pass("propagate", propagate), *_attention_passes(attention)):
        gm = run_pass(graph_pass, gm, ctx)
    return named("context_parallel", lambda: (attention_masks(gm), reduced_shapes(gm)))


def sequence_shard(value: Any, cp: int) -> Any:
    """``value``'s tensors (meta or fake: shapes only) with dim 1, the sequence, cut to
    one rank's ``1 / cp`` of it, contiguous as the runtime's shards are
    (``partc.runtime.cp_layout.shard``); tensors of fewer dims as they are."""
    def cut(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() < 2:
            return tensor
        if tensor.shape[1] % cp:
            raise ContextParallelError(
                f"an input of shape {tuple(tensor.shape)}: its sequence (dim 1) of "
                f"{tensor.shape[1]} does not divide over cp={cp}")
        return tensor.narrow(1, 0, tensor.shape[1] // cp).contiguous()
    return pytree.tree_map_only(torch.Tensor, cut, value)


def _split(gm: fx.GraphModule, stages: Sequence[Sequence[str]]) -> list[StageGraph]:
    started = time.perf_counter()
    result = named("split", lambda: split(gm, stages))
    meta.add_pass_time(gm, "split", time.perf_counter() - started)
    if verify.enabled():
        for stage in result:
            verify.check("split", stage.module)
        for before, after in zip(result, result[1:]):
            if len(before.sends) != len(after.receives):
                raise AssertionError(f"after pass 'split': stage {before.index} sends "
                                     f"{len(before.sends)} values, stage {after.index} "
                                     f"receives {len(after.receives)}")
    return result


def _planned_graph(model: nn.Module, inputs: tuple[tuple, dict, Any], lowering: Lowering,
                   loss_fn: Callable | None) -> fx.GraphModule:
    """``model`` traced at the batch of ``inputs`` and grouped into layers as lowering
    groups it: the graph a plan's tensor-parallel choices were made on."""
    args, kwargs, target = inputs
    gm, ctx = _trace(model, args, kwargs=kwargs, loss_fn=loss_fn, example_target=target)
    front = lowering_passes(lowering)
    return run_passes(front[:[p.name for p in front].index("layers") + 1], gm,
                      dataclasses.replace(ctx, lowering=lowering))


def _plan_sharding(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    """The plan's sharding, rebuilt from its per-node choices, then one rank's graph."""
    lowering = ctx.lowering
    chosen = tp_chooser.apply(gm, lowering.tp, lowering.sequence_parallel,
                              {name: tuple(c) for name, c in lowering.tp_choices.items()},
                              made_on=ctx.sharding_graph)
    return tp_rewrite(gm, dataclasses.replace(ctx, sharding=chosen))
