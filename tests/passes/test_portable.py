"""drop_assertions, device_from_inputs and unpin_dtypes on tiny hand-built graphs: the
trace's assertions go, its device literals read the input's device, values stay the
same; in mixed precision its device moves no longer pin the traced dtype."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import fx, nn

from partc.passes.context import Lowering
from partc.passes.pipeline import lowering_passes
from partc.passes.portable import device_from_inputs, drop_assertions, unpin_dtypes

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


def _moves_and_casts() -> fx.GraphModule:
    """``(x.to(device) + x.to(x.dtype) + x.to(device, copy=True)).to(torch.float64)`` as
    export records it on an fp32 ``x``: a device move that names the traced dtype, a
    cast to it, a move asked to copy, and a move that changes the dtype."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4)

    def node(target, args, kwargs=None, dtype=torch.float32):
        made = graph.call_function(target, args, kwargs or {})
        made.meta["val"] = torch.empty(4, dtype=dtype)
        return made

    moved = node(aten.to.dtype_layout, (x,), {"dtype": torch.float32,
                                               "layout": torch.strided, "device": CPU})
    cast = node(aten.to.dtype, (x, torch.float32))
    copied = node(aten.to.device, (x, CPU, torch.float32), {"copy": True})
    total = node(aten.add.Tensor, (node(aten.add.Tensor, (moved, cast)), copied))
    graph.output(node(aten.to.device, (total, CPU, torch.float64), dtype=torch.float64))
    return fx.GraphModule(nn.Module(), graph)


def test_mixed_precision_drops_the_device_moves_that_pin_the_traced_dtype():
    gm = unpin_dtypes(_moves_and_casts())
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    # The move that did nothing goes; the cast (an upcast, for all the graph tells),
    # the copy and the real conversion stay.
    assert aten.to.dtype_layout not in targets
    assert targets.count(aten.to.dtype) == 1 and targets.count(aten.to.device) == 2
    assert [n.args[0].op for n in gm.graph.nodes if n.target is aten.add.Tensor] == \
        ["placeholder", "call_function"]
    # Run in bf16, the moved value stays bf16 (the cast's fp32 promotes the sum).
    x = torch.randn(4, dtype=torch.bfloat16)
    assert torch.equal(gm(x), (x + x.float() + x.float()).to(torch.float64))
    # Only mixed precision runs the pass.
    fp32 = Lowering(stages=(), recompute={})
    assert "unpin_dtypes" not in [p.name for p in lowering_passes(fp32)]
    assert "unpin_dtypes" in [p.name for p in lowering_passes(replace(fp32, mixed=True))]


class PinnedRotary(nn.Module):
    """Built like transformers 5.17's rotary embedding: fp32 angles from a matmul under
    ``no_grad``, pinned with ``.float()``. ``torch.export`` asserts the dtypes it traced
    (fp32) inside the ``wrap_with_set_grad_enabled`` body; the shape check in ``forward``
    keeps ``symbolic_trace`` out, as transformers' models do."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.register_buffer("inv_freq", torch.linspace(1.0, 0.01, width // 2),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.proj.in_features:
            raise ValueError("width")
        h = self.proj(x)
        with torch.no_grad():
            pos = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)
            freqs = (self.inv_freq[:, None].float() @ pos[None, :]).transpose(0, 1)
            cos = torch.cat([freqs, freqs], -1).cos().float()
        return h * cos.to(h.dtype)


def test_mixed_precision_compiles_an_exported_graph_with_pinned_dtypes():
    """Under bf16 autocast the matmul above yields bf16 where export asserted fp32: the
    analysis (which measures the graph under the training's autocast) drops the
    assertions as lowering does, instead of failing on them."""
    import partc

    torch.manual_seed(0)
    model = PinnedRotary()
    x = torch.randn(4, 8, 16)
    exported = torch.export.export(model, (x,), strict=False).module()
    assert any("_assert_tensor_metadata" in m.code for m in exported.modules()
               if isinstance(m, fx.GraphModule))
    program = partc.compile(model, (x,), loss_fn=lambda out, y: ((out - y) ** 2).mean(),
                            example_target=torch.randn(4, 8, 16),
                            budget=partc.DeviceBudget(num_devices=1, device="CPU"),
                            train=partc.TrainSpec(global_batch_size=4, dtype=torch.bfloat16))
    assert program.plan.predicted.step_time_s > 0
