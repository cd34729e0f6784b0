"""What crosses a stage boundary, on one process: every tensor a stage sends (its outputs,
its inputs' gradients) is contiguous, and pipelining's first-step shape inference runs a
later stage on zeros. End to end under torchrun: the ``handoff-pp2`` parity case
(``tests/models.Handoff``), and the Hugging Face families of
``benchmarks/hf_coverage.py`` (OPT, BERT, RoBERTa and ViT sent strided views; GPT-J and
Whisper send integer positions and token ids on)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining._utils import extract_tensor_meta

from partc.runtime.pipeline_stage import CountingStage, contiguous_transfers
from partc.runtime.rank_build import PlannedLoss


class Strided(nn.Module):
    """Receives (batch, width, seq) and returns it transposed through a linear: its output
    is a transpose, and so is its input's gradient."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.linear(h.transpose(1, 2)).transpose(1, 2)
        return out, mask.expand(-1, 4, -1)


def run(module: nn.Module) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    h = torch.randn(2, 6, 5, requires_grad=True)
    outputs = module(h, torch.ones(2, 1, 5, dtype=torch.bool))
    # As pipelining's shape inference takes it (a leaf's ``.grad`` may be a contiguous copy).
    grad_h, = torch.autograd.grad(outputs[0], [h], torch.ones_like(outputs[0]),
                                  retain_graph=True)
    torch.autograd.backward(outputs[0], torch.ones_like(outputs[0]))
    return outputs, grad_h


def test_without_the_hooks_the_stage_sends_strided_tensors():
    (out, mask), grad = run(Strided())
    assert not out.is_contiguous() and not mask.is_contiguous() and not grad.is_contiguous()


@pytest.mark.parametrize("first, last", [(False, False), (True, False), (False, True)])
def test_what_a_stage_sends_is_contiguous(first, last):
    torch.manual_seed(0)
    plain = Strided()
    wrapped = Strided()
    wrapped.load_state_dict(plain.state_dict())
    contiguous_transfers(wrapped, first=first, last=last)
    torch.manual_seed(1)
    (out, mask), grad = run(wrapped)
    torch.manual_seed(1)
    (ref_out, ref_mask), ref_grad = run(plain)
    # Outputs are sent unless the stage is the last; gradients unless it is the first.
    assert out.is_contiguous() == mask.is_contiguous() == (not last)
    assert grad.is_contiguous() == (not first)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(mask, ref_mask, rtol=0, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=0)
    torch.testing.assert_close(wrapped.linear.weight.grad, plain.linear.weight.grad,
                               rtol=0, atol=0)


class PassOn(nn.Module):
    """Sends on what it received (a skip across its blocks) and a reshape of its own
    result: both views."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, skip: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(h).view(-1), skip


def test_no_stage_output_is_a_view():
    # A zero-bubble schedule's split backward detaches every output in place, which
    # autograd refuses for a view ("Can't detach views in-place").
    torch.manual_seed(0)
    plain = PassOn()
    wrapped = PassOn()
    wrapped.load_state_dict(plain.state_dict())
    contiguous_transfers(wrapped, first=False, last=False)
    h, skip = torch.randn(2, 6, requires_grad=True), torch.randn(2, 6, requires_grad=True)
    outputs = wrapped(h, skip)
    ref_outputs = plain(h, skip)
    assert ref_outputs[0]._is_view() and not any(t._is_view() for t in outputs)
    grads = [torch.randn_like(t) for t in outputs]
    got = torch.autograd.grad(outputs, [h, skip, wrapped.linear.weight], grads)
    want = torch.autograd.grad(ref_outputs, [h, skip, plain.linear.weight], grads)
    for ours, theirs in zip(got, want):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    for t in outputs:
        t.detach_()


def test_a_loss_that_is_a_view_is_not_one_for_the_schedule():
    # ``losses[0]``: the split backward of the last stage detaches the loss in place.
    loss = PlannedLoss(lambda out, target: ((out - target) ** 2).mean(0)[:1].view(()),
                       "none")
    out = torch.randn(4, 3, requires_grad=True)
    value = loss(out, torch.zeros(4, 3))
    assert not value._is_view()
    value.backward()
    assert out.grad is not None


@pytest.fixture
def group_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_shape_inference_runs_a_later_stage_on_zeros(group_of_one):
    # Uninitialised integers used as indices (GPT-J's positions, Whisper's decoder ids)
    # failed the first step with "index 140372623695280 is out of bounds".
    stage = CountingStage(nn.Linear(3, 3), 1, 2, torch.device("cpu"))
    ids = stage._to_tensor(extract_tensor_meta(torch.full((2, 16), 7, dtype=torch.int64)))
    hidden = stage._to_tensor(extract_tensor_meta(torch.randn(2, 16, 3, requires_grad=True)))
    assert ids.dtype == torch.int64 and ids.shape == (2, 16) and not ids.any()
    assert hidden.shape == (2, 16, 3) and hidden.requires_grad and not hidden.any()
    real = torch.randn(2, 3)
    assert torch.equal(stage._to_tensor(real), real)  # stage 0's real inputs stay
