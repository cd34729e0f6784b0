"""Recognising attention cores (what selective recompute reruns) on small traced graphs:
attention written out, a fused call, and a model that returns its probabilities."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx, nn

from partc.passes.attention_core import attention_cores, core_inputs


class Attention(nn.Module):
    def __init__(self, fused: bool = False, returns_probs: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.1)
        self.fused, self.returns_probs = fused, returns_probs

    def forward(self, x: torch.Tensor, mask: torch.Tensor):
        q, k, v = self.qkv(x).split(8, dim=-1)
        if self.fused:
            return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        scores = (q @ k.transpose(-2, -1)) * 8 ** -0.5
        probs = self.drop((scores + mask).softmax(-1).float())
        out = self.out(probs @ v)
        return (out, probs) if self.returns_probs else out


def _nodes(module: nn.Module) -> list[fx.Node]:
    return list(fx.symbolic_trace(module).graph.nodes)


def test_a_written_out_core_runs_from_the_first_product_to_the_second():
    nodes = _nodes(Attention())
    [core] = attention_cores(nodes)
    assert [n.name for n in core] == ["matmul", "mul", "add", "softmax", "float_1", "drop",
                                      "matmul_1"]
    # What its checkpoint keeps: q, k transposed, the mask and v (views of the qkv output).
    assert [n.name for n in core_inputs(core)] == ["getitem", "transpose", "mask",
                                                   "getitem_2"]


def test_a_fused_call_is_a_core_by_itself():
    nodes = _nodes(Attention(fused=True))
    assert [[n.name for n in core] for core in attention_cores(nodes)] == [
        ["scaled_dot_product_attention"]]


def test_probabilities_read_outside_make_no_core():
    assert attention_cores(_nodes(Attention(returns_probs=True))) == []


def test_a_softmax_without_products_around_it_is_no_core():
    class Classifier(nn.Module):
        def forward(self, x):
            return x.softmax(-1) * 2

    assert attention_cores(_nodes(Classifier())) == []


def test_the_cores_softmax_becomes_the_runtimes_and_computes_the_same():
    from partc.passes.attention_softmax import attention_softmax
    from partc.runtime.softmax import softmax

    torch.manual_seed(0)
    model = Attention().eval()
    gm = fx.symbolic_trace(model)
    x, mask = torch.randn(2, 5, 8), torch.zeros(5, 5)
    want = model(x, mask)
    attention_softmax(gm, None)
    [node] = [n for n in gm.graph.nodes if n.name == "softmax"]
    assert (node.target, node.args) == (softmax, (node.args[0], -1))
    assert torch.equal(gm(x, mask), want)
    # A softmax outside an attention core stays as written.
    classifier = fx.symbolic_trace(nn.Softmax(-1))
    code = classifier.code
    attention_softmax(classifier, None)
    assert classifier.code == code
