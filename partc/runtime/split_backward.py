"""A stage's backward split in two, input gradients first and weight gradients later (the
zero-bubble schedules' ``I`` and ``W``), right for any graph a stage holds.

Torch's own split (``stage_backward_input`` / ``stage_backward_weight`` in
``torch.distributed.pipelining``) gets three things wrong that real models do:

- a weight whose value reaches a stage output without meeting the stage's inputs (DeBERTa's
  normed relative embeddings, made in one stage and sent on to the next) loses that part
  of its gradient;
- it merges weights into groups without following earlier merges, so one weight can sit in
  two groups: its gradient is counted twice, or the second group's backward runs through
  a graph the first one freed ("Trying to backward through the graph a second time");
- a weight read at two depths of the stage (a layer's weights shared by two layers)
  has the second group's backward run through nodes the first one freed, the same error.

The split here works on the autograd graph of one microbatch:

- *input side*: the nodes that depend on the stage's inputs (those that need gradients);
  the *weight side*: those reached from the weights only;
- *frontier*: the input-side nodes that read a weight-side node (a matmul reading a
  weight's transpose, a norm reading its scale);
- :func:`input_grads` computes the inputs' gradients from the outputs (the graph kept)
  and records the gradient that arrives at each frontier node; the outputs on the weight
  side keep their incoming gradient;
- :func:`weight_grads` computes, per group of weights that share a frontier node or a
  weight-side output, the weights' gradients from those recorded gradients: one
  ``autograd.grad`` per group, so that the pass reaches only the group's own weight-side
  nodes (no input gradient computed again), with each frontier node's gradient held to
  the recorded one (the pass may reach it a second time from another of the group's
  frontier nodes, through the input side, when a weight is read at two depths). Every
  call keeps the graph: the groups of such a weight walk one stretch of the input side
  each; the graph goes when the microbatch's state does.

A weight's gradient is then the sum, over the frontier nodes its paths reach first, of
the gradient recorded there carried back along the weight side, plus what the outputs
on the weight side carry: every path from a weight to an output crosses into the input
side at one first node, or never does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class WeightGroup:
    """Weights whose gradients come from one set of roots: the frontier nodes they reach
    (with the gradients recorded there) and the weight-side outputs they make."""

    weights: list[torch.Tensor] = field(default_factory=list)
    frontier: list[Node] = field(default_factory=list)
    outputs: list[tuple[GradientEdge, torch.Tensor]] = field(default_factory=list)


@dataclass
class SplitState:
    """What :func:`input_grads` leaves for :func:`weight_grads`: the groups, and the
    gradient recorded at each frontier node (per output of the node; None where none
    came)."""

    groups: list[WeightGroup]
    recorded: dict[Node, tuple[torch.Tensor | None, ...]]


def input_grads(outputs: Sequence[torch.Tensor], output_grads: Sequence[Any] | None,
                inputs: Sequence[Any], weights: Iterable[torch.Tensor]
                ) -> tuple[tuple[torch.Tensor | None, ...], SplitState]:
    """The gradients of ``inputs`` (None for those that need none), and the state
    :func:`weight_grads` finishes from. ``output_grads`` None: ``outputs`` is the loss
    (its gradient one). The outputs the weight pass cannot need (:func:`_detachable`:
    the loss, most stage outputs) are detached in place afterwards, as torch's split
    does, so that only the graph the weight gradients need stays alive."""
    pairs = [(t, torch.ones_like(t) if output_grads is None else output_grads[i])
             for i, t in enumerate(outputs)
             if isinstance(t, torch.Tensor) and (t.requires_grad or t.grad_fn is not None)]
    wanted = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    roots = [get_gradient_edge(t).node for t, _ in pairs]
    consumers = _consumers(roots)
    input_side = _reached([get_gradient_edge(t).node for t in wanted], consumers)
    weights = [w for w in _unique(weights) if w.requires_grad]
    groups, frontier = _groups(weights, consumers, input_side)
    for t, grad in pairs:
        node = get_gradient_edge(t).node
        if node not in input_side and node in groups.owner:
            groups.of(node).outputs.append((get_gradient_edge(t), grad))
    recorded: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    handles = [node.register_prehook(_recorder(recorded, node)) for node in frontier]
    try:
        grads = _grads([t for t, _ in pairs], wanted, [g for _, g in pairs])
    finally:
        for handle in handles:
            handle.remove()
    done = set(frontier)
    for t, _ in pairs:
        if _detachable(t, consumers, input_side, done):
            t.detach_()
    found = iter(grads)
    result = tuple(next(found) if isinstance(t, torch.Tensor) and t.requires_grad else None
                   for t in inputs)
    return result, SplitState(groups.distinct(), recorded)


def weight_grads(state: SplitState) -> list[torch.Tensor]:
    """Add each weight's gradient of the microbatch to its ``.grad``; the weights given
    one."""
    given = []
    for group in state.groups:
        roots, grads = [], []
        for node in group.frontier:
            for index, grad in enumerate(state.recorded.get(node, ())):
                if grad is not None:
                    roots.append(GradientEdge(node, index))
                    grads.append(grad)
        for edge, grad in group.outputs:
            roots.append(edge)
            grads.append(grad)
        if not roots:
            continue
        # More than one frontier node: the pass may reach one from another through the
        # input side; its gradient is the one recorded, whatever arrives.
        handles = ([node.register_prehook(_held(state.recorded.get(node, ())))
                    for node in group.frontier] if len(group.frontier) > 1 else [])
        try:
            found = torch.autograd.grad(roots, [get_gradient_edge(w) for w in group.weights],
                                        grad_outputs=grads, retain_graph=True,
                                        allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        for weight, grad in zip(group.weights, found):
            if grad is None:
                continue
            if weight.grad is None:
                weight.grad = grad
            else:   # in place: the gradient may be a view of a bucket (GradBuckets)
                weight.grad += grad
            given.append(weight)
    state.groups.clear()
    state.recorded.clear()
    return given


class _Groups:
    """Weights joined (union-find) when they reach a common node: their groups' roots."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        self.parent = list(range(len(weights)))
        self.members = [WeightGroup(weights=[w]) for w in weights]
        self.owner: dict[Node, int] = {}   # a frontier node or weight-side node → a weight

    def find(self, index: int) -> int:
        while self.parent[index] != index:
            self.parent[index] = self.parent[self.parent[index]]
            index = self.parent[index]
        return index

    def claim(self, node: Node, index: int) -> None:
        if node in self.owner:
            a, b = self.find(self.owner[node]), self.find(index)
            if a != b:
                self.parent[b] = a
        else:
            self.owner[node] = index

    def of(self, node: Node) -> WeightGroup:
        return self.members[self.find(self.owner[node])]

    def distinct(self) -> list[WeightGroup]:
        merged: dict[int, WeightGroup] = {}
        for index, member in enumerate(self.members):
            group = merged.setdefault(self.find(index), WeightGroup())
            group.weights += member.weights
            group.frontier += member.frontier
            group.outputs += member.outputs
        return list(merged.values())


def _groups(weights: list[torch.Tensor], consumers: dict[Node, list[Node]],
            input_side: set[Node]) -> tuple[_Groups, list[Node]]:
    """The weights' groups, each with its frontier nodes, and every frontier node."""
    groups = _Groups(weights)
    frontier: dict[Node, None] = {}
    for index, weight in enumerate(weights):
        start = get_gradient_edge(weight).node
        if start not in consumers:
            continue   # no output of the stage depends on it
        groups.claim(start, index)   # the stage may send a weight on as it is
        seen, queue = {start}, deque([start])
        while queue:
            node = queue.popleft()
            for user in consumers.get(node, ()):
                if user in seen:
                    continue
                seen.add(user)
                groups.claim(user, index)
                if user in input_side:
                    frontier[user] = None
                else:
                    queue.append(user)
    for node in frontier:
        groups.members[groups.owner[node]].frontier.append(node)
    return groups, list(frontier)


def _detachable(t: torch.Tensor, consumers: dict[Node, list[Node]], input_side: set[Node],
                frontier: set[Node]) -> bool:
    """Whether output ``t`` can be detached in place: no node the weight pass may run
    keeps it. Not a leaf (a weight or an input sent on as it is would stop requiring
    gradients), nor a view (autograd cannot: see ``not_a_view``); and its node is one
    the weight pass never runs (input side, no frontier node) and nothing in the stage
    reads it (a node reading it may keep it, as ``tanh`` keeps its result)."""
    if t.grad_fn is None or t._is_view():
        return False
    node = get_gradient_edge(t).node
    return node in input_side and node not in frontier and not consumers.get(node)


def _consumers(roots: list[Node]) -> dict[Node, list[Node]]:
    """Every node of the graph below ``roots``, with the nodes that read it (the forward
    direction)."""
    consumers: dict[Node, list[Node]] = {root: [] for root in roots}
    queue = deque(consumers)
    while queue:
        node = queue.popleft()
        for source, _ in node.next_functions:
            if source is None:
                continue
            if source not in consumers:
                consumers[source] = []
                queue.append(source)
            consumers[source].append(node)
    return consumers


def _reached(starts: list[Node], consumers: dict[Node, list[Node]]) -> set[Node]:
    """The nodes that depend on ``starts`` (``starts`` included)."""
    seen = {node for node in starts if node in consumers}
    queue = deque(seen)
    while queue:
        for user in consumers[queue.popleft()]:
            if user not in seen:
                seen.add(user)
                queue.append(user)
    return seen


def _grads(outputs: list[torch.Tensor], wanted: list[torch.Tensor],
           grads: list[Any]) -> tuple[torch.Tensor | None, ...]:
    if not wanted or not outputs:
        return tuple(None for _ in wanted)
    return torch.autograd.grad(outputs, wanted, grad_outputs=grads, retain_graph=True,
                               allow_unused=True)


def _recorder(recorded: dict, node: Node):
    def hook(grad_outputs: tuple) -> None:
        recorded[node] = tuple(grad_outputs)
    return hook


def _held(grads: tuple):
    def hook(_grad_outputs: tuple) -> tuple:
        return grads
    return hook


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())
