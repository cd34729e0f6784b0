"""The loss over vocabulary-sharded logits: Megatron's vocab-parallel cross entropy behind
the user's own loss function.

A column-parallel LM head leaves each rank of a tensor-parallel group a slice of the
vocabulary of every position's logits. Gathering them for the loss costs an all-gather of
the whole logits and, on every rank, the whole loss: at a vocabulary of 131072 and 16384
tokens a microbatch, 4.3 GB of bf16 logits moved, and the fp32 log-softmax, its gradient
and the logits' own fp32 copy (26 GB) made on each of the ranks. Megatron computes the
cross entropy on the slices instead: each rank's maximum and sum of exponentials and the
target's logit where the rank holds it, completed by two all-reduces of one number per
position, and each rank's gradient is its slice's ``softmax - one_hot``, with no
collective in backward.

partc's loss is the user's Python (``passes/trace.LossCall``), never traced into.
:class:`VocabParallelLoss` runs it on the slice under a torch-function mode
(:class:`_ShardedVocab`) that follows the slice through what the loss does to it:

- ``F.cross_entropy`` (``nn.CrossEntropyLoss`` calls it) of the slice, class indices as
  target, no class weights: the vocab-parallel cross entropy
  (:func:`vocab_parallel_cross_entropy`; ``ignore_index``, ``label_smoothing`` and the
  three reductions as torch has them);
- ``logsumexp`` over the classes (PaLM's z-loss): each rank's maximum and sum of
  exponentials, all-reduced; ``log_softmax`` over them likewise, its output a slice
  (the sum's gradient all-reduced in backward); ``F.nll_loss`` of a slice: the target's
  entry picked where the rank holds it, all-reduced;
- ops that keep the class dim whole and move it: reshapes and views that keep it a dim
  of its own (``logits.view(-1, vocab)``), ``flatten``, transposes and permutes,
  indexing that takes all of it (``logits[:, :-1]``), dtype casts, ``contiguous``,
  ``clone``, ``detach``, scaling by a number, ``tanh`` (soft-capping);
- a size asked of the slice is the whole tensor's (``logits.size(-1)`` is the
  vocabulary), so that the loss's arithmetic on sizes keeps its meaning; what autograd
  and memory tools ask of a tensor (hooks, storages, strides, bytes) is the slice's;
- anything else first gathers the slice whole (an all-gather whose backward keeps this
  rank's part) and runs as written: slower, never different. An in-place change of the
  slice is refused: the gathered copy would take it, not the values the loss reads next.

The compiler uses it only where a probe (:func:`probe`: the loss run once on meta
tensors, the slice at its local size, over a stand-in group) found the loss to compute a
vocab-parallel cross entropy with nothing gathered; the plan counts the all-reduces that
run made (two per cross entropy, the second of two or, with label smoothing, three
numbers a position), and the planner prices what it moved and launched.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from partc.runtime.tp import TensorParallelGroup


class ShardedLossError(RuntimeError):
    """The loss changed its vocabulary slice in place."""


# ------------------------------------------------------------------- the cross entropy

class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per position, the cross entropy of logits whose last dim is this rank's slice of
    the classes (rank r holds classes ``[r * n, (r + 1) * n)``), in fp32 (fp64 logits in
    fp64)."""

    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, smoothing):
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))
        width = x.shape[-1]
        top = group.all_reduce(x.amax(-1), op="max")
        shifted = x - top.unsqueeze(-1)
        local = target - group.rank * width
        owned = (local >= 0) & (local < width)
        index = local.masked_fill(~owned, 0).unsqueeze(-1)
        picked = shifted.gather(-1, index).squeeze(-1).masked_fill(~owned, 0.0)
        parts = [picked] + ([shifted.sum(-1)] if smoothing else [])
        exp = shifted.exp_()
        sums = group.all_reduce(torch.stack([exp.sum(-1), *parts]))
        log_total = sums[0].log()
        loss = log_total - sums[1]
        if smoothing:
            vocab = width * group.size
            loss = (1.0 - smoothing) * loss + smoothing * (log_total - sums[2] / vocab)
        ignored = target == ignore_index
        softmax = exp.div_(sums[0].unsqueeze(-1))
        # In the logits' dtype, as torch's own cross entropy keeps its log-softmax.
        ctx.save_for_backward(softmax.to(logits.dtype), index, owned, ignored)
        ctx.smoothing, ctx.vocab, ctx.dtype = smoothing, width * group.size, logits.dtype
        return loss.masked_fill(ignored, 0.0)

    @staticmethod
    def backward(ctx, grad):
        softmax, index, owned, ignored = ctx.saved_tensors
        result = softmax.to(torch.promote_types(ctx.dtype, torch.float32), copy=True)
        if ctx.smoothing:
            result.sub_(ctx.smoothing / ctx.vocab)
        hit = owned.unsqueeze(-1).to(result.dtype) * -(1.0 - ctx.smoothing)
        result.scatter_add_(-1, index, hit)
        result.mul_(grad.to(result.dtype).masked_fill(ignored, 0.0).unsqueeze(-1))
        return result.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(group: TensorParallelGroup, logits: torch.Tensor,
                                 target: torch.Tensor, ignore_index: int = -100,
                                 reduction: str = "mean", label_smoothing: float = 0.0
                                 ) -> torch.Tensor:
    """``F.cross_entropy(whole, target, ...)`` where ``logits`` is this rank's slice of
    ``whole``'s class dim (dim 1, or 0 for one unbatched position), computed in fp32 (or
    fp64) and returned in the logits' dtype."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"{reduction} is not a valid value for reduction")
    x = logits.movedim(1 if logits.dim() > 1 else 0, -1)
    per = _VocabParallelCrossEntropy.apply(x, target, group, ignore_index, label_smoothing)
    return _reduced(per, target, ignore_index, reduction).to(logits.dtype)


def _reduced(per: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str
             ) -> torch.Tensor:
    """Per-position losses reduced as torch's class-index losses reduce them: a mean is
    over the positions not ignored."""
    if reduction == "none":
        return per
    total = per.sum()
    return total / (target != ignore_index).sum() if reduction == "mean" else total


# ------------------------------------------------------------- following the slice

_CROSS_ENTROPY = inspect.signature(F.cross_entropy)
_NLL_LOSS = inspect.signature(F.nll_loss)
# Reads of a tensor's metadata that do not depend on its sizes: as they are.
_AS_IS = {torch.Tensor.dim, torch.Tensor.is_floating_point, torch.Tensor.is_complex,
          torch.Tensor.element_size, torch.Tensor.get_device}
_AS_IS_ATTRIBUTES = {"ndim", "dtype", "device", "requires_grad", "is_cuda", "is_meta",
                     "layout", "is_leaf", "grad_fn", "is_sparse", "is_quantized", "grad",
                     "itemsize", "nbytes", "_version", "output_nr", "_base", "is_nested",
                     "names"}
# What autograd, memory trackers and the runtime's own machinery ask of the tensor they
# are handed (hooks, storages, strides): the slice, as it is. Gathering for them would
# hook or measure a copy.
_MACHINERY = {torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook,
              torch.Tensor.retain_grad, torch.Tensor.requires_grad_,
              torch.Tensor.untyped_storage, torch.Tensor.data_ptr,
              torch.Tensor.storage_offset, torch.Tensor.stride, torch.Tensor.is_contiguous,
              torch.Tensor.is_pinned, torch.Tensor.__hash__}
# The slice in, the slice out, its class dim where it was.
_KEEP = {torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.double,
         torch.Tensor.to, torch.Tensor.type_as, torch.Tensor.contiguous,
         torch.Tensor.clone, torch.clone, torch.Tensor.detach, torch.detach,
         torch.Tensor.tanh, torch.tanh}
_SCALE = {torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.Tensor.__truediv__,
          torch.Tensor.mul, torch.mul, torch.Tensor.div, torch.div}


def _attribute(func: Callable) -> str | None:
    """The name of the tensor attribute ``func`` reads (``Tensor.shape``'s getter), if any."""
    owner = getattr(func, "__self__", None)
    if getattr(func, "__name__", "") == "__get__" and type(owner).__name__ == "getset_descriptor":
        return owner.__name__
    return None


def _in_place(func: Callable, kwargs: dict) -> bool:
    name = getattr(func, "__name__", "")
    return ("out" in kwargs or name == "__setitem__"
            or (name.endswith("_") and not name.endswith("__")))


class _ShardedVocab(TorchFunctionMode):
    """Follows vocabulary slices (tensor → its class dim) through a loss function."""

    def __init__(self, group: TensorParallelGroup) -> None:
        super().__init__()
        self.group = group
        self.dims: dict[int, tuple[torch.Tensor, int]] = {}  # id → (the slice, class dim)
        self.gathered = 0          # slices gathered whole for an op not followed
        self.cross_entropies = 0   # vocab-parallel cross entropies run
        self.vocab_parallel_ops = 0   # those and the logsumexps, log-softmaxes, nll losses
        # Their all-reduces, as (kind, phase, bytes): what a plan counts of this loss.
        self.collectives: list[tuple[str, str, int]] = []

    def follow(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        self.dims[id(tensor)] = (tensor, dim % tensor.dim())
        return tensor

    def dim_of(self, value: Any) -> int | None:
        held = self.dims.get(id(value)) if isinstance(value, torch.Tensor) else None
        return held[1] if held is not None and held[0] is value else None

    def whole(self, value: Any) -> Any:
        """``value`` gathered whole where it is a followed slice."""
        dim = self.dim_of(value)
        if dim is None:
            return value
        self.gathered += 1
        return self.group.gather_from_tp(value, dim)

    def global_shape(self, tensor: torch.Tensor, dim: int) -> torch.Size:
        sizes = list(tensor.shape)
        sizes[dim] *= self.group.size
        return torch.Size(sizes)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        if func in _MACHINERY or not any(self.dim_of(leaf) is not None for leaf in leaves):
            return func(*args, **kwargs)
        if _in_place(func, kwargs):
            raise ShardedLossError(
                f"the loss changes its vocabulary-sharded input in place "
                f"({getattr(func, '__name__', func)}); plan without tensor parallelism "
                "of the LM head, or write the loss without in-place ops on the logits")
        followed = self._followed(func, args, kwargs)
        if followed is not NotImplemented:
            return followed
        args, kwargs = pytree.tree_map(self.whole, (args, kwargs))
        return func(*args, **kwargs)

    def _followed(self, func, args, kwargs) -> Any:
        x = args[0] if args else None
        dim = self.dim_of(x)
        attribute = _attribute(func)
        if attribute is not None:
            if attribute == "shape" and dim is not None:
                return self.global_shape(x, dim)
            if attribute == "data" and dim is not None:
                return self.follow(func(*args, **kwargs), dim)
            return func(*args, **kwargs) if attribute in _AS_IS_ATTRIBUTES else NotImplemented
        if func is F.cross_entropy:
            return self._cross_entropy(args, kwargs)
        if func in (torch.logsumexp, torch.Tensor.logsumexp) and dim is not None:
            return self._logsumexp(x, dim, args[1:], kwargs)
        if func in (F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax) \
                and dim is not None:
            return self._log_softmax(x, dim, args[1:], kwargs)
        if func is F.nll_loss:
            return self._nll_loss(args, kwargs)
        if dim is None:
            return NotImplemented
        if func in _AS_IS:
            return func(*args, **kwargs)
        if func is torch.Tensor.size:
            whole = self.global_shape(x, dim)
            index = args[1] if len(args) > 1 else kwargs.get("dim")
            return whole if index is None else whole[index]
        if func is torch.Tensor.numel:
            return x.numel() * self.group.size
        if func is torch.Tensor.__len__:
            return self.global_shape(x, dim)[0]
        if func in _KEEP:
            return self.follow(func(*args, **kwargs), dim)
        if func in _SCALE:
            other = args[1] if len(args) > 1 else kwargs.get("other")
            if not isinstance(other, (int, float)) or len(args) > 2 or \
                    set(kwargs) - {"other"}:
                return NotImplemented
            return self.follow(func(*args, **kwargs), dim)
        return self._moved(func, x, dim, args[1:], kwargs)

    def _moved(self, func, x: torch.Tensor, dim: int, rest: tuple, kwargs: dict) -> Any:
        """Reshapes, transposes and indexing that keep the class dim whole."""
        whole = self.global_shape(x, dim)
        if func in (torch.Tensor.reshape, torch.Tensor.view, torch.reshape):
            sizes = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
            sizes = kwargs.get("shape", sizes)
            if not all(isinstance(s, int) for s in sizes) or \
                    set(kwargs) - {"shape"} or (len(rest) > 1 and "shape" in kwargs):
                return NotImplemented
            return self._reshaped(x, dim, whole, list(sizes), func)
        if func in (torch.Tensor.flatten, torch.flatten):
            start = rest[0] if rest else kwargs.get("start_dim", 0)
            end = rest[1] if len(rest) > 1 else kwargs.get("end_dim", -1)
            start, end = start % len(whole), end % len(whole)
            if start > end:
                return NotImplemented
            sizes = [*whole[:start], -1, *whole[end + 1:]]
            return self._reshaped(x, dim, whole, sizes, torch.Tensor.reshape)
        order = self._order(func, len(whole), rest, kwargs)
        if order is not None:
            return self.follow(func(x, *rest, **kwargs), order.index(dim))
        if func is torch.Tensor.__getitem__ and not kwargs and len(rest) == 1:
            moved = _index_keeps(rest[0], dim, len(whole))
            if moved is not None:
                return self.follow(x[rest[0]], moved)
        return NotImplemented

    def _reshaped(self, x, dim, whole, sizes, func) -> Any:
        local = _local_sizes(whole, dim, sizes, self.group.size)
        if local is None:
            return NotImplemented
        sizes, moved = local
        return self.follow(func(x, sizes), moved)

    @staticmethod
    def _order(func, n: int, rest: tuple, kwargs: dict) -> list[int] | None:
        """Where each dim of a transpose's, permute's or movedim's output comes from."""
        if kwargs:
            return None
        order = list(range(n))
        if func in (torch.Tensor.transpose, torch.transpose, torch.Tensor.swapaxes,
                    torch.swapaxes) and len(rest) == 2:
            a, b = rest[0] % n, rest[1] % n
            order[a], order[b] = order[b], order[a]
            return order
        if func in (torch.Tensor.permute, torch.permute) and rest:
            dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
            return [d % n for d in dims]
        if func in (torch.Tensor.movedim, torch.movedim) and len(rest) == 2 \
                and all(isinstance(d, int) for d in rest):
            source = order.pop(rest[0] % n)
            order.insert(rest[1] % n, source)
            return order
        return None

    def _cross_entropy(self, args, kwargs) -> Any:
        given = self._class_indices(_CROSS_ENTROPY, args, kwargs)
        if given is None:
            return NotImplemented
        logits, target = given["input"], given["target"]
        classes = 1 if logits.dim() > 1 else 0
        self.cross_entropies += 1
        self.vocab_parallel_ops += 1
        # Per position: the maximum, then the sum of exponentials and the target's logit
        # (and, smoothing, the sum of the logits), in the dtype it computes in.
        positions = logits.numel() // max(logits.shape[classes], 1)
        width = torch.promote_types(logits.dtype, torch.float32).itemsize * positions
        sums = 3 if given["label_smoothing"] else 2
        self.collectives += [("all_reduce", "forward", width),
                             ("all_reduce", "forward", sums * width)]
        return vocab_parallel_cross_entropy(self.group, logits, target, given["ignore_index"],
                                            given["reduction"], given["label_smoothing"])

    def _logsumexp(self, x: torch.Tensor, dim: int, rest: tuple, kwargs: dict) -> Any:
        """``logsumexp`` over the class dim: the maximum and the sum of exponentials
        all-reduced. What reads the result is replicated, so each rank's gradient of it is
        whole: the sum's all-reduce needs none in backward."""
        over = rest[0] if rest else kwargs.get("dim")
        keep = rest[1] if len(rest) > 1 else kwargs.get("keepdim", False)
        over = over[0] if isinstance(over, (tuple, list)) and len(over) == 1 else over
        if not isinstance(over, int) or over % x.dim() != dim or len(rest) > 2 or \
                set(kwargs) - {"dim", "keepdim"}:
            return NotImplemented
        top, total = self._log_partition(x.to(torch.promote_types(x.dtype, torch.float32)),
                                         dim, grad_partial=False)
        result = (top + total.log()).to(x.dtype)
        return result if keep else result.squeeze(dim)

    def _log_softmax(self, x: torch.Tensor, dim: int, rest: tuple, kwargs: dict) -> Any:
        """``log_softmax`` over the class dim, as this rank's slice: ``x`` less the
        all-reduced log-partition. What reads the slice leaves each rank part of the
        log-partition's gradient: summed over the group in backward."""
        over = rest[0] if rest else kwargs.get("dim")
        dtype = rest[1] if len(rest) > 1 else kwargs.get("dtype")
        if not isinstance(over, int) or over % x.dim() != dim or len(rest) > 2 or \
                set(kwargs) - {"dim", "dtype", "_stacklevel"}:
            return NotImplemented
        wide = x.to(torch.promote_types(dtype or x.dtype, torch.float32))
        top, total = self._log_partition(wide, dim, grad_partial=True)
        return self.follow((wide - top - total.log()).to(dtype or x.dtype), dim)

    def _nll_loss(self, args, kwargs) -> Any:
        given = self._class_indices(_NLL_LOSS, args, kwargs)
        if given is None or given["reduction"] not in ("mean", "sum", "none"):
            return NotImplemented
        scores, target = given["input"], given["target"]
        classes = 1 if scores.dim() > 1 else 0
        self.vocab_parallel_ops += 1
        width = scores.shape[classes]
        local = target - self.group.rank * width
        owned = (local >= 0) & (local < width)
        index = local.masked_fill(~owned, 0).unsqueeze(classes)
        picked = scores.gather(classes, index).squeeze(classes).masked_fill(~owned, 0.0)
        total = self.group.reduce_from_tp(picked)
        self.collectives.append(("all_reduce", "forward", total.numel() * total.element_size()))
        per = (-total).masked_fill(target == given["ignore_index"], 0.0)
        return _reduced(per, target, given["ignore_index"], given["reduction"])

    def _class_indices(self, signature: inspect.Signature, args, kwargs) -> dict | None:
        """A cross entropy's or nll loss's arguments, bound by ``signature``, where the
        call is ours to run: its input a slice by the class dim, class indices as target,
        no weights, no legacy reduction flags; else None."""
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        scores, target = given["input"], given["target"]
        ours = (self.dim_of(scores) == (1 if scores.dim() > 1 else 0)
                and given["weight"] is None and given["size_average"] is None
                and given["reduce"] is None and isinstance(target, torch.Tensor)
                and not target.is_floating_point() and self.dim_of(target) is None)
        return given if ours else None

    def _log_partition(self, wide: torch.Tensor, dim: int, grad_partial: bool
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each position's maximum over the classes and its sum of exponentials below
        it, both all-reduced (the sum's gradient too where ``grad_partial``)."""
        self.vocab_parallel_ops += 1
        top = self.group.all_reduce(wide.detach().amax(dim, keepdim=True), op="max")
        total = self.group.reduce_from_tp((wide - top).exp().sum(dim, keepdim=True),
                                          grad_partial=grad_partial)
        nbytes = top.numel() * top.element_size()
        self.collectives += [("all_reduce", "forward", nbytes)] * 2 + (
            [("all_reduce", "backward", nbytes)] if grad_partial else [])
        return top, total


def _local_sizes(whole: torch.Size, dim: int, sizes: list[int], tp: int
                 ) -> tuple[list[int], int] | None:
    """A reshape of a tensor of shape ``whole`` sharded on ``dim`` to ``sizes``, as the
    slice's reshape and the class dim's place in it; None unless the class dim stays
    one dim of its own (the dims before it and after it regrouped among themselves)."""
    total = 1
    for size in whole:
        total *= size
    if sizes.count(-1) > 1:
        return None
    if -1 in sizes:
        known = 1
        for size in sizes:
            known *= size if size != -1 else 1
        if not known or total % known:
            return None
        sizes = [total // known if s == -1 else s for s in sizes]
    before = 1
    for size in whole[:dim]:
        before *= size
    prefix = 1
    for k, size in enumerate(sizes):
        if prefix == before and size == whole[dim]:
            local = list(sizes)
            local[k] = size // tp
            return local, k
        prefix *= size
        if prefix > before:
            return None
    return None


def _index_keeps(index: Any, dim: int, n: int) -> int | None:
    """Where the class dim ``dim`` of an ``n``-dim tensor lands after ``x[index]``; None
    unless the index takes all of it with basic indexing (slices, ints, ``None``,
    ``...``)."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(not (isinstance(i, (int, slice)) or i is None or i is Ellipsis) for i in items):
        return None
    if items.count(Ellipsis) > 1:
        return None
    if Ellipsis in items:
        at = items.index(Ellipsis)
        used = sum(1 for i in items if i is not None and i is not Ellipsis)
        items[at:at + 1] = [slice(None)] * (n - used)
    source, out = 0, 0
    for item in items:
        if item is None:
            out += 1
            continue
        if source == dim:
            return out if item == slice(None) else None
        source += 1
        out += 0 if isinstance(item, int) else 1
    return out + (dim - source) if dim >= source else None


# ------------------------------------------------------------------- the loss module

class VocabParallelLoss(nn.Module):
    """The user's loss (``loss_call``, a ``passes/trace.LossCall``) with its input
    ``position`` sharded over ``tp`` by its last (class) dim; see the module docstring."""

    def __init__(self, group: TensorParallelGroup, loss_call: nn.Module, position: int
                 ) -> None:
        super().__init__()
        self.tp = group
        self.loss_call = loss_call
        self.position = position
        # What the last call gathered whole, the vocab-parallel cross entropies and other
        # vocab-parallel ops it ran, and their collectives (the probe reads them).
        self.gathered = 0
        self.cross_entropies = 0
        self.vocab_parallel_ops = 0
        self.collectives: tuple[tuple[str, str, int], ...] = ()

    def forward(self, *leaves_and_target: Any) -> Any:
        mode = _ShardedVocab(self.tp)
        mode.follow(leaves_and_target[self.position], -1)
        with mode:
            result = self.loss_call(*leaves_and_target)
        # A slice the loss returns as it is leaves whole.
        result = pytree.tree_map(mode.whole, result)
        self.gathered, self.cross_entropies = mode.gathered, mode.cross_entropies
        self.vocab_parallel_ops = mode.vocab_parallel_ops
        self.collectives = tuple(mode.collectives)
        return result

    def extra_repr(self) -> str:
        return f"input={self.position}, sharded by its last dim"


def probe(loss_call: nn.Module, inputs: list[Any], position: int, tp: int
          ) -> tuple[tuple[str, str, int], ...] | None:
    """The collectives (kind, phase, bytes) ``loss_call`` runs on ``inputs`` (tensors'
    shapes and dtypes, the whole values) with input ``position`` sharded ``tp`` ways by
    its last dim, where it runs some vocab-parallel op (a cross entropy, logsumexp,
    log-softmax, nll loss) and gathers nothing; else None. Run once on meta tensors over
    a stand-in group."""
    def on_meta(value: Any) -> Any:
        return torch.empty(value.shape, dtype=value.dtype, device="meta") \
            if isinstance(value, torch.Tensor) else value

    values = [on_meta(v) for v in inputs]
    sharded = values[position]
    if not (isinstance(sharded, torch.Tensor) and sharded.is_floating_point()
            and sharded.dim() >= 1 and sharded.shape[-1] % tp == 0):
        return None
    values[position] = sharded.narrow(-1, 0, sharded.shape[-1] // tp)
    run = VocabParallelLoss(TensorParallelGroup(tp), loss_call, position)
    try:
        with torch.no_grad():
            run(*values)
    except Exception:   # any loss the probe cannot run stays unsharded: never wrong
        return None
    return run.collectives if run.vocab_parallel_ops and not run.gathered else None
