"""Padding masks left out of the trace where they change no counted output, checked on
every batch.

A tokenizer's batch carries ``attention_mask``. ``partc.compile`` traces the model
without it, where the forward takes none, in two cases:

- **unpadded rows**: the example batch's mask is all ones, or has no values to read
  (meta tensors, planned by their shapes). A Hugging Face model given ones computes what
  it computes given none (transformers itself drops such a mask before its attention
  kernels);
- **rows padded at their end, whose pads count no label** (a collator's right padding,
  labels -100 under it), of a model that is causal throughout: every attention causal
  or a sliding window, and no other op reading along the sequence
  (``ModelSummary.attention_causal``, ``context_parallel_blocker``), its loss a mean over
  the labels it counts (:func:`takes_end_padding`). Each real token then sees only the
  tokens before it, which are real, with the mask or without; the pads' own outputs
  change, and count nothing (their gradients are zero).

:func:`mask_left_out` tells the two apart.

Each attention's mask then follows from the shapes (causal): attention is priced and run
causal, with no ``(seq x seq)`` mask made, and the sequence may be split over
context-parallel ranks. ``position_ids`` of 0..S-1 in every row (what the model counts
without them, the mask given or left out) are left out beside the mask, or where no mask
is given (:func:`plain_positions`): given, transformers reads them for documents packed
in a row, a mask that depends on the batch. The plan lists what it left out
(``plan.model.left_out``, and ``pads_at_end`` for the second case); the runtime takes
them with each batch, checks them (:func:`refusal`) and leaves them out. A batch padded
otherwise (at the start of its rows, or with labels under its pads; any padding for a
plan of unpadded rows only), or whose positions are not 0..S-1, is refused, naming its
rows. Otherwise the mask (and the positions) stay inputs.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

import torch

from partc.runtime.label_weights import IGNORED

# The keyword input a padding mask comes in (a Hugging Face tokenizer's batch), and the
# one of each token's position.
PADDING_MASK = "attention_mask"
POSITION_IDS = "position_ids"


def takes_none(model: Any, name: str = PADDING_MASK) -> bool:
    """Whether ``model``'s forward takes keyword ``name`` with a default of None."""
    try:
        parameter = inspect.signature(model.forward).parameters.get(name)
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.default is None


def mask_left_out(model: Any, kwargs: Mapping[str, Any],
                  labels: Any) -> tuple[tuple[str, ...], bool]:
    """The padding mask of ``kwargs`` (:data:`PADDING_MASK`, (batch, seq)) that
    ``model``'s forward can be called without, and whether only a model causal
    throughout may be (:func:`takes_end_padding`): unpadded rows (all ones, or no values
    to read: meta or fake), or rows padded at their end only whose pads count no label
    in ``labels`` (the own loss's ``labels``, or a loss_fn's (batch, seq) target), the
    latter needing it; ``((), False)`` for any other."""
    value = kwargs.get(PADDING_MASK)
    if not (_is_mask(value) and takes_none(model)):
        return (), False
    if _no_values(value) or bool((value == 1).all()):
        return (PADDING_MASK,), False
    if _end_padding_refusal(PADDING_MASK, value, labels) is None:
        return (PADDING_MASK,), True
    return (), False


def plain_positions(model: Any, kwargs: Mapping[str, Any],
                    left_out: tuple[str, ...]) -> tuple[str, ...]:
    """:data:`POSITION_IDS` where ``kwargs`` gives them 0..S-1 in every row (or with no
    values to read), ``model``'s forward takes None for them, and the padding mask is
    ``left_out`` or not given: what the model counts without them (from the padding mask
    where it reads one, the same on rows padded at their end)."""
    value = kwargs.get(POSITION_IDS)
    if PADDING_MASK in kwargs and PADDING_MASK not in left_out:
        return ()
    if not (_is_mask(value) and takes_none(model, POSITION_IDS)):
        return ()
    return (POSITION_IDS,) if _no_values(value) or _positions_refusal(POSITION_IDS, value) \
        is None else ()


def takes_end_padding(summary: Any) -> bool:
    """Whether a model traced without its padding mask (``summary``: its
    ``ModelSummary``) computes every counted output as it would with a mask padding rows
    at their end: it is causal throughout (every attention causal or a sliding window,
    no other op reading along the sequence), and its loss is a mean over the labels it
    counts, read position by position (a causal LM's own loss given its labels shifted,
    which adds no router loss; or a loss_fn over its target's entries not -100)."""
    return (summary.attention_causal and not summary.context_parallel_blocker
            and (bool(summary.shift_labels) or summary.counted_target is True))


def refusal(name: str, value: Any, labels: Any = None,
            pads_at_end: bool = False) -> str | None:
    """Why a batch whose input ``name`` is ``value`` (and whose counted labels are
    ``labels``) does not suit a plan that left that input out (``pads_at_end``: one that
    takes rows padded at their end, whose pads count no label); None where it does."""
    if not _is_mask(value):
        return f"{name} is not a (batch, seq) tensor"
    if name == POSITION_IDS:
        return _positions_refusal(name, value)
    return _padding_refusal(name, value, labels, pads_at_end)


def _positions_refusal(name: str, positions: torch.Tensor) -> str | None:
    """Why ``positions`` are not 0..S-1 in every row; None where they are."""
    plain = torch.arange(positions.shape[1], device=positions.device)
    return _refused((positions != plain).any(dim=-1), lambda rows: (
        f"{name} of row(s) {rows} are not 0..{positions.shape[1] - 1} (documents packed "
        f"in a row, or padding at its start), and the plan was made for rows whose tokens "
        f"count from 0 (the model was traced without them): compile with an example "
        f"batch whose {name} are as these are"))


def _padding_refusal(name: str, mask: torch.Tensor, labels: Any,
                     pads_at_end: bool) -> str | None:
    if pads_at_end:
        return _end_padding_refusal(name, mask, labels)
    return _refused((mask != 1).any(dim=-1), lambda rows: (
        f"{name} pads row(s) {rows}, and the plan was made for unpadded rows (the example "
        f"batch's {name} was all ones, so the model was traced without it): pack the "
        f"sequences without padding, or compile with an example batch padded as these are"))


def _end_padding_refusal(name: str, mask: torch.Tensor, labels: Any) -> str | None:
    """Why ``mask`` is not ones then zeros in every row with ``labels`` -100 under its
    zeros; None where it is."""
    if not bool(((mask == 0) | (mask == 1)).all()):
        return f"{name} holds values other than 0 and 1"
    kept = mask != 0
    # Rows with a token after a pad.
    early = _refused((kept[:, 1:] & ~kept[:, :-1]).any(dim=-1), lambda rows: (
        f"{name} pads row(s) {rows} before their last token, and the plan was made for "
        f"rows padded at their end (the model was traced without the mask, causal): pad on "
        f"the right (tokenizer.padding_side = \"right\"), or compile with an example batch "
        f"padded as these are"))
    if early is not None:
        return early
    if not isinstance(labels, torch.Tensor) or tuple(labels.shape) != tuple(mask.shape):
        if bool(kept.all()):
            return None
        return (f"{name} pads rows, and the labels under the pads cannot be read (no "
                f"(batch, seq) labels or target): the plan was made for pads that count no "
                f"label")
    return _refused((~kept & (labels != IGNORED)).any(dim=-1), lambda rows: (
        f"the labels of row(s) {rows} count pad positions (not -100 where {name} is 0), "
        f"and the plan was made for pads that count no label (the model was traced "
        f"without the mask): set their labels to -100, as a collator does"))


def _refused(flags: torch.Tensor, why: Callable[[str], str]) -> str | None:
    """``why`` of the rows ``flags`` marks (the first five named), or None where it
    marks none."""
    if not bool(flags.any()):
        return None
    rows = flags.nonzero().flatten().tolist()
    return why(", ".join(str(r) for r in rows[:5])
               + (f" and {len(rows) - 5} more" if len(rows) > 5 else ""))


def _is_mask(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 2


def _no_values(value: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return value.is_meta or isinstance(value, FakeTensor)
