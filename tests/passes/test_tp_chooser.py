"""The tensor-parallel chooser on a hand-built layer: the pick it makes, pins, and its
CP-SAT model's optimum against a brute-force enumeration of every pick, priced by an
objective written here from the formulation (passes/tp/chooser.py's docstring)."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from partc import meta
from partc.cost.collectives import Group, collective_seconds
from partc.cost.pipeline_config import to_ps
from partc.options import ShardingOptions
from partc.passes.tp import chooser as tp_chooser
from partc.passes.helpers.graph import tensor_inputs
from partc.passes.tp.chooser import Link, apply, choose
from partc.passes.tp.rules import redistribute, regathers
from partc.placement import PARTIAL, REPLICATE, Shard

# Slow arithmetic, a fast free link: splitting the work pays.
FAST_LINK = Link(group=Group(ranks=2, bandwidth=1e12, latency_s=0.0), flops=1e9,
                 hbm_bandwidth=1e12)
# Every collective step costs a millisecond: nothing is worth a collective.
SLOW_LINK = Link(group=Group(ranks=2, bandwidth=1e6, latency_s=1e-3), flops=1e12,
                 hbm_bandwidth=1e12)


class Mlp(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)


def mlp_layer(batch: int = 4, seq: int = 8, width: int = 16, hidden: int = 64
              ) -> fx.GraphModule:
    """``down(relu(up(x)))`` as one layer, "mlp", with the metadata the chooser reads:
    fake values, parameter FQNs, tensor sizes, the layer, and forward costs."""
    root = Mlp(width, hidden)
    graph = fx.Graph()

    def node(made: fx.Node, value: torch.Tensor, cost: meta.NodeCost | None = None):
        made.meta["val"] = value.to("meta")
        meta.set_tensors(made, (meta.TensorInfo.of(made.meta["val"]),))
        if made.op != "placeholder":
            meta.set_layer(made, meta.LayerRef(0, "mlp"))
        if made.op == "get_attr":
            meta.set_params(made, (made.target,))
        if cost is not None:
            meta.set_cost(made, cost)
        return made

    def linear(x: fx.Node, fqn: str, n_in: int, n_out: int) -> fx.Node:
        w = node(graph.get_attr(f"{fqn}.weight"), torch.empty(n_out, n_in))
        b = node(graph.get_attr(f"{fqn}.bias"), torch.empty(n_out))
        tokens = batch * seq
        return node(graph.call_function(F.linear, (x, w, b)), torch.empty(batch, seq, n_out),
                    meta.NodeCost(flops=2.0 * tokens * n_in * n_out,
                                  bytes_moved=4.0 * tokens * (n_in + n_out),
                                  compute_heavy=True, is_view=False,
                                  output_bytes=4.0 * tokens * n_out, saved_bytes=0.0,
                                  weight_bytes=4.0 * (n_in + 1) * n_out))

    x = node(graph.placeholder("x"), torch.empty(batch, seq, width))
    h = linear(x, "up", width, hidden)
    nbytes = 4.0 * batch * seq * hidden
    r = node(graph.call_function(torch.relu, (h,)), torch.empty(batch, seq, hidden),
             meta.NodeCost(flops=0.0, bytes_moved=2 * nbytes, compute_heavy=False,
                           is_view=False, output_bytes=nbytes, saved_bytes=nbytes))
    y = linear(r, "down", hidden, width)
    graph.output(y)
    gm = fx.GraphModule(root, graph)
    names = tuple(n.name for n in gm.graph.nodes if n.op not in ("placeholder", "output"))
    meta.set_layers(gm, (meta.LayerInfo(index=0, name="mlp", key="mlp", signature="mlp",
                                        nodes=names),))
    return gm


def picked(sharding: tp_chooser.Sharding) -> dict[str, tuple[str, str]]:
    return {n.name: (s.name, str(s.out)) for n, s in sharding.strategy.items()}


def test_an_mlp_is_split_column_then_row():
    gm = mlp_layer()
    sharding = choose(gm, 2, FAST_LINK)
    assert picked(sharding) == {
        "up_weight": ("parameter", "Shard(0)"),
        "up_bias": ("parameter", "Shard(0)"),
        "linear": ("column-parallel", "Shard(2)"),
        "relu": ("shard dim 2", "Shard(2)"),
        "down_weight": ("parameter", "Shard(1)"),
        "down_bias": ("parameter", "Replicate()"),
        "linear_1": ("row-parallel", "Partial()"),
    }
    (layer,) = sharding.layers
    # One all-reduce of the output, to the layer boundary's Replicate(); x reaches the
    # column-parallel linear as it is (it carries no gradient to sum).
    assert [(c.kind, c.phase, c.bytes) for c in layer.collectives] == \
        [("all_reduce", "forward", 4 * 8 * 16 * 4)]
    assert layer.params == (("up.weight", "Shard(0)"), ("up.bias", "Shard(0)"),
                            ("down.weight", "Shard(1)"), ("down.bias", "Replicate()"))
    assert layer.note == ""
    # A plan's indices rebuild the same sharding.
    again = apply(gm, 2, False, {layer.name: layer.choices})
    assert picked(again) == picked(sharding) and again.layers == sharding.layers


def test_on_a_slow_link_the_layer_stays_replicated_and_says_why():
    sharding = choose(mlp_layer(), 2, SLOW_LINK)
    assert {out for _, out in picked(sharding).values()} == {"Replicate()"}
    (layer,) = sharding.layers
    assert layer.collectives == ()
    assert layer.note == "replicating is faster than any split at this group's bandwidth"


def test_a_pinned_parameter_keeps_its_placement():
    problem = layer_problem(mlp_layer())
    # up.weight replicated: the first linear cannot split (both of its splits shard the
    # weight); its output is sliced for free (gathered in backward) into the second
    # linear, which still runs row-parallel (Megatron's scatter to the region). The ReLU
    # before it stays whole: without sequence parallelism a value that carries a
    # gradient is sliced only for a row-parallel linear (constraint (7)).
    choice, _ = tp_chooser._solve_layer(problem, {"up.weight": REPLICATE}, "time",
                                        ShardingOptions())
    chosen = {n.name: problem.options[n][i] for n, i in choice.items()}
    assert chosen["up_weight"].out == REPLICATE
    assert chosen["linear"].name == "replicate"
    assert (chosen["relu"].out, chosen["linear_1"].name) == (REPLICATE, "row-parallel")
    assert chosen["linear_1"].ins[0] == Shard(2)


def test_a_pin_no_strategy_can_meet_names_the_layer():
    problem = layer_problem(mlp_layer())
    with pytest.raises(RuntimeError, match=r"layer mlp: .*up\.weight"):
        tp_chooser._solve_layer(problem, {"up.weight": Shard(1, 2)}, "time",
                                ShardingOptions())


@pytest.mark.parametrize("sp", [False, True], ids=["", "sp"])
@pytest.mark.parametrize("link", [FAST_LINK, SLOW_LINK], ids=["fast", "slow"])
@pytest.mark.parametrize("prefer", ["time", "memory"])
def test_the_model_finds_the_brute_force_optimum(link, prefer, sp):
    problem = layer_problem(mlp_layer(), link, sp)
    picks = [dict(zip(problem.items, indices)) for indices in itertools.product(
        *(range(len(problem.options[n])) for n in problem.items))]
    assert len(picks) == 3 * 2 * 3 * 3 * 3 * 2 * 3
    priced = [objective(problem, pick, prefer) for pick in picks]
    best = min(value for value in priced if value is not None)
    choice, value = tp_chooser._solve_layer(problem, {}, prefer, ShardingOptions())
    assert value == best
    assert objective(problem, choice, prefer) == best


def layer_problem(gm: fx.GraphModule, link: Link = FAST_LINK, sp: bool = False
                  ) -> tp_chooser._LayerProblem:
    _, (problem,), _ = tp_chooser._layer_problems(gm, 2, link, sequence_parallel=sp)
    return problem


def objective(problem: tp_chooser._LayerProblem, pick: dict[fx.Node, int],
              prefer: str) -> int | None:
    """The formulation's objective of one pick, None where a constraint forbids it."""
    link, tp = problem.link, problem.tp
    strategy = {n: problem.options[n][i] for n, i in pick.items()}

    def move_ps(collectives: tuple, nbytes: float) -> int:
        return to_ps(sum(collective_seconds(kind, nbytes, link.group)
                         for kind, _ in collectives))

    time_ps, moves, kept = 0, {}, {}
    outputs = sum(meta.output_bytes(v) for v in problem.computed)
    # A (memory first, sequence-parallel boundaries): per-mille of the layer's outputs,
    # what it keeps for backward of each value as placed (a tp-th where sharded), and of
    # each kept value gathered whole for a reader that keeps it so (not a linear that
    # keeps the shard to gather again: tp_rules.regathers).
    weighs = prefer == "memory" and problem.sequence_parallel
    activations = sum(round(1000 * (meta.cost(v).saved_bytes / tp if strategy[v].out.is_shard
                                    else meta.cost(v).saved_bytes) / outputs)
                      for v in problem.computed if meta.cost(v).saved_bytes) if weighs else 0
    for v in problem.computed:
        chosen, cost = strategy[v], meta.cost(v)
        # C[v,s]: forward and backward (twice forward), each at the roofline.
        seconds = 3 * max(cost.flops / link.flops,
                          (cost.bytes_moved + cost.weight_bytes) / link.hbm_bandwidth)
        sharded = chosen.out != REPLICATE or any(p != REPLICATE for p in chosen.ins)
        time_ps += to_ps(seconds / tp if sharded else seconds)
        for position, u in enumerate(tensor_inputs(v)):
            need = chosen.ins[position]
            if u.op == "get_attr":
                if strategy[u].out != need:
                    return None                            # (3): parameters never move
                continue
            have = strategy[u].out if u in strategy else problem.boundary.get(u, REPLICATE)
            grad_partial = need == REPLICATE and chosen.out != REPLICATE and u in problem.grads
            collectives = redistribute(have, need, grad_partial)
            if collectives is None:
                return None                                # (3)
            if collectives:                                # (4): M_r, once per move
                moves[u, have, need, collectives] = move_ps(collectives, meta.output_bytes(u))
                if weighs and have.is_shard and need == REPLICATE and meta.cost(u).saved_bytes \
                        and not regathers(v, position, have, need, grad_partial):
                    kept[u, have, need] = round(1000 * meta.cost(u).saved_bytes / outputs)
        if v in problem.boundary:
            collectives = redistribute(chosen.out, problem.boundary[v], False)
            if collectives is None:
                return None                                # (5)
            time_ps += move_ps(collectives, meta.output_bytes(v))  # B[v,s]
    time_ps += sum(moves.values())
    params = [n for n in problem.items if n.op == "get_attr"]
    total = sum(meta.output_bytes(n) for n in params)
    # W: per-mille of the layer's parameter bytes held (vectors left out for memory).
    held = {n: meta.output_bytes(n) / tp if strategy[n].out.is_shard
            else float(meta.output_bytes(n)) for n in params}
    memory = sum(round(1000 * held[n] / total) for n in params
                 if prefer == "time" or len(n.meta["val"].shape) >= 2)
    assert all(s.out != PARTIAL for n, s in strategy.items() if n.op == "get_attr")
    if prefer == "memory":
        scale = 10**18
        return ((memory * scale) + activations + sum(kept.values())) * scale + time_ps
    return time_ps * 1000 + memory


def tied_layers(rows: int = 64, width: int = 3, batch: int = 4, seq: int = 8
                ) -> fx.GraphModule:
    """One parameter ``w`` (rows x width) read by two layers: "head", ``linear(x, w)``,
    which can split only by rows (``width`` is odd: no row-parallel form), and "scaled",
    ``w * 2``, which can split only along ``width`` (so not at all)."""
    root = nn.Module()
    root.w = nn.Parameter(torch.empty(rows, width))
    graph = fx.Graph()

    def node(made: fx.Node, value: torch.Tensor, layer: str | None = None,
             cost: meta.NodeCost | None = None) -> fx.Node:
        made.meta["val"] = value.to("meta")
        meta.set_tensors(made, (meta.TensorInfo.of(made.meta["val"]),))
        if layer is not None:
            meta.set_layer(made, meta.LayerRef(["head", "scaled"].index(layer), layer))
        if made.op == "get_attr":
            meta.set_params(made, (made.target,))
        if cost is not None:
            meta.set_cost(made, cost)
        return made

    x = node(graph.placeholder("x"), torch.empty(batch, seq, width))
    w = node(graph.get_attr("w"), torch.empty(rows, width), "head")
    tokens = batch * seq
    logits = node(graph.call_function(F.linear, (x, w)), torch.empty(batch, seq, rows),
                  "head", meta.NodeCost(flops=2.0 * tokens * width * rows,
                                        bytes_moved=4.0 * tokens * (width + rows),
                                        compute_heavy=True, is_view=False,
                                        output_bytes=4.0 * tokens * rows, saved_bytes=0.0,
                                        weight_bytes=4.0 * width * rows))
    w_again = node(graph.get_attr("w"), torch.empty(rows, width), "scaled")
    scaled = node(graph.call_function(torch.mul, (w_again, 2.0)), torch.empty(rows, width),
                  "scaled")
    graph.output((logits, scaled))
    gm = fx.GraphModule(root, graph)
    meta.set_layers(gm, tuple(
        meta.LayerInfo(index=i, name=name, key=name, signature=name, nodes=nodes)
        for i, (name, nodes) in enumerate([("head", ("w", "linear")),
                                           ("scaled", ("w_1", "mul"))])))
    return gm


def test_a_shared_parameter_takes_a_placement_every_layer_can_meet():
    # Alone, "head" splits w by rows and "scaled" keeps it whole; w by rows is a pin
    # "scaled" cannot meet, so the shared placement is the one both can: replicated.
    gm = tied_layers()
    alone = {layer.name: layer.params for layer in choose(gm, 2, FAST_LINK).layers}
    problems = tp_chooser._layer_problems(gm, 2, FAST_LINK, False)[1]
    firsts = [tp_chooser._solve_layer(p, {}, "time", ShardingOptions())[0] for p in problems]
    assert {str(problems[i].options[n][c].out) for i in (0, 1)
            for n, c in firsts[i].items() if n.op == "get_attr"} == {"Shard(0)", "Replicate()"}
    with pytest.raises(tp_chooser.PinInfeasible, match="layer scaled"):
        tp_chooser._solve_layer(problems[1], {"w": Shard(0)}, "time", ShardingOptions())
    assert alone == {"head": (("w", "Replicate()"),), "scaled": (("w", "Replicate()"),)}


def test_a_layer_whose_search_finds_nothing_in_its_work_stays_replicated(monkeypatch):
    limit = ShardingOptions(work_limit=7.0, seed=5)

    class OutOfWork(tp_chooser.cp_model.CpSolver):
        def solve(self, model, *args):
            if self.parameters.random_seed == limit.seed:   # the search's own solves
                self.parameters.max_deterministic_time = 0.0
                super().solve(model, *args)
                return tp_chooser.cp_model.UNKNOWN
            return super().solve(model, *args)

    monkeypatch.setattr(tp_chooser.cp_model, "CpSolver", OutOfWork)
    sharding = choose(mlp_layer(), 2, FAST_LINK, options=limit)
    assert {out for _, out in picked(sharding).values()} == {"Replicate()"}
    assert sharding.layers[0].collectives == ()


def _gpt_with_loss(loss_fn, vocab: int = 256):
    from partc.passes.pipeline import analyze
    from samples.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=vocab, block_size=8))
    ids = torch.zeros(2, 8, dtype=torch.long)
    gm, _ = analyze(model, (ids,), loss_fn=loss_fn, example_target=ids.clone(), name="gpt")
    return gm


def _loss_node(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in gm.graph.nodes if meta.role(n) == meta.ROLE_LOSS)


def test_the_loss_reads_the_heads_class_shards_where_it_is_a_cross_entropy():
    from samples.gpt import loss_fn

    gm = _gpt_with_loss(loss_fn)
    sharding = choose(gm, 2, FAST_LINK)
    loss = _loss_node(gm)
    logits = loss.args[0]
    assert meta.vocab_sharded(loss, 2) == 0
    assert sharding.boundary[logits] == Shard(2)
    assert sharding.strategy[loss].name == "vocab-parallel"
    assert sharding.strategy[loss].ins == (Shard(2), REPLICATE)
    (layer,) = [layer for layer in sharding.layers if layer.name == "loss"]
    # Its two forward all-reduces (per position: the maximum; the sum of exponentials and
    # the target's logit), and no gather of the logits anywhere.
    assert [(c.kind, c.phase, c.bytes) for c in layer.collectives] == [
        ("all_reduce", "forward", 4 * 16), ("all_reduce", "forward", 8 * 16)]
    assert not any(c.kind == "all_gather" and c.bytes == meta.run_bytes(logits)
                   for layer in sharding.layers for c in layer.collectives)


def test_a_loss_that_is_no_plain_cross_entropy_gets_the_logits_whole():
    def entropy_bonus(logits, target):
        probs = logits.softmax(-1)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1)) \
            + (probs * probs.log()).sum(-1).mean()

    gm = _gpt_with_loss(entropy_bonus)
    sharding = choose(gm, 2, FAST_LINK)
    loss = _loss_node(gm)
    assert meta.vocab_probed(loss, 2) and meta.vocab_sharded(loss, 2) is None
    assert sharding.boundary[loss.args[0]] == REPLICATE
    assert [s.name for s in tp_chooser._LayerProblem(
        gm, meta.layers(gm)[meta.layer(loss).index], 2, FAST_LINK, sharding.boundary,
        set(), tp_chooser.ChunkHints.of(gm)).options[loss]] == ["replicate"]
    # 256 classes do not split 3 ways: no probe can accept them.
    assert tp_chooser.probe_loss(_gpt_with_loss(lambda x, t: F.cross_entropy(
        x.flatten(0, 1), t.flatten())), 3) is None


def test_both_objectives_can_share_the_layer_problems():
    """The layer problems made once for a group (the pipeline's tensor-parallel options
    make them once for both objectives) give each objective the pick it makes alone."""
    gm = mlp_layer()
    shared = tp_chooser.layer_problems(gm, 2, FAST_LINK, False)
    for prefer in ("time", "memory"):
        alone = choose(gm, 2, FAST_LINK, prefer=prefer)
        reused = choose(gm, 2, FAST_LINK, prefer=prefer, problems=shared)
        assert (reused.layers, reused.strategy, reused.boundary) == \
            (alone.layers, alone.strategy, alone.boundary)


def test_a_layer_of_a_thousand_nodes_is_proven(caplog, monkeypatch):
    """Qwen 3.5's gated delta rule unrolls a 63-step loop into about 1,000 nodes. CP-SAT's
    default linearization stopped at the work limit there with a 17-50% gap (and picks
    up to 21% slower); after a tenth of a second of work (a layer this large) the fuller
    one takes over and proves the pick, for both objectives, the same optimum it proves
    alone or after a whole second."""
    from partc.passes.pipeline import analyze
    from tests.hf_families import FAMILIES, batch, loss_for

    family = FAMILIES["qwen3_5"]
    model = family.build()
    inputs, target = batch(family.data, model, 2, 16, torch.Generator().manual_seed(0))
    gm, _ = analyze(model, inputs, loss_fn=loss_for(family.data), example_target=target)
    layer = next(info for info in meta.layers(gm) if info.name == "model.layers.0")
    assert len(tp_chooser.layer_nodes(gm, layer)) > 500
    link = Link(group=Group(ranks=2, bandwidth=25e9, latency_s=1e-6), flops=1e13,
                hbm_bandwidth=1e12)
    values = {}
    solve_layer = tp_chooser._solve_layer

    def kept(problem, pins, prefer, options):
        pick, value = solve_layer(problem, pins, prefer, options)
        values.setdefault(problem.info.name, []).append(value)
        return pick, value

    monkeypatch.setattr(tp_chooser, "_solve_layer", kept)
    with caplog.at_level("WARNING", logger="partc"):
        for prefer in ("time", "memory"):
            choose(gm, 2, link, prefer=prefer)
    assert "work limit" not in caplog.text
    fuller = values.pop("model.layers.0")
    # The fuller linearization alone, from the start, and after a whole second at the
    # default one (as layers of up to _LARGE_LAYER nodes are solved): the same optima.
    for first in (0.0, tp_chooser._DEFAULT_LP_WORK):
        monkeypatch.setattr(tp_chooser, "_DEFAULT_LP_WORK", first)
        monkeypatch.setattr(tp_chooser, "_LARGE_LP_WORK", first)
        values.clear()
        for prefer in ("time", "memory"):
            choose(gm, 2, link, prefer=prefer)
        assert values["model.layers.0"] == fuller
