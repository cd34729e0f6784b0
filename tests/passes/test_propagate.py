import pytest
import torch

from partc import meta
from partc.errors import TraceError
from partc.passes.propagate import propagate
from partc.passes.trace import trace
from samples.gpt import gpt_tiny, loss_fn
from tests import models


def test_shapes_and_dtypes_of_every_node():
    gm, ctx = trace(models.MLP(), (torch.randn(2, 8),))
    propagate(gm, ctx)
    infos = {n.name: meta.tensors(n) for n in gm.graph.nodes if n.op != "output"}
    assert infos["x"][0].shape == (2, 8)
    assert infos["linear"][0].shape == (2, 16) and infos["linear"][0].dtype == torch.float32
    assert infos["linear_1"][0].shape == (2, 4) and infos["linear_1"][0].nbytes == 32


def test_meta_model_and_derived_target():
    with torch.device("meta"):
        model = gpt_tiny()
    gm, ctx = trace(model, (torch.zeros(3, 16, dtype=torch.long),), loss_fn=loss_fn)
    propagate(gm, ctx)
    nodes = {n.name: n for n in gm.graph.nodes}
    assert meta.tensors(nodes["target"])[0].shape == (3, 16)
    assert meta.tensors(nodes["target"])[0].dtype == torch.int64
    assert meta.tensors(nodes["linear_8"])[0].shape == (3, 16, 128)
    assert meta.tensors(nodes["loss"])[0].shape == ()


@pytest.mark.parametrize("tracer", ["symbolic_trace", "export"])
def test_data_dependent_shape_is_a_trace_error_naming_op_and_module(tracer):
    """Mixtral's older experts loop picks each expert's tokens with torch.where: fake
    tensors cannot run it after symbolic_trace, export leaves its size symbolic; both
    are refused naming the op and the module, with the way out."""
    model = models.ListMoEModel(dispatch="indexed")
    ids = torch.zeros(2, 8, dtype=torch.long)
    args, kwargs = ((ids,), None) if tracer == "symbolic_trace" else ((), {"ids": ids})
    gm, ctx = trace(model, args, kwargs=kwargs)
    assert meta.trace_info(gm).tracer == tracer
    with pytest.raises(TraceError, match="ListMoEModel: where in module moes.0 gives a "
                                         "tensor whose shape depends on tensor values") as err:
        propagate(gm, ctx)
    assert "run every expert on every token and weight its output by the router" \
        in str(err.value)
    # The static-shape variant of the same layer propagates.
    gm, ctx = trace(models.ListMoEModel(dispatch="dense"), args, kwargs=kwargs)
    propagate(gm, ctx)


def _counting_copies(monkeypatch, copy: bool) -> list[int]:
    """Propagate's copies of repeated layers counted, or (``copy`` False) none made."""
    import partc.passes.propagate as propagate_module

    copied, same = [0], propagate_module._Repeats.same

    def counted(self, node, env):
        found = same(self, node, env) if copy else None
        copied[0] += found is not None
        return found

    monkeypatch.setattr(propagate_module._Repeats, "same", counted)
    return copied


@pytest.mark.parametrize("build", ["llama", "gpt"])
def test_a_repeated_layer_takes_the_earlier_layers_values(build, monkeypatch):
    """The tensor-parallel measurement propagates each sharding of the whole graph; a
    layer that runs what an earlier one ran, on inputs alike, takes its values node for
    node (Qwen 3.5's 1,000-node blocks, each sharding: 5 s -> 1.5 s). The options equal
    those propagated node by node (the sample GPT's fused attention weight, sharded by
    pieces, as well as Llama's)."""
    from partc.passes.pipeline import analyze, tensor_parallel_options
    from tests.passes.test_dedupe import LINK, assert_same_options

    ids = torch.randint(1, 64, (2, 8))
    model = models.llama(n_layer=4) if build == "llama" else gpt_tiny()
    gm, _ = analyze(model, (ids,), loss_fn=loss_fn if build == "gpt" else None,
                    full_trace=True)
    copied = _counting_copies(monkeypatch, copy=True)
    options = tensor_parallel_options(gm, [LINK], (False, True), ("time",))
    assert copied[0] > 0
    _counting_copies(monkeypatch, copy=False)
    assert_same_options(options, tensor_parallel_options(gm, [LINK], (False, True), ("time",)))


def test_a_layer_reshaping_its_input_in_place_is_run():
    """A call that changes its input's shape in place (``unsqueeze_``) changes what the
    layers after it read: such a layer is run, never copied."""
    from partc.passes.propagate import _Repeats

    gm, ctx = trace(models.MLP(), (torch.randn(2, 8),))
    propagate(gm, ctx)
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    with gm.graph.inserting_after(node):
        reshaped = gm.graph.call_method("unsqueeze_", (node, 0))
    env = {n: n.meta.get("val") for n in gm.graph.nodes}
    repeats = _Repeats(gm)
    repeats.members = {0: [node, reshaped], 1: [node]}
    assert repeats._source(0, env) is None and not repeats.earlier   # never stands for one
    assert repeats._source(1, env) is None and len(repeats.earlier) == 1
