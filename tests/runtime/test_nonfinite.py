"""The non-finite check's verdict and message (partc/runtime/nonfinite.py), from reduced
numbers, in one process. The check itself runs under torchrun in
test_distributed_optimizer.py (a poisoned batch raised on, or skipped, under ZeRO-1 over
dp=2, a pipeline of 2 stages and FSDP2)."""

from __future__ import annotations

import torch

from partc.runtime.nonfinite import GRAD_NORM, LOSS, StepNumbers, describe

INF, NAN = float("inf"), float("nan")


def _numbers(loss: float, norm: float | None, loss_stages=(0, 0), grad_stages=(0, 0),
             loss_rank=None, grad_rank=None) -> StepNumbers:
    return StepNumbers(step=7, loss=torch.tensor(loss),
                       grad_norm=None if norm is None else torch.tensor(norm),
                       loss_value=loss, grad_norm_value=norm, loss_stages=loss_stages,
                       grad_stages=grad_stages, loss_rank=loss_rank, grad_rank=grad_rank)


def test_what_is_non_finite():
    assert _numbers(1.0, 2.0).nonfinite == ()
    assert _numbers(1.0, None).nonfinite == ()   # the norm not measured
    assert _numbers(NAN, 2.0, loss_stages=(0, 1), loss_rank=3).nonfinite == (LOSS,)
    assert _numbers(1.0, INF).nonfinite == (GRAD_NORM,)
    assert _numbers(INF, NAN).nonfinite == (LOSS, GRAD_NORM)


def test_the_message_names_step_stages_ranks_and_parameters():
    numbers = _numbers(NAN, NAN, loss_stages=(0, 1), grad_stages=(2, 1), loss_rank=3)
    message = describe(numbers, rank=0, stage=0, parameters=tuple(f"w{i}" for i in range(6)),
                       mode="raise")
    assert message.startswith("step 7: the loss is nan and the gradient norm is nan")
    assert "the loss on stage 1 (rank 3)" in message
    assert "gradients on stages 0 (2 ranks), 1 (1 rank)" in message
    assert "on this rank (0, stage 0) the gradients of w0, w1, w2, w3 and 2 more" in message
    assert "no parameter has changed" in message and "on_nonfinite='skip'" in message
    skipped = describe(numbers, rank=0, stage=0, parameters=(), mode="skip")
    assert "the step is skipped" in skipped and "this rank" not in skipped


def test_a_norm_that_overflows_without_a_non_finite_gradient_says_so():
    message = describe(_numbers(1.0, INF), rank=1, stage=0, parameters=(), mode="raise")
    assert "the gradient norm is inf" in message and "overflowed float32" in message
