"""A stage's backward split in two (``partc/runtime/split_backward.py``: input gradients,
then weight gradients, as the zero-bubble schedules run it) gives the gradients of one
whole backward, on one process, for the graphs torch's own split gets wrong: a weight
whose value leaves the stage without meeting its inputs (DeBERTa's normed relative
embeddings), a weight read at two depths, weights that share a node, an output a node
of the weight pass keeps. End to end under
torchrun: ``hf-deberta-v2-pp2-zbv`` in ``tests/runtime/test_hf_families.py``."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from partc.runtime import split_backward
from tests.tolerances import FP32


def _weights(count: int) -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(4, 4)) for _ in range(count)]


def _chain(x, w):  # two linears: every weight meets the input in its own layer
    return (torch.tanh(x @ w[0]) @ w[1],)


def _sent_on(x, w):  # a weight-only value used here and sent to the next stage
    normed = F.layer_norm(w[0], (4,), w[1][0], w[2][0])
    return x @ normed, normed * 2


def _two_depths(x, w):  # one weight read by the first and the last layer
    return (torch.tanh(torch.tanh(x @ w[0]) @ w[1]) @ w[0],)


def _shared_node(x, w):  # two weights summed, read at two depths and sent on (a view)
    both = w[0] + w[1]
    h = torch.tanh(torch.tanh(x @ both) @ w[2]) @ (both * 2)
    return h, both.t()


def _weight_sent_on(x, w):  # a weight sent on as it is
    return x @ w[0], w[1]


def _kept_output(x, w):  # an output tanh keeps, read again by a weight at two depths
    h = torch.tanh(x @ w[0])
    return torch.tanh(h @ w[1]) @ w[0], h


GRAPHS: dict[str, tuple[Callable, int]] = {
    "chain": (_chain, 2), "sent-on": (_sent_on, 3), "two-depths": (_two_depths, 2),
    "shared-node": (_shared_node, 3), "weight-sent-on": (_weight_sent_on, 2),
    "kept-output": (_kept_output, 2)}


@pytest.mark.parametrize("name", GRAPHS)
def test_split_backward_gives_the_whole_backward_gradients(name):
    graph, count = GRAPHS[name]
    torch.manual_seed(0)
    weights = _weights(count)
    x = torch.randn(3, 4)
    grads = [torch.randn_like(t) for t in graph(x, weights)]

    whole_x = x.clone().requires_grad_()
    torch.autograd.backward(graph(whole_x, weights), grads)
    expected = [w.grad.clone() for w in weights]
    for w in weights:
        w.grad = None

    split_x = x.clone().requires_grad_()
    outputs = graph(split_x, weights)
    (grad_x,), state = split_backward.input_grads(outputs, grads, [split_x], weights)
    torch.testing.assert_close(grad_x, whole_x.grad, rtol=FP32, atol=1e-6)
    assert all(w.grad is None for w in weights)   # weights wait for the second half
    split_backward.weight_grads(state)
    for index, (weight, want) in enumerate(zip(weights, expected)):
        torch.testing.assert_close(weight.grad, want, rtol=FP32, atol=1e-6,
                                   msg=f"weight {index}")
        assert weight.requires_grad


def test_a_stage_of_integer_inputs_takes_every_gradient_in_the_second_half():
    # Nothing it receives needs a gradient: every weight is on the weight side.
    torch.manual_seed(0)
    embedding, linear = nn.Embedding(10, 4), nn.Linear(4, 1)
    ids = torch.randint(0, 10, (3,))
    loss = linear(embedding(ids)).square().mean()
    params = [*embedding.parameters(), *linear.parameters()]
    expected = torch.autograd.grad(loss, params)
    loss = linear(embedding(ids)).square().mean()   # the last stage: the loss alone
    (grad_ids,), state = split_backward.input_grads([loss], None, [ids], params)
    assert grad_ids is None
    split_backward.weight_grads(state)
    for param, want in zip(params, expected):
        torch.testing.assert_close(param.grad, want, rtol=FP32, atol=1e-7)


def test_the_loss_is_detached_after_the_input_half():
    # Its graph (a cross entropy keeps the softmax) is not the weight pass's to keep.
    torch.manual_seed(0)
    linear = nn.Linear(4, 3)
    x = torch.randn(5, 4, requires_grad=True)
    loss = F.cross_entropy(linear(x), torch.tensor([0, 1, 2, 0, 1]))
    _, state = split_backward.input_grads([loss], None, [x], linear.parameters())
    assert loss.grad_fn is None
    split_backward.weight_grads(state)
    assert linear.weight.grad is not None
