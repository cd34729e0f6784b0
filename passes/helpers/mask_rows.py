"""A shapes-only attention mask evaluated in blocks of query rows, so that proving it
causal takes host memory linear in the sequence.

:func:`partc.passes.fuse_attention` evaluates a mask that depends on shapes only (no
input, no parameter) on CPU to learn whether it is causal. Hugging Face builds such a
mask as element-wise ops over broadcast position vectors (``arange(S)[:, None] <=
arange(S)[None, :]``, ANDed with a same-document test, cast, expanded): each of those
ops makes a (seq x seq) tensor, six of them at once, which at 131,072 tokens is over
100 GB. Here an element-wise op whose result would hold more than :data:`BLOCK_ELEMENTS`
elements is not run: it is kept as a :class:`RowBlocks` (the op and its operands), and
the result is produced a block of query rows (dim -2) at a time, each operand sliced to
the same rows (or broadcast where its dim -2 is 1). An element-wise op commutes with
slicing rows of its broadcast operands, so each block is exactly those rows of the
whole value: the proof is the same, only its memory is bounded. Any other op reading
a deferred value gets it whole (what evaluation did before).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

# A deferred value's blocks hold at most this many elements (16 Mi: 16 MiB of a bool
# mask, 64 MiB of an fp32 one); smaller values are computed whole, as before.
BLOCK_ELEMENTS = 1 << 24

# Ops computed element by element over broadcast operands (``expand`` too: it only
# broadcasts), by the name fuse_attention's ``_name`` gives them.
ELEMENTWISE = frozenset({
    "le", "lt", "ge", "gt", "eq", "ne", "__and__", "__or__", "__xor__", "and_", "or_",
    "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "logical_and", "logical_or",
    "logical_not", "__invert__", "invert", "to", "_to_copy", "type", "where", "masked_fill",
    "add", "sub", "mul", "neg", "expand", "clone", "contiguous"})


@dataclass(frozen=True)
class RowBlocks:
    """An element-wise op over (possibly deferred) operands, not yet run: its result's
    ``shape`` and ``dtype``, and how to make any block of its query rows."""

    run: Callable[..., torch.Tensor]
    args: tuple
    kwargs: dict
    shape: torch.Size
    dtype: torch.dtype
    name: str

    def dim(self) -> int:
        return len(self.shape)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of dim -2 of the value."""
        ndim = len(self.shape)
        args = [_rows_of(a, start, stop, ndim) for a in self.args]
        if self.name == "expand":   # its sizes name the rows: the block's count
            sizes = list(args[1]) if isinstance(args[1], (list, tuple)) else list(args[1:])
            sizes[-2] = stop - start
            args = [args[0], sizes]
        kwargs = {k: _rows_of(v, start, stop, ndim) for k, v in self.kwargs.items()}
        return self.run(*args, **kwargs)

    def whole(self) -> torch.Tensor:
        return self.rows(0, self.shape[-2])


def _rows_of(value: Any, start: int, stop: int, ndim: int) -> Any:
    """An operand's part in rows ``start:stop`` of a result of ``ndim`` dims: a deferred
    operand's block, a tensor aligned to the result's dims and sliced (a row dim of 1
    broadcasts, a tensor of fewer than two dims has none), anything else as it is."""
    if isinstance(value, RowBlocks):
        return value.rows(start, stop)
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return value
    aligned = value.reshape((1,) * (ndim - value.dim()) + tuple(value.shape))
    return aligned if aligned.shape[-2] == 1 else aligned[..., start:stop, :]


def deferred(name: str, run: Callable[..., torch.Tensor], args: list, kwargs: dict,
             shape: torch.Size, dtype: torch.dtype) -> RowBlocks | None:
    """The op as :class:`RowBlocks` when it is element-wise, makes at least two dims and
    more than :data:`BLOCK_ELEMENTS` elements; None to run it now."""
    if name not in ELEMENTWISE or len(shape) < 2 or shape.numel() <= BLOCK_ELEMENTS:
        return None
    return RowBlocks(run=run, args=tuple(args), kwargs=dict(kwargs), shape=shape,
                     dtype=dtype, name=name)


def whole(value: Any) -> Any:
    """``value`` with every deferred part computed (an op that is not element-wise)."""
    if isinstance(value, RowBlocks):
        return value.whole()
    if isinstance(value, (list, tuple)):
        return type(value)(whole(v) for v in value)
    return value


def blocks(value: torch.Tensor | RowBlocks) -> Iterator[tuple[int, torch.Tensor]]:
    """``value`` a block of query rows at a time, each with its first row: a tensor in
    one block, a deferred value in blocks of at most :data:`BLOCK_ELEMENTS`."""
    if not isinstance(value, RowBlocks):
        yield 0, value
        return
    rows = value.shape[-2]
    per_row = max(1, value.shape.numel() // rows)
    step = max(1, BLOCK_ELEMENTS // per_row)
    for start in range(0, rows, step):
        yield start, value.rows(start, min(rows, start + step))
