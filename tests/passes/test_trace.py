import copy

import pytest
import torch

from partc import meta
from partc.errors import TraceError
from partc.passes.trace import trace
from samples.gpt import gpt_tiny
from tests import models


def test_symbolic_trace_is_functional_and_keeps_params_and_paths():
    gm, ctx = trace(models.MLP(), (torch.randn(2, 8),))
    assert meta.trace_info(gm).tracer == "symbolic_trace"
    # Traced through torch.nn modules too: parameters are get_attr nodes under their FQNs.
    assert "fc1_weight = self.fc1.weight" in gm.code
    assert "linear = torch._C._nn.linear(x, fc1_weight, fc1_bias)" in gm.code
    assert not [n for n in gm.graph.nodes if n.op == "call_module"]
    nodes = {n.name: n for n in gm.graph.nodes}
    assert meta.params(nodes["fc1_weight"]) == ("fc1.weight",)
    assert meta.module_path(nodes["linear"]) == "fc1"
    assert meta.module_path(nodes["linear_1"]) == "fc2"
    assert meta.module_path(nodes["relu"]) == ""
    assert ctx.batch_size == 2


class _ThreeInputs(torch.nn.Module):
    def forward(self, q, k, v):
        return (q @ k.transpose(2, 3)) @ v


def test_placeholders_keep_the_forwards_order():
    q, k, v = (torch.randn(2, 3, 8, 4) for _ in range(3))
    gm, _ = trace(_ThreeInputs(), (q, k, v))
    assert [n.name for n in gm.graph.nodes][:3] == ["q", "k", "v"]
    torch.testing.assert_close(gm(q, k, v), _ThreeInputs()(q, k, v))


def test_real_inputs_become_fake():
    _, ctx = trace(models.MLP(), (torch.randn(2, 8),))
    assert all(isinstance(t, torch._subclasses.FakeTensor) for t in ctx.fake_inputs)


def test_export_fallback_on_hugging_face_keeps_fqns():
    model = models.gpt2()
    gm, _ = trace(model, (torch.zeros(2, 16, dtype=torch.long),))
    assert meta.trace_info(gm).tracer == "export"
    nodes = list(gm.graph.nodes)
    assert nodes[0].op == "placeholder" and nodes[0].name == "input_ids"
    targets = {n.target for n in nodes if n.op == "get_attr"}
    assert "transformer.h.1.attn.c_attn.weight" in targets
    assert not any(n.op == "call_module" for n in nodes)  # the export guard is gone
    fqns = dict(model.named_parameters())
    for node in nodes:
        if node.op == "get_attr" and node.target in fqns:
            assert gm.get_parameter(node.target) is fqns[node.target]
            assert node.next in node.users or node.next.op == "get_attr"
    paths = {meta.module_path(n) for n in nodes}
    assert "transformer.h.0.mlp.c_fc" in paths


def test_meta_model_traces_without_weights():
    with torch.device("meta"):
        model = gpt_tiny()
    gm, _ = trace(model, (torch.zeros(2, 16, dtype=torch.long),))
    assert all(p.is_meta for p in gm.parameters())


def test_loss_is_one_node_after_the_model_with_a_target_placeholder():
    gm, _ = trace(models.MLP(), (torch.randn(2, 8),), loss_fn=torch.nn.functional.mse_loss,
                  example_target=torch.randn(2, 4))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert [n.name for n in placeholders] == ["x", "target"]
    assert meta.role(placeholders[1]) == meta.ROLE_TARGET
    loss = [n for n in gm.graph.nodes if meta.role(n) == meta.ROLE_LOSS]
    assert len(loss) == 1 and "loss = self.loss(linear_1, target)" in gm.code
    assert meta.trace_info(gm).has_loss and meta.trace_info(gm).num_inputs == 1
    # The model's own FQNs are unchanged: no wrapper prefix.
    assert {n for n, _ in gm.named_parameters()} == {"fc1.weight", "fc1.bias",
                                                     "fc2.weight", "fc2.bias"}


def test_loss_gets_the_output_in_its_structure():
    def hf_loss(output, target):
        return torch.nn.functional.cross_entropy(output.logits.flatten(0, 1), target.flatten())

    gm, _ = trace(models.gpt2(), (torch.zeros(2, 16, dtype=torch.long),), loss_fn=hf_loss)
    assert meta.trace_info(gm).out_spec is not None
    assert any(meta.role(n) == meta.ROLE_LOSS for n in gm.graph.nodes)


def test_trace_error_names_both_tracers_the_construct_and_a_fix():
    with pytest.raises(TraceError) as info:
        trace(models.DataDependent(), (torch.randn(2, 4),))
    message = str(info.value)
    assert "symbolic_trace" in message and "torch.export" in message
    assert "models.py" in message and "if x.sum() > 0" in message
    assert "What you can do" in message and "turn off caches" in message


class _OptionalInputs(torch.nn.Module):
    """A forward with optional parameters the example inputs leave out."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x, mask=None, scale: float = 2.0, *, shift=1):
        y = self.a(x)
        if mask is not None:
            y = y * mask
        return self.b(torch.relu(y * scale + shift))


def test_parameters_left_to_their_defaults_are_traced_as_constants():
    """``forward(self, x, mask=None)`` with a loss: the defaults are not inputs (left as
    inputs they came before the target without a default, and the generated code was a
    SyntaxError), and fx's checks of the specialised values are gone."""
    def loss_fn(out, target):
        return ((out - target) ** 2).mean()

    model = _OptionalInputs()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    gm, _ = trace(model, (x,), loss_fn=loss_fn, example_target=y)
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["x", "target"]
    assert "_assert" not in gm.code and "specialized" not in gm.code
    torch.testing.assert_close(gm(x, y), loss_fn(model(x), y), rtol=0, atol=0)


class _KeywordsToo(torch.nn.Module):
    """Hugging Face's shape of forward: every input has a default, ``**kwargs`` last."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)

    def forward(self, x=None, mask=None, **kwargs):
        y = self.a(x)
        return y if mask is None else y * mask


def test_given_inputs_lose_their_defaults_and_unused_kwargs_go():
    """Seen on Falcon: ``x=None`` kept its default before the target placeholder, and
    ``**kwargs`` shifted which placeholders were taken for the defaults (SyntaxError)."""
    def loss_fn(out, target):
        return ((out - target) ** 2).mean()

    model = _KeywordsToo()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    gm, _ = trace(model, (x,), loss_fn=loss_fn, example_target=y)
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["x", "target"]
    assert all(not n.args for n in gm.graph.nodes if n.op == "placeholder")
    torch.testing.assert_close(gm(x, y), loss_fn(model(x), y), rtol=0, atol=0)


class _ReturnsModelOutput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)

    def forward(self, x):
        from transformers.modeling_outputs import BaseModelOutput

        return BaseModelOutput(last_hidden_state=self.a(x))


def test_a_returned_mapping_keeps_its_class_for_the_loss():
    """fx would hand the loss a plain dict where the model returns a ModelOutput (read as
    ``.last_hidden_state``); such a model is traced by export, which keeps the class."""
    def loss_fn(out, target):
        return ((out.last_hidden_state - target) ** 2).mean()

    model = _ReturnsModelOutput()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    gm, _ = trace(model, (x,), loss_fn=loss_fn, example_target=y)
    assert meta.trace_info(gm).tracer == "export"
    assert meta.trace_info(gm).has_loss


class _ExportOnly(torch.nn.Module):
    """A projection in a forward only torch.export captures: it branches on a shape, as
    Falcon's does on its configuration."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def projected(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError("x must be (batch, sequence, 8)")
        return self.proj(x)


class _IndexWithLists(_ExportOnly):
    """Indexes with lists of ints."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.projected(x).view(x.shape[0], x.shape[1], 4, 2)
        y[:, :, [0, 3]] = y[:, :, [1, 2]] * 2
        return y[..., [-2]].sum(-1) + y[:, :, [[1], [2]]].sum((-1, -2, -3)).unsqueeze(-1)


def test_lists_indexing_a_meta_model_keep_their_values():
    """Seen before: Falcon-40B's shape (``new_decoder_architecture``) on meta failed with
    "Cannot copy out of meta tensor; no data!": its ``qkv[..., [-2]]`` made the index on
    the meta device, and export lifted it as a constant without values. The graph traced
    on meta, given the real weights, computes what the model does."""
    torch.manual_seed(0)
    model = _IndexWithLists()
    x = torch.randn(2, 3, 8)
    gm, _ = trace(copy.deepcopy(model).to("meta"), (x.to("meta"),))
    assert meta.trace_info(gm).tracer == "export"
    gm.load_state_dict(model.state_dict(), strict=False, assign=True)
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)


def test_falcons_new_decoder_architecture_traces_on_meta():
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(hidden_size=64, num_attention_heads=8, num_kv_heads=2,
                          new_decoder_architecture=True, num_hidden_layers=2, vocab_size=128,
                          use_cache=False)
    with torch.device("meta"):
        model = FalconForCausalLM(config)
    gm, _ = trace(model, (torch.zeros(2, 16, dtype=torch.long, device="meta"),))
    indices = [n for n in gm.graph.nodes if n.target is torch.tensor]
    assert indices and all(n.args[0] in ([-2], [-1]) for n in indices)


class _ConstantFromPython(_ExportOnly):
    """Makes a tensor from a Python number on the input's device and computes on it, as
    Gemma 3n's activation sparsity takes a normal quantile."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.projected(x)
        cutoff = torch.special.ndtri(torch.tensor(0.75, dtype=torch.float32, device=x.device))
        return torch.relu(y - y.mean(-1, keepdim=True) * cutoff)


def test_a_constant_made_on_the_meta_device_stays_an_attribute_of_the_trace():
    """Seen before: Gemma 3n's default config on meta failed with "Cannot copy out of meta
    tensor; no data!": export lifted a constant the forward made on the meta device, and
    it has no values to write into the graph. On meta it stays an attribute the fake runs
    read, and the model plans; with weights it is written into the graph as before."""
    import partc

    gm, _ = trace(_ConstantFromPython().to("meta"), (torch.zeros(2, 3, 8, device="meta"),))
    lifted = [n for n in gm.graph.nodes if n.op == "get_attr" and "lifted" in str(n.target)]
    assert lifted and all(n.meta["val"].device.type == "meta" for n in lifted)
    model, x = _ConstantFromPython(), torch.randn(2, 3, 8)
    gm, _ = trace(model, (x,))
    assert not any("lifted" in str(n.target) for n in gm.graph.nodes)
    assert any(n.target is torch.tensor for n in gm.graph.nodes)
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
    with torch.device("meta"):
        on_meta = _ConstantFromPython()
    program = partc.compile(on_meta, (torch.zeros(2, 3, 8, device="meta"),),
                            budget=partc.DeviceBudget(num_devices=2, device="H100-80GB"),
                            train=partc.TrainSpec(global_batch_size=2),
                            loss_fn=lambda out, target: out.float().pow(2).mean(),
                            example_target=torch.zeros(2, device="meta"))
    assert program.plan.pp * program.plan.dp * program.plan.tp == 2
