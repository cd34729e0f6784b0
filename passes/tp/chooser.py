"""The tensor-parallel chooser: one strategy per node of every layer, by CP-SAT.

Each node's strategies come from :mod:`partc.passes.tp.rules`. Within a layer a small
CP-SAT model picks one per node to minimise compute (sharded ops do a ``tp``-th of the
work) plus communication, forward and backward, with the layer's inputs and outputs in a
fixed *boundary placement*: ``Replicate()``, or, with sequence parallelism, ``Shard(1)``
(the sequence dim) for the hidden states that flow from layer to layer
(:func:`boundaries`). Megatron-LM's layouts come out of this search rather than going
into it: attention split by heads (QKV column-parallel, output projection row-parallel),
the MLP column-then-row, the embedding vocabulary-parallel, the LM head column-parallel
followed by a gather.

Model, for one layer (costs from :mod:`partc.cost`, scaled to integers by
:class:`_Objective`):

Sets
    ``V``: the layer's computed nodes (ops that make a tensor, but size queries and
    metadata checks, :data:`tp_rules.NO_STRATEGY_OPS`); ``A``: the parameters they read
    (``get_attr`` nodes, the layer's own and those fetched in another layer);
    ``N = V + A``. ``S_n``: the strategies of node ``n`` (:func:`~partc.passes.tp.rules.strategies`;
    for a parameter, one per placement its consumers here need, ``Replicate()`` always,
    ``Partial()`` never). Edges ``(u, v, i)``: ``u`` is the ``i``-th tensor input of
    ``v`` in ``V``, either a node of ``N`` or a value made outside the layer, which
    arrives in its boundary placement ``b_u``. ``O``: the nodes of ``V`` whose values
    leave the layer, in boundary placement ``b_v``. Moves ``r = (u, p, q, c)``: value
    ``u`` brought from placement ``p`` to placement ``q`` by the collectives ``c`` of
    :func:`~partc.passes.tp.rules.redistribute` (which depend on whether the consumer leaves
    a partial gradient to sum); consumers that need the same move share it, as the rewrite
    (:mod:`partc.passes.shard`) emits it once.
Parameters
    ``C[v,s]``: compute of ``v`` under ``s``, its forward and backward at the roofline
    (:func:`partc.cost.layer_compute.op_step_seconds`; unlike the stage cost model, light
    ops and their parameters are priced so too), a ``tp``-th of it when ``s`` shards an
    input or the output. ``M_r``: move ``r``'s collectives over the group, forward and
    backward (:func:`partc.cost.communication.collectives_seconds`). ``B[v,s]``: the same
    for bringing ``v``'s output from ``s``'s placement to ``b_v``. Times in picoseconds.
    ``W[a,s]``: the bytes parameter ``a`` holds under ``s`` (a ``tp``-th when sharded), in
    per-mille of the layer's parameter bytes; with ``prefer="memory"`` 0 for vectors (biases
    and norm weights: counting them would trade a row-parallel layer for a column-parallel
    one).
    ``K[v,s]``: what the unsharded layer keeps for backward of the storage ``v`` makes
    (``NodeCost.saved_bytes``), a ``tp``-th when ``s`` shards it; ``G_u``: the same
    bytes whole, for value ``u`` gathered from a shard for a reader that keeps its input
    as read (every reader but a product that keeps the shard and gathers it again,
    :func:`~partc.passes.tp.rules.regathers`); both in per-mille of the layer's output bytes.
Variables
    ``pick[n,s]``, boolean: node ``n`` runs strategy ``s``. ``move[r]``, boolean: move
    ``r`` is made. ``kept[u,p,q]``, boolean: ``u`` gathered from ``p`` to ``q`` is kept
    whole.
Objective
    ``T = sum C[v,s] pick[v,s] + sum M_r move[r] + sum B[v,s] pick[v,s]``,
    ``W = sum W[a,s] pick[a,s]`` and ``A = sum K[v,s] pick[v,s] + sum G_u kept[u,p,q]``.
    ``prefer="time"``: minimise ``1000 T + W`` (time first; ``W``, about 1000 at most,
    tells apart picks within a picosecond of each other). ``prefer="memory"``: minimise
    ``(1 + A_max) W + A`` (``A_max``: all of ``A``'s terms, so parameter bytes first, then
    activation bytes), then ``T`` with that held at its least (a second solve, from the
    first one's pick). ``A`` counts only where the layer's values arrive and leave sequence-sharded
    (sequence parallelism): between replicated boundaries, keeping fewer activations
    means sharding values by the sequence inside the layer, which (7) forbids there;
    under sequence parallelism the fastest pick can keep a narrow layer's norms,
    dropouts and residuals whole (three collectives beat four), and memory-first keeps
    them sharded.
Constraints
    (1) one strategy per node: ``sum_s pick[n,s] = 1`` for ``n`` in ``N``;
    (2) pins: a parameter pinned to placement ``p`` (see below) makes ``p``:
        ``pick[a,s] = 0`` for ``s.out != p``;
    (3) no unsupported move: where no collectives bring ``u``'s placement under ``t`` to
        the one ``s`` needs at edge ``(u, v, i)``, ``not pick[u,t] or not pick[v,s]``
        (``pick[v,s] = 0`` for a value from outside the layer); a parameter arrives as
        its consumer needs it, with no move;
    (4) a needed move is made: ``not pick[u,t] or not pick[v,s] or move[r]`` for each edge
        and pair of strategies that needs move ``r`` (``not pick[v,s] or move[r]`` from
        outside);
    (5) outputs reach their boundary placement: ``pick[v,s] = 0`` for ``v`` in ``O``
        where no collectives bring ``s.out`` to ``b_v``;
    (6) a gathered copy that is kept is counted: ``not pick[u,t] or not pick[v,s] or
        kept[u,p,q]`` for each edge and pair of strategies whose move gathers a value
        ``G_u`` counts for (memory first, sequence-parallel boundaries);
    (7) without sequence parallelism, Megatron's plain tensor parallelism: no move
        shards a value outside a tensor-parallel region
        (:meth:`_LayerProblem.leaves_plain_tp`): a partial sum is all-reduced, never
        reduce-scattered (nor at the layer's boundary); a value that carries a gradient
        is sliced from its replicated copy only into a row-parallel linear; any other
        value is not sliced along a dim as long as the sequence. Norms, residuals and
        dropout between the regions then run whole, as the plan's
        ``sequence_parallel=False`` says, even where a fast link would make their
        sequence shards faster (reduce-scatter and all-gather cost what one all-reduce
        does in a ring, and the shards do a ``tp``-th of the work);
    (8) an in-place op writes the value it reads, not a moved copy, where that value is
        read after the write: at an edge ``(u, v, i)`` where ``v`` writes input ``i`` in
        place (``h.relu_()``) and a later node reads ``u``'s storage
        (:func:`~partc.passes.helpers.graph.writes_read_later`), ``not pick[u,t] or not
        pick[v,s]`` for each pair that needs any move (the write would land on the copy,
        and the later reader would miss it).

Every layer has a solution without pins (all replicated). CP-SAT runs under
:class:`partc.options.ShardingOptions` (a work limit in CP-SAT's deterministic seconds,
never wall-clock, so every rank and machine picks alike; workers; seed: it settles which
of equally good picks is returned). Layers with the same signature and boundary
placements share one solve, their nodes matched in one order (a parameter just before
its first consumer, whether the layer fetches it itself or reads one fetched in an
earlier layer, as the later calls of a module called from several layers do). A
parameter that several layers use (a tied embedding) gets one placement for all of them:
where the layers' picks disagree, each placement they picked, and ``Replicate()``, is
tried as a pin (2) on every layer, and the one with the smallest summed objective kept
among those every layer can meet, one parameter at a time (until none disagree). So the
search never fails a plan: a layer whose search finds no pick in its work limit stays
replicated (with a warning), and replicated meets every layer.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from ortools.sat.python import cp_model
from torch import fx

from partc import meta
from partc.cost.collectives import Group
from partc.cost.communication import collectives_seconds
from partc.cost.layer_compute import op_step_seconds
from partc.cost.pipeline_config import to_ps
from partc.cp_sat import deterministic_solver, set_work, work_done
from partc.options import ShardingOptions
from partc.passes.helpers.graph import (carries_grad, is_tensorish, layer_nodes, op_name,
                                        storage_of, tensor_inputs, writes_read_later)
from partc.passes.tp.carry import carried_choices
from partc.passes.tp.rules import (NO_STRATEGY_OPS, ChunkHints, Collective, Strategy, divides,
                                   output_shape, own_collectives, redistribute, regathers,
                                   strategies)
from partc.placement import REPLICATE, Placement, Shard
from partc.problem import HeavyOp
from partc.runtime.tp_loss import probe

log = logging.getLogger("partc")


class PinInfeasible(RuntimeError):
    """No pick of a layer meets its pins (without pins, replicated always does)."""


@dataclass(frozen=True)
class Link:
    """What the cost of a choice depends on: the group's communicator, priced by
    :mod:`partc.cost.collectives` as the cost model prices it, and the device."""

    group: Group
    flops: float            # achievable FLOP/s
    hbm_bandwidth: float

    @property
    def tp(self) -> int:
        return self.group.ranks


@dataclass(frozen=True)
class LayerSharding:
    """What was chosen for one layer, in the words the report uses."""

    name: str
    choices: tuple[int, ...]            # strategy index per node of the layer (-1: none)
    params: tuple[tuple[str, str], ...]  # (parameter FQN, placement) for the layer's own
    collectives: tuple[Collective, ...]  # per step of the traced batch, whole tensors
    note: str = ""                       # why the layer stays replicated, when it does


@dataclass
class Sharding:
    """The result of :func:`choose` (or :func:`apply`): a strategy for every node."""

    tp: int
    sequence_parallel: bool
    strategy: dict[fx.Node, Strategy] = field(default_factory=dict)
    boundary: dict[fx.Node, Placement] = field(default_factory=dict)
    layers: tuple[LayerSharding, ...] = ()
    # Replicated parameters whose gradient is partial on every rank (they feed sharded
    # ops only): their gradients are all-reduced over the group once per step.
    partial_grad_params: frozenset[str] = frozenset()

    def placement(self, node: fx.Node) -> Placement:
        chosen = self.strategy.get(node)
        return chosen.out if chosen is not None else REPLICATE

    def param_placements(self) -> dict[str, Placement]:
        result = {}
        for node, chosen in self.strategy.items():
            if node.op == "get_attr":
                for fqn in meta.params(node):
                    result[fqn] = chosen.out
        return result


def sequence_length(gm: fx.GraphModule) -> int:
    """Tokens per sample: dim 1 of the first integer 2-D input (0 if there is none)."""
    for node in gm.graph.nodes:
        if node.op == "placeholder" and meta.role(node) != meta.ROLE_TARGET:
            value = node.meta.get("val")
            integer = isinstance(value, torch.Tensor) and not value.is_floating_point()
            return int(value.shape[1]) if integer and value.dim() == 2 else 0
    return 0


def probe_loss(gm: fx.GraphModule, tp: int) -> fx.Node | None:
    """Whether the loss can read one of its inputs sharded ``tp`` ways by the class dim
    (``partc.runtime.tp_loss.probe``, each floating input in turn), recorded on the loss
    node with the collectives it then runs (``meta.VOCAB_SHARDED``); the logits it reads
    so, if any."""
    loss = next((n for n in gm.graph.nodes if meta.role(n) == meta.ROLE_LOSS
                 and n.op == "call_module"), None)
    if loss is None or tp == 1:
        return None
    if not meta.vocab_probed(loss, tp):
        values = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in loss.args]
        call = gm.get_submodule(str(loss.target))
        meta.set_vocab_sharded(loss, tp, None)
        for i, arg in enumerate(loss.args[:-1]):
            value = values[i]
            if not (isinstance(arg, fx.Node) and isinstance(value, torch.Tensor)
                    and value.dim() >= 2 and divides(value.shape[-1], tp)):
                continue
            collectives = probe(call, values, i, tp)
            if collectives is not None:
                meta.set_vocab_sharded(loss, tp, i, collectives)
                break
    position = meta.vocab_sharded(loss, tp)
    return loss.args[position] if position is not None else None


def boundaries(gm: fx.GraphModule, tp: int, sequence_parallel: bool) -> dict[fx.Node, Placement]:
    """The placement of every value that crosses from one layer to another: replicated,
    or sharded by the sequence (sequence parallelism's hidden states), or, for logits the
    loss alone reads and reads vocab-parallel (:func:`probe_loss`), by their classes."""
    grads = carries_grad(gm)
    seq = sequence_length(gm) if sequence_parallel else 0
    loss_layers = {info.index for info in meta.layers(gm) if info.is_loss}
    logits = probe_loss(gm, tp)
    result = {}
    for node in gm.graph.nodes:
        if node.op in ("output", "get_attr") or not is_tensorish(node):
            continue
        here = meta.layer(node).index if node.op != "placeholder" else -1
        users = list(node.users)
        crossing = [u for u in users if u.op == "output" or meta.layer(u).index != here]
        if not crossing:
            continue
        value = node.meta["val"]
        hidden = (seq and node in grads and isinstance(value, torch.Tensor)
                  and value.is_floating_point() and value.dim() == 3
                  and int(value.shape[1]) == seq and divides(seq, tp)
                  and not any(u.op == "output" or meta.layer(u).index in loss_layers
                              for u in crossing))
        if node is logits and all(meta.role(u) == meta.ROLE_LOSS for u in crossing):
            result[node] = Shard(value.dim() - 1)
            continue
        result[node] = Shard(1) if hidden else REPLICATE
    return result


def choose(gm: fx.GraphModule, tp: int, link: Link, *, sequence_parallel: bool = False,
           prefer: str = "time", options: ShardingOptions = ShardingOptions(),
           problems: LayerProblems | None = None) -> Sharding:
    """Pick every node's strategy for a group of ``tp``, layer by layer.

    Reads ``meta.LAYERS``, ``meta.LAYER``, ``meta.COST``, ``node.meta["val"]``. Requires
    ``estimate``. ``prefer``: "time" or "memory" (the module docstring's objective).
    ``options``: CP-SAT's limits, workers and seed. ``problems``: this graph's
    :func:`layer_problems` for the same group and sequence parallelism, made once for
    both objectives (else made here). Returns a :class:`Sharding`; ``gm`` is not changed.
    """
    shared = problems if problems is not None else layer_problems(gm, tp, link,
                                                                   sequence_parallel)
    result = Sharding(tp=tp, sequence_parallel=sequence_parallel, boundary=shared.boundary)
    grads, problems = shared.grads, list(shared.layers)
    pins: dict[str, Placement] = {}
    # Solutions by layer key, shared by the trials: a pin changes only the keys of the
    # layers that use the pinned parameter.
    cache: dict[tuple, tuple[list[int], int] | None] = {}

    def solve_all(pins: dict[str, Placement]) -> list[tuple[dict[fx.Node, int], int]] | None:
        return _solve_all(problems, pins, prefer, options, cache)

    solved = solve_all(pins)
    if solved is None:  # cannot happen: with no pins every layer may stay replicated
        raise RuntimeError("the sharding search found no pick without pins")
    # A parameter several layers use has one placement: try each the layers chose, and
    # replicated, which every layer can meet. A placement some layer cannot meet (a
    # tied LM head whose sequence-parallel output cannot come from a vocabulary shard)
    # is not a candidate. A pin can move other parameters' picks: a parameter the layers
    # come to disagree on after one is settled in its turn.
    unsettled = _disagreements(problems, solved)
    while unsettled:
        fqn, placements = next(iter(unsettled.items()))
        best = None
        for placement in sorted(placements | {REPLICATE}):
            trial = solve_all({**pins, fqn: placement})
            if trial is None:
                continue
            total = sum(cost for _, cost in trial)
            if best is None or total < best[0]:
                best = (total, placement, trial)
        if best is None:  # cannot happen: replicated meets every layer
            raise RuntimeError(f"no placement of {fqn} meets every layer that reads it")
        pins[fqn], solved = best[1], best[2]
        del unsettled[fqn]
        for other, seen in _disagreements(problems, solved).items():
            if other not in pins:
                unsettled.setdefault(other, set()).update(seen)
    return _apply_choices(gm, result, problems, [c for c, _ in solved], grads)


def apply(gm: fx.GraphModule, tp: int, sequence_parallel: bool,
          choices: dict[str, tuple[int, ...]],
          made_on: Callable[[], fx.GraphModule] | None = None) -> Sharding:
    """Rebuild a :class:`Sharding` from a plan's per-layer strategy indices. Where a
    layer of ``gm`` has other nodes than the plan chose for (a trace at another batch
    size that took another branch of the model's code), ``made_on()`` gives the graph
    the plan chose on, and the choices are carried over (:mod:`partc.passes.tp.carry`)."""
    # Costs play no part in rebuilding: any link will do.
    link = Link(group=Group(ranks=tp, bandwidth=1.0, latency_s=0.0), flops=1.0,
                hbm_bandwidth=1.0)
    result, problems, grads = _layer_problems(gm, tp, link, sequence_parallel)
    if made_on is not None and any(len(choices.get(p.info.name, ())) != len(p.items)
                                   for p in problems):
        _, chosen_on, _ = _layer_problems(made_on(), tp, link, sequence_parallel)
        choices = carried_choices(chosen_on, problems, choices)
    picked = []
    for problem in problems:
        indices = choices.get(problem.info.name)
        if indices is None or len(indices) != len(problem.items):
            raise ValueError(f"layer {problem.info.name}: the plan's sharding has "
                             f"{len(indices or ())} node choices, the traced layer "
                             f"{len(problem.items)}")
        picked.append(dict(zip(problem.items, indices)))
    return _apply_choices(gm, result, problems, picked, grads)


@dataclass(frozen=True)
class LayerProblems:
    """What :func:`choose` solves on a graph for one group and sequence parallelism,
    whatever it prefers: the boundary placements, one problem per layer, and the nodes
    that carry gradients. Read only, so both objectives' searches can share it."""

    boundary: dict[fx.Node, Placement]
    layers: tuple[_LayerProblem, ...]
    grads: set[fx.Node]


def layer_problems(gm: fx.GraphModule, tp: int, link: Link, sequence_parallel: bool
                   ) -> LayerProblems:
    """The problems :func:`choose` solves on ``gm`` for a group of ``tp`` on ``link``."""
    boundary = boundaries(gm, tp, sequence_parallel)
    grads = carries_grad(gm)
    hints = ChunkHints.of(gm)
    written = writes_read_later(gm)
    return LayerProblems(boundary, tuple(
        _LayerProblem(gm, info, tp, link, boundary, grads, hints, sequence_parallel, written)
        for info in meta.layers(gm)), grads)


def _layer_problems(gm: fx.GraphModule, tp: int, link: Link, sequence_parallel: bool
                    ) -> tuple[Sharding, list[_LayerProblem], set[fx.Node]]:
    """An empty Sharding with its boundaries, one problem per layer, and the nodes that
    carry gradients."""
    problems = layer_problems(gm, tp, link, sequence_parallel)
    result = Sharding(tp=tp, sequence_parallel=sequence_parallel, boundary=problems.boundary)
    return result, list(problems.layers), problems.grads


class _LayerProblem:
    """One layer's nodes, their strategies, and the edges between them: the sets and
    parameters of the module docstring's model."""

    def __init__(self, gm: fx.GraphModule, info: meta.LayerInfo, tp: int, link: Link,
                 boundary: dict[fx.Node, Placement], grads: set[fx.Node],
                 hints: ChunkHints, sequence_parallel: bool = False,
                 written_then_read: set[tuple[fx.Node, fx.Node]] = frozenset()) -> None:
        self.info, self.tp, self.link = info, tp, link
        self.written_then_read = written_then_read  # constraint (8)
        self.sequence_parallel = sequence_parallel
        self.sequence = sequence_length(gm)  # tokens per sample; 0: not a token model
        self.boundary, self.grads = boundary, grads
        nodes = layer_nodes(gm, info)
        members = set(nodes)
        self.members = members
        computed = [n for n in nodes if n.op in ("call_function", "call_method", "call_module")
                    and is_tensorish(n) and op_name(n) not in NO_STRATEGY_OPS]
        self.options: dict[fx.Node, list[Strategy]] = {
            n: strategies(n, tp, hints) for n in computed}
        params: dict[fx.Node, set[Placement]] = {}
        for n in computed:
            for position, a in enumerate(tensor_inputs(n)):
                if a.op == "get_attr":
                    wanted = params.setdefault(a, {REPLICATE})
                    wanted.update(s.ins[position] for s in self.options[n])
        for a, wanted in params.items():
            self.options[a] = [Strategy("parameter", p, ()) for p in sorted(wanted)
                               if p.kind != "P"]
        # Deterministic order: the layer's nodes, then parameters fetched elsewhere.
        self.items = [n for n in nodes if n in self.options] + \
            [a for a in params if a not in members]
        self.computed = computed
        # The items in an order that is the same for every layer of one signature: each
        # parameter just before its first consumer, wherever its get_attr is (a layer's
        # own parameter comes first in ``items``, one fetched elsewhere last). Solutions
        # are shared between such layers in this order.
        rank: dict[fx.Node, tuple[int, int, int]] = {}
        for i, n in enumerate(computed):
            for position, a in enumerate(tensor_inputs(n)):
                if a.op == "get_attr":
                    rank.setdefault(a, (i, 0, position))
            rank[n] = (i, 1, 0)
        self.canonical = sorted(self.items, key=rank.__getitem__)

    def signature_key(self, pins: dict[str, Placement]) -> tuple:
        """All this layer's solution depends on: its signature, the pins on its
        parameters, the placements its inputs arrive in and its outputs leave in."""
        pinned = tuple(str(pins.get(meta.params(a)[0], "")) for a in self.canonical
                       if a.op == "get_attr" and meta.params(a))
        ends = tuple(str(self.boundary.get(a, REPLICATE)) for n in self.computed
                     for a in tensor_inputs(n) if a not in self.members and a.op != "get_attr")
        outs = tuple(str(self.boundary[n]) for n in self.computed if n in self.boundary)
        return (self.info.signature, pinned, ends, outs)

    def pin(self, node: fx.Node, pins: dict[str, Placement]) -> Placement | None:
        """The placement ``node`` is pinned to, if it is a pinned parameter."""
        if node.op == "get_attr" and meta.params(node):
            return pins.get(meta.params(node)[0])
        return None

    def keeps_gathered(self, producer: fx.Node, consumer: fx.Node, position: int,
                       src: Placement, dst: Placement, consumer_out: Placement) -> float:
        """The bytes of ``producer``'s value gathered whole for input ``position`` of
        ``consumer`` that stay kept for backward: a value the layer keeps
        (:func:`_saved_bytes` of the storage it views), gathered from a shard for a
        reader that keeps its input as read, not the shard to gather again
        (:func:`~partc.passes.tp.rules.regathers`). 0 otherwise."""
        if not (src.kind == "S" and dst.kind == "R") or producer.op == "get_attr":
            return 0.0
        grad_partial = consumer_out.kind != "R" and producer in self.grads
        if regathers(consumer, position, src, dst, grad_partial):
            return 0.0
        return _saved_bytes(storage_of(producer, _is_view))

    def leaves_plain_tp(self, value: fx.Node, src: Placement, dst: Placement,
                        reader: Strategy | None) -> bool:
        """Whether bringing ``value`` from ``src`` to ``dst`` for a reader running
        ``reader`` shards it outside a tensor-parallel region, as only sequence
        parallelism does (constraint (7)): a partial sum reduce-scattered rather than
        all-reduced; a value that carries a gradient (a residual, a norm's input) sliced
        from its replicated copy, but for a row-parallel linear's input (Megatron's
        scatter to the region); a value without one (positions, masks) sliced along a
        dim as long as the sequence. ``reader`` None: a layer's output brought to its
        boundary placement (replicated, or by class for a vocabulary-parallel loss)."""
        if self.sequence_parallel or dst.kind != "S":
            return False
        if src.kind == "P":
            return True
        if src.kind != "R" or reader is None or value.op == "get_attr":
            return False
        if value in self.grads:
            return reader.name != "row-parallel"
        made = value.meta.get("val")
        return (self.sequence > 0 and isinstance(made, torch.Tensor) and made.dim() > 0
                and int(made.shape[dst.dim % made.dim()]) == self.sequence)

    def edge_moves(self, producer: fx.Node, src: Placement, dst: Placement,
                   consumer_out: Placement) -> tuple | None:
        """The collectives that bring ``producer``'s value from ``src`` to ``dst`` for a
        consumer making ``consumer_out`` (None: unsupported). A value that carries no
        gradient has no backward: a slice of it is free (no all-gather of a gradient)."""
        if producer.op == "get_attr" or not isinstance(producer.meta.get("val"), torch.Tensor):
            return () if src == dst or dst.kind == "*" else None
        grad_partial = dst.kind == "R" and consumer_out.kind != "R" and producer in self.grads
        moves = redistribute(src, dst, grad_partial)
        if moves and producer not in self.grads:
            return tuple(move for move in moves if move[1] != "backward")
        return moves


def _solve_all(problems: list[_LayerProblem], pins: dict[str, Placement], prefer: str,
               options: ShardingOptions, cache: dict[tuple, tuple[list[int], int] | None]
               ) -> list[tuple[dict[fx.Node, int], int]] | None:
    """Every layer's pick (node → strategy index) and objective value under ``pins``;
    None where some layer cannot meet them."""
    solved = []
    for problem in problems:
        key = problem.signature_key(pins)
        if key not in cache:
            try:
                choice, cost = _solve_layer(problem, pins, prefer, options)
                cache[key] = ([choice[n] for n in problem.canonical], cost)
            except PinInfeasible:
                cache[key] = None
        if cache[key] is None:
            return None
        indices, cost = cache[key]
        solved.append((dict(zip(problem.canonical, indices)), cost))
    return solved


def _disagreements(problems: list[_LayerProblem], solved: list) -> dict[str, set[Placement]]:
    """Parameters that layers picked different placements for, with those placements."""
    seen: dict[str, set[Placement]] = {}
    for problem, (choice, _) in zip(problems, solved):
        for node, index in choice.items():
            if node.op == "get_attr" and meta.params(node):
                seen.setdefault(meta.params(node)[0], set()).add(problem.options[node][index].out)
    return {fqn: options for fqn, options in seen.items() if len(options) > 1}


# ------------------------------------------------------------------------------- costs

def _compute_seconds(node: fx.Node, chosen: Strategy, link: Link) -> float:
    """``C[v,s]``: the node's forward and backward, a ``tp``-th of it when sharded."""
    cost = meta.cost(node)
    if cost is None:
        return 0.0
    op = HeavyOp(flops=cost.flops, activation_bytes=cost.bytes_moved,
                 weight_bytes=cost.weight_bytes)
    seconds = op_step_seconds(op, link.flops, link.hbm_bandwidth)
    sharded = chosen.out.kind != "R" or any(p.kind != "R" for p in chosen.ins)
    seconds += sum(_moves_seconds(((c.kind, c.phase),), c.bytes, link)
                   for c in own_collectives(node, chosen, link.tp))
    return seconds / link.tp if sharded else seconds


def _moves_seconds(moves: tuple, nbytes: float, link: Link) -> float:
    """``M_r`` (or ``B[v,s]``): the collectives of a move of ``nbytes``, both phases."""
    by_phase = collectives_seconds(((kind, phase, nbytes) for kind, phase in moves),
                                   link.group)
    return sum(by_phase.values())


# How far apart a memory-first objective's parts lie in its value (a layer's picoseconds
# and per-milles stay below it), so that layers' values add up part by part.
_GOAL_SCALE = 10 ** 18


def _is_view(node: fx.Node) -> bool:
    cost = meta.cost(node)
    return cost is not None and cost.is_view


def _saved_bytes(node: fx.Node) -> float:
    """What the unsharded layer keeps for backward of the storage ``node`` makes."""
    cost = meta.cost(node) if node.op != "get_attr" else None
    return float(cost.saved_bytes) if cost is not None else 0.0


def _param_share(node: fx.Node, placement: Placement, tp: int) -> float:
    """The bytes of parameter ``node`` one rank holds under ``placement``."""
    nbytes = meta.output_bytes(node)
    return nbytes / tp if placement.kind == "S" else float(nbytes)


class _Objective:
    """The objective's terms, each cost scaled to an integer here and only here: time in
    picoseconds (:func:`partc.cost.pipeline_config.to_ps`), parameter bytes in per-mille of
    the layer's, activation bytes in per-mille of the layer's outputs made whole."""

    def __init__(self, param_bytes: int, output_bytes: int) -> None:
        self.param_bytes, self.output_bytes = param_bytes, output_bytes
        self.time_terms: list[tuple[int, cp_model.IntVar]] = []    # (picoseconds, var): T
        self.memory_terms: list[tuple[int, cp_model.IntVar]] = []  # (per-mille, var): W
        self.activation_terms: list[tuple[int, cp_model.IntVar]] = []  # (per-mille, var): A

    def add_time(self, seconds: float, literal: cp_model.IntVar) -> None:
        self.time_terms.append((to_ps(seconds), literal))

    def add_memory(self, nbytes: float, literal: cp_model.IntVar) -> None:
        self.memory_terms.append((int(round(1000 * nbytes / self.param_bytes)), literal))

    def add_activations(self, nbytes: float, literal: cp_model.IntVar) -> None:
        self.activation_terms.append((int(round(1000 * nbytes / self.output_bytes)), literal))

    def goals(self, prefer: str) -> list[cp_model.LinearExprT]:
        """What is minimised, most important first (:meth:`_LayerModel.solve`)."""
        time = sum(c * literal for c, literal in self.time_terms if c)
        memory = sum(c * literal for c, literal in self.memory_terms if c)
        if prefer == "memory":
            activations = sum(c * literal for c, literal in self.activation_terms if c)
            most = sum(c for c, _ in self.activation_terms if c > 0)
            return [memory * (most + 1) + activations, time]
        return [time * 1000 + memory]

    def value(self, prefer: str, solver: cp_model.CpSolver) -> int:
        """The solved pick's objective as one integer that layers' values add up in:
        ``1000 T + W``; with prefer="memory" ``W``, ``A`` and ``T`` each
        :data:`_GOAL_SCALE` apart."""
        def total(terms: list[tuple[int, cp_model.IntVar]]) -> int:
            return sum(c for c, literal in terms if c and solver.boolean_value(literal))

        time, memory = total(self.time_terms), total(self.memory_terms)
        if prefer == "memory":
            activations = total(self.activation_terms)
            return (memory * _GOAL_SCALE + activations) * _GOAL_SCALE + time
        return time * 1000 + memory


# ----------------------------------------------------------------------- the model

# Deterministic seconds a goal is searched at CP-SAT's default linearization before the
# fuller one takes over (:meth:`_LayerModel._solve_goal`); on a layer of more than
# _LARGE_LAYER nodes (a loop unrolled), _LARGE_LP_WORK: Qwen 3.5's gated delta rule at
# 1,024 tokens (1,258 nodes) proved at the default linearization in under 0.05 s where it
# did at all, and spent the whole second before the fuller one proved it, 12 goals of 18.
_DEFAULT_LP_WORK = 1.0
_LARGE_LAYER = 500
_LARGE_LP_WORK = 0.1


class _LayerModel:
    """The module docstring's model of one layer, built constraint by constraint."""

    def __init__(self, problem: _LayerProblem, pins: dict[str, Placement], prefer: str
                 ) -> None:
        self.problem, self.model = problem, cp_model.CpModel()
        self.pick = {n: [self.model.new_bool_var(f"pick[{n.name},{i}:{s.name}]")
                         for i, s in enumerate(problem.options[n])] for n in problem.items}
        self.move: dict[tuple, cp_model.IntVar] = {}
        self.kept: dict[tuple, cp_model.IntVar] = {}
        self.prefer = prefer
        # A (activation bytes) is a goal where memory comes first and the layer's values
        # arrive and leave sequence-sharded; see the module docstring.
        self.weighs_activations = prefer == "memory" and problem.sequence_parallel
        self.objective = _Objective(
            sum(meta.output_bytes(n) for n in problem.items if n.op == "get_attr") or 1,
            sum(meta.output_bytes(n) for n in problem.computed) or 1)
        for node in problem.items:
            self._one_strategy(node, problem.pin(node, pins))
        for node in problem.computed:
            for i, chosen in enumerate(problem.options[node]):   # C[v,s]
                self.objective.add_time(_compute_seconds(node, chosen, problem.link),
                                        self.pick[node][i])
            for position, producer in enumerate(tensor_inputs(node)):
                self._edges(node, position, producer)
            if node in problem.boundary:
                self._boundary(node)
        self._param_bytes(prefer)
        if self.weighs_activations:
            self._activation_bytes()

    def solve(self, solver: cp_model.CpSolver) -> tuple[int, int]:
        """Minimise the objective's goals in turn, each held at its best while the next
        is minimised (from the last solution). The last solve's status and the pick's
        :meth:`_Objective.value`."""
        goals = self.objective.goals(self.prefer)
        work = solver.parameters.max_deterministic_time   # each goal's
        settled = True   # every earlier goal proven at its best
        for i, goal in enumerate(goals):
            self.model.minimize(goal)
            status = self._solve_goal(solver, work)
            if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
                return status, 0
            settled &= status == cp_model.OPTIMAL
            if i + 1 < len(goals):
                self.model.add(goal <= round(solver.objective_value))
                self._hint(solver)
        return (status if settled else cp_model.FEASIBLE), self.objective.value(self.prefer,
                                                                                solver)

    def _solve_goal(self, solver: cp_model.CpSolver, work: float) -> int:
        """CP-SAT on the model as it stands, within ``work`` deterministic seconds: at
        CP-SAT's default linearization for :data:`_DEFAULT_LP_WORK`, which proves the
        layers of a transformer block at once; where that leaves the goal unproven, at the
        fuller one (level 2, every constraint in the linear relaxation) for the rest, from
        the pick found. Qwen 3.5's gated delta rule (a 63-step loop unrolled: 1,000 nodes,
        4,847 variables) stopped at the default's 10 s with gaps of 17-50% and picks up to
        21% slower than the optimum, which the fuller one proves in 0.1-0.5 s."""
        solver.parameters.linearization_level = 1
        large = len(self.problem.canonical) > _LARGE_LAYER
        set_work(solver, min(work, _LARGE_LP_WORK if large else _DEFAULT_LP_WORK))
        status = solver.solve(self.model)
        spent = work_done(solver)
        if status in (cp_model.OPTIMAL, cp_model.INFEASIBLE, cp_model.MODEL_INVALID) \
                or spent >= work:
            return status
        if status == cp_model.FEASIBLE:
            self._hint(solver)
        solver.parameters.linearization_level = 2
        set_work(solver, work - spent)
        fuller = solver.solve(self.model)
        if fuller in (cp_model.OPTIMAL, cp_model.FEASIBLE) or status != cp_model.FEASIBLE:
            return fuller
        # The fuller one found nothing in its work: the default's pick again, from its
        # hint (one more second of work at most).
        solver.parameters.linearization_level = 1
        set_work(solver, min(work, _DEFAULT_LP_WORK))
        return solver.solve(self.model)

    def _hint(self, solver: cp_model.CpSolver) -> None:
        """The last solve's pick as the next solve's hint."""
        self.model.clear_hints()
        for var in (v for picks in self.pick.values() for v in picks):
            self.model.add_hint(var, solver.boolean_value(var))

    def _one_strategy(self, node: fx.Node, pin: Placement | None) -> None:
        # (1) exactly one strategy per node.
        self.model.add_exactly_one(self.pick[node])
        # (2) a pinned parameter makes its pinned placement.
        if pin is not None:
            for var, chosen in zip(self.pick[node], self.problem.options[node]):
                if chosen.out != pin:
                    self.model.add(var == 0)

    def _edges(self, consumer: fx.Node, position: int, producer: fx.Node) -> None:
        """Constraints (3) and (4) for every pair of strategies at one edge."""
        problem = self.problem
        nbytes = float(meta.run_bytes(producer))
        if producer in self.pick:
            sources = list(zip(self.pick[producer], problem.options[producer]))
        else:  # made outside the layer: in its boundary placement
            outside = problem.boundary.get(producer, REPLICATE)
            sources = [(None, Strategy("boundary", outside, ()))]
        written = (consumer, producer) in problem.written_then_read
        for var, chosen in zip(self.pick[consumer], problem.options[consumer]):
            need = chosen.ins[position]
            for source_var, made in sources:
                moves = problem.edge_moves(producer, made.out, need, chosen.out)
                if problem.leaves_plain_tp(producer, made.out, need, chosen):
                    moves = None  # (7) plain tensor parallelism
                if moves and written:
                    moves = None  # (8) an in-place write reads its value as made
                both = [var] + ([source_var] if source_var is not None else [])
                if moves is None:
                    # (3) no strategy pair whose edge needs an unsupported move.
                    self.model.add_bool_or([~lit for lit in both])
                elif moves:
                    # (4) the pair makes its move; consumers needing the same share it.
                    seconds = _moves_seconds(moves, nbytes, problem.link)
                    move = self._move(producer, made.out, need, moves, seconds)
                    self.model.add_bool_or([~lit for lit in both] + [move])
                    kept = self.weighs_activations and problem.keeps_gathered(
                        producer, consumer, position, made.out, need, chosen.out)
                    if kept:
                        self.model.add_bool_or([~lit for lit in both] + [
                            self._kept_whole(producer, made.out, need, kept)])

    def _move(self, value: fx.Node, src: Placement, dst: Placement, moves: tuple,
              seconds: float) -> cp_model.IntVar:
        """``move[r]`` for ``r = (value, src, dst, moves)``, charged ``M_r`` once."""
        key = (value, src, dst, moves)
        if key not in self.move:
            self.move[key] = self.model.new_bool_var(f"move[{value.name},{src}->{dst}]")
            self.objective.add_time(seconds, self.move[key])
        return self.move[key]

    def _boundary(self, node: fx.Node) -> None:
        """Constraint (5) and the cost ``B[v,s]`` of an output that leaves the layer."""
        problem = self.problem
        nbytes = float(meta.run_bytes(node))
        for var, chosen in zip(self.pick[node], problem.options[node]):
            moves = redistribute(chosen.out, problem.boundary[node], False)
            if moves is None or problem.leaves_plain_tp(node, chosen.out,
                                                        problem.boundary[node], None):
                # (5) the output can reach its boundary placement; (7).
                self.model.add(var == 0)
            elif moves:
                self.objective.add_time(_moves_seconds(moves, nbytes, problem.link), var)

    def _param_bytes(self, prefer: str) -> None:
        """``W``: a tie-breaker for time, and with prefer="memory" the first goal."""
        for node in self.problem.items:
            if node.op != "get_attr" or (prefer == "memory" and len(output_shape(node)) < 2):
                continue
            for var, chosen in zip(self.pick[node], self.problem.options[node]):
                share = _param_share(node, chosen.out, self.problem.tp)
                self.objective.add_memory(share, var)

    def _activation_bytes(self) -> None:
        """``A``'s part for the values the layer makes: what the unsharded layer keeps
        of each for backward (``NodeCost.saved_bytes``), a ``tp``-th where the value is
        sharded."""
        for node in self.problem.computed:
            nbytes = _saved_bytes(node)
            if not nbytes:
                continue
            for var, chosen in zip(self.pick[node], self.problem.options[node]):
                self.objective.add_activations(
                    nbytes / self.problem.tp if chosen.out.is_shard else nbytes, var)

    def _kept_whole(self, producer: fx.Node, src: Placement, dst: Placement,
                    nbytes: float) -> cp_model.IntVar:
        """``kept[u, p, q]``: a kept value gathered whole for a reader that keeps the
        gathered copy (``A``'s other part, its bytes once however many readers keep it)."""
        key = (producer, src, dst)
        if key not in self.kept:
            self.kept[key] = self.model.new_bool_var(f"kept[{producer.name},{src}->{dst}]")
            self.objective.add_activations(nbytes, self.kept[key])
        return self.kept[key]


def _solve_layer(problem: _LayerProblem, pins: dict[str, Placement], prefer: str,
                 options: ShardingOptions) -> tuple[dict[fx.Node, int], int]:
    """One layer's pick (node → strategy index) and its objective value."""
    layer = _LayerModel(problem, pins, prefer)
    solver = deterministic_solver(options.work_limit, options.num_workers, options.seed)
    status, value = layer.solve(solver)
    if status == cp_model.FEASIBLE:
        # The same pick on every rank and machine (the limit is work): a warning, as it
        # may not be the best one.
        log.warning("layer %s (%s): the sharding search stopped at its work limit "
                    "(ShardingOptions.work_limit, %g deterministic s) before proving its "
                    "pick the best; keeping the best pick found", problem.info.name,
                    _variant(problem, prefer), options.work_limit)
    elif status == cp_model.INFEASIBLE:
        pinned = {fqn: str(p) for fqn, p in pins.items()
                  if any(problem.pin(n, {fqn: p}) is not None for n in problem.items)}
        raise PinInfeasible(f"layer {problem.info.name}: no strategy per node meets the "
                            f"layer's boundary placements and pins {pinned}")
    elif status != cp_model.OPTIMAL:
        log.warning("layer %s (%s): the sharding search found no pick within its work "
                    "limit (ShardingOptions.work_limit, %g deterministic s; %s); the layer "
                    "stays replicated", problem.info.name, _variant(problem, prefer),
                    options.work_limit, solver.status_name(status))
        return _solve_replicated(problem, pins, prefer)
    return _picked(problem, layer, solver), value


def _variant(problem: _LayerProblem, prefer: str) -> str:
    """The tensor-parallel variant a layer's search is for, as the log names it: one
    layer is searched once per degree, sequence parallelism and objective."""
    return (f"tp={problem.tp}{', sequence parallel' if problem.sequence_parallel else ''}, "
            f"{prefer} first")


def _solve_replicated(problem: _LayerProblem, pins: dict[str, Placement], prefer: str
                      ) -> tuple[dict[fx.Node, int], int]:
    """The layer all replicated (its parameters as pinned), priced by the same model."""
    layer = _LayerModel(problem, pins, prefer)
    for node in problem.items:
        if problem.pin(node, pins) is None:
            index = next(i for i, s in enumerate(problem.options[node]) if s.out == REPLICATE)
            layer.model.add(layer.pick[node][index] == 1)
    # No limit: the layer's picks are fixed, so this prices them rather than searching.
    # (Seed 1 is CP-SAT's default, with which this has always run.)
    solver = deterministic_solver(math.inf, 1, 1)
    status, value = layer.solve(solver)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise PinInfeasible(f"layer {problem.info.name}: replicated does not meet its "
                            f"boundary placements and pins ({solver.status_name(status)})")
    return _picked(problem, layer, solver), value


# ------------------------------------------------------------------------ the result

def _picked(problem: _LayerProblem, layer: _LayerModel, solver: cp_model.CpSolver
            ) -> dict[fx.Node, int]:
    """The solved layer's pick (node → strategy index)."""
    return {n: next(i for i, var in enumerate(layer.pick[n]) if solver.boolean_value(var))
            for n in problem.items}


def _apply_choices(gm: fx.GraphModule, result: Sharding, problems: list[_LayerProblem],
                   picked: list[dict[fx.Node, int]], grads: set[fx.Node]) -> Sharding:
    """Fill ``result`` with the picked strategies, each layer's collectives and notes."""
    layers = []
    partial_uses: dict[fx.Node, list[bool]] = {}
    param_edges: dict[int, list[fx.Node]] = {}
    for problem, choice in zip(problems, picked):
        for node, index in choice.items():
            chosen = problem.options[node][index]
            # A parameter read in several layers has one placement for all its reads.
            if node in result.strategy and result.strategy[node].out != chosen.out:
                raise ValueError(f"layer {problem.info.name}: parameter {node.name} is "
                                 f"{chosen.out} here, {result.strategy[node].out} in an "
                                 f"earlier layer")
            result.strategy[node] = chosen
    for problem, choice in zip(problems, picked):
        collectives, seen = [], set()
        for v in problem.computed:
            chosen = result.strategy[v]
            for position, u in enumerate(tensor_inputs(v)):
                src = result.placement(u) if u in problem.members or u.op == "get_attr" \
                    else result.boundary.get(u, REPLICATE)
                dst = chosen.ins[position]
                if u.op == "get_attr":
                    partial = dst.kind == "R" and chosen.out.kind != "R" and u in grads
                    partial_uses.setdefault(u, []).append(partial)
                    if partial:
                        param_edges.setdefault(len(layers), []).append(u)
                    continue
                moves = problem.edge_moves(u, src, dst, chosen.out) or ()
                if moves and (u, dst, moves) not in seen:
                    seen.add((u, dst, moves))
                    collectives += [Collective(k, ph, meta.run_bytes(u)) for k, ph in moves]
                partial = dst.kind == "R" and chosen.out.kind != "R" and u in grads
                if regathers(v, position, src, dst, partial) and (u, "again") not in seen:
                    seen.add((u, "again"))
                    collectives.append(Collective("all_gather", "backward", meta.run_bytes(u)))
            if v in result.boundary:
                moves = redistribute(chosen.out, result.boundary[v], False) or ()
                collectives += [Collective(k, ph, meta.run_bytes(v)) for k, ph in moves]
            collectives += own_collectives(v, chosen, problem.tp)
        own = tuple((meta.params(n)[0], str(result.strategy[n].out)) for n in problem.items
                    if n.op == "get_attr" and n in problem.members and meta.params(n))
        layers.append(LayerSharding(
            name=problem.info.name, choices=tuple(choice[n] for n in problem.items),
            params=own, collectives=tuple(collectives), note=_why_replicated(problem, result)))
    result.partial_grad_params = frozenset(
        meta.params(node)[0] for node, uses in partial_uses.items()
        if meta.params(node) and all(uses) and result.strategy[node].out.kind == "R")
    # A parameter used both ways sums its partial gradient where it is used sharded.
    for index, nodes in param_edges.items():
        extra = tuple(Collective("all_reduce", "backward", meta.run_bytes(u)) for u in
                      dict.fromkeys(nodes) if meta.params(u)
                      and meta.params(u)[0] not in result.partial_grad_params)
        if extra:
            layers[index] = dataclasses.replace(layers[index],
                                                collectives=layers[index].collectives + extra)
    result.layers = tuple(layers)
    return result


def _why_replicated(problem: _LayerProblem, result: Sharding) -> str:
    """For a layer whose heavy nodes all stay replicated, say what stopped sharding."""
    heavy = [n for n in problem.computed if (meta.cost(n) and meta.cost(n).compute_heavy)]
    if not heavy or any(result.strategy[n].out.kind != "R" for n in heavy):
        return ""
    for n in heavy:
        if len(problem.options[n]) == 1:
            shape = output_shape(n)
            return (f"{n.name} ({op_name(n)}, output {list(shape)}) has no dim that "
                    f"{problem.tp} ranks can split evenly")
    return "replicating is faster than any split at this group's bandwidth"
