"""A model's checks on its inputs' values, kept in the program partc makes of it.

A model may check its batch's values: LLaVA and Gemma 3 check that the ids hold one
image token per image feature (``torch._check`` on ``(n_tokens * width ==
features.numel()).all()``). ``torch.export`` captures such a check as ops that read a
value (``_is_all_true``, ``item``) and assertions on the number, which fake tensors
cannot run: planning would stop there. ``partc.passes.portable.drop_assertions`` puts
:func:`value_check` in their place, on the same condition: it does nothing on fake or
meta tensors (planning) and raises where the values are real (a rank's batch), as the
model run on one device raises, rather than train on a batch the model refuses.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.node import has_side_effect

from partc.errors import PartcError


# Set while torch's pipelining learns a stage's shapes from made-up inputs.
_SKIPPED = contextvars.ContextVar("partc_value_checks_skipped", default=False)


@contextlib.contextmanager
def skipped() -> Iterator[None]:
    """Within: :func:`value_check` checks nothing (the stage runs on made-up values)."""
    token = _SKIPPED.set(True)
    try:
        yield
    finally:
        _SKIPPED.reset(token)


class ValueCheckError(PartcError, ValueError):
    """A batch failed a check the model makes on its values (a model run on one device
    raises there too)."""


@has_side_effect
def value_check(condition: torch.Tensor, where: str) -> None:
    """Raise :class:`ValueCheckError` unless every element of ``condition`` is true;
    nothing on a fake or meta tensor, nor within :func:`skipped`. ``where``: the module
    whose forward checks."""
    if isinstance(condition, FakeTensor) or condition.device.type == "meta" \
            or _SKIPPED.get():
        return
    if not bool(condition.all()):
        raise ValueCheckError(
            f"the batch fails a check the model makes on its values in {where or 'its forward'} "
            "(the model run on one device raises there too: for a vision-language model, "
            "the ids' image tokens must number the image features)")
