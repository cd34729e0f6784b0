"""Which labels a model's own loss averages over, read from its traced graph.

A model given ``labels`` returns its loss as a mean over some of them; the runtime
weighs each microbatch's loss by its count of those labels
(``partc.runtime.label_weights``), so it must know which they are: "shifted" (those of
``labels[:, 1:]`` not -100, a causal LM's next tokens), "tokens" (every label not -100)
or "samples" (a mean over samples). A model's class name does not say it reliably
(``BartForCausalLM`` is a causal LM whose cross-entropy reads its labels unshifted);
its trace does: the loss's cross-entropy (or NLL) ops, their reduction and
``ignore_index``, and the ops between the ``labels`` input and their target.

:func:`counted_in_graph` runs those ops on a probe, the labels' positions numbered from
1, and sees which positions each cross-entropy counts. It answers only what it can see:
a loss whose cross-entropy reads labels through other inputs, sums instead of
averaging, weighs its classes, or counts some other pattern is "unknown", with why.

A user's ``loss_fn`` is not traced into; :func:`counts_its_target` asks it instead, on
small random inputs of its shapes: is its value the mean, over the target's entries not
-100, of what each entry alone gives (cross-entropy's default)? Then the runtime weighs
its value per microbatch by that count, as it weighs a model's own loss.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx

from partc import meta
from partc.runtime.label_weights import IGNORED

aten = torch.ops.aten

# The ops whose mean is over the targets not ``ignore_index`` (class weights aside).
_CROSS_ENTROPY_OPS = {
    aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_forward.default,
    aten.nll_loss2d.default, aten.nll_loss2d_forward.default, aten.nll_loss_nd.default,
    F.cross_entropy, F.nll_loss,
}
_MEAN = (1, "mean")   # torch's Reduction.Mean, as aten and torch.nn.functional write it


@dataclass(frozen=True)
class Counted:
    """The answer: ``kind`` "shifted", "tokens" or "samples", or "unknown" and ``why``."""
    kind: str
    why: str = ""


def counted_in_graph(gm: fx.GraphModule, loss: fx.Node, labels: fx.Node,
                     shape: tuple[int, ...]) -> Counted:
    """Which of ``labels`` (a placeholder of ``shape``) the value ``loss`` averages over.

    Every cross-entropy op ``loss`` depends on must average over targets made from
    ``labels`` alone, each counting the same positions; without any, the loss is taken
    as a mean over samples (a regression's or classification's own loss)."""
    above = _ancestors(loss)
    terms = [node for node in gm.graph.nodes
             if node in above and node.op == "call_function"
             and node.target in _CROSS_ENTROPY_OPS]
    if not terms:
        return Counted("samples")
    kinds = set()
    for node in terms:
        kind = _term_kind(gm, node, labels, shape)
        if kind.kind == "unknown":
            return kind
        kinds.add(kind.kind)
    if len(kinds) > 1:
        return Counted("unknown", f"its cross-entropy terms count different labels "
                                  f"({', '.join(sorted(kinds))})")
    return Counted(kinds.pop())


def _term_kind(gm: fx.GraphModule, node: fx.Node, labels: fx.Node,
               shape: tuple[int, ...]) -> Counted:
    bound = _arguments(node)
    if bound.get("reduction", 1) not in _MEAN:
        return Counted("unknown", f"its {_name(node)} is reduced by "
                                  f"{bound.get('reduction')!r}, not a mean")
    if bound.get("weight") is not None:
        return Counted("unknown", f"its {_name(node)} weighs its classes")
    if bound.get("ignore_index", IGNORED) != IGNORED:
        return Counted("unknown", f"its {_name(node)} ignores the label "
                                  f"{bound.get('ignore_index')}, not -100")
    target = bound.get("target")
    if not isinstance(target, fx.Node):
        return Counted("unknown", f"its {_name(node)} has no target node")
    numel = 1
    for size in shape:
        numel *= size
    probe = torch.arange(1, numel + 1, dtype=torch.int64).reshape(shape)
    try:
        values = _evaluate(gm, target, labels, probe)
    except _NotFromLabels as why:
        return Counted("unknown", f"the target of its {_name(node)} {why}")
    except Exception as error:   # an op that does not run on a plain CPU tensor
        return Counted("unknown", f"the target of its {_name(node)} could not be followed "
                                  f"({type(error).__name__}: {error})")
    return _pattern(values, shape, numel, _name(node))


def _pattern(values: torch.Tensor, shape: tuple[int, ...], numel: int,
             name: str) -> Counted:
    """The kind of the positions ``values`` (probe numbers, -100 where padded) hold."""
    counted = values.flatten()
    counted = counted[counted != IGNORED]
    if counted.numel() and (int(counted.min()) < 1 or int(counted.max()) > numel):
        return Counted("unknown", f"the target of its {name} is not made of the labels")
    seen = torch.zeros(numel, dtype=torch.int64)
    seen.index_add_(0, counted - 1, torch.ones_like(counted))
    if counted.numel() and int(seen.max()) > 1:
        return Counted("unknown", f"the target of its {name} repeats labels")
    rows = seen.reshape(shape[0] if shape else 1, -1).bool()
    if not bool((rows == rows[:1]).all()):
        return Counted("unknown", f"the target of its {name} counts other positions "
                                  f"in different samples")
    row = rows[0]
    if bool(row.all()):
        return Counted("tokens")
    if len(shape) >= 2:
        shifted = torch.ones(shape[1:], dtype=torch.bool)
        shifted[0] = False
        if torch.equal(row, shifted.flatten()):
            return Counted("shifted")
    return Counted("unknown", f"the target of its {name} counts neither every label nor "
                              f"labels[:, 1:]")


class _NotFromLabels(Exception):
    pass


def _evaluate(gm: fx.GraphModule, target: fx.Node, labels: fx.Node,
              probe: torch.Tensor) -> torch.Tensor:
    """``target``'s value, the graph's ops between it and ``labels`` run on ``probe``
    (on the CPU: a device an op names is ignored)."""
    needed = _ancestors(target)
    if labels not in needed:
        inputs = sorted(node.name for node in needed if node.op == "placeholder")
        raise _NotFromLabels(f"is made from {', '.join(inputs) or 'constants'}, "
                             f"not from labels")
    env: dict[fx.Node, object] = {labels: probe}
    for node in gm.graph.nodes:
        if node not in needed or node is labels:
            continue
        if node.op not in ("call_function", "call_method"):
            raise _NotFromLabels(f"reads {node.name} ({node.op}), not the labels alone")
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = {key: (torch.device("cpu") if key == "device" and value is not None
                        else value)
                  for key, value in fx.node.map_arg(node.kwargs, env.__getitem__).items()}
        args = tuple(torch.device("cpu") if isinstance(a, torch.device) else a
                     for a in args)
        if node.op == "call_function":
            env[node] = node.target(*args, **kwargs)
        else:
            env[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
    value = env[target]
    if not isinstance(value, torch.Tensor):
        raise _NotFromLabels("is not a tensor")
    return value


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, todo = {node}, [node]
    while todo:
        for parent in todo.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def _arguments(node: fx.Node) -> dict[str, object]:
    """``node``'s arguments by name, defaults filled (an aten op's schema, or a Python
    function's signature)."""
    target = node.target
    schema = getattr(target, "_schema", None)
    if schema is not None:
        bound = {}
        for i, argument in enumerate(schema.arguments):
            if i < len(node.args):
                bound[argument.name] = node.args[i]
            elif argument.name in node.kwargs:
                bound[argument.name] = node.kwargs[argument.name]
            elif argument.has_default_value():
                bound[argument.name] = argument.default_value
        return bound
    signature = inspect.signature(target)
    arguments = signature.bind(*node.args, **node.kwargs)
    arguments.apply_defaults()
    return dict(arguments.arguments)


def _name(node: fx.Node) -> str:
    """The op's name as a person writes it (``cross_entropy_loss``, ``cross_entropy``)."""
    target = node.target
    return getattr(target, "_opname", None) or getattr(target, "__name__", str(target))


# The probe's target: (samples, positions) cut to this (a target of one dim per sample:
# the samples alone), and the largest input it makes (elements), beyond which it does
# not ask.
_PROBE_SHAPE = (2, 3)
_PROBE_ELEMENTS = 1 << 24


def counts_its_target(gm: fx.GraphModule) -> bool | None:
    """Whether the loss layer (the user's ``loss_fn``) returns the mean, over its target's
    entries not -100, of what each such entry gives alone: asked on random inputs of the
    loss's input shapes, the target's leading dims (and any input's that share them) cut
    to :data:`_PROBE_SHAPE`, class 0 at the counted entries. False for a loss that sums,
    averages over every entry or reads no target of class indices; None where it cannot
    be asked so (shapes written into it, its own parameters, inputs too large)."""
    loss = next((n for n in gm.graph.nodes if meta.role(n) == meta.ROLE_LOSS), None)
    if loss is None:
        return False
    *leaves, target = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in loss.args]
    if not isinstance(target, torch.Tensor) or target.dim() not in (1, 2) \
            or target.is_floating_point() or target.dtype == torch.bool:
        return False
    lead, small = tuple(target.shape), _PROBE_SHAPE[:target.dim()]
    generator = torch.Generator().manual_seed(0)
    made = [_probe_input(leaf, lead, small, generator) for leaf in leaves]
    if any(m is _TOO_BIG for m in made):
        return None
    module = gm.get_submodule(str(loss.target))

    def value(counted: tuple[int, ...]) -> float:
        probe = torch.full(small, IGNORED, dtype=target.dtype)
        probe.view(-1)[list(counted)] = 0
        with torch.no_grad():
            return float(module(*made, probe))

    try:
        alone = [value((i,)) for i in range(math.prod(small))]
        sets = [(0, 2, 5), (1, 3)] if len(small) == 2 else [(0, 1)]
        means = [(value(s), sum(alone[i] for i in s) / len(s)) for s in sets]
    except Exception:   # noqa: BLE001 - a loss that cannot be asked so is not weighed
        return None
    if not all(math.isfinite(x) for x in alone) or max(alone) - min(alone) <= 1e-6:
        return False   # the target changes nothing: no count to weigh by
    return all(math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-7) for got, want in means)


_TOO_BIG = object()


def _probe_input(leaf: object, lead: tuple[int, ...], small: tuple[int, ...],
                 generator: torch.Generator) -> object:
    """A random real stand-in of ``leaf`` (a fake or meta tensor), its dims shared with
    the target (``lead``) cut to ``small``; anything else as it is."""
    if not isinstance(leaf, torch.Tensor):
        return leaf
    shape = tuple(leaf.shape)
    if shape[:len(lead)] == lead:
        shape = small + shape[len(lead):]
    elif shape and shape[0] == lead[0]:
        shape = small[:1] + shape[1:]
    if math.prod(shape) > _PROBE_ELEMENTS:
        return _TOO_BIG
    if leaf.is_floating_point():
        return torch.randn(shape, generator=generator)
    return torch.zeros(shape, dtype=leaf.dtype)
