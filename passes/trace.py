"""Capture a model as an fx graph, on fake inputs, keeping its parameter FQNs.

``torch.fx.symbolic_trace`` is tried first (it keeps ``call_module`` nodes and reads
well); models it cannot capture (Hugging Face transformers 5.x among them) go through
``torch.export.export(strict=False)``. Inputs are turned into fake tensors before either
tracer sees them, so no real activation is computed and a model on the meta device works.

The loss, when given, is appended as one ``call_module`` node whose module calls the
user's ``loss_fn`` on the model's output rebuilt in its original structure; it is never
traced into, so any Python loss works as long as it runs on fake tensors.

Inputs are positional tensors, keyword tensors (``model(**batch)``: kept in the order of
the forward's parameters, so a batch's key order does not change the graph), or both.
Without ``loss_fn``, a model whose output holds a ``loss`` (a Hugging Face model given
``labels``) trains on that loss: traced with the rest of the forward, it becomes the
loss layer's input, and the loss layer weighs each microbatch's mean by its share of the
batch's counted labels (:func:`weighted_own_loss`; ``partc.runtime.label_weights`` makes
the weights), so that the step's loss is the whole batch's mean, as on one device.
A causal LM's loss whose function takes its labels already shifted is given them
(:func:`shifted_labels`): it then reads no label across the sequence, which context
parallelism splits.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import operator
import os
import traceback
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

from partc import meta
from partc.errors import TraceError
from partc.identity import param_fqns
from partc.passes.context import Context
from partc.passes.helpers import loss_labels
from partc.runtime.label_weights import SHIFT_LABELS, next_labels

log = logging.getLogger("partc")

LOSS_MODULE = "loss"
# What transformers' loss functions, by ``model.loss_type``, average over: "shifted" the
# labels after the first position not -100 (a causal LM predicts the next token),
# "tokens" every label not -100; any other model's loss is taken as a mean over samples.
_COUNTED_LABELS = {"ForCausalLM": "shifted", "ForMaskedLM": "tokens",
                   "ForTokenClassification": "tokens"}


class LossCall(nn.Module):
    """Calls ``loss_fn(output, target)`` with the model's output in its own structure.
    ``constants``: the output's leaves that are no traced value (a None field), by
    position; the call is given the others, in order, then the target."""

    def __init__(self, loss_fn: Callable, out_spec: pytree.TreeSpec,
                 constants: dict[int, Any] | None = None) -> None:
        super().__init__()
        self.loss_fn = loss_fn
        self.out_spec = out_spec
        self.constants = dict(constants or {})

    def forward(self, *leaves_and_target: Any) -> torch.Tensor:
        *given, target = leaves_and_target
        values = iter(given)
        leaves = [self.constants[i] if i in self.constants else next(values)
                  for i in range(len(given) + len(self.constants))]
        return self.loss_fn(pytree.tree_unflatten(leaves, self.out_spec), target)


def weighted_own_loss(loss: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The model's own loss of one microbatch, a mean over its counted labels, times the
    sum of its rows' weights: its count of labels over the batch's, times the number of
    microbatches and replicas the runtime averages over (1 per microbatch for a mean
    over samples)."""
    return loss * weights.sum()


def trace(model: nn.Module, example_inputs: Any, *, kwargs: dict | None = None,
          loss_fn: Callable | None = None, example_target: Any = None,
          name: str | None = None, shift_labels: bool = False
          ) -> tuple[fx.GraphModule, Context]:
    """Trace ``model`` into a GraphModule whose placeholders are its forward inputs.

    Reads: nothing. Writes: ``meta.PARAMS``, ``meta.MODULE_PATH``, ``meta.ROLE`` on nodes,
    ``meta.TRACE`` on the graph module.
    Requires: ``example_inputs`` a tensor or tuple and ``kwargs`` tensors by name (dim 0
    of the first is the batch).
    Ensures: placeholders first (positional inputs in order, then keyword inputs in the
    forward's order, then ``target`` when there is a loss), each get_attr right before
    its first user, get_attr targets are the model's own parameter FQNs, the output is
    the loss or the model's flattened output. Without ``loss_fn``, an output holding a
    ``loss`` makes the loss layer :func:`weighted_own_loss` of it, with a target of one
    float weight per sample (``TraceInfo.own_loss`` says which labels it counts).
    ``shift_labels``: give a causal LM's own loss its labels already shifted where it
    takes them (:func:`shifted_labels`), as ``partc.compile`` does; a plan's own inputs
    (traced again to load or lower it) say whether it had them.
    """
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    kwargs = dict(kwargs or {})
    shifted = shift_labels and loss_fn is None and shifted_labels(model, kwargs)
    if shifted:
        kwargs[SHIFT_LABELS] = next_labels(kwargs["labels"])
    kwargs = in_signature_order(model, kwargs)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    device = _model_device(model)
    fake_args, fake_kwargs = pytree.tree_map_only(
        torch.Tensor, lambda t: _fake_like(fake_mode, t, device), (args, kwargs))
    with without_kv_cache(model):
        gm, tracer = _capture(model, fake_args, fake_kwargs, name or type(model).__name__)
    if tracer == "export":
        out_spec = _normalize_export(gm)
        _inline_constants(gm, model)
    else:
        out_spec = _flatten_output(gm)
    _order_nodes(gm)
    _record_modules(gm, tracer)
    _record_params(gm, model)
    inputs = [a for a in pytree.tree_leaves((fake_args, fake_kwargs))
              if isinstance(a, torch.Tensor)]
    batch = int(inputs[0].shape[0]) if inputs and inputs[0].dim() else 1
    own_loss = _own_loss_leaf(out_spec) if loss_fn is None else None
    if own_loss is not None:
        if example_target is None:
            example_target = torch.empty(batch, dtype=torch.float32, device="meta")
        loss_fn = weighted_own_loss
    target = pytree.tree_map_only(
        torch.Tensor, lambda t: _fake_like(fake_mode, t, device), example_target)
    if loss_fn is not None:
        _append_loss(gm, loss_fn, out_spec, only=own_loss)
    gm.recompile()
    names = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder")
    meta.set_trace_info(gm, meta.TraceInfo(
        tracer=tracer, num_inputs=len(names) - (loss_fn is not None), input_names=names,
        out_spec=out_spec, has_loss=loss_fn is not None, batch_size=batch,
        keywords=tuple(kwargs), shift_labels=shifted,
        own_loss=None if own_loss is None else counted_labels(model, kwargs, gm,
                                                              len(names) - len(kwargs) - 1)))
    ctx = Context(model=model, name=name or type(model).__name__, fake_mode=fake_mode,
                  fake_inputs=tuple(inputs), fake_target=target, batch_size=batch,
                  param_fqns=param_fqns(model))
    return gm, ctx


def shifted_labels(model: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether to give ``model``'s own loss, a causal LM's given ``labels``, its labels
    already shifted (the keyword ``shift_labels``, which transformers' causal-LM loss
    reads instead of shifting ``labels`` along the sequence): where its forward calls
    ``self.loss_function``, that function takes them, the forward passes them on, and
    the loss is that function's alone (a router's auxiliary loss, over every token of
    the sequence, is not split so)."""
    if "labels" not in kwargs or SHIFT_LABELS in kwargs:
        return False
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any(getattr(c, "output_router_logits", False) for c in (config, text)) \
            or not _calls_loss_function(model):
        return False
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:
        return False
    # As transformers' ``loss_function`` picks it: one set on the model, else its loss
    # type's, else (a type it does not know: GPT-2's LMHeadModel) the causal LM's.
    loss = getattr(model, "_loss_function", None) or LOSS_MAPPING.get(
        getattr(model, "loss_type", None) or "", LOSS_MAPPING.get("ForCausalLM"))
    try:
        takes = inspect.signature(loss).parameters if loss is not None else {}
        forward = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    passes_on = any(p.kind == p.VAR_KEYWORD or p.name == SHIFT_LABELS for p in forward)
    return SHIFT_LABELS in takes and passes_on


@contextlib.contextmanager
def without_kv_cache(model: nn.Module) -> Iterator[None]:
    """Within, every config of ``model``'s modules that says ``use_cache=True`` (a Hugging
    Face model's default, its composite parts' configs too) says False, and as before
    after: training reads no cache, and a forward that makes one returns it beside its
    outputs (a ``DynamicCache``, which neither tracer takes). The model is traced as
    Hugging Face's own training runs it, with the user's model left as it was."""
    configs = {id(config): config for module in model.modules()
               if getattr(config := getattr(module, "config", None), "use_cache", False)
               is True}
    for config in configs.values():
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True


def in_signature_order(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` in the order of the forward's parameters (names it takes through
    ``**kwargs`` after them, as given)."""
    try:
        order = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return kwargs
    position = {name: i for i, name in enumerate(order)}
    return dict(sorted(kwargs.items(), key=lambda item: position.get(item[0], len(order))))


def counted_labels(model: nn.Module, kwargs: dict[str, Any], gm: fx.GraphModule,
                   first_keyword: int) -> str:
    """Which labels the model's own loss averages over: "shifted", "tokens", or "samples"
    (a mean over the batch's samples). Read from ``gm``'s graph where it shows
    (:func:`~partc.passes.helpers.loss_labels.counted_in_graph`: the ops between the
    ``labels`` input, or ``shift_labels`` where the loss reads those, and the loss's
    cross-entropy; ``first_keyword`` is the position of the first keyword input among
    the placeholders); else guessed from the model's ``loss_type`` (see
    ``_COUNTED_LABELS``), with a warning that the guess may be wrong."""
    if "labels" not in kwargs:
        return "samples"
    loss = next(node for node in gm.graph.nodes if meta.role(node) == meta.ROLE_LOSS)
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    seen = None
    for name in (SHIFT_LABELS, "labels"):
        if name in kwargs:
            labels = placeholders[first_keyword + list(kwargs).index(name)]
            seen = loss_labels.counted_in_graph(gm, loss.args[0], labels,
                                                tuple(kwargs[name].shape))
            if seen.kind != "unknown":
                return seen.kind
    guess = _counted_by_name(model)
    log.warning(
        "%s's own loss: partc cannot tell which labels it averages over (%s); it "
        "weighs microbatches as if %s, and the step's loss equals one device's only if "
        "that is so. Give compile a loss_fn to be sure.", type(model).__name__, seen.why,
        {"shifted": "a mean over labels[:, 1:] not -100",
         "tokens": "a mean over the labels not -100",
         "samples": "a mean over samples"}[guess])
    return guess


def _counted_by_name(model: nn.Module) -> str:
    """What the model's ``loss_type`` says its loss averages over."""
    loss_type = getattr(model, "loss_type", None) or ""
    if loss_type == "ForConditionalGeneration":
        # One name, two losses: transformers' mapping for it, a causal LM's (shifted),
        # where the forward calls ``self.loss_function`` (LLaVA, Gemma 3, Qwen2-VL);
        # an encoder-decoder's own cross-entropy over the labels as given otherwise
        # (T5, BART, Whisper: their decoders read the labels shifted right).
        if _calls_loss_function(model):
            return "shifted"
        if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            return "tokens"
    return _COUNTED_LABELS.get(loss_type, "samples")


def _calls_loss_function(model: nn.Module) -> bool:
    """Whether the model's forward, as written, calls ``self.loss_function``."""
    try:
        source = inspect.getsource(inspect.unwrap(type(model).forward))
    except (OSError, TypeError):
        return False
    return "self.loss_function" in source


def _own_loss_leaf(out_spec: pytree.TreeSpec) -> int | None:
    """The position of ``loss`` among the output's leaves, if the output (a mapping, a
    Hugging Face ``ModelOutput``) holds one directly."""
    keys = out_spec.context if out_spec.num_children and isinstance(
        out_spec.context, (list, tuple)) else ()
    if "loss" not in keys:
        return None
    position = list(keys).index("loss")
    # torch < 2.9 has no ``children()``; later ones deprecate ``children_specs``.
    children = list(out_spec.children() if hasattr(out_spec, "children")
                    else out_spec.children_specs)
    if not children[position].is_leaf():
        return None
    return sum(child.num_leaves for child in children[:position])


def _model_device(model: nn.Module) -> torch.device:
    for tensor in list(model.parameters()) + list(model.buffers()):
        return tensor.device
    return torch.device("cpu")


def _fake_like(mode: FakeTensorMode, tensor: torch.Tensor, device: torch.device) -> Any:
    # Inputs follow the parameters' device, so meta example inputs work with a CPU model
    # and the other way round.
    with mode:
        return torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()),
                                   dtype=tensor.dtype, device=device)


class _FunctionalTracer(fx.Tracer):
    """Traces through every module, torch.nn's included: parameters become get_attr
    nodes and every computation a function call, so later passes can cut a graph
    anywhere and pass parameters as plain values."""

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return False


def _capture(model: nn.Module, args: tuple, kwargs: dict,
             name: str) -> tuple[fx.GraphModule, str]:
    fx_error: BaseException = TypeError("symbolic_trace takes no keyword inputs")
    if not kwargs:
        try:
            defaults = _defaults_not_given(model, args)
            graph = _FunctionalTracer().trace(model, concrete_args=defaults or None)
            _drop_specialized(graph, len(args))
            returned = next(n for n in reversed(graph.nodes) if n.op == "output").args[0]
            if isinstance(returned, dict):
                # fx keeps a returned mapping as a plain dict, not its class (a Hugging
                # Face ModelOutput that the loss reads as ``.logits``); export keeps it.
                raise TypeError("forward returns a mapping: fx would not keep its type")
            return fx.GraphModule(model, graph, class_name=type(model).__name__), \
                "symbolic_trace"
        except Exception as error:  # any failure sends the model to the second tracer
            fx_error = error
    try:
        with _IndexListsKept():
            exported = torch.export.export(model, args, kwargs, strict=False)
        return exported.module(), "export"
    except Exception as export_error:
        raise TraceError(_trace_error_message(name, fx_error, export_error)) from export_error


class _IndexListsKept(TorchFunctionMode):
    """Indexing a meta tensor with a list of ints (Falcon's ``qkv[..., [-2]]``) indexes
    with a tensor made from the list on the meta device, which drops its values, and
    export lifts that tensor as a constant no one can read back
    (:func:`_inline_constants`). Within, such a list is made a CPU tensor first, as the
    model would index with ``torch.tensor([-2])``: the same elements, and export keeps
    their values."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1 \
                and isinstance(args[0], torch.Tensor) and args[0].device.type == "meta":
            args = (args[0], _index_lists_on_cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


def _index_lists_on_cpu(index: Any) -> Any:
    """``index`` (as ``Tensor.__getitem__`` takes it) with each list of ints or of bools
    among its parts made a CPU tensor. A list as the whole index is taken so only when
    flat: torch reads a list holding lists as a tuple of indices."""
    if isinstance(index, tuple):
        return tuple(_list_tensor(part, nested=True) for part in index)
    return _list_tensor(index, nested=False)


def _list_tensor(part: Any, nested: bool) -> Any:
    if not isinstance(part, list) or not part:
        return part
    leaves = pytree.tree_leaves(part)
    if not nested and len(leaves) != len(part):
        return part
    kinds = {type(leaf) for leaf in leaves}
    if kinds not in ({int}, {bool}):
        return part
    try:
        return torch.tensor(part, device="cpu")
    except (TypeError, ValueError):   # ragged
        return part


def _defaults_not_given(model: nn.Module, args: tuple) -> dict[str, Any]:
    """The forward's parameters after the given positional inputs that have defaults
    (``mask=None``): traced as those constants, as the model runs when they are not
    passed. Left as inputs, they would precede the loss's target without a default."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name: p.default for p in parameters[len(args):]
            if p.kind in kinds and p.default is not inspect.Parameter.empty}


def _drop_specialized(graph: fx.Graph, given: int) -> None:
    """Keep the first ``given`` placeholders (the example inputs), always passed: no
    default. Remove the rest: those fx keeps for the defaults traced as constants
    (``concrete_args``), with their checks (a remaining use reads the constant itself),
    and an unused ``*args`` / ``**kwargs``."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node in placeholders[:given]:
        node.args = ()
    for node in placeholders[given:]:
        if str(node.target).startswith("*"):
            if node.users:
                raise TypeError(f"forward reads {node.target} (its variable arguments)")
            graph.erase_node(node)
            continue
        value = node.args[0] if node.args else None
        for user in list(node.users):
            if getattr(user.target, "__name__", "").startswith("_assert_is_none"):
                graph.erase_node(user)
            elif user.target is operator.eq and all(
                    check.target is torch._assert for check in user.users):
                for check in list(user.users):  # fx's check of a specialised value
                    graph.erase_node(check)
                graph.erase_node(user)
            else:
                user.args = fx.node.map_arg(user.args, lambda a: value if a is node else a)
                user.kwargs = fx.node.map_arg(user.kwargs, lambda a: value if a is node else a)
        graph.erase_node(node)


def _trace_error_message(name: str, fx_error: BaseException,
                         export_error: BaseException) -> str:
    return (
        f"partc could not trace {name}: both tracers failed.\n"
        f"  torch.fx.symbolic_trace: {_describe(fx_error)}\n"
        f"  torch.export.export(strict=False): {_describe(export_error)}\n"
        "What you can do: make Python control flow independent of tensor values "
        "(static shapes and branches), turn off caches and optional outputs the "
        "forward returns (a Hugging Face config's use_cache partc turns off itself), "
        "pass concrete example inputs "
        "of the shape you train with, or move the data-dependent part out of forward."
    )


def _describe(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    first_line = text[0] if text else ""
    where = _user_frame(error)
    return f"{type(error).__name__}: {first_line}" + (f" (at {where})" if where else "")


def _user_frame(error: BaseException) -> str:
    """The innermost traceback frame outside torch and partc: the user's construct."""
    library_dirs = (os.path.dirname(torch.__file__), os.path.dirname(__file__),
                    os.path.dirname(meta.__file__))
    frames = traceback.extract_tb(error.__traceback__)
    cause = error.__cause__ or error.__context__
    while cause is not None:
        frames.extend(traceback.extract_tb(cause.__traceback__))
        cause = cause.__cause__
    user = [f for f in frames if not f.filename.startswith(library_dirs)
            and "importlib" not in f.filename and "<" not in f.filename]
    if not user:
        return ""
    frame = user[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"


def _normalize_export(gm: fx.GraphModule) -> pytree.TreeSpec:
    """Make ``ep.module()`` a plain GraphModule: flat inputs, flat outputs, no guards."""
    out_spec = gm.graph._codegen.pytree_info.out_spec
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
            gm.delete_submodule("_guards_fn")
    gm.graph._codegen = fx.graph.CodeGen()
    output = _output(gm)
    leaves = list(output.args[0])
    output.args = (leaves[0] if out_spec.is_leaf() else tuple(leaves),)
    return out_spec


# Constants up to this many elements are written into the graph; larger ones are refused.
_MAX_INLINED = 1024


def _inline_constants(gm: fx.GraphModule, model: nn.Module) -> None:
    """Write export's lifted constants into the graph as ``torch.tensor`` calls.

    A tensor the forward makes from Python values (the 0 of ``y[:, 0] = 0``, a
    ``torch.tensor(-inf)``) becomes an attribute ``lifted_tensor_<n>`` of the exported
    module that the model does not have, so a stage built from the model could not find
    it. Written as a call, it travels in the stage's code like any other op.
    """
    own = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    own |= {name for name, _ in model.named_buffers(remove_duplicate=False)}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}   # the readers' places
    for node in [n for n in gm.graph.nodes if n.op == "get_attr" and n.target not in own]:
        owner, _, attr = str(node.target).rpartition(".")
        value = getattr(gm.get_submodule(owner), attr)
        if not isinstance(value, torch.Tensor) or isinstance(value, nn.Parameter):
            continue  # a subgraph that export's higher-order ops call
        if value.device.type == "meta":
            # Made on the meta device (a model planned on meta): no values to write, and
            # none to read; it stays an attribute of the traced module, which the runs
            # on fake tensors read. A model with weights is traced again to train.
            continue
        if value.numel() > _MAX_INLINED:
            raise TraceError(
                f"{type(model).__name__}'s forward makes a constant tensor of "
                f"{value.numel()} elements ({node.target}, shape {tuple(value.shape)}) that "
                "torch.export lifted out of the model: register it as a buffer of its "
                "module so that each stage holds it")
        # Made where it is first read, so it lies in the reader's layer: export puts its
        # constants before everything, and one read by the fifth block would cross four.
        first = min(node.users, key=order.__getitem__) if node.users else node
        with gm.graph.inserting_before(first):
            call = gm.graph.call_function(torch.tensor, (value.tolist(),),
                                          {"dtype": value.dtype, "device": value.device})
        call.meta = dict(node.meta)
        if "nn_module_stack" in first.meta:   # the reader's module, for its layer
            call.meta["nn_module_stack"] = first.meta["nn_module_stack"]
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        delattr(gm.get_submodule(owner), attr)


def _flatten_output(gm: fx.GraphModule) -> pytree.TreeSpec:
    output = _output(gm)
    leaves, spec = pytree.tree_flatten(output.args[0])
    output.args = (leaves[0] if spec.is_leaf() else tuple(leaves),)
    return spec


def _output(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


def _order_nodes(gm: fx.GraphModule) -> None:
    # Placeholders first (export puts parameters before them), and each get_attr next to
    # its first user, so that every later pass can treat graph order as layer order.
    graph = gm.graph
    # Before the first other node, one after another: their order is the forward's.
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for node in [n for n in graph.nodes if n.op == "placeholder"]:
        first.prepend(node)
    for node in [n for n in graph.nodes if n.op == "get_attr"]:
        if node.users:
            min(node.users, key=_position(graph)).prepend(node)
        else:
            graph.erase_node(node)
    graph.lint()


def _position(graph: fx.Graph) -> Callable[[fx.Node], int]:
    order = {node: i for i, node in enumerate(graph.nodes)}
    return order.__getitem__


def _record_modules(gm: fx.GraphModule, tracer: str) -> None:
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        path = _normalize_fqn(list(stack.values())[-1][0]) if stack else ""
        if node.op == "call_module" and tracer == "symbolic_trace":
            path = str(node.target)
        meta.set_module_path(node, path)


def _normalize_fqn(fqn: str) -> str:
    # Older exporters wrote "L['self'].layers[0]"; keep only the attribute path.
    for prefix in ("L['self'].", "L__self__."):
        fqn = fqn.removeprefix(prefix)
    return fqn.replace("[", ".").replace("]", "").replace("'", "")


def _record_params(gm: fx.GraphModule, model: nn.Module) -> None:
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            meta.set_params(node, (str(node.target),))
        elif node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            names = [f"{node.target}.{n}" for n, _ in module.named_parameters()]
            names += [f"{node.target}.{n}" for n, _ in module.named_buffers()]
            meta.set_params(node, tuple(names))


def _append_loss(gm: fx.GraphModule, loss_fn: Callable, out_spec: pytree.TreeSpec,
                 only: int | None = None) -> None:
    """The loss call after the model's outputs; ``only``: it reads that output leaf
    alone (the model's own loss), the others are no longer outputs."""
    name = LOSS_MODULE if not hasattr(gm, LOSS_MODULE) else "partc_loss"
    output = _output(gm)
    leaves = list(output.args[0]) if isinstance(output.args[0], tuple) else [output.args[0]]
    if only is not None:
        leaves, out_spec = [leaves[only]], pytree.tree_flatten(0)[1]
    constants = {i: leaf for i, leaf in enumerate(leaves) if not isinstance(leaf, fx.Node)}
    leaves = [leaf for leaf in leaves if isinstance(leaf, fx.Node)]
    gm.add_submodule(name, LossCall(loss_fn, out_spec, constants))
    last_input = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(last_input):
        target = gm.graph.placeholder("target")
    meta.set_role(target, meta.ROLE_TARGET)
    with gm.graph.inserting_before(output):
        loss = gm.graph.call_module(name, tuple(leaves) + (target,))
    meta.set_role(loss, meta.ROLE_LOSS)
    meta.set_module_path(loss, name)
    meta.set_params(loss, tuple(f"{name}.{n}"
                                for n, _ in gm.get_submodule(name).named_parameters()))
    output.args = (loss,)
