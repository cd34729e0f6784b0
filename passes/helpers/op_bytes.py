"""What one op reads and writes, as the estimate counts it.

A node's forward and a layer's backward are priced by the bytes their memory-bound ops
move (``passes/estimate.py``); calibrate's element-wise mix is counted the same way so that
its rate is in the same bytes. :class:`MovedBytes` counts them for every op dispatched
below it: the tensors each op reads and writes, parameters and buffers apart; the copy an
out-of-place op makes of its input before running in place; and, on CUDA, the kernels
that differ from the op dispatched. Matmuls, convolutions and attention kernels move
nothing here: the roofline prices their FLOPs.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

# Out-of-place ops that ATen runs as a copy of their input and then their in-place form
# (``masked_fill`` is ``clone`` then ``masked_fill_``): two kernels, the copy's bytes on
# top of what the op reads and writes.
COPY_THEN_IN_PLACE = frozenset(
    getattr(torch.ops.aten, name) for name in ("masked_fill", "index_fill", "index_put",
                                               "masked_scatter", "index_add", "index_copy",
                                               "put"))


def _same_flops_as(packet) -> Any:
    """FlopCounterMode's formula for ``packet``, for an op of the same arguments (raw:
    the registered formula takes the tensors and reads their shapes itself)."""
    formula = flop_registry[packet]

    def flops(*args: Any, **kwargs: Any) -> int:
        return formula(*args, **kwargs)

    flops._get_raw = True  # type: ignore[attr-defined]
    return flops


def _matrix_vector_flops(matrix: Any, vector: Any, *args: Any, **kwargs: Any) -> int:
    """``mv(matrix, vector)``: a multiply and an add per element of the matrix."""
    rows, columns = matrix
    return 2 * rows * columns


def _added_matrix_vector_flops(start: Any, matrix: Any, vector: Any, *args: Any,
                               **kwargs: Any) -> int:
    """``addmv(start, matrix, vector)``: the product's, the add is memory-bound."""
    return _matrix_vector_flops(matrix, vector)


def _added_batch_sum_flops(start: Any, first: Any, second: Any, *args: Any,
                           **kwargs: Any) -> int:
    """``addbmm(start, first, second)``: the batch of products (b x n x k by b x k x m),
    summed into one n x m matrix (as ``baddbmm``'s products, the sum over the batch
    folded in)."""
    batch, rows, inner = first
    return 2 * batch * rows * inner * second[-1]


def _dot_flops(first: Any, second: Any, *args: Any, **kwargs: Any) -> int:
    return 2 * first[0]


def _grouped_flops(first: Any, second: Any, *args: Any, out_shape: Any = None,
                   **kwargs: Any) -> int:
    """A grouped matmul (a mixture of experts' routed tokens, each group by its own
    expert's matrix): every output element is one row times one column of the inner
    size, ``2 * outputs * inner``. Where both operands are 2-D the groups split the
    inner size (a weight's gradient, one ``(m, n)`` per group), so the whole inner size
    is summed over once."""
    if len(first) == 2 and len(second) == 2:
        return 2 * first[0] * first[1] * second[-1]
    return 2 * math.prod(out_shape) * first[-1]


def _grouped_backward_flops(first: Any, second: Any, offsets: Any, grad: Any, *args: Any,
                            **kwargs: Any) -> int:
    """The backward of a grouped matmul of ``first`` (tokens, k) by ``second`` (groups,
    k, n): the input's gradient and the weights', each a grouped matmul as large as
    the forward."""
    return 2 * _grouped_flops(first, second, out_shape=grad)


# What FlopCounterMode lacks (``passes.estimate`` counts with these): the fused kernel
# that fake CPU tensors dispatch attention to, the same two products of (seq_q x seq_k)
# as the CUDA flash kernel and the written ops; the in-place forms of the products
# (``c.addmm_(a, b)``, ``c.baddbmm_(a, b)``: a matmul accumulating into its output),
# the out-of-place op's FLOPs; and the products it has no formula for at all
# (matrix-vector, the batch-summed ``addbmm``, dot products), in FlopCounterMode's unit
# (a multiply-add is two).
FLOP_FORMULAS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        _same_flops_as(torch.ops.aten._scaled_dot_product_flash_attention),
    torch.ops.aten.addmm_: _same_flops_as(torch.ops.aten.addmm),
    torch.ops.aten.baddbmm_: _same_flops_as(torch.ops.aten.baddbmm),
    torch.ops.aten.mv: _matrix_vector_flops,
    torch.ops.aten.addmv: _added_matrix_vector_flops,
    torch.ops.aten.addmv_: _added_matrix_vector_flops,
    torch.ops.aten.addbmm: _added_batch_sum_flops,
    torch.ops.aten.addbmm_: _added_batch_sum_flops,
    torch.ops.aten.dot: _dot_flops,
    torch.ops.aten.vdot: _dot_flops,
    **({torch.ops.aten._grouped_mm: _grouped_flops}
       if hasattr(torch.ops.aten, "_grouped_mm") else {})}
# Grouped matmuls of libraries' own custom ops, by name (``namespace::op``): they are
# registered when the library is imported, so they are looked up as a layer is
# measured (:func:`flop_formulas`). Hugging Face's mixture-of-experts layers run their
# experts on ``transformers::grouped_mm_fallback`` where ``torch._grouped_mm`` does not
# take their dtype: without a formula a model whose router partc does not recognise
# (PhiMoE's, which picks its experts by ``max``, not ``topk``) lost its experts' FLOPs.
_CUSTOM_FORMULAS = {"transformers::grouped_mm_fallback": _grouped_flops,
                    "transformers::grouped_mm_fallback_backward": _grouped_backward_flops}

# The ops the roofline prices by their FLOPs, forward and backward (matmuls,
# convolutions, attention kernels): FlopCounterMode's, those above, and CPU's fused
# attention's backward.
_HEAVY = frozenset(flop_registry) | frozenset(FLOP_FORMULAS) | {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward}


def flop_formulas() -> dict[Any, Any]:
    """:data:`FLOP_FORMULAS` and those of :data:`_CUSTOM_FORMULAS` registered now."""
    formulas = dict(FLOP_FORMULAS)
    for name, formula in _CUSTOM_FORMULAS.items():
        namespace, _, op = name.partition("::")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None:
            formulas[packet] = formula
    return formulas


def _is_heavy(packet: Any) -> bool:
    return packet in _HEAVY or getattr(packet, "_qualified_op_name", None) in _CUSTOM_FORMULAS


# Ops that write their output without reading it (the destination of a copy, a fill).
_WRITE_ONLY = frozenset((torch.ops.aten.copy_, torch.ops.aten.fill_, torch.ops.aten.zero_))
# Ops that allocate and move nothing.
_ALLOCATING = frozenset((torch.ops.aten.empty, torch.ops.aten.empty_like,
                         torch.ops.aten.new_empty, torch.ops.aten.empty_strided,
                         torch.ops.aten.new_empty_strided))


def _accumulating() -> bool:
    """Whether autograd is storing a leaf's gradient (its copy of a gradient it cannot
    take over): the stand-ins' inputs are leaves where the runtime's are the previous
    layer's outputs, and the runtime's adds into its gradient buckets are priced apart
    (``partc.cost.communication.gradient_work_seconds``)."""
    node = _current_autograd_node()
    return node is not None and node.name().endswith("AccumulateGrad")


_current_autograd_node = getattr(torch._C, "_current_autograd_node", lambda: None)


class MovedBytes(TorchDispatchMode):
    """Counts (``moved``) the bytes the memory-bound ops run below it read and write:
    every tensor an op reads and writes, parameters and buffers (``frozen`` storages)
    apart, and the copy an out-of-place op makes before running in place
    (:data:`COPY_THEN_IN_PLACE`); views, allocations, the heavy ops (:data:`_HEAVY`,
    priced by their FLOPs) and autograd's storing of leaves' gradients move nothing
    here.

    ``kernels`` counts the device kernels the same ops launch: one per op that moves
    bytes or is heavy, two for a copy-then-in-place op, and on CUDA two for softmax's
    backward; views, allocations, queries and leaves' gradient copies launch none. (A
    GPU spends a few microseconds on each kernel whatever its size:
    ``DeviceNumbers.kernel_overhead_s``.)

    It runs for every op of every layer the estimate measures, forward and backward: what
    it knows of each op is looked up once (:class:`_OpKind`), an op's tensors are walked
    by hand rather than with pytree, and storages are told apart by the address of their
    implementation (what ``StorageWeakRef`` compares) without taking a weak reference."""

    def __init__(self, frozen: set, cuda: bool) -> None:
        super().__init__()
        self.frozen = frozen
        self.cuda = cuda
        self.moved = 0.0
        self.kernels = 0
        self._paused = False
        self._kinds: dict[Any, _OpKind] = {}

    @contextlib.contextmanager
    def paused(self):
        """Count nothing of what runs inside (the stand-ins' own making)."""
        paused, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = paused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind = self._kinds.get(func)
        if kind is None:
            kind = self._kinds[func] = _OpKind(func)
        if self._paused or kind.moves_nothing or _accumulating():
            return out
        if kind.heavy:
            self.kernels += 1
            return out
        outputs = _tensors(out, [])
        tensors = _tensors(kwargs, _tensors(args, [])) if kwargs else _tensors(args, [])
        read = {t.untyped_storage()._cdata for t in tensors}
        if not outputs or not kind.mutable and all(
                t.untyped_storage()._cdata in read for t in outputs):
            return out   # a query, or an alias the schema does not declare (_unsafe_view)
        inputs = [t for t in tensors if _Storage(t) not in self.frozen]
        if kind.write_only:   # the destination is written (an output), not read
            inputs = [t for t in inputs if t is not args[0]]
        self.moved += sum(nbytes(t) for t in inputs) + sum(nbytes(t) for t in outputs)
        self.kernels += 1
        if kind.copy_then_in_place:
            self.moved += 2.0 * sum(nbytes(t) for t in outputs)
            self.kernels += 1
        if self.cuda and kind.softmax_backward:
            # CUDA's kernel first multiplies the gradient by the output, a kernel of its
            # own (reads both, writes their product), then reduces and subtracts.
            grad, output = args[0], args[1]
            self.moved += nbytes(grad) + 2.0 * nbytes(output)
            self.kernels += 1
        return out


class _OpKind:
    """What :class:`MovedBytes` asks of an op, read off it once."""

    __slots__ = ("moves_nothing", "heavy", "mutable", "write_only", "copy_then_in_place",
                 "softmax_backward")

    def __init__(self, func: Any) -> None:
        packet = func.overloadpacket
        # (Queries that return no tensor, prim.device above all, are asked for each op
        # autograd runs: answered without a look at their arguments.)
        self.moves_nothing = func.is_view or packet in _ALLOCATING or not any(
            _may_hold_tensor(result.type) for result in func._schema.returns)
        self.heavy = _is_heavy(packet)
        self.mutable = func._schema.is_mutable
        self.write_only = packet in _WRITE_ONLY
        self.copy_then_in_place = packet in COPY_THEN_IN_PLACE
        self.softmax_backward = packet is torch.ops.aten._softmax_backward_data


# Return types that hold no tensor (a schema's type kinds; lists are looked into).
_NO_TENSOR_KINDS = frozenset(("DeviceObjType", "IntType", "FloatType", "BoolType", "NumberType",
                              "SymIntType", "SymFloatType", "SymBoolType", "StringType",
                              "ScalarTypeType", "LayoutType", "MemoryFormatType", "NoneType"))


def _may_hold_tensor(kind: Any) -> bool:
    """Whether an op's return of schema type ``kind`` may be or hold a tensor."""
    if kind.kind() == "ListType":
        return _may_hold_tensor(kind.getElementType())
    return kind.kind() not in _NO_TENSOR_KINDS


class _Storage:
    """A live tensor's storage as a key equal to its ``StorageWeakRef`` (which hashes
    and compares the address of the storage's implementation), without the weak
    reference: the tensor keeps the storage alive while it is looked up."""

    __slots__ = ("cdata",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.cdata = tensor.untyped_storage()._cdata

    def __hash__(self) -> int:
        return self.cdata

    def __eq__(self, other: object) -> bool:
        return self.cdata == getattr(other, "cdata", None)


def _tensors(value: Any, found: list) -> list:
    """The tensors in an op's arguments or result (tensors, and lists, tuples and dicts
    of them, as aten ops take and return them), appended to ``found``."""
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tensors(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _tensors(item, found)
    return found


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
