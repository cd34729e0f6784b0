"""Shapes and dtypes of every node, computed on fake tensors (no memory, meta models ok).

Every shape must be known before the model runs: partc measures and plans from them. An
op whose output shape depends on tensor values (``nonzero``, ``torch.where`` with one
argument, boolean-mask indexing: a mixture-of-experts loop that picks each expert's
tokens) is refused with a :class:`TraceError` naming the op and its module, whichever
tracer captured it (fake tensors cannot run it after ``symbolic_trace``; ``torch.export``
gives it an unbacked symbolic size).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                           DynamicOutputShapeException)

from partc import meta
from partc.errors import TraceError
from partc.passes.context import Context
from partc.passes.helpers.graph import fetch, op_name, outside_inputs
from partc.passes.helpers.run_memo import layer_form


def propagate(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    """Give every node a fake value (``node.meta["val"]``) and its tensors' metadata.

    Reads: ``meta.ROLE``; ``node.meta["val"]`` where torch.export left one (reused: the
    exporter already ran the graph on fake tensors).
    Writes: ``node.meta["val"]``, ``meta.TENSORS``; ``meta.LOSS_USES`` on the loss.
    Requires: ``trace``. Ensures: every node but the output has ``val`` and ``TENSORS``,
    and every tensor shape is made of plain ints (a data-dependent one is a TraceError).
    """
    env: dict[fx.Node, Any] = {}
    inputs = iter(ctx.fake_inputs)
    repeats = _Repeats(gm)
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if "val" in node.meta:
            value = node.meta["val"]
        elif node.op == "placeholder":
            value = _placeholder(node, inputs, ctx)
        elif (same := repeats.same(node, env)) is not None:
            value = env[same]
        else:
            try:
                value = _run(gm, node, env, ctx)
            except (DynamicOutputShapeException, DataDependentOutputException) as error:
                raise _data_dependent(node, ctx, f"fake tensors cannot tell its output "
                                                 f"shape: {error}") from error
            if meta.role(node) == meta.ROLE_LOSS:
                meta.set_loss_uses(node, _loss_uses(gm, node, env, ctx))
        _require_static(node, value, ctx)
        env[node] = value
        node.meta["val"] = value
        meta.set_tensors(node, _tensor_infos(value))
    return gm


class _Repeats:
    """The nodes of a layer that repeats an earlier one, in a graph grouped into layers
    (each sharding the tensor-parallel measurement propagates: a stack's blocks): its
    values are the earlier layer's, node for node, where both run the same
    (:func:`~partc.passes.helpers.run_memo.layer_form`) on values from outside alike in
    shape, stride and dtype. Fake tensors compute nothing but metadata, so each
    value of the earlier layer stands for its own (no pass reads which storage a value
    holds). The steps of a loop the trace unrolled inside one layer are that layer's
    nodes, run."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.layer_of: dict[fx.Node, tuple[int, int]] = {}   # node -> (layer, place)
        self.members: dict[int, list[fx.Node]] = {}
        by_name = {node.name: node for node in gm.graph.nodes}
        for index, info in enumerate(meta.layers(gm)):
            if info.is_loss:
                continue
            nodes = [by_name[name] for name in info.nodes if name in by_name]
            self.members[index] = nodes
            for place, node in enumerate(nodes):
                self.layer_of[node] = (index, place)
        self.earlier: dict[tuple, int] = {}      # (form, what it reads) -> a layer
        self.source: dict[int, int | None] = {}  # layer -> the layer it repeats, or None

    def same(self, node: fx.Node, env: dict) -> fx.Node | None:
        """The node of an earlier layer whose value ``node``'s is, or None: run it."""
        if node not in self.layer_of or node.op in ("get_attr", "placeholder"):
            return None
        index, place = self.layer_of[node]
        if index not in self.source:
            self.source[index] = self._source(index, env)
        source = self.source[index]
        if source is None:
            return None
        found = self.members[source][place]
        return found if found in env else None   # layers may interleave: run it

    def _source(self, index: int, env: dict) -> int | None:
        nodes = self.members[index]
        outside = outside_inputs(nodes)
        if any(_name(node) in _RESHAPED_IN_PLACE for node in nodes) \
                or any(value not in env for value in outside):
            return None
        form = layer_form(self.gm, nodes, propagating=True)
        reads = tuple(_metadata(env[value]) for value in outside)
        if form is None or any(read is None for read in reads):
            return None
        key = (form, reads)
        if key in self.earlier:
            return self.earlier[key]
        self.earlier[key] = index   # the first of its form: run, then stands for later ones
        return None


# In-place calls that change their input's shape, strides or autograd flag: a layer that
# runs one is run, so that the value it changes changes.
_RESHAPED_IN_PLACE = frozenset({
    "unsqueeze_", "squeeze_", "t_", "transpose_", "swapdims_", "swapaxes_", "resize_",
    "resize_as_", "as_strided_", "set_", "detach_", "requires_grad_", "unflatten_"})


def _name(node: fx.Node) -> str:
    """A call's bare name: ``unsqueeze_`` for the method and for ``aten.unsqueeze_.default``."""
    target = node.target
    if isinstance(target, str):
        return target
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet or target, "__name__", "")


def _metadata(value: Any) -> tuple | None:
    """What a value's fake computation depends on; None for a value of another kind."""
    leaves, spec = pytree.tree_flatten(value)
    found = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            found.append((tuple(leaf.shape), leaf.stride(), leaf.dtype, str(leaf.device),
                          leaf.requires_grad, leaf.storage_offset()))
        elif leaf is None or isinstance(leaf, (bool, int, float, str, torch.dtype)):
            found.append((type(leaf).__name__, repr(leaf)))
        elif isinstance(leaf, nn.Module):   # the same module (a stand-in group), not one alike
            found.append(("module", id(leaf)))
        else:
            return None
    return (str(spec), tuple(found))


def _require_static(node: fx.Node, value: Any, ctx: Context) -> None:
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor) and not all(isinstance(d, int) for d in leaf.shape):
            raise _data_dependent(node, ctx, f"its output has shape {tuple(leaf.shape)}, "
                                             f"sizes the tracer left symbolic")


def _data_dependent(node: fx.Node, ctx: Context, detail: str) -> TraceError:
    module = meta.module_path(node) if meta.MODULE_PATH in node.meta else ""
    where = f"module {module}" if module else f"{ctx.name}'s own forward"
    source = (node.stack_trace or "").strip().splitlines()
    line = f"\n  traced at {source[-2].strip()}: {source[-1].strip()}" \
        if len(source) >= 2 else ""
    return TraceError(
        f"{ctx.name}: {op_name(node)} in {where} gives a tensor whose shape depends on "
        f"tensor values ({detail}); partc measures and plans from shapes known before "
        f"the model runs.{line}\n"
        "What you can do: keep shapes static, selecting with masks rather than indices. "
        "A mixture-of-experts layer whose experts pick their tokens with torch.where or "
        "nonzero can run every expert on every token and weight its output by the "
        "router, or hold its experts as batched weights run by a grouped matmul over "
        "the tokens sorted by expert (as Hugging Face's current MoE models do).")


def _placeholder(node: fx.Node, inputs: Any, ctx: Context) -> Any:
    if meta.role(node) == meta.ROLE_TARGET:
        return ctx.fake_target  # None until the loss node derives it from the output
    try:
        return next(inputs)
    except StopIteration:
        # symbolic_trace keeps optional forward arguments as placeholders with defaults.
        return node.args[0] if node.args else None


def _run(gm: fx.GraphModule, node: fx.Node, env: dict, ctx: Context) -> Any:
    if meta.role(node) == meta.ROLE_LOSS:
        _derive_target(node, env, ctx)
    args = fx.node.map_arg(node.args, env.__getitem__)
    kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
    with ctx.fake_mode:
        if node.op == "get_attr":
            value = fetch(gm, str(node.target))
            # export's higher-order ops read subgraphs through get_attr too.
            if not isinstance(value, torch.Tensor):
                return value
            return ctx.fake_mode.from_tensor(value)
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            self_arg, *rest = args
            return getattr(self_arg, node.target)(*rest, **kwargs)
        return gm.get_submodule(str(node.target))(*args, **kwargs)


def _loss_uses(gm: fx.GraphModule, loss: fx.Node, env: dict, ctx: Context) -> tuple[bool, ...]:
    """Which of the model's outputs the loss reads, found by differentiating it on fake
    tensors: an output it ignores (an encoder's pooler) gets no gradient in backward."""
    args = [env[a] if isinstance(a, fx.Node) else a for a in loss.args]
    probes = [a.detach().requires_grad_() if isinstance(a, torch.Tensor)
              and a.is_floating_point() else a for a in args[:-1]]
    wanted = [p for p in probes if isinstance(p, torch.Tensor) and p.requires_grad]
    try:
        with ctx.fake_mode, torch.enable_grad():
            value = gm.get_submodule(str(loss.target))(*probes, args[-1])
            grads = torch.autograd.grad(value, wanted, allow_unused=True) if wanted else ()
    except Exception:  # a loss that cannot be differentiated here: assume it reads all
        return tuple(True for _ in args)
    got = {id(p): g is not None for p, g in zip(wanted, grads)}
    return tuple(got.get(id(p), False) for p in probes) + (False,)


def _derive_target(loss: fx.Node, env: dict, ctx: Context) -> None:
    """Without an example target, a (batch, seq, vocab) output gets int64 class indices."""
    target_node = loss.args[-1]
    if env[target_node] is not None:
        return
    output = env[loss.args[0]]
    if not (isinstance(output, torch.Tensor) and output.dim() == 3
            and output.is_floating_point()):
        raise TraceError(
            "loss_fn was given without example_target, and partc can only guess the "
            "target of a (batch, seq, vocab) output: pass example_target")
    with ctx.fake_mode:
        target = torch.zeros(tuple(output.shape[:-1]), dtype=torch.int64,
                             device=output.device)
    env[target_node] = target
    target_node.meta["val"] = target
    meta.set_tensors(target_node, _tensor_infos(target))


def _tensor_infos(value: Any) -> tuple[meta.TensorInfo, ...]:
    leaves = pytree.tree_leaves(value)
    return tuple(meta.TensorInfo.of(t) for t in leaves if isinstance(t, torch.Tensor))
