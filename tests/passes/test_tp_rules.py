"""The tensor-parallel strategy rules, on tiny hand-built graphs: each node's strategies
follow from its op and shapes (``node.meta["val"]``) alone."""

import operator

import torch
import torch.nn.functional as F
from torch import fx

from partc.passes.tp.rules import ChunkHints, Strategy, redistribute, strategies
from partc.placement import PARTIAL, REPLICATE, Shard

R, P = REPLICATE, PARTIAL


class Builder:
    """An fx graph whose nodes carry the fake values the rules read."""

    def __init__(self) -> None:
        self.graph = fx.Graph()
        self.params: dict[str, torch.Tensor] = {}

    def input(self, name: str, *shape: int, dtype: torch.dtype = torch.float32) -> fx.Node:
        return self._val(self.graph.placeholder(name), torch.empty(shape, dtype=dtype))

    def param(self, name: str, *shape: int) -> fx.Node:
        self.params[name] = torch.empty(shape)
        return self._val(self.graph.get_attr(name), self.params[name])

    def module(self, result: fx.Node) -> fx.GraphModule:
        self.graph.output(result)
        return fx.GraphModule(self.params, self.graph)

    def call(self, target, *args, **kwargs) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        fake = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
        return self._val(node, target(*fake, **kwargs))

    def method(self, name: str, *args) -> fx.Node:
        node = self.graph.call_method(name, args)
        fake = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
        return self._val(node, getattr(fake[0], name)(*fake[1:]))

    @staticmethod
    def _val(node: fx.Node, value) -> fx.Node:
        node.meta["val"] = value.to("meta") if isinstance(value, torch.Tensor) else \
            tuple(v.to("meta") for v in value)
        return node


def placements(found: list[Strategy]) -> list[tuple]:
    return [(s.name, s.out, s.ins) for s in found]


def test_a_linear_is_replicated_column_parallel_or_row_parallel():
    g = Builder()
    x, w, b = g.input("x", 4, 8, 16), g.param("w", 32, 16), g.param("b", 32)
    y = g.call(F.linear, x, w, b)
    # Inputs in order x, w, b. Column-parallel splits the weight's rows (its outputs) and
    # the bias with them; row-parallel its columns, leaving partial sums.
    assert placements(strategies(y, 2, ChunkHints())) == [
        ("replicate", R, (R, R, R)),
        ("column-parallel", Shard(2), (R, Shard(0), Shard(0))),
        ("row-parallel", P, (Shard(2), Shard(1), R)),
    ]
    # 16 inputs split over 32 ranks is not even: column-parallel only at tp=32.
    assert [s.name for s in strategies(y, 32, ChunkHints())] == ["replicate", "column-parallel"]
    assert [s.name for s in strategies(y, 64, ChunkHints())] == ["replicate"]


def test_a_view_carries_a_shard_into_the_dim_it_becomes():
    g = Builder()
    x = g.input("x", 4, 8, 32)
    heads = g.method("view", x, 4, 8, 4, 8)   # (batch, seq, heads, head dim)
    found = placements(strategies(heads, 2, ChunkHints()))
    assert ("shard dim 1", Shard(1), (Shard(1),)) in found   # the sequence stays dim 1
    assert ("shard dim 2", Shard(2), (Shard(2),)) in found   # the width becomes the heads
    assert ("partial", P, (P,)) in found
    # Never the batch, and never the head dim, which is not the first of its block.
    assert all(s.out not in (Shard(0), Shard(3)) for s in strategies(heads, 2, ChunkHints()))


def test_a_transpose_moves_the_shard_with_its_dim():
    g = Builder()
    x = g.input("x", 4, 8, 6, 16)
    moved = g.method("transpose", x, 1, 2)
    found = placements(strategies(moved, 2, ChunkHints()))
    assert ("shard dim 1", Shard(1), (Shard(2),)) in found
    assert ("shard dim 2", Shard(2), (Shard(1),)) in found


def test_a_pad_keeps_a_shard_on_the_dims_it_leaves_alone():
    g = Builder()
    x = g.input("x", 4, 8, 6, 16)   # (batch, heads, seq, features)
    padded = g.call(F.pad, x, [0, 8, 1, 0])   # features, then one row in front
    found = placements(strategies(padded, 2, ChunkHints()))
    assert ("shard dim 1", Shard(1), (Shard(1),)) in found
    assert all(s.out not in (Shard(2), Shard(3)) for s in strategies(padded, 2, ChunkHints()))


def test_an_embedding_can_be_vocabulary_parallel_or_split_by_columns():
    g = Builder()
    ids, table = g.input("ids", 4, 8, dtype=torch.long), g.param("table", 128, 16)
    out = g.call(F.embedding, ids, table)
    assert placements(strategies(out, 2, ChunkHints())) == [
        ("replicate", R, (R, R)),
        ("vocab-parallel", P, (R, Shard(0))),        # each rank looks up its rows, sums
        ("column-parallel", Shard(2), (R, Shard(1))),
    ]


def test_elementwise_ops_keep_shared_shards_and_broadcast_dims_replicated():
    g = Builder()
    x, scale = g.input("x", 4, 8, 16), g.param("scale", 16)
    y = g.call(operator.mul, x, scale)
    found = placements(strategies(y, 2, ChunkHints()))
    assert ("shard dim 1", Shard(1), (Shard(1), R)) in found   # scale has no dim 1
    assert ("shard dim 2", Shard(2), (Shard(2), Shard(0))) in found
    assert all(s.out != P for s in strategies(y, 2, ChunkHints()))  # x * scale is bilinear


def test_logits_keep_their_vocabulary_shard_through_scales_caps_and_biases():
    """After a column-parallel LM head: Cohere's ``logits * scale``, Gemma-2's
    ``tanh(logits / cap) * cap`` and BART's ``logits + final_logits_bias`` (1, vocab),
    as fx and as torch.export write them, keep the shard of the vocabulary dim."""
    aten = torch.ops.aten
    for mul, div, tanh, add in [(operator.mul, operator.truediv, torch.tanh, operator.add),
                                (aten.mul.Tensor, aten.div.Tensor, aten.tanh.default,
                                 aten.add.Tensor)]:
        g = Builder()
        x, w, bias = g.input("x", 4, 8, 16), g.param("w", 32, 16), g.param("bias", 1, 32)
        logits = g.call(F.linear, x, w)
        assert ("column-parallel", Shard(2), (R, Shard(0))) in \
            placements(strategies(logits, 2, ChunkHints()))
        scaled = g.call(mul, logits, 0.0625)
        capped = g.call(mul, g.call(tanh, g.call(div, scaled, 30.0)), 30.0)
        biased = g.call(add, capped, bias)
        for node in (scaled, capped, capped.args[0], capped.args[0].args[0]):
            assert ("shard dim 2", Shard(2), (Shard(2),)) in \
                placements(strategies(node, 2, ChunkHints()))
        assert ("shard dim 2", Shard(2), (Shard(2), Shard(1))) in \
            placements(strategies(biased, 2, ChunkHints()))


def test_an_op_without_a_rule_stays_replicated():
    g = Builder()
    x = g.input("x", 4, 8, 16)
    y = g.call(torch.cumsum, x, 1)
    assert placements(strategies(y, 2, ChunkHints())) == [("replicate", R, (R,))]


def test_split_hints_shard_each_piece_of_a_fused_projection():
    g = Builder()
    x, w = g.input("x", 4, 8, 16), g.param("w", 48, 16)
    qkv = g.call(F.linear, x, w)
    pieces = g.call(torch.split, qkv, 16, 2)
    q = g.call(operator.getitem, pieces, 0)
    hints = ChunkHints.of(g.module(q))
    assert dict(hints.pieces) == {qkv: frozenset({3})}
    # Without the hint only the whole output can be split; with it, each of q, k and v.
    assert Shard(0, 3) not in {s.ins[1] for s in strategies(qkv, 2, ChunkHints())}
    column = [s for s in strategies(qkv, 2, hints) if s.out == Shard(2, 3)]
    assert placements(column) == [("column-parallel", Shard(2, 3), (R, Shard(0, 3)))]
    assert ("shard dim 2 per piece", Shard(2), (Shard(2, 3),)) in \
        placements(strategies(pieces, 2, hints))


def test_redistribute_names_the_collectives_both_ways():
    assert redistribute(R, R, grad_partial=False) == ()
    assert redistribute(R, Shard(1), grad_partial=False) == (("all_gather", "backward"),)
    assert redistribute(P, R, grad_partial=False) == (("all_reduce", "forward"),)
    assert redistribute(P, R, grad_partial=True) == \
        (("all_reduce", "forward"), ("all_reduce", "backward"))
    assert redistribute(P, Shard(1), grad_partial=False) == \
        (("reduce_scatter", "forward"), ("all_gather", "backward"))
    assert redistribute(Shard(1), R, grad_partial=True) == \
        (("all_gather", "forward"), ("reduce_scatter", "backward"))
    assert redistribute(R, R, grad_partial=True) == (("all_reduce", "backward"),)
    assert redistribute(Shard(1), Shard(2), grad_partial=False) is None
    assert redistribute(R, P, grad_partial=False) is None
