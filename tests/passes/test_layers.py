import pytest
import torch

import partc
from partc import meta
from partc.passes import analyze
from partc.passes.layers import _LayerKeyer
from tests import models


def names(analysis):
    return [layer.name for layer in analysis.layers]


def test_layer_keys_descend_only_towards_repeated_containers():
    keyer = _LayerKeyer(models.gpt2())
    assert keyer.key("transformer.h.3.attn.c_attn") == "transformer.h.3"
    assert keyer.key("transformer.wte") == "transformer.wte"
    assert keyer.key("transformer") is None
    assert keyer.key("lm_head") == "lm_head"
    assert keyer.key("") is None


def test_mlp_layers_and_crossing_bytes():
    gm, analysis = analyze(models.MLP(), (torch.randn(2, 8),))
    assert names(analysis) == ["fc1", "fc2"]
    # relu is a root-level function: it joins the layer in progress.
    relu = next(n for n in gm.graph.nodes if n.name == "relu")
    assert meta.layer(relu) == meta.LayerRef(0, "fc1")
    assert analysis.cut_bytes == (16 * 4.0,)  # relu output, per sample


def test_skip_connection_crosses_every_boundary_it_jumps():
    _, analysis = analyze(models.LongSkip(), (torch.randn(2, 8),))
    assert names(analysis) == ["stem", "blocks.0", "blocks.1", "blocks.2", "head"]
    row = 8 * 4.0
    # stem's output feeds blocks.0 and the add at the end of blocks.2.
    assert analysis.cut_bytes == (row, 2 * row, 2 * row, row)


def test_module_called_twice_is_two_layers_sharing_parameters():
    _, analysis = analyze(models.CalledTwice(), (torch.randn(2, 8),))
    assert names(analysis) == ["shared", "middle", "shared#2"]
    assert analysis.layers[0].signature == analysis.layers[2].signature
    shared = {s.name: s for s in analysis.shared}
    assert shared["shared.weight"].layers == (0, 2)
    assert analysis.layers[0].param_count == 0  # held as shared, not by one layer


@pytest.mark.parametrize("pins", [{}, {"tp": 2, "tp_objective": "memory"}])
def test_a_module_called_twice_in_a_row_compiles_with_or_without_tensor_parallelism(pins):
    """Both calls are layers of their own (graph cuts) reading one weight: the chooser
    finds a placement both can meet, never INFEASIBLE, whether tp is asked for or not.
    Parity under tp=2: the worker case ``twice-tp2``."""
    program = partc.compile(
        models.CalledTwiceInARow(width=16), torch.randn(8, 16),
        loss_fn=lambda out, target: ((out - target) ** 2).mean(),
        example_target=torch.randn(8, 16),
        budget=partc.DeviceBudget(num_devices=2, device="CPU"),
        train=partc.TrainSpec(global_batch_size=8, optimizer="sgd"),
        constraints=partc.Constraints(**pins))
    tp = program.plan.tensor_parallel
    if pins:
        assert tp is not None and tp.params["shared.weight"].kind == "S"
    assert len(program.plan.stages[0].layers) == 3  # shared.0, shared.1, loss


def test_root_level_model_is_split_at_single_tensor_cuts():
    gm, analysis = analyze(models.Flat(), (torch.randn(2, 8),))
    assert names(analysis) == ["root.0", "root.1", "root.2"]
    by_layer = {}
    for node in gm.graph.nodes:
        if node.op.startswith("call_"):
            by_layer.setdefault(meta.layer(node).name, []).append(node.name)
    assert by_layer == {"root.0": ["matmul", "tanh"],
                        "root.1": ["matmul_1", "relu", "add"],
                        "root.2": ["matmul_2", "sum_1"]}
    assert analysis.cut_bytes == (32.0, 32.0)


def test_repeated_blocks_share_a_signature_and_layers_are_in_order():
    gm, analysis = analyze(models.LongSkip(depth=4), (torch.randn(2, 8),))
    sigs = [l.signature for l in analysis.layers]
    assert sigs[1] == sigs[2]  # blocks.0 and blocks.1: same ops, shapes, relative params
    layers = meta.layers(gm)
    assert [info.index for info in layers] == list(range(len(layers)))
    indices = [meta.layer(n).index for n in gm.graph.nodes if n.op.startswith("call_")]
    assert indices == sorted(indices)


def test_an_in_place_activation_joins_the_layer_it_writes_to():
    gm, analysis = analyze(models.in_place_relu(), (torch.randn(2, 8),))
    assert names(analysis) == ["0", "2", "4"]
    relu = next(n for n in gm.graph.nodes if n.name == "relu")
    assert meta.layer(relu) == meta.LayerRef(0, "0")


class _WritesBack(torch.nn.Module):
    """Writes in place, after another block, to the first block's output."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](x)
        a = self.blocks[1](h)
        h.mul_(2)
        return a + h


def test_an_in_place_write_to_another_layers_value_is_refused():
    with pytest.raises(partc.TraceError, match=r"mul_ .* writes in place to linear, made "
                                               r"in layer blocks.0, not its own \(output\)"):
        analyze(_WritesBack(), (torch.randn(2, 8),))


class _Tables(torch.nn.Module):
    """A stem that makes a cosine and a sine table in the order ``order`` names them (as
    code iterating a set of strings does, in the order its process's string hashing
    decides), and a head whose ``mix`` reads them (or the cosine twice: ``same``)."""

    def __init__(self, order: tuple[str, ...], same: bool = False) -> None:
        super().__init__()
        self.stem, self.mix = torch.nn.Linear(8, 8), _Mix()
        self.order, self.same = order, same

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tables = {name: torch.cos(x) if name == "cos" else torch.sin(x) for name in self.order}
        h = self.stem(x)
        return self.mix(h, tables["cos"], tables["cos" if self.same else "sin"])


class _Mix(torch.nn.Module):
    def forward(self, h: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return h * a + b


def test_the_signature_a_problem_holds_says_what_a_layer_computes_in_no_order():
    """``LayerCost.signature`` (the plan cache's key reads it) is the same for two traces
    of one model in two orders, where the graph-order signature layers pair by is not;
    and it still tells apart a layer that reads one value twice from one reading two."""
    traced = {order: analyze(_Tables(order), (torch.randn(2, 8),))
              for order in (("cos", "sin"), ("sin", "cos"))}
    (gm, one), (other_gm, other) = traced.values()
    assert [info.name for info in meta.layers(gm)] == ["stem", "mix"]
    assert meta.layers(gm)[0].signature != meta.layers(other_gm)[0].signature
    assert [layer.signature for layer in one.layers] == \
        [layer.signature for layer in other.layers]
    _, twice = analyze(_Tables(("cos", "sin"), same=True), (torch.randn(2, 8),))
    assert twice.layers[1].signature != one.layers[1].signature


def test_a_value_flowing_back_to_an_earlier_layer_is_refused():
    """Layers are consecutive runs, so only a graph regrouped by hand can break the
    order: a later layer feeding an earlier one is named, and a cycle is named as one."""
    from torch import fx

    from partc.passes.layers import _check_dag

    gm = fx.symbolic_trace(models.MLP())
    nodes = [n for n in gm.graph.nodes if n.op not in ("get_attr",)]
    infos = [meta.LayerInfo(index=i, name=f"l{i}", key=f"l{i}", signature="", nodes=())
             for i in range(3)]

    def group(indices):
        for node, index in zip(nodes, indices):
            meta.set_layer(node, meta.LayerRef(index, f"l{index}"))

    group([0] + [1] * (len(nodes) - 2) + [2])
    _check_dag(gm, infos)   # in order
    group([0, 2] + [1] * (len(nodes) - 3) + [1])
    with pytest.raises(AssertionError, match="layer l2 feeds earlier layer l1"):
        _check_dag(gm, infos)
    group([0, 1, 2] + [1] * (len(nodes) - 3))
    with pytest.raises(AssertionError, match="has a cycle"):
        _check_dag(gm, infos)


class _PerLayerSlices(torch.nn.Module):
    """Gemma 3n's shape: a stem makes one input per block, each block reads its own
    slice of it (a select at the block's number) and scales by a tensor constant it
    makes (the trace lifts it, named by its count in the whole trace); the third block's
    scaled value is read again after the last block (as Gemma 3n's last blocks read
    the keys and values of earlier ones), and the last block reads a wider slice."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.depth = depth
        self.stem = torch.nn.Linear(8, 8 * depth + 8)
        self.blocks = torch.nn.ModuleList(_SliceBlock() for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        per = self.stem(x).view(x.shape[0], self.depth + 1, 8)
        h, kept = x, []
        for i, block in enumerate(self.blocks):
            h, scaled = block(h, per, i, wide=i == self.depth - 1)
            kept.append(scaled)
        return h * kept[2]


class _SliceBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.where = self.fc.weight.device   # a plain value: the tracers read no tensor

    def forward(self, h: torch.Tensor, per: torch.Tensor, i: int,
                wide: bool) -> tuple[torch.Tensor, torch.Tensor]:
        mine = per[:, i:i + 2].sum(1) if wide else per[:, i]
        scaled = self.fc(h) * torch.tensor(0.5, device=self.where)
        return scaled + mine, scaled


@pytest.mark.parametrize("tracer", ["symbolic_trace", "export"])
def test_like_blocks_reading_their_own_slice_and_constants_sign_alike(tracer):
    """The layer signature estimate copies a measurement by and the sharding chooser a
    solution leaves out what differs between like blocks without changing their costs or
    shardings: a select's index (a subscript's, under fx) and the trace-wide number of a
    lifted constant (export's, kept as an attribute on meta). A block that computes
    otherwise, or whose values a later layer reads (backward carries their gradients),
    still signs apart."""
    if tracer == "export":   # keyword inputs go to export
        with torch.device("meta"):
            model = _PerLayerSlices()
        gm, _ = analyze(model, (), kwargs={"x": torch.randn(2, 8, device="meta")})
        assert any(n.target == torch.ops.aten.select.int for n in gm.graph.nodes)
    else:
        gm, _ = analyze(_PerLayerSlices(), (torch.randn(2, 8),))
    infos = meta.layers(gm)
    assert [info.name for info in infos][:5] == ["stem"] + [f"blocks.{i}" for i in range(4)]
    constants = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"
                 and ("tensor_constant" in str(n.target) or "lifted_tensor" in str(n.target))}
    assert len(constants) == 4   # one constant per block, each of its own name
    assert infos[1].signature == infos[2].signature
    assert infos[3].signature != infos[1].signature   # a value read after the last block
    assert infos[4].signature != infos[1].signature   # a wider slice


class _SharedWithAdapters(torch.nn.Module):
    """Zamba2's shape: one module shared by every block, holding an adapter per block."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        shared = _Shared(depth)
        self.blocks = torch.nn.ModuleList(_Adapted(shared, i) for i in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class _Shared(torch.nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.adapters = torch.nn.ModuleList(torch.nn.Linear(8, 8, bias=False)
                                            for _ in range(depth))

    def forward(self, x: torch.Tensor, i: int) -> torch.Tensor:
        return self.fc(x) + self.adapters[i](x)


class _Adapted(torch.nn.Module):
    def __init__(self, shared: torch.nn.Module, index: int) -> None:
        super().__init__()
        self.shared, self.index, self.own = shared, index, torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.own(self.shared(x, self.index))


def test_blocks_reading_their_own_adapter_of_a_shared_module_sign_alike():
    """A parameter of another module is signed by its order among those the layer reads
    and its shapes, not its name: blocks 1 and 2 sign alike though each reads its own
    adapter, which export names under the last block holding the shared module (block
    0 fetches the shared weights, so reads them as its own). Traced by export (keyword
    inputs), whose module paths are the calls' own."""
    gm, _ = analyze(_SharedWithAdapters(), (), kwargs={"x": torch.randn(2, 8)})
    infos = {info.name: info for info in meta.layers(gm)}
    assert list(infos) == [f"blocks.{i}" for i in range(4)]
    adapters = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"
                and ".adapters." in str(n.target)}
    assert adapters == {f"blocks.3.shared.adapters.{i}.weight" for i in range(4)}
    assert infos["blocks.1"].signature == infos["blocks.2"].signature
