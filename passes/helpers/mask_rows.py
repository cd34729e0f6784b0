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

import math
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

    def tile(self, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        """The value's tile: rows ``rows`` of dim -2, columns ``cols`` of dim -1."""
        ndim = len(self.shape)
        args = [tile_of(a, rows, cols, ndim) for a in self.args]
        if self.name == "expand":
            sizes = list(args[1]) if isinstance(args[1], (list, tuple)) else list(args[1:])
            sizes[-2:] = [rows[1] - rows[0], cols[1] - cols[0]]
            args = [args[0], sizes]
        kwargs = {k: tile_of(v, rows, cols, ndim) for k, v in self.kwargs.items()}
        return self.run(*args, **kwargs)


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


# ------------------------------------------------------------ tiles and their bounds
#
# Proving a (seq x seq) mask causal row block by row block reads every element: time
# quadratic in the sequence (hours at a million tokens). A mask made from shapes is an
# element-wise function of position vectors, so over a tile of rows x columns its bounds
# follow from its operands' bounds there (interval arithmetic, op by op): a tile whose
# bounds show it kept or dropped whole is checked against the expected pattern without
# being made, and only tiles that mix both (along a causal diagonal or a window's edge)
# are split, down to tiles small enough to make and compare. A causal mask then costs
# about ``seq x LEAF_SIDE`` elements made and ``seq / LEAF_SIDE`` tiles bounded.

LEAF_SIDE = 256   # a mixed tile this small (per side) is made and compared
Bounds = tuple[float, float]


def tile_of(value: Any, rows: tuple[int, int], cols: tuple[int, int], ndim: int) -> Any:
    """``value``'s part in rows ``rows`` and columns ``cols`` (dims -2 and -1) of a
    result of ``ndim`` dims: a deferred value's tile made, a tensor aligned and sliced
    (a dim of 1 broadcasts), anything else as it is."""
    if isinstance(value, RowBlocks):
        return value.tile(rows, cols)
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    aligned = value.reshape((1,) * (ndim - value.dim()) + tuple(value.shape))
    if aligned.dim() >= 2 and aligned.shape[-2] != 1:
        aligned = aligned[..., rows[0]:rows[1], :]
    return aligned if aligned.shape[-1] == 1 else aligned[..., cols[0]:cols[1]]


def bounds(value: Any, rows: tuple[int, int], cols: tuple[int, int], ndim: int
           ) -> Bounds | None:
    """The least and greatest element of ``value`` over a tile (booleans as 0 and 1), or
    None where an op has no bound rule here (the tile is then made)."""
    if isinstance(value, bool):
        return float(value), float(value)
    if isinstance(value, (int, float)):
        return float(value), float(value)
    if isinstance(value, torch.Tensor):
        part = tile_of(value, rows, cols, ndim)
        if part.numel() == 0:
            return None
        part = part.to(torch.float64) if part.dtype == torch.bool else part
        return float(part.min()), float(part.max())
    if not isinstance(value, RowBlocks):
        return None
    rule = _BOUND_RULES.get(value.name)
    if rule is None:
        return None
    operands = [bounds(a, rows, cols, ndim) if isinstance(a, (torch.Tensor, RowBlocks, bool,
                                                                int, float)) else a
                for a in value.args]
    return rule(value, operands)


def _tensor_operands(value: RowBlocks, operands: list, count: int) -> list[Bounds] | None:
    found = [o for o in operands[:count]]
    return found if len(found) == count and all(isinstance(o, tuple) for o in found) else None


def _compare(test: Callable[[Bounds, Bounds], bool | None]):
    def rule(value: RowBlocks, operands: list) -> Bounds | None:
        pair = _tensor_operands(value, operands, 2)
        if pair is None:
            return None
        known = test(*pair)
        return (0.0, 1.0) if known is None else (float(known), float(known))
    return rule


def _le(a: Bounds, b: Bounds) -> bool | None:
    return True if a[1] <= b[0] else False if a[0] > b[1] else None


def _lt(a: Bounds, b: Bounds) -> bool | None:
    return True if a[1] < b[0] else False if a[0] >= b[1] else None


def _eq(a: Bounds, b: Bounds) -> bool | None:
    if a[0] == a[1] == b[0] == b[1]:
        return True
    return False if a[1] < b[0] or b[1] < a[0] else None


def _negated(test):
    def opposite(a: Bounds, b: Bounds) -> bool | None:
        known = test(a, b)
        return None if known is None else not known
    return opposite


def _logic(combine: Callable[[Bounds, Bounds], Bounds]):
    def rule(value: RowBlocks, operands: list) -> Bounds | None:
        pair = _tensor_operands(value, operands, 2)
        return None if pair is None else combine(*pair)
    return rule


def _invert(value: RowBlocks, operands: list) -> Bounds | None:
    one = _tensor_operands(value, operands, 1)
    if one is None or value.dtype != torch.bool:
        return None
    return 1.0 - one[0][1], 1.0 - one[0][0]


def _same(value: RowBlocks, operands: list) -> Bounds | None:
    """A cast, a copy or a broadcast: the operand's bounds (to bool: nonzero)."""
    one = _tensor_operands(value, operands, 1)
    if one is None:
        return None
    lo, hi = one[0]
    if value.dtype == torch.bool:
        nonzero = lo > 0 or hi < 0
        return (1.0, 1.0) if nonzero else (0.0, 0.0) if lo == hi == 0 else (0.0, 1.0)
    return lo, hi


def _arith(combine: Callable[[Bounds, Bounds], Bounds]):
    def rule(value: RowBlocks, operands: list) -> Bounds | None:
        pair = _tensor_operands(value, operands, 2)
        if pair is None or value.dtype == torch.bool:
            return None
        lo, hi = combine(*pair)
        return None if math.isnan(lo) or math.isnan(hi) else (lo, hi)
    return rule


def _product(a: Bounds, b: Bounds) -> Bounds:
    corners = [x * y for x in a for y in b]
    return min(corners), max(corners)


def _choose(condition: Bounds | None, kept: Bounds | None, other: Bounds | None
            ) -> Bounds | None:
    if condition is None or not isinstance(condition, tuple):
        return None
    if condition == (1.0, 1.0):
        return kept
    if condition == (0.0, 0.0):
        return other
    if kept is None or other is None:
        return None
    return min(kept[0], other[0]), max(kept[1], other[1])


def _where(value: RowBlocks, operands: list) -> Bounds | None:
    three = _tensor_operands(value, operands, 3)
    return None if three is None else _choose(*three)


def _masked_fill(value: RowBlocks, operands: list) -> Bounds | None:
    three = _tensor_operands(value, operands, 3)
    return None if three is None else _choose(three[1], three[2], three[0])


_BOUND_RULES: dict[str, Callable[[RowBlocks, list], Bounds | None]] = {
    "le": _compare(_le), "lt": _compare(_lt), "ge": _compare(lambda a, b: _le(b, a)),
    "gt": _compare(lambda a, b: _lt(b, a)), "eq": _compare(_eq),
    "ne": _compare(_negated(_eq)),
    **{name: _logic(lambda a, b: (a[0] * b[0], a[1] * b[1]))
       for name in ("__and__", "and_", "bitwise_and", "logical_and")},
    **{name: _logic(lambda a, b: (max(a[0], b[0]), max(a[1], b[1])))
       for name in ("__or__", "or_", "bitwise_or", "logical_or")},
    **{name: _invert for name in ("bitwise_not", "logical_not", "__invert__", "invert")},
    **{name: _same for name in ("to", "_to_copy", "type", "expand", "clone", "contiguous")},
    "add": _arith(lambda a, b: (a[0] + b[0], a[1] + b[1])),
    "sub": _arith(lambda a, b: (a[0] - b[1], a[1] - b[0])),
    "mul": _arith(_product),
    "neg": lambda value, operands: None if _tensor_operands(value, operands, 1) is None
    else (-operands[0][1], -operands[0][0]),
    "where": _where, "masked_fill": _masked_fill,
}


def tiles(value: RowBlocks, uniform: Callable[[Bounds, tuple[int, int], tuple[int, int]],
                                              bool | None],
          exact: Callable[[torch.Tensor, tuple[int, int], tuple[int, int]], bool]) -> bool:
    """Whether every tile of ``value`` passes: ``uniform(bounds, rows, cols)`` judges a
    tile from its bounds (True or False; None: cannot tell, split it), ``exact(tile,
    rows, cols)`` a tile made whole (one of at most :data:`LEAF_SIDE` per side, or whose
    bounds have no rule). Tiles are halved along their longer side."""
    seq_rows, seq_cols, ndim = value.shape[-2], value.shape[-1], len(value.shape)
    pending = [((0, seq_rows), (0, seq_cols))]
    while pending:
        rows, cols = pending.pop()
        found = bounds(value, rows, cols, ndim)
        verdict = None if found is None else uniform(found, rows, cols)
        if verdict is not None:
            if not verdict:
                return False
            continue
        height, width = rows[1] - rows[0], cols[1] - cols[0]
        if found is None and height * width <= BLOCK_ELEMENTS or \
                max(height, width) <= LEAF_SIDE:
            if not exact(value.tile(rows, cols), rows, cols):
                return False
            continue
        if height >= width:
            middle = (rows[0] + rows[1]) // 2
            pending += [((rows[0], middle), cols), ((middle, rows[1]), cols)]
        else:
            middle = (cols[0] + cols[1]) // 2
            pending += [(rows, (cols[0], middle)), (rows, (middle, cols[1]))]
    return True
