"""drop_assertions and device_from_inputs on a tiny hand-built graph: the trace's
assertions go, its device literals read the input's device, values stay the same."""

from __future__ import annotations

import torch
from torch import fx, nn

from partc.passes.portable import device_from_inputs, drop_assertions

aten = torch.ops.aten
CPU, META = torch.device("cpu"), torch.device("meta")


def call(module, mode, *args):
    """Stands for ``checkpoint_layer(module, mode, *inputs)``."""
    return module(*args)


def _traced_like_export() -> fx.GraphModule:
    """``x + arange(4)`` with a metadata assertion, a meta-device literal that is the
    model's own choice, and a nested module (placeholders without values) that makes
    another arange on the traced device."""
    inner = fx.Graph()
    h = inner.placeholder("h")
    ramp = inner.call_function(aten.arange.default, (4,), {"device": CPU})
    inner.output(inner.call_function(aten.add.Tensor, (h, ramp)))

    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4)
    graph.call_function(aten._assert_tensor_metadata.default, (x,),
                        {"dtype": torch.float32, "device": CPU, "layout": torch.strided})
    ramp = graph.call_function(aten.arange.default, (4,), {"device": CPU})
    kept = graph.call_function(aten.zeros.default, ([2],), {"device": META})
    total = graph.call_function(aten.add.Tensor, (x, ramp))
    total.meta["val"] = torch.empty(4)
    fetch = graph.get_attr("body")
    nested = graph.call_function(call, (fetch, "full", total))
    graph.output((nested, kept))
    root = nn.Module()
    root.body = fx.GraphModule(nn.Module(), inner, class_name="body")
    return fx.GraphModule(root, graph)


def test_assertions_are_dropped():
    gm = drop_assertions(_traced_like_export())
    assert "_assert_tensor_metadata" not in gm.code


def test_device_literals_read_the_input_device():
    gm = _traced_like_export()
    x = torch.arange(4.0)
    before, _ = gm(x)
    device_from_inputs(drop_assertions(gm))
    assert "input_device = x.device" in gm.code
    assert "aten.arange.default(4, device = input_device)" in gm.code
    assert "device(type='meta')" in gm.code  # not the traced device: the model's choice
    # The nested module's placeholder has no value: its call site's argument tells.
    assert "input_device = h.device" in gm.body.code
    assert "device(type='cpu')" not in gm.code + gm.body.code
    after, _ = gm(x)
    torch.testing.assert_close(after, before)
