"""Under mixed precision, a LayerNorm that only matmuls read becomes
:func:`partc.runtime.norm.layer_norm`, whose output is in the 16-bit dtype and which keeps
its 16-bit input for backward (autocast's fp32 LayerNorm keeps an fp32 copy of it and
returns fp32: see that module).

The matmuls (every op autocast computes in the 16-bit dtype, ``LOWER_PRECISION``) cast
the norm's output to that dtype themselves, so reading it already narrowed they compute
the same values. A reader that moves data without computing (a view, a transpose, a
split) passes the question on to its own readers; one that only asks the output's size
is not a reader. Any other reader (a residual add, as after a post-LN block; the graph's
output; a dropout) keeps the norm as it is: it would compute on the narrowed values.
Where several matmuls read the output their gradients add up in the 16-bit dtype before
the norm's backward, not in fp32 after autocast's casts (Megatron, whose QKV is one
matmul, adds them in bf16 too).

The pass lists run it only for mixed precision (:mod:`.pipeline`); without autocast the
runtime function is ``F.layer_norm``. Tensor parallelism sees the norm under the same name
(``layer_norm``) and shards it as it did; under sequence parallelism the all-gather
after it then moves 16-bit values.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

from partc.autocast_policy import LOWER_PRECISION
from partc.passes.context import Context
from partc.passes.helpers.graph import op_name
from partc.runtime.norm import layer_norm


def norm_dtype(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    """Rewrite each LayerNorm whose output only matmuls read as ``layer_norm(x, shape,
    weight, bias, eps)`` of :mod:`partc.runtime.norm`.

    Reads: the graph. Writes: the target and arguments of each rewritten node.
    Requires: nothing. Ensures: under autocast every value a matmul computes is the
    same; the norm keeps and returns its 16-bit dtype.
    """
    changed = False
    for node in list(gm.graph.nodes):
        operands = _layer_norm_operands(node)
        if operands is not None and _only_matmuls_read(node):
            node.op, node.target = "call_function", layer_norm
            node.args, node.kwargs = operands, {}
            changed = True
    if changed:
        gm.recompile()
    return gm


_COMPUTING_IN_LOW = frozenset(name.split(".")[0] for name in LOWER_PRECISION)

# Readers that move or view data without computing on it: their output holds the same
# values in whichever dtype their input had.
_MOVING = frozenset({
    "view", "reshape", "_unsafe_view", "flatten", "unflatten", "transpose", "swapaxes",
    "permute", "t", "contiguous", "clone", "unsqueeze", "squeeze", "expand", "split",
    "split_with_sizes", "chunk", "unbind", "select", "slice", "narrow", "getitem", "alias",
})

# Readers of the size alone. (``new_ones`` and the like read the dtype too, unless the
# call names one.)
_SIZE_ONLY = frozenset({"size", "dim", "numel", "sym_size", "sym_numel", "stride"})
_NEW = frozenset({"new_ones", "new_zeros", "new_empty", "new_full"})


def _only_matmuls_read(node: fx.Node) -> bool:
    """Whether every reader of ``node``'s value, through readers that only move data,
    computes in the 16-bit dtype; at least one does."""
    found, stack, seen = False, list(node.users), set()
    while stack:
        user = stack.pop()
        if user in seen:
            continue
        seen.add(user)
        name = "getitem" if user.target is operator.getitem else op_name(user)
        if user.op == "output":
            return False
        if name in _SIZE_ONLY or name in _NEW and "dtype" in user.kwargs \
                or user.op == "call_function" and user.target is getattr \
                and user.args[1] in ("shape", "device", "ndim"):
            continue
        if name in _MOVING:
            stack.extend(user.users)
            continue
        if name not in _COMPUTING_IN_LOW:
            return False
        found = True
    return found


def _layer_norm_operands(node: fx.Node) -> tuple | None:
    """``(input, normalized_shape, weight, bias, eps)`` of a LayerNorm, else None."""
    if node.op != "call_function":
        return None
    if node.target is F.layer_norm:
        names = ("input", "normalized_shape", "weight", "bias", "eps")
    elif node.target in (torch.ops.aten.layer_norm.default, torch.layer_norm):
        names = ("input", "normalized_shape", "weight", "bias", "eps", "cudnn_enable")
    else:
        return None
    values = {**dict(zip(names, node.args)), **node.kwargs}
    x, shape = values.get("input"), values.get("normalized_shape")
    if not isinstance(x, fx.Node) or shape is None:
        return None
    return (x, shape, values.get("weight"), values.get("bias"), values.get("eps", 1e-5))
