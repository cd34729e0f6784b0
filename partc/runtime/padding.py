"""Padding masks of unpadded batches: left out of the trace, checked on every batch.

A tokenizer's batch carries ``attention_mask``; where no row is padded it holds only
ones, and a Hugging Face model given ones computes what it computes given none
(transformers itself drops such a mask before its attention kernels). ``partc.compile``
therefore traces a model whose example batch's mask is all ones (or has no values to
read: meta tensors, planned by their shapes) without it, where the forward takes none
(:func:`unpadded_masks`): each attention's mask then follows from the shapes (causal),
attention is priced and run as causal with no ``(seq x seq)`` mask made, and the
sequence may be split over context-parallel ranks. The plan lists those masks
(``plan.model.unpadded_masks``); the runtime takes them with each batch, checks that
they are still all ones, and leaves them out (:func:`padded_rows`,
``partc.runtime.batch_check``). A padded batch is refused, naming its rows: such a
plan was made for unpadded rows. A padded example batch keeps its mask as an input.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import torch

# The keyword input a padding mask comes in (a Hugging Face tokenizer's batch).
PADDING_MASK = "attention_mask"


def unpadded_masks(model: Any, kwargs: Mapping[str, Any]) -> tuple[str, ...]:
    """The keyword inputs of ``kwargs`` that are padding masks of unpadded rows, which
    ``model``'s forward can be called without: :data:`PADDING_MASK`, (batch, seq), all
    ones or with no values to read (meta or fake), where the forward gives it a default
    of None."""
    value = kwargs.get(PADDING_MASK)
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        return ()
    try:
        parameter = inspect.signature(model.forward).parameters.get(PADDING_MASK)
    except (TypeError, ValueError):
        return ()
    if parameter is None or parameter.default is not None:
        return ()
    if _no_values(value) or bool((value == 1).all()):
        return (PADDING_MASK,)
    return ()


def _no_values(value: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return value.is_meta or isinstance(value, FakeTensor)


def padded_rows(name: str, mask: Any) -> str | None:
    """Why a batch whose ``name`` is ``mask`` does not suit a plan that left that mask
    out (its rows padded, or no tensor of (batch, seq)); None where it is all ones."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return (f"{name} is not a (batch, seq) tensor, and the plan was made for "
                f"unpadded rows")
    padded = (mask != 1).any(dim=-1)
    if not bool(padded.any()):
        return None
    rows = padded.nonzero().flatten().tolist()
    shown = ", ".join(str(r) for r in rows[:5]) + (f" and {len(rows) - 5} more"
                                                    if len(rows) > 5 else "")
    return (f"{name} pads row(s) {shown}, and the plan was made for unpadded rows (the "
            f"example batch's {name} was all ones, so the model was traced without it, "
            f"causal: context parallelism may split the sequence): pack the sequences "
            f"without padding, or compile with an example batch that pads a row")
