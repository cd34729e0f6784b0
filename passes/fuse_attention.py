"""Attention written as plain ops, rewritten into one fused kernel call.

Models written for readability (``samples/gpt.py``, Hugging Face's eager attention)
spell attention out::

    scores = q @ k.transpose(-2, -1)          # (batch, heads, seq_q, seq_k)
    scores = scores * scale                    # or / sqrt(d), or no scale
    scores = scores + mask                     # additive mask; or masked_fill(~keep, -inf)
    probs  = dropout(softmax(scores, -1), p)   # dtype casts around it allowed
    out    = probs @ v

and autograd keeps the (seq_q, seq_k) scores and probabilities of every head for
backward. ``torch.nn.functional.scaled_dot_product_attention`` (flash and memory-efficient
kernels) keeps only q, k, v, the output and one log-sum-exp per row, and recomputes the
probabilities in backward. This pass finds the pattern above and puts one such call in
its place, with ``scale`` the scale written (1.0 when there is none), ``dropout_p`` the
dropout's probability when it trains, and the mask:

- ``is_causal=True`` when the mask is provably causal: it depends on shapes only (no
  input, no parameter), so it is evaluated once here on CPU, and every position it keeps
  is exactly ``j <= i`` while every other is ``-inf`` or at most the dtype's lowest
  finite value (which softmax turns into exactly 0 whenever a row keeps one position,
  as a causal row always does: its diagonal);
- no mask when it keeps every position (a BERT batch without padding);
- otherwise an additive mask is passed as ``attn_mask`` unchanged (SDPA adds it to the
  scaled scores, as the written code does); a boolean ``masked_fill`` mask that is not
  causal is left alone, since a fully masked row differs between the two.

A model's own SDPA call (Hugging Face's ``sdpa`` attention) whose mask is provably
causal or keeps every position, by the same evaluation, loses the mask the same way:
the flash kernels take ``is_causal`` but no mask, and a mask is kept for backward.

Attention with sinks (gpt-oss) adds one logit per head to every row's softmax and drops
its column after it: ``softmax(cat([scores + mask, sinks], -1))[..., :-1] @ v``. That is
attention over one more key whose score is the sink's logit and whose value is zero,
which SDPA computes exactly when each query gets one more feature, 1, each key a 0, and
the extra key (first) is zero but for ``sink / scale`` there; the features are padded
with zeros to a multiple of 8, the values get a zero row, and the mask, when there is
one, a kept column. The sinks keep their gradients. A row's shift by its own maximum
before the softmax (``x - x.max(-1, keepdim=True)``) changes nothing and is dropped,
with or without sinks.

Grouped-query attention's ``repeat_kv`` (expand + reshape of k and v) stays before the
call: the kernel then sees as many key/value heads as query heads. Dropout inside the
kernel draws its own mask, with the same distribution as the written dropout.

A match is rewritten only when the result is the same function (the checks above, one
user for every intermediate, softmax over the last dim); otherwise the graph is left as
it is and the log says why, once per reason.
"""

from __future__ import annotations

import functools
import logging
import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from partc import meta
from partc.passes.context import Context
from partc.passes.helpers.graph import is_dtype_check
from partc.passes.helpers.mask_rows import RowBlocks, blocks, deferred, tiles, whole

log = logging.getLogger("partc")


@dataclass(frozen=True)
class Match:
    """One attention found in the graph, in the terms of the fused call."""

    query: fx.Node
    key: fx.Node       # (..., seq_k, d): the operand before its transpose
    value: fx.Node
    scale: float | None       # None: SDPA's own, 1 / sqrt(head dim)
    mask: fx.Node | None      # passed as attn_mask (None when causal or none)
    is_causal: bool
    dropout_p: float
    chain: tuple[fx.Node, ...]  # the nodes the call replaces, the output product last
    enable_gqa: bool = False
    # Attention sinks (gpt-oss): one more logit per head in each row's softmax, whose
    # value is zero. ``sink`` its (..., heads, 1, 1) logits; ``sink_mask`` the additive
    # mask to pass (None when causal or keeping all), which the call extends by the
    # sink's column.
    sink: fx.Node | None = None
    sink_mask: fx.Node | None = None


class _NoMatch(Exception):
    """Why a candidate is not rewritten (the log's words)."""


def fuse_attention(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    """Replace each attention written as plain ops by ``F.scaled_dot_product_attention``.

    Reads: ``node.meta["val"]``, ``meta.MODULE_PATH``. Writes: the graph (the new call
    takes the place of the output product; the replaced nodes and what only they used
    are erased); ``val``, ``meta.TENSORS``, ``meta.MODULE_PATH`` on the new node.
    Requires: ``propagate``. Ensures: every rewritten attention computes what it did.
    """
    reasons: set[str] = set()
    kinds: dict[fx.Node, str] = {}  # per mask node: one evaluation for every layer
    fused = unmasked = 0
    for node in list(gm.graph.nodes):
        if _is(node, "scaled_dot_product_attention"):
            match = _unmasked(node, kinds)
            if match is not None:
                _rewrite(gm, match, ctx)
                unmasked += 1
        elif _is(node, "softmax", "_softmax") and _over_scores(node):
            try:
                match = _match(node, kinds)
            except _NoMatch as why:
                reasons.add(str(why))
                continue
            _rewrite(gm, match, ctx)
            fused += 1
    for reason in sorted(reasons):
        log.info("attention left as written: %s", reason)
    if fused or unmasked:
        gm.graph.lint()
        gm.recompile()
        log.info("attention as the flash kernels take it: %d written as plain ops fused "
                 "into scaled_dot_product_attention; %d of the model's own "
                 "scaled_dot_product_attention calls given is_causal (or no mask) for an "
                 "explicit mask that was causal (or masked nothing)", fused, unmasked)
    return gm


def _over_scores(softmax: fx.Node) -> bool:
    """Whether ``softmax`` could be attention's: over a value of three dims or more
    ((batch, [heads,] queries, keys)). A router's over (tokens, experts) is not, and is
    passed over without a word in the log."""
    value = _val(_arg(softmax, 0, "input"))
    return isinstance(value, torch.Tensor) and value.dim() >= 3


def count_fused(gm: fx.GraphModule) -> int:
    """How many ``F.scaled_dot_product_attention`` calls ``gm`` holds (this pass puts
    in such calls; torch.export writes a model's own as the aten op)."""
    return sum(1 for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention)


# ----------------------------------------------------------------------- matching

def _name(node: fx.Node) -> str:
    target = node.target
    if node.op == "call_method":
        return str(target)
    if node.op != "call_function":
        return ""
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return {operator.matmul: "matmul", operator.mul: "mul", operator.truediv: "div",
            operator.add: "add", operator.invert: "bitwise_not"}.get(
        target, getattr(target, "__name__", ""))


def _is(node: Any, *names: str) -> bool:
    return isinstance(node, fx.Node) and _name(node) in names


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def _users(node: fx.Node) -> list[fx.Node]:
    """Users that compute something (dtype checks export leaves are not)."""
    return [u for u in node.users if not is_dtype_check(u)]


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _match(softmax: fx.Node, kinds: dict[fx.Node, str]) -> Match:
    scores = _arg(softmax, 0, "input")
    value = _val(scores)
    dim = _arg(softmax, 1, "dim")
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or \
            dim not in (-1, value.dim() - 1):
        raise _NoMatch("softmax over another dim than the last")
    dtype = _arg(softmax, 2, "dtype") if _name(softmax) != "_softmax" else None
    if _name(softmax) == "_softmax" and softmax.args[2]:
        raise _NoMatch("half-to-float softmax")
    if dtype not in (None, value.dtype, torch.float32):
        raise _NoMatch(f"softmax in {dtype}")
    chain = [softmax]
    cut = _sink_cut(softmax)
    if cut is not None:
        chain.append(cut)
    probs, dropout_p = _after_softmax(cut if cut is not None else softmax, chain)
    product = _users(probs)
    if len(product) > 1:
        raise _NoMatch(f"{probs.name} is used outside the attention (e.g. attention "
                       "probabilities returned)")
    if not product or not _is(product[0], "matmul") or product[0].args[0] is not probs:
        raise _NoMatch("softmax output is not multiplied by the values")
    chain.append(product[0])
    scores = _unshifted(scores, chain)
    sink = None
    if cut is not None:
        scores, sink = _sink_column(scores, chain)
    mask, is_causal, logits = _mask(scores, chain, kinds)
    scale, qk = _scale(logits, chain)
    if not _is(qk, "matmul"):
        raise _NoMatch("no q @ k^T before the softmax")
    chain.append(qk)
    inside = set(chain)
    for node in chain:
        if node is not product[0] and not set(_users(node)) <= inside:
            raise _NoMatch(f"{node.name} is used outside the attention (e.g. attention "
                           "probabilities returned)")
    query, key_t = qk.args[:2]
    key = _untransposed(key_t)
    v = product[0].args[1]
    if not all(isinstance(_val(t), torch.Tensor) and _val(t).dim() >= 3
               for t in (query, key, v)):
        raise _NoMatch("q, k, v are not (batch, ..., seq, dim) tensors")
    if is_causal and _val(query).shape[-2] != _val(key).shape[-2]:
        raise _NoMatch("causal mask with seq_q != seq_k")
    ordered = sorted(set(chain), key=_position(softmax.graph))
    if sink is not None:   # causal: a square causal call; else the mask, extended
        return Match(query=query, key=key, value=v, scale=scale, mask=None,
                     is_causal=is_causal, dropout_p=dropout_p, chain=tuple(ordered),
                     sink=sink, sink_mask=mask)
    return Match(query=query, key=key, value=v, scale=scale, mask=mask,
                 is_causal=is_causal, dropout_p=dropout_p, chain=tuple(ordered))


def _unmasked(call: fx.Node, kinds: dict[fx.Node, str]) -> Match | None:
    """A model's own SDPA call whose mask is causal or keeps everything, as one without
    (``is_causal``, which the flash kernels take, or no mask); None for any other."""
    query, key, value, mask = (_arg(call, i, name) for i, name in
                               enumerate(("query", "key", "value", "attn_mask")))
    if not isinstance(mask, fx.Node) or _arg(call, 5, "is_causal", False):
        return None
    if mask not in kinds:
        kinds[mask] = _mask_kind(mask, "keeps" if _val(mask).dtype == torch.bool
                                 else "additive")
    if kinds[mask] == "other" or (kinds[mask] == "causal" and
                                  _val(query).shape[-2] != _val(key).shape[-2]):
        return None
    return Match(query=query, key=key, value=value, scale=call.kwargs.get("scale"),
                 mask=None, is_causal=kinds[mask] == "causal",
                 dropout_p=float(_arg(call, 4, "dropout_p", 0.0)), chain=(call,),
                 enable_gqa=bool(call.kwargs.get("enable_gqa", False)))


def _position(graph: fx.Graph):
    order = {node: i for i, node in enumerate(graph.nodes)}
    return order.__getitem__


def _is_noop_cast(node: fx.Node) -> bool:
    if not _is(node, "to", "type_as", "float", "_to_copy"):
        return False
    source, result = _val(node.args[0]), _val(node)
    return isinstance(result, torch.Tensor) and isinstance(source, torch.Tensor) and \
        result.dtype == source.dtype and result.is_floating_point()


def _after_softmax(softmax: fx.Node, chain: list[fx.Node]) -> tuple[fx.Node, float]:
    """Casts and one dropout after the softmax: the node whose output meets v, and p."""
    node, dropout_p = softmax, 0.0
    while True:
        users = _users(node)
        if len(users) != 1:
            return node, dropout_p
        user = users[0]
        if _is_noop_cast(user):
            pass
        elif _is(user, "dropout") and dropout_p == 0.0 and user.args[0] is node:
            p = _arg(user, 1, "p", 0.5)
            train = _arg(user, 2, "train", _arg(user, 2, "training", True))
            if not isinstance(p, (int, float)) or not isinstance(train, bool):
                raise _NoMatch("dropout with a computed probability or train flag")
            dropout_p = float(p) if train else 0.0
        else:
            return node, dropout_p
        chain.append(user)
        node = user


def _sink_cut(softmax: fx.Node) -> fx.Node | None:
    """The slice that drops the softmax's last column (an attention sink's), when that is
    all the softmax's output is read through; else None."""
    users = _users(softmax)
    if len(users) != 1 or not _is(users[0], "slice") or users[0].args[0] is not softmax:
        return None
    cut, value = users[0], _val(softmax)
    dim = _arg(cut, 1, "dim", 0)
    start, end = _arg(cut, 2, "start", None), _arg(cut, 3, "end", None)
    step = _arg(cut, 4, "step", 1)
    columns = value.shape[-1]
    if dim not in (-1, value.dim() - 1) or start not in (None, 0) or step != 1 \
            or end not in (-1, columns - 1):
        return None
    return cut


def _unshifted(scores: fx.Node, chain: list[fx.Node]) -> fx.Node:
    """``scores`` without a subtraction of its own row maximum (``x - x.max(-1,
    keepdim=True).values``), which changes no softmax."""
    if not (_is(scores, "sub") and len(scores.args) == 2 and not scores.kwargs):
        return scores
    x, top = scores.args
    if _is(top, "getitem") and top.args[1] == 0:
        top_of = top.args[0]
        if _is(top_of, "max", "amax") and top_of.args[0] is x \
                and _arg(top_of, 1, "dim", None) in (-1, _val(x).dim() - 1) \
                and _arg(top_of, 2, "keepdim", False):
            # ``max`` also returns the indices, which nothing reads.
            unread = [u for u in top_of.users if u is not top and not u.users]
            chain.extend((scores, top, top_of, *unread))
            return x
    if _is(top, "amax") and top.args[0] is x \
            and _arg(top, 1, "dim", None) in ([-1], (-1,), [_val(x).dim() - 1]) \
            and _arg(top, 2, "keepdim", False):
        chain.extend((scores, top))
        return x
    return scores


def _sink_column(scores: fx.Node, chain: list[fx.Node]) -> tuple[fx.Node, fx.Node]:
    """For a softmax whose last column is dropped: the scores before ``cat([scores,
    sinks], -1)`` and the sinks, one logit per head for every row ((..., heads, 1, 1),
    broadcast over the rows)."""
    if not (_is(scores, "cat") and _arg(scores, 1, "dim", 0) in (-1, _val(scores).dim() - 1)
            and len(scores.args[0]) == 2):
        raise _NoMatch("the softmax's last column, dropped, is no concatenated sink")
    real, sink = scores.args[0]
    value = _val(sink)
    if not isinstance(value, torch.Tensor) or value.shape[-1] != 1:
        raise _NoMatch("the sink column is not one logit per row")
    if value.shape[-2] != 1:   # expanded over the rows: the one per head it expands
        base = sink.args[0] if _is(sink, "expand") else None
        if base is None or _val(base).dim() != value.dim() or _val(base).shape[-2:] != (1, 1):
            raise _NoMatch("the sink logits differ between rows")
        if len(sink.users) == 1:
            chain.append(sink)
        sink = base
    chain.append(scores)
    return real, sink


def _mask(scores: fx.Node, chain: list[fx.Node], kinds: dict[fx.Node, str]
          ) -> tuple[fx.Node | None, bool, fx.Node]:
    """The mask applied to ``scores`` (the softmax input): (additive mask to pass, is
    causal, the scaled scores before the mask)."""
    if _is(scores, "add") and len(scores.args) == 2 and not scores.kwargs:
        left, right = scores.args
        logits, mask = (left, right) if _is(left, "mul", "div", "matmul") else (right, left)
        if not isinstance(_val(mask), torch.Tensor) or not _val(mask).is_floating_point():
            raise _NoMatch("added mask is not a float tensor")
        chain.append(scores)
        if mask not in kinds:
            kinds[mask] = _mask_kind(mask, "additive")
        return (mask if kinds[mask] == "other" else None, kinds[mask] == "causal", logits)
    if _is(scores, "masked_fill"):
        logits, fill, fill_value = scores.args[:3]
        chain.append(scores)
        if fill not in kinds:
            kinds[fill] = _mask_kind(fill, "drops")
        if not _is_lowest(fill_value) or kinds[fill] == "other":
            raise _NoMatch("masked_fill mask not provably causal")
        return None, kinds[fill] == "causal", logits
    return None, False, scores


def _scale(logits: fx.Node, chain: list[fx.Node]) -> tuple[float, fx.Node]:
    """The scale applied to ``q @ k^T`` and the product itself."""
    if not _is(logits, "mul", "div"):
        return 1.0, logits
    left, right = logits.args[:2]
    product, factor = (left, right) if _is(left, "matmul") else (right, left)
    if _name(logits) == "div" and factor is left:
        raise _NoMatch("a scale divided by the scores")
    number = _val(factor)
    if isinstance(number, torch.Tensor) or not isinstance(number, (int, float)):
        raise _NoMatch("scale is a tensor, not a number")
    chain.append(logits)
    return (1.0 / float(number) if _name(logits) == "div" else float(number)), product


def _untransposed(key_t: Any) -> fx.Node:
    value = _val(key_t)
    if _is(key_t, "transpose") and isinstance(value, torch.Tensor):
        dims = {d % value.dim() for d in key_t.args[1:3]}
        if dims == {value.dim() - 1, value.dim() - 2}:
            return key_t.args[0]
    raise _NoMatch("second operand of q @ k^T is not a transpose of the last two dims")


def _is_lowest(fill: Any) -> bool:
    return isinstance(fill, float) and (fill == -math.inf or fill <= torch.finfo(
        torch.float32).min)


# ----------------------------------------------------------------- causal masks

def _mask_kind(mask: fx.Node, meaning: str) -> str:
    """``"causal"``, ``"none"`` (keeps every position) or ``"other"``: what ``mask`` is,
    found by evaluating it when it depends on shapes only. ``meaning``: ``"additive"``
    (0 keeps, the lowest float drops), ``"drops"`` (boolean, True drops: masked_fill's)
    or ``"keeps"`` (boolean, True keeps: SDPA's). A long sequence's mask is checked a
    block of query rows at a time (:mod:`partc.passes.helpers.mask_rows`), so the host
    holds a few rows of it, never the (seq x seq) whole."""
    try:
        value = _evaluate(mask, {})
    except _NotConstant:
        return "other"
    if not isinstance(value, (torch.Tensor, RowBlocks)) or value.dim() < 2:
        return "other"
    if isinstance(value, RowBlocks):
        return _tiled_mask_kind(value, meaning)
    keeps_all, causal = True, True
    for start, block in blocks(value):
        keep = _kept(block, meaning)
        if keep is None:
            return "other"
        rows, columns = keep.shape[-2:]
        keeps_all = keeps_all and bool(keep.all())
        # Causal: position j kept in row i exactly when j <= i (tril of the whole).
        lower = torch.arange(columns)[None, :] <= torch.arange(start, start + rows)[:, None]
        causal = causal and torch.equal(keep, lower.expand_as(keep))
        if not (keeps_all or causal):
            return "other"
    return "none" if keeps_all else "causal" if causal else "other"


def _tiled_mask_kind(value: RowBlocks, meaning: str) -> str:
    """:func:`_mask_kind` of a long sequence's mask, judged tile by tile from the tiles'
    bounds (:func:`partc.passes.helpers.mask_rows.tiles`: time about linear in the
    sequence for a causal mask or one keeping everything)."""
    for kind in ("none", "causal"):
        def expected(rows: tuple[int, int], cols: tuple[int, int]) -> bool | None:
            """Whether the kind keeps the whole tile (True), none of it (False), or some."""
            if kind == "none" or cols[1] - 1 <= rows[0]:
                return True
            return False if cols[0] > rows[1] - 1 else None

        def uniform(found, rows, cols) -> bool | None:
            kept = _bounds_kept(found, meaning, value.dtype)
            want = expected(rows, cols)
            return None if kept is None or want is None else kept == want

        def exact(tile: torch.Tensor, rows, cols) -> bool:
            keep = _kept(tile, meaning)
            if keep is None:
                return False
            lower = (torch.arange(cols[0], cols[1])[None, :]
                     <= torch.arange(rows[0], rows[1])[:, None])
            return bool(keep.all()) if kind == "none" else \
                torch.equal(keep, lower.expand_as(keep))

        if tiles(value, uniform, exact):
            return kind
    return "other"


def _bounds_kept(found: tuple[float, float], meaning: str, dtype: torch.dtype
                 ) -> bool | None:
    """Whether a tile with these bounds is kept whole (True), dropped whole (False), or
    either (None), as a mask of ``meaning``."""
    lo, hi = found
    if meaning == "additive":
        if not dtype.is_floating_point:
            return None
        lowest = torch.finfo(dtype).min
        if lo == hi == 0:
            return True
        return False if hi == -math.inf or hi <= lowest else None
    if dtype != torch.bool or lo != hi:
        return None
    return (lo == 1.0) == (meaning == "keeps")


def _kept(value: torch.Tensor, meaning: str) -> torch.Tensor | None:
    """Which positions a (block of a) mask keeps; None where it is not a mask of that
    meaning (an additive mask with a value other than 0 and the lowest)."""
    if meaning == "additive" and value.is_floating_point():
        keep = value == 0
        dropped = (value == -math.inf) | (value <= torch.finfo(value.dtype).min)
        return keep if bool((keep | dropped).all()) else None
    if value.dtype == torch.bool and meaning != "additive":
        return value if meaning == "keeps" else ~value
    return None


class _NotConstant(Exception):
    pass


def constant_value(node: fx.Node) -> torch.Tensor | RowBlocks | None:
    """``node``'s value computed on CPU when it depends on shapes only (a mask made
    from ``arange`` and the sizes), else None; a long sequence's mask as
    :class:`~partc.passes.helpers.mask_rows.RowBlocks`, to be read a block of query rows
    at a time."""
    try:
        value = _evaluate(node, {})
    except _NotConstant:
        return None
    return value if isinstance(value, (torch.Tensor, RowBlocks)) else None


# Methods and ops whose tensor argument gives only a dtype and device, not values.
_LIKE = ("new_ones", "new_zeros", "new_full", "new_empty")


def _evaluate(node: Any, env: dict) -> Any:
    """The value of ``node`` computed on CPU, when it depends on shapes only."""
    if not isinstance(node, fx.Node):
        if isinstance(node, (list, tuple)):
            return type(node)(_evaluate(a, env) for a in node)
        return torch.device("cpu") if isinstance(node, torch.device) else node
    if node in env:
        return env[node]
    value = _val(node)
    if not isinstance(value, torch.Tensor):
        if node.op == "placeholder" or isinstance(value, (torch.SymInt, torch.SymFloat)):
            raise _NotConstant(node.name)
        env[node] = torch.device("cpu") if isinstance(value, torch.device) else value
        return env[node]
    if node.op != "call_function" and node.op != "call_method":
        raise _NotConstant(node.name)
    args = list(node.args)
    if _name(node) in _LIKE:
        like = _val(args[0])
        args[0] = torch.empty(0, dtype=like.dtype)
    args = [a if isinstance(a, torch.Tensor) else _evaluate(a, env) for a in args]
    kwargs = {k: _evaluate(v, env) for k, v in node.kwargs.items()}
    run = (_method(node.target) if node.op == "call_method" else node.target)
    # A large element-wise result is made a block of rows at a time, when read.
    result = deferred(_name(node), run, args, kwargs, value.shape, value.dtype)
    if result is None:
        result = run(*whole(args), **{k: whole(v) for k, v in kwargs.items()})
    env[node] = result
    return result


def _method(name: str):
    """A call of method ``name`` on its first argument, as a function."""
    def call(self_arg, *rest, **kwargs):
        return getattr(self_arg, name)(*rest, **kwargs)
    return call


# ----------------------------------------------------------------------- rewriting

def _rewrite(gm: fx.GraphModule, match: Match, ctx: Context) -> None:
    graph = gm.graph
    output = match.chain[-1]
    kwargs: dict[str, Any] = {"dropout_p": match.dropout_p, "is_causal": match.is_causal,
                              "scale": match.scale}
    if match.mask is not None:
        kwargs = {"attn_mask": match.mask, **kwargs}
    if match.enable_gqa:
        kwargs["enable_gqa"] = True
    args = (match.query, match.key, match.value)
    if match.sink is not None:
        args, mask = _with_sink(graph, match, output, ctx)
        if mask is not None:
            kwargs = {"attn_mask": mask, **kwargs}
    with graph.inserting_before(output):
        call = graph.call_function(F.scaled_dot_product_attention, args, kwargs)
    _measured_like(call, output, ctx)
    result = call
    if match.sink is not None:
        meta.set_attention_sink(call)
        if match.is_causal:   # the first (made-up) row and the padded features dropped
            rows, features = _val(output).shape[-2:]
            result = _added(graph, output, ctx, torch.narrow, (call, -2, 1, rows))
            result = _added(graph, output, ctx, torch.narrow, (result, -1, 0, features))
    output.replace_all_uses_with(result)
    _erase_dead(graph, list(match.chain))


def _added(graph: fx.Graph, output: fx.Node, ctx: Context, target: Any, args: tuple,
           kwargs: dict | None = None, op: str = "call_function") -> fx.Node:
    """A node computing ``target(*args)``, before ``output`` and measured as its kin."""
    with graph.inserting_before(output):
        node = graph.create_node(op, target, args, kwargs or {})
    _measured_like(node, output, ctx)
    return node


def _measured_like(node: fx.Node, like: fx.Node, ctx: Context) -> None:
    """``node``'s module path from ``like`` and its fake value and tensors."""
    node.meta.update({k: v for k, v in like.meta.items()
                      if k in ("nn_module_stack", meta.MODULE_PATH)})
    run = node.target if node.op == "call_function" else _method(str(node.target))
    with ctx.fake_mode:
        fake = fx.node.map_arg(node.args, _val), fx.node.map_arg(node.kwargs, _val)
        node.meta["val"] = run(*fake[0], **fake[1])
    meta.set_tensors(node, (meta.TensorInfo.of(node.meta["val"]),))


def _with_sink(graph: fx.Graph, match: Match, output: fx.Node, ctx: Context
               ) -> tuple[tuple[fx.Node, fx.Node, fx.Node], fx.Node | None]:
    """q, k, v and the mask of the SDPA call equal to attention with a sink: one more
    key, first, whose score is the sink's logit and whose value is zero. Each query gets
    one more feature, 1, and each key a 0, so that the sink's key, zero but for
    ``sink / scale`` there, scores ``sink`` against every query and the other keys score
    as before; the features are padded with zeros to a multiple of 8 (what the GPU
    kernels align to). Under a written mask, the mask keeps the sink's column. Under a
    causal one, the queries get a made-up first row too and the call is square and
    causal: row i + 1 (query i) sees the sink and keys 0..i, as written, and the kernel
    skips the hidden half; the values are padded like the keys, and the caller drops
    the first row and the padding of the call's output."""
    query, key, value = match.query, match.key, match.value
    features = _val(query).shape[-1]
    width = -(-(features + 1) // 8) * 8
    scale = match.scale if match.scale is not None else features ** -0.5

    add = functools.partial(_added, graph, output, ctx)
    row = 1 if match.is_causal else 0   # the made-up first query row
    ones = add(F.pad, (query, [0, 1]), {"value": 1.0})
    query = add(F.pad, (ones, [0, width - features - 1, row, 0])) \
        if width > features + 1 or row else ones
    key = add(F.pad, (key, [0, width - features]))
    logit = add(torch.mul, (match.sink, 1.0 / scale))
    sink_key = add(F.pad, (logit, [features, width - features - 1]))
    rows = [*_val(key).shape[:-2], 1, width]
    sink_key = add("expand", (sink_key, rows), op="call_method")
    key = add(torch.cat, ([sink_key, key], -2))
    value_width = width - _val(value).shape[-1] if match.is_causal else 0
    value = add(F.pad, (value, [0, value_width, 1, 0]))
    mask = add(F.pad, (match.sink_mask, [1, 0])) if match.sink_mask is not None else None
    return (query, key, value), mask


def _erase_dead(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase ``nodes`` and then whatever computed only for them (the mask, the scale)."""
    pending, erased = list(reversed(nodes)), set()
    while pending:
        node = pending.pop(0)
        if node in erased or node.op in ("placeholder", "output"):
            continue
        for user in [u for u in node.users if is_dtype_check(u)]:
            graph.erase_node(user)
        if node.users or (node not in nodes and node.is_impure()):
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        erased.add(node)
        pending.extend(inputs)


# ----------------------------------------------------------------------- measuring

def is_fused(node: fx.Node) -> bool:
    """Whether ``node`` calls ``scaled_dot_product_attention`` (this pass's calls, a
    model's own, or torch.export's aten op), with key/value heads as many as the query's."""
    return node.op == "call_function" and node.target in (
        F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default
    ) and not node.kwargs.get("enable_gqa", False)


def measured(node: fx.Node, runtime_device: str = "cuda") -> Any:
    """What the estimate calls to run ``node`` for a runtime on ``runtime_device``
    ("cuda" or "cpu"): the node's own function, except for a fused call, which it runs
    as :func:`fused_kernel`, or with dropout on a CPU as :func:`cpu_dropout_kernel`."""
    if not is_fused(node):
        return node.target
    if runtime_device == "cpu" and _arg(node, 4, "dropout_p", 0.0):
        return cpu_dropout_kernel
    return fused_kernel


def cpu_dropout_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                       is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention`` with dropout as a CPU runs it: the CPU flash
    kernel takes no dropout, so SDPA takes the math path, which keeps every head's
    (seq x seq) probabilities and dropout mask for backward (GPT-BigCode's and GPT-2's
    attention dropout, trained on a CPU: 8x the memory planned as the fused kernel)."""
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale)[0]


def fused_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                 is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention`` as the estimate measures it: always the fused
    CPU kernel, which keeps for backward what the flash and memory-efficient kernels keep
    on a GPU — q, k, v, the output and the log-sum-exp (and ``attn_mask``).

    Left to choose, SDPA on fake tensors would not always pick it: on the meta device
    (a model planned without weights) and with dropout it takes the math path, which
    keeps the (seq x seq) probabilities and dropout mask of every head. The GPU kernels
    draw dropout from a seed, again in backward, so they keep only that seed: the kernel
    is run without dropout, which keeps what they keep but two scalars, and counts the
    same products.

    A mask that needs a gradient (T5's learned relative position bias, passed as
    ``attn_mask``) is the exception: the fused CPU kernel cannot differentiate it, and
    SDPA itself then takes the math path, which keeps the probabilities — so it is
    measured on that path.
    """
    if attn_mask is not None and attn_mask.requires_grad:
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, 0.0, is_causal, scale=scale)[0]
    if value.shape[-1] != query.shape[-1]:
        return _unequal_heads_kernel(query, key, value, attn_mask, is_causal, scale)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # SDPA turns a boolean mask into an additive one of the queries' dtype before
        # any kernel runs, and the kernel keeps that copy for backward.
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=attn_mask.device
                                ).masked_fill_(~attn_mask, float("-inf"))
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return kernel(query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]


def _unequal_heads_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attn_mask: torch.Tensor | None, is_causal: bool,
                          scale: float | None) -> torch.Tensor:
    """Attention whose values have another head size than queries and keys (DeepSeek's
    multi-head latent attention: 192 against 128). The flash kernels take one head size
    (the CPU one's fake output would have the queries'), so CUDA's SDPA runs the
    memory-efficient kernel, which keeps for backward what flash keeps; its mask an
    additive bias over every head, as SDPA makes it of a boolean one."""
    bias = attn_mask
    if bias is not None:
        if bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=query.dtype, device=bias.device) \
                .masked_fill(~bias, float("-inf"))
        bias = bias.to(query.dtype).expand(*query.shape[:-1], key.shape[-2])
    kernel = torch.ops.aten._scaled_dot_product_efficient_attention
    return kernel(query, key, value, bias, True, 0.0, is_causal, scale=scale)[0]


def skips_masked_blocks(node: fx.Node, device: str) -> bool:
    """Whether the kernel that runs fused call ``node`` on ``device`` ("cuda" or "cpu")
    skips the blocks a causal mask hides, doing about half the (seq x seq) products
    forward and backward: a causal call (``is_causal=True``, no ``attn_mask``, square) on
    the CUDA flash and memory-efficient kernels, and on the CPU flash kernel, which SDPA
    picks on a CPU only without dropout (with dropout it takes the math path, which
    computes every score and masks them)."""
    if not is_fused(node) or not _arg(node, 5, "is_causal", False) \
            or _arg(node, 3, "attn_mask") is not None:
        return False
    return device == "cuda" or not _arg(node, 4, "dropout_p", 0.0)


def backward_recompute_flops(node: fx.Node, forward_flops: float) -> float:
    """FLOPs a fused call's backward spends beyond the usual twice its forward: it
    recomputes ``q @ k^T`` (FlashAttention-2: five products of (seq_q x seq_k) in
    backward for two in forward, 2.5x instead of 2x)."""
    return 0.5 * forward_flops if is_fused(node) else 0.0
