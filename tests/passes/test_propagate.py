import torch

from partc import meta
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
