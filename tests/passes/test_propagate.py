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
