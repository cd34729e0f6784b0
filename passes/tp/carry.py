"""A plan's tensor-parallel choices carried from the graph they were made on to another
trace of the same model.

The planner chooses each layer's sharding on the graph it measured, traced at the
example's batch; lowering traces at the micro-batch size. Where the model's code
branches on the batch, the two differ: Hugging Face's masks expand the position ids to
the batch only when it is not 1 (``if batch_size != position_ids.shape[0]``), so at a
micro-batch of 4 the embedding layer has one node more than at 1. A plan's choices are
one strategy index per node of a layer, in node order, so they cannot be read on the
other graph as they are.

:func:`carried_choices` aligns each layer's nodes in the two graphs by what they compute
(the op, or the parameter read; :class:`difflib.SequenceMatcher`), gives every matched
node the strategy the plan chose for its counterpart (by its placements, not its index:
a node's strategies depend on its shape), and every node the other graph lacks the
strategy that takes its inputs as they come (no collective), else the replicated one.
"""

from __future__ import annotations

from difflib import SequenceMatcher
from typing import Any, Mapping, Sequence

from torch import fx

from partc import meta
from partc.passes.helpers.graph import op_name, tensor_inputs
from partc.passes.tp.rules import Strategy
from partc.placement import REPLICATE, Placement


def carried_choices(made_on: Sequence[Any], problems: Sequence[Any],
                    choices: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """``choices`` (layer -> strategy index per node of ``made_on``'s layer problems)
    as indices into ``problems``, the same layers of another trace (the chooser's
    ``_LayerProblem``: ``info.name``, ``items``, ``options``). A layer the plan has no
    choices for, or whose choices do not fit ``made_on``, is left as it is (the chooser
    refuses it, naming the layer)."""
    source = {problem.info.name: problem for problem in made_on}
    carried = dict(choices)
    for problem in problems:
        name = problem.info.name
        made, indices = source.get(name), choices.get(name)
        if made is None or indices is None or len(indices) != len(made.items):
            continue
        chosen = {node: made.options[node][index] for node, index in zip(made.items, indices)}
        carried[name] = _layer(made, chosen, problem)
    return carried


def _key(node: fx.Node) -> tuple:
    """What a node computes, as two traces of one model both name it."""
    if node.op == "get_attr":
        return ("parameter", tuple(meta.params(node)) or str(node.target))
    return (op_name(node), len(tensor_inputs(node)))


def _layer(made: Any, chosen: dict[fx.Node, Strategy], problem: Any) -> tuple[int, ...]:
    picked: dict[fx.Node, int] = {}
    matcher = SequenceMatcher(None, [_key(n) for n in made.items],
                              [_key(n) for n in problem.items], autojunk=False)
    for first, second, size in matcher.get_matching_blocks():
        for offset in range(size):
            node = problem.items[second + offset]
            index = _same(problem.options[node], chosen[made.items[first + offset]])
            if index is not None:
                picked[node] = index
    for node in problem.items:   # in node order: a producer is settled before its readers
        if node not in picked:
            picked[node] = _as_inputs_come(problem, node, picked)
    return tuple(picked[node] for node in problem.items)


def _same(options: list[Strategy], strategy: Strategy) -> int | None:
    for index, option in enumerate(options):
        if (option.name, option.out, option.ins) == (strategy.name, strategy.out,
                                                     strategy.ins):
            return index
    return next((index for index, option in enumerate(options)
                 if (option.out, option.ins) == (strategy.out, strategy.ins)), None)


def _as_inputs_come(problem: Any, node: fx.Node, picked: dict[fx.Node, int]) -> int:
    """The strategy of ``node`` that reads its inputs in the placements they arrive in,
    else the one that replicates everything, else the first."""
    options = problem.options[node]
    arriving: list[Placement] = []
    for value in tensor_inputs(node):
        if value in picked:
            arriving.append(problem.options[value][picked[value]].out)
        else:
            arriving.append(problem.boundary.get(value, REPLICATE))
    for index, option in enumerate(options):
        if list(option.ins) == arriving:
            return index
    for index, option in enumerate(options):
        if option.out == REPLICATE and all(p == REPLICATE for p in option.ins):
            return index
    return 0
