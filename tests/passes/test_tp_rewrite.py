"""The tensor-parallel rewrite on tiny graphs: a stack of two-linear MLP blocks (Megatron's
column-then-row pair) and an embedding followed by a linear head, each sharded for tp=2
by the chooser, rewritten, and checked on the printed graph, ``node.meta`` and the
parameters' local shapes; run on the rewrite's stand-in group (rank 0 of 2, no data
moved)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import fx, nn

from partc import meta
from partc.cost.collectives import Group
from partc.passes.tp import chooser as tp_chooser
from partc.passes.estimate import estimate
from partc.passes.helpers.graph import (aliases_input, op_name, storage_of,
                                        writes_read_later)
from partc.passes.layers import layers
from partc.passes.propagate import propagate
from partc.passes.tp.rewrite import GROUP, copy_module, fuse_rings, tp_rewrite
from partc.passes.trace import trace
from partc.runtime.tp import TensorParallelGroup, bind_group
from tests import models

LINK = tp_chooser.Link(group=Group(ranks=2, bandwidth=1e11, latency_s=1e-6), flops=1e12,
                     hbm_bandwidth=1e11)


class Stack(nn.Module):
    """Two MLP blocks (8 → 16 → 8): each block is one layer."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([models.MLP(8, 16, 8) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class EmbeddingHead(nn.Module):
    """A 32-word embedding 7 wide (odd: only its vocabulary can be split) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 7)
        self.head = nn.Linear(7, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


class GatedBlock(nn.Module):
    """Three linears reading one normed input (as a Llama's q, k, v or gate and up), and
    an output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.q, self.k = nn.Linear(16, 32), nn.Linear(16, 32)
        self.v = nn.Linear(16, 32, bias=False)
        self.o = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.o(self.q(h) * torch.sigmoid(self.k(h)) + self.v(h))


class GatedStack(nn.Module):
    """An embedding, two ``block``s and a head."""

    def __init__(self, block: type[nn.Module] = GatedBlock) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList([block() for _ in range(2)])
        self.head = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _rewritten(model: nn.Module, example: torch.Tensor, sequence_parallel: bool = False
               ) -> tuple[fx.GraphModule, tp_chooser.Sharding]:
    """``model`` traced and measured, sharded for tp=2 (fewest parameter bytes first),
    then a copy rewritten for one rank with fresh fake values."""
    gm, ctx = trace(model, (example,))
    for run in (propagate, layers, estimate):
        gm = run(gm, ctx)
    chosen = tp_chooser.choose(gm, 2, LINK, sequence_parallel=sequence_parallel,
                               prefer="memory")
    local, moved = copy_module(gm, chosen)
    tp_rewrite(local, dataclasses.replace(ctx, sharding=moved))
    propagate(local, ctx)
    return local, chosen


def _nodes(gm: fx.GraphModule) -> dict[str, fx.Node]:
    return {node.name: node for node in gm.graph.nodes}


@pytest.fixture(scope="module")
def stack() -> tuple[Stack, fx.GraphModule, tp_chooser.Sharding]:
    torch.manual_seed(0)
    model = Stack()
    gm, chosen = _rewritten(model, torch.randn(4, 8))
    return model, gm, chosen


def test_mlp_blocks_are_column_then_row_parallel(stack):
    _, _, chosen = stack
    for layer in chosen.layers:
        assert dict(layer.params) == {
            f"{layer.name}.fc1.weight": "Shard(0)", f"{layer.name}.fc1.bias": "Shard(0)",
            f"{layer.name}.fc2.weight": "Shard(1)", f"{layer.name}.fc2.bias": "Replicate()"}


def test_parameters_become_this_ranks_shards(stack):
    model, gm, _ = stack
    block = gm.get_submodule("blocks.0")
    assert block.fc1.weight.shape == (8, 8)  # half of the column-parallel weight's 16 rows
    assert block.fc1.bias.shape == (8,)
    assert block.fc2.weight.shape == (8, 8)  # half of the row-parallel weight's 16 columns
    assert block.fc2.bias.shape == (8,)      # replicated
    # Rank 0's rows, as narrow_param stands them in.
    torch.testing.assert_close(block.fc1.weight, model.blocks[0].fc1.weight[:8])


def test_the_group_is_a_submodule_read_once_per_layer(stack):
    _, gm, _ = stack
    group = gm.get_submodule(GROUP)
    assert isinstance(group, TensorParallelGroup)
    assert (group.size, group.rank, group.simulated) == (2, 0, True)
    reads = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == GROUP]
    assert [meta.layer(n).name for n in reads] == ["blocks.0", "blocks.1"]
    for read in reads:
        assert all(meta.layer(user) == meta.layer(read) for user in read.users)
        assert all(user.op == "call_method" and user.args[0] is read for user in read.users)
    # The layers list the new nodes in graph order.
    names = meta.layers(gm)[0].nodes
    assert names.index("tp") < names.index("reduce_from_tp") == len(names) - 1


def test_collectives_are_inserted_where_placements_change(stack):
    _, gm, _ = stack
    code = gm.code
    # Block 0: the row-parallel linear adds bias / 2 on each rank; its partial sums are
    # all-reduced. Block 1 reads a value that carries a gradient: copy_to_tp in front of
    # its column-parallel linear all-reduces that gradient in backward.
    assert "truediv = blocks_0_fc2_bias / 2" in code
    assert "reduce_from_tp = tp.reduce_from_tp(linear_1)" in code
    assert "copy_to_tp = tp_1.copy_to_tp(reduce_from_tp)" in code
    assert "reduce_from_tp_1 = tp_1.reduce_from_tp(linear_3)" in code
    nodes = _nodes(gm)
    assert list(nodes["linear_1"].users) == [nodes["reduce_from_tp"]]
    assert meta.layer(nodes["reduce_from_tp"]).name == "blocks.0"
    # Local shapes: the hidden activations are half wide, the block outputs whole.
    assert nodes["relu"].meta["val"].shape == (4, 8)
    assert nodes["reduce_from_tp"].meta["val"].shape == (4, 8)


def test_rewritten_stack_runs_as_rank_0_of_a_stand_in_group(stack):
    model, gm, _ = stack
    x = torch.randn(4, 8)
    # The stand-in moves no data: each all-reduce returns rank 0's partial sum.
    expected = x
    for block in model.blocks:
        hidden = torch.relu(nn.functional.linear(expected, block.fc1.weight[:8],
                                                 block.fc1.bias[:8]))
        expected = nn.functional.linear(hidden, block.fc2.weight[:, :8], block.fc2.bias / 2)
    torch.testing.assert_close(gm(x), expected)


def test_vocabulary_parallel_embedding_and_column_parallel_head():
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (4, 6))
    gm, chosen = _rewritten(EmbeddingHead(), ids)
    assert dict(p for layer in chosen.layers for p in layer.params) == {
        "emb.weight": "Shard(0)", "head.weight": "Shard(0)", "head.bias": "Shard(0)"}
    assert gm.emb.weight.shape == (16, 7) and gm.head.weight.shape == (16, 7)
    code = gm.code
    assert "embedding = tp.vocab_parallel_embedding(ids, emb_weight, -1)" in code
    assert "reduce_from_tp = tp.reduce_from_tp(embedding)" in code
    assert "gather_from_tp = tp_1.gather_from_tp(linear, 2)" in code
    nodes = _nodes(gm)
    assert nodes["embedding"].meta["val"].shape == (4, 6, 7)  # a partial sum, whole
    assert nodes["linear"].meta["val"].shape == (4, 6, 16)    # this rank's 16 words
    assert nodes["gather_from_tp"].meta["val"].shape == (4, 6, 32)
    assert gm(ids).shape == (4, 6, 32)


def test_each_rewrite_has_its_own_group_and_counts():
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    first, _ = _rewritten(Stack(), x.detach())
    second, _ = _rewritten(Stack(), x.detach())
    assert first.get_submodule(GROUP) is not second.get_submodule(GROUP)
    group = TensorParallelGroup(2)
    bind_group(first, group)
    assert first.get_submodule(GROUP) is group
    others = dict(second.get_submodule(GROUP).counts)  # propagate's run, on fake tensors
    first(x).sum().backward()
    # Forward: one all-reduce per block; backward: block 1's copy_to_tp all-reduces.
    assert group.counts == {"all_reduce": 3}
    assert second.get_submodule(GROUP).counts == others
    with pytest.raises(ValueError, match="group of 2, not 4"):
        bind_group(second, TensorParallelGroup(4))


def test_a_parameter_read_by_several_layers_has_one_placement_for_every_read():
    # The layers reading position.weight share one solve though only the first holds
    # its get_attr; every read must find the weight as the parameter's one placement.
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (4, 8))
    model = models.SharedEmbedding(vocab=32, seq=8, depth=2)
    gm, chosen = _rewritten(model, ids)
    readers = [layer for layer in chosen.layers if layer.name.startswith("position")]
    assert len(readers) == 2
    weight = next(node for node in chosen.strategy if node.op == "get_attr"
                  and meta.params(node) == ("position.weight",))
    uses = [chosen.strategy[user].ins[1] for user in weight.users]
    assert len(uses) == 2 and set(uses) == {chosen.placement(weight)}
    assert gm(ids).shape == (4, 8, 32)


def test_sequence_parallel_collectives_are_fused_with_the_linears_beside_them():
    # The gather of a block's normed input and the three linears reading it become one
    # linears_of_gathered (an output per linear, read by getitem where the linears
    # were); the output projection and the reduce-scatter after it, one
    # linear_reduce_scatter. Nothing of the block is gathered or reduce-scattered apart.
    torch.manual_seed(0)
    gm, _ = _rewritten(GatedStack(), torch.randint(0, 32, (2, 8)), sequence_parallel=True)
    nodes = _nodes(gm)
    for index, (fused, out) in enumerate((("linears_of_gathered", "linear_3"),
                                          ("linears_of_gathered_1", "linear_7"))):
        block = f"blocks.{index}"
        in_block = [n for n in gm.graph.nodes if meta.LAYER in n.meta
                    and meta.layer(n).name == block]
        assert not [n.target for n in in_block if n.target in ("gather_from_tp",
                                                                 "reduce_scatter_to_tp")]
        gathered = nodes[fused]
        assert meta.layer(gathered).name == block
        weights, biases = gathered.args[2], gathered.args[3]
        assert [w.target for w in weights] == [f"{block}.{m}.weight" for m in "qkv"]
        assert [b.target if b is not None else None for b in biases] == [
            f"{block}.q.bias", f"{block}.k.bias", None]
        readers = sorted(gathered.users, key=lambda n: n.args[1])
        assert [r.args[1] for r in readers] == [0, 1, 2]
        # The whole sequence, half the features; the projection's shard of the sequence.
        assert readers[0].meta["val"].shape == (2, 8, 16)
        scattered = nodes[out]
        assert scattered.target == "linear_reduce_scatter"
        assert scattered.meta["val"].shape == (2, 4, 16)


def _scattered_head(dim: int) -> fx.GraphModule:
    """A linear (8 → 16 features on (2, 8, 8) inputs) reduce-scattered along ``dim``, as
    the rewrite leaves it before fusing: the sequence (1) or the features (2, -1: a
    vocabulary-parallel head's output)."""
    root = nn.Module()
    root.add_module(GROUP, TensorParallelGroup(2))
    root.weight = nn.Parameter(torch.randn(16, 8))
    graph = fx.Graph()
    x = graph.placeholder("x")
    group, weight = graph.get_attr(GROUP), graph.get_attr("weight")
    linear = graph.call_function(torch.nn.functional.linear, (x, weight))
    scattered = graph.call_method("reduce_scatter_to_tp", (group, linear, dim))
    graph.output(scattered)
    linear.meta["val"] = torch.empty(2, 8, 16, device="meta")
    for node in (linear, scattered):
        meta.set_layer(node, meta.LayerRef(0, "head"))
    return fx.GraphModule(root, graph)


@pytest.mark.parametrize("dim, fused", [(1, True), (2, False), (-1, False)])
def test_a_ring_cuts_rows_never_the_features_a_linear_maps(dim, fused):
    # ELECTRA's masked-LM head reduce-scattered by class ran as a ring that cut its
    # input's features: "mat1 and mat2 shapes cannot be multiplied".
    gm = _scattered_head(dim)
    fuse_rings(gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_method"]
    assert targets == (["linear_reduce_scatter"] if fused else ["reduce_scatter_to_tp"])


def test_without_sequence_parallelism_norms_and_residuals_stay_whole():
    # Megatron's plain tensor parallelism: each block's row-parallel output is
    # all-reduced and its norm and residual run on the whole sequence. On a fast link the
    # fastest pick would otherwise reduce-scatter the output, run the residual and norm
    # on sequence shards and gather them again: sequence parallelism inside the layer,
    # under a plan that says it is off.
    torch.manual_seed(0)
    fast = tp_chooser.Link(group=Group(ranks=2, bandwidth=1e12, latency_s=1e-7),
                           flops=1e12, hbm_bandwidth=1e11)
    gm, ctx = trace(GatedStack(), (torch.randint(0, 32, (2, 64)),))
    for run in (propagate, layers, estimate):
        gm = run(gm, ctx)
    chosen = tp_chooser.choose(gm, 2, fast, sequence_parallel=False, prefer="time")
    blocks = {layer.name: sorted((c.kind, c.phase) for c in layer.collectives)
              for layer in chosen.layers if layer.name.startswith("blocks.")}
    assert blocks == {name: [("all_reduce", "backward"), ("all_reduce", "forward")]
                      for name in ("blocks.0", "blocks.1")}
    local, moved = copy_module(gm, chosen)
    tp_rewrite(local, dataclasses.replace(ctx, sharding=moved))
    propagate(local, ctx)
    assert "reduce_scatter_to_tp" not in local.code and "scatter_to_tp" not in local.code
    assert local.code.count(".reduce_from_tp(") == 2  # the all-reduces, one per block
    norms = [n for n in local.graph.nodes if op_name(n) == "layer_norm"]
    assert len(norms) == 2 and all(n.meta["val"].shape == (2, 64, 16) for n in norms)


class WrittenBlock(nn.Module):
    """A block whose activation is written in place before the block returns it (the
    random models' ``gelu`` then ``relu_``): the value the next block reads is the
    written one."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.fc(x))
        h.relu_()
        return h


def test_a_value_leaves_its_layer_after_the_in_place_writes_to_it():
    # Under sequence parallelism the block's output is brought to its sequence shard by
    # a collective, a copy: made right after gelu, it held the value before relu_, and
    # every later layer trained on that (a random model's loss 5e-5 off one process).
    torch.manual_seed(0)
    gm, _ = _rewritten(GatedStack(WrittenBlock), torch.randint(0, 32, (2, 8)), sequence_parallel=True)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for index in range(2):
        block = f"blocks.{index}"
        written = next(n for n in gm.graph.nodes if op_name(n) == "relu_"
                       and meta.layer(n).name == block)
        storage = storage_of(written.args[0], aliases_input)
        leaving = {a for n in gm.graph.nodes if meta.LAYER in n.meta
                   and meta.layer(n).name != block for a in n.all_input_nodes
                   if meta.LAYER in a.meta and meta.layer(a).name == block}
        assert leaving
        for value in leaving:  # the written value itself, or what was made of it after
            assert storage_of(value, aliases_input) is storage or order[value] > order[written], (
                f"{value.name} leaves {block} before {written.name} writes it:\n{gm.code}")


class WrittenResidual(nn.Module):
    """A projection's output written in place by a sum with the block's input, then read
    by a second projection: the write must land on the value the projection reads."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h.add_(x)
        return self.out(h)


def test_an_in_place_op_writes_the_value_it_reads_never_a_moved_copy():
    # Megatron's column-then-row pair would keep fc's output sharded by features for
    # ``out``, and bring it whole (a gathered copy) to the add_ with the replicated
    # input: the sum would land on the copy and ``out`` would read fc's output without it.
    torch.manual_seed(0)
    gm, chosen = _rewritten(GatedStack(WrittenResidual), torch.randint(0, 32, (2, 8)),
                            sequence_parallel=True)
    writes = [n for n in chosen.strategy if op_name(n) == "add_"]
    assert len(writes) == 2
    for node in writes:
        producer = node.args[0]
        assert chosen.strategy[node].ins[0] == chosen.placement(producer), node.name
    local_writes = [n for n in gm.graph.nodes if op_name(n) == "add_"]
    for node in local_writes:  # the rewritten add_ writes fc's value, read by ``out``
        written = node.args[0]
        assert written.op == "call_function" or written.target not in (
            "gather_from_tp", "scatter_to_tp", "reduce_from_tp", "copy_to_tp"), gm.code


class ReadBeforeAndAfter(nn.Module):
    """A value read by one projection, written in place, then read by another."""

    def __init__(self) -> None:
        super().__init__()
        self.p, self.q = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        y = self.p(h)
        h.relu_()
        return y + self.q(h)


def test_a_move_is_not_shared_across_an_in_place_write():
    # Both projections read ``h`` moved to the same placement (row-parallel: sliced by
    # features): one move would serve both but for relu_ between them, which the second
    # must see.
    torch.manual_seed(0)
    gm, _ = _rewritten(GatedStack(ReadBeforeAndAfter), torch.randint(0, 32, (2, 8)),
                       sequence_parallel=True)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for index in range(2):
        block = [n for n in gm.graph.nodes if meta.LAYER in n.meta
                 and meta.layer(n).name == f"blocks.{index}"]
        written = next(n for n in block if op_name(n) == "relu_")
        moves = [n for n in block if n.op == "call_method" and len(n.args) > 1
                 and getattr(n.args[0], "target", None) == GROUP
                 and n.args[1] is written.args[0]]
        assert sorted(order[n] > order[written] for n in moves) == [False, True], gm.code


def _read_on(x: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x)
    h.relu_()
    return h * 2


def _result_read_on(x: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x)
    return nn.functional.relu(h, inplace=True) * 2


def _view_read_on(x: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x)
    flat = h.view(-1)
    h.relu_()
    return flat * 2


@pytest.mark.parametrize("forward, must_land", [
    (_read_on, True), (_result_read_on, False), (_view_read_on, True)])
def test_a_write_must_land_on_its_value_only_where_the_value_is_read_after_it(
        forward, must_land):
    # Where only the write's result is read on (nn.ReLU(inplace=True) as a random
    # model's block has it), the chooser may move the value to the write: a write to
    # the copy computes the same. Forbidding that too left a ring's output (a view a
    # custom Function made) written in place, which autograd refuses.
    gm = fx.symbolic_trace(forward)
    found = {(writer.name, value.name) for writer, value in writes_read_later(gm)}
    writer = next(n.name for n in gm.graph.nodes if "relu" in n.name)
    assert found == ({(writer, "tanh")} if must_land else set())
def test_gpt2_conv1d_products_run_as_rings_like_linears():
    # GPT-2's Conv1D is addmm(bias, x.view(-1, in), weight) with an (in, out) weight: as
    # the linear it is (weight.t()), the gather before c_attn and c_fc and the
    # reduce-scatter after each c_proj run as rings beside the matmuls; nothing of the
    # block is gathered, copied (copy_to_tp's all-reduce) or reduce-scattered apart.
    torch.manual_seed(0)
    gm, _ = _rewritten(models.gpt2(n_layer=1, dropout=0.0), torch.randint(0, 64, (2, 16)),
                       sequence_parallel=True)
    in_block = [n for n in gm.graph.nodes if meta.LAYER in n.meta
                and meta.layer(n).name.endswith("h.0") and n.op == "call_method"]
    targets = [n.target for n in in_block]
    assert targets.count("linears_of_gathered") == 2, targets
    assert targets.count("linear_reduce_scatter") == 2, targets
    assert not {"gather_from_tp", "copy_to_tp", "reduce_scatter_to_tp",
                "addmm_of_gathered"} & set(targets)
    weights = [w.args[0].target for n in in_block if n.target == "linears_of_gathered"
               for w in n.args[2]]
    assert [w.rsplit(".", 2)[-2] for w in weights] == ["c_attn", "c_fc"]
