"""Recognising attention cores (what selective recompute reruns) on small traced graphs:
attention written out, a fused call, and a model that returns its probabilities."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx, nn

from partc.passes.helpers.attention_core import attention_cores, core_inputs


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


class _ProbsTo(nn.Module):
    """Softmax read by the second product directly, through a dropout, or by more."""

    def __init__(self, reader: str) -> None:
        super().__init__()
        self.reader = reader
        self.drop = nn.Dropout(0.1 if reader == "dropout" else 0.0)

    def forward(self, q, k, v):
        probs = (q @ k.transpose(-2, -1)).softmax(-1)
        if self.reader == "two readers":
            return (probs + probs.mean(-1, keepdim=True)) @ v
        if self.reader == "functional p=0":
            return F.dropout(probs, p=0.0, training=True) @ v
        return self.drop(probs) @ v


def test_probabilities_only_the_product_reads_are_handed_over_in_its_dtype():
    """The second product as the only reader, directly or through a dropout of
    probability 0, gets ``softmax_for_product``; a real dropout or another reader keeps
    the plain runtime softmax (the fp32 values are read as such)."""
    from partc.passes.attention_softmax import attention_softmax
    from partc.runtime.softmax import softmax, softmax_for_product

    q, k, v = (torch.randn(2, 4, 6) for _ in range(3))
    chosen = {}
    for reader in ("dropout p=0", "functional p=0", "dropout", "two readers"):
        gm = fx.symbolic_trace(_ProbsTo(reader).eval())
        attention_softmax(gm, None)
        [node] = [n for n in gm.graph.nodes if n.name == "softmax"]
        chosen[reader] = node.target
        if reader != "dropout":
            assert torch.equal(gm(q, k, v), _ProbsTo(reader).eval()(q, k, v))
    assert chosen == {"dropout p=0": softmax_for_product, "functional p=0": softmax_for_product,
                      "dropout": softmax, "two readers": softmax}
