"""Context parallelism applied to a traced model: its sequence split over ``cp`` ranks.

The model is traced at one rank's share of the sequence (``S / cp`` tokens, the
load-balanced layout of ``partc.runtime.cp_layout``), so every op already has the
shard's shapes; what reads across tokens must change:

- each attention core (an SDPA call: the model's own, or written-out attention that
  ``fuse_attention`` turned into one under ``TrainSpec(attention="fused")``) becomes
  ``partc.runtime.cp_group.attention(cp, q, k, v, scale=..., mask=..., window=...)``:
  the ring or the all-to-all, as the plan's kind says. Its mask is read where it means what it means, on a trace at the whole
  sequence's length (:func:`attention_masks`): ``"none"``, ``"causal"`` or
  ``"sliding"`` with its window (Mistral's). The mask's own nodes, made from shapes,
  then have no user and go. Grouped-query attention's ``repeat_kv`` (unsqueeze, expand,
  reshape) is looked through: the ring passes the key/value heads, not their copies;
- each ``arange`` of the shard's length left (position ids, rotary angles, learned
  position embeddings) becomes ``cp_group.positions(cp, n)``: this rank's
  tokens' places in the whole sequence;
- an op outside attention and the loss that reads along the sequence (a cumulative
  sum, a sort, a mean or softmax over it) would compute on the shard what the model
  means over the whole: refused, the op and its module named
  (:class:`partc.ContextParallelError`); so is an attention whose mask depends on the
  batch, or one with dropout. The sequence's dims are those whose size differs between
  the two traces (a width that equals the shard's length is no sequence).

The loss runs on each rank's tokens; the runtime averages it over the cp group (the
global token mean, each rank holding as many tokens), as it does the gradients.

Reads: ``node.meta["val"]``, ``meta.LAYERS``, ``meta.LAYER``, ``meta.MODULE_PATH``,
``ctx.lowering`` (``cp``, ``cp_kind``, ``attention_masks``, ``whole_length_shapes``).
Writes: the submodule ``cp`` (a stand-in ``ContextParallelGroup`` the runtime binds);
the attention and position calls, in their layers; ``meta.LAYERS``' node lists.
Requires: ``layers``, and the graph traced at the shard's length (``pipeline.lower``).
Ensures: no SDPA call and no ``arange`` of the shard's length is left; every op left
that reads along the sequence is attention's or the loss's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import fx

from partc import meta
from partc.errors import ContextParallelError
from partc.passes.context import Context
from partc.passes.fuse_attention import constant_value
from partc.passes.helpers.mask_rows import BLOCK_ELEMENTS, RowBlocks, tiles
from partc.passes.helpers.graph import is_dtype_check, op_name
from partc.runtime import cp_group as cp_runtime
from partc.runtime.cp_group import ContextParallelGroup
from partc.runtime.ring_attention import CAUSAL, NONE, SLIDING, AttentionMask

GROUP = "cp"  # the group's attribute on the rewritten module
_SDPA = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)
# Ops that mix values along a dim: on a shard of the sequence they would compute the
# shard's answer, not the sequence's.
_ALONG = frozenset({"cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "sort",
                    "argsort", "topk", "kthvalue", "median", "mean", "sum", "amax", "amin",
                    "max", "min", "argmax", "argmin", "var", "std", "var_mean", "std_mean",
                    "softmax", "_softmax", "log_softmax", "_log_softmax", "logsumexp",
                    "norm", "linalg_vector_norm", "prod", "diff", "flip", "roll", "cross"})


def is_attention_call(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _SDPA


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


# ------------------------------------------------------------------ masks, whole length

def attention_masks(gm: fx.GraphModule) -> tuple[AttentionMask, ...]:
    """The mask of each SDPA call of ``gm`` (traced at the whole sequence's length), in
    graph order; :class:`partc.ContextParallelError` for one that is neither none,
    causal nor a sliding window, or that depends on the batch."""
    return tuple(_mask_of(node) for node in gm.graph.nodes if is_attention_call(node))


def _mask_of(call: fx.Node) -> AttentionMask:
    mask = _arg(call, 3, "attn_mask")
    causal = bool(_arg(call, 5, "is_causal", False))
    if mask is None:
        return AttentionMask(CAUSAL if causal else NONE)
    value = constant_value(mask) if isinstance(mask, fx.Node) else None
    if value is None:
        raise _refusal(call, "its attention mask depends on the batch (padding, a "
                       "document mask): only masks made from the shapes (none, causal, a "
                       "sliding window) follow the sequence's shards")
    seq = value.shape[-1]
    if value.shape[-2] != seq:
        raise _refusal(call, "its attention mask is not square (queries and keys differ)")
    # The last query row keeps the window (causal: every key); each block of rows is
    # then checked against it, so the host holds a few rows, never (seq x seq).
    last = _keeps(value, seq - 1, seq)[0, 0]
    window = int(last.sum())
    candidate = (AttentionMask(NONE) if bool(last.all()) and bool(_keeps(value, 0, 1).all())
                 else AttentionMask(CAUSAL) if window >= seq else AttentionMask(SLIDING, window))
    if not _matches(value, candidate):
        raise _refusal(call, "its attention mask is neither causal nor a sliding "
                       "window, or differs between samples or heads")
    return candidate


def _matches(value: torch.Tensor | RowBlocks, candidate: AttentionMask) -> bool:
    """Whether the mask keeps what ``candidate`` keeps. A deferred one (a long mask made
    from shapes) is judged tile by tile from its tiles' bounds
    (:func:`partc.passes.helpers.mask_rows.tiles`), only the tiles mixing kept and
    dropped positions made (the diagonal band: about seq x 256 elements, not seq x
    seq); a tensor already whole is compared a block of rows at a time."""
    seq = value.shape[-1]
    if isinstance(value, RowBlocks):
        def uniform(found: tuple[float, float], rows: tuple[int, int],
                    cols: tuple[int, int]) -> bool | None:
            want = candidate.visibility(range(*rows), range(*cols))
            kept = _tile_kept(found, value.dtype)
            return None if kept is None or want == "part" else kept == (want == "all")

        def exact(tile: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]) -> bool:
            keep = tile if tile.dtype == torch.bool else tile == 0
            return bool((keep == candidate.keeps(torch.arange(*rows),
                                                 torch.arange(*cols))).all())

        return tiles(value, uniform, exact)
    every = torch.arange(seq)
    step = max(1, BLOCK_ELEMENTS // max(1, value.shape.numel() // seq))
    for start in range(0, seq, step):
        stop = min(seq, start + step)
        rows = _keeps(value, start, stop)
        if not bool((rows == candidate.keeps(torch.arange(start, stop), every)).all()):
            return False
    return True


def _tile_kept(found: tuple[float, float], dtype: torch.dtype) -> bool | None:
    """Whether a mask's tile whose elements lie in ``found`` is kept whole (True),
    dropped whole (False) or either (None), as :func:`_keeps` reads it: a bool mask
    keeps True, an additive one 0."""
    low, high = found
    if dtype == torch.bool:
        return None if low != high else low == 1.0
    if low == high == 0:
        return True
    return False if high < 0 or low > 0 else None


def _keeps(value: torch.Tensor | RowBlocks, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of a mask as (samples x heads, rows, keys) bool, True kept
    (SDPA's bool masks keep True; an additive one keeps 0)."""
    rows = value.rows(start, stop) if isinstance(value, RowBlocks) \
        else value[..., start:stop, :]
    keep = rows if rows.dtype == torch.bool else rows == 0
    return keep.reshape(-1, *keep.shape[-2:])


# ---------------------------------------------------------------------------- the pass

def context_parallel(gm: fx.GraphModule, ctx: Context) -> fx.GraphModule:
    """The module's doc: attention cores and positions over the cp group."""
    lowering = ctx.lowering
    masks = lowering.attention_masks
    calls = [node for node in gm.graph.nodes if is_attention_call(node)]
    if len(calls) != len(masks):
        raise ContextParallelError(
            f"the model traced at the shard's length has {len(calls)} attention calls and "
            f"{len(masks)} at the whole length: its attention depends on the sequence "
            "length; plan it with cp=1")
    gm.add_submodule(GROUP, ContextParallelGroup(lowering.cp, lowering.cp_kind))
    for call, mask in zip(calls, masks):
        _replace_attention(gm, call, mask, lowering.cp, lowering.cp_kind)
    seq_local = _shard_length(ctx)
    for node in list(gm.graph.nodes):
        if _is_position_arange(node, seq_local):
            _replace_positions(gm, node, seq_local)
    _refuse_sequence_ops(gm, seq_local, lowering.whole_length_shapes)
    _relayer(gm)
    gm.graph.lint()
    gm.recompile()
    return gm


def _shard_length(ctx: Context) -> int:
    first = next(t for t in ctx.fake_inputs if isinstance(t, torch.Tensor) and t.dim() >= 2)
    return int(first.shape[1])


def _replace_attention(gm: fx.GraphModule, call: fx.Node, mask: AttentionMask, cp: int,
                       kind: str) -> None:
    graph = gm.graph
    dropout = _arg(call, 4, "dropout_p", 0.0)
    if dropout:
        raise _refusal(call, f"it drops attention probabilities (dropout_p={dropout}), "
                       "which context-parallel attention does not draw; train with "
                       "attention dropout 0")
    query, key, value = (_arg(call, i, name) for i, name in
                         enumerate(("query", "key", "value")))
    if kind == cp_runtime.RING or _heads(_unrepeated(key)) % cp == 0:
        key, value = _unrepeated(key), _unrepeated(value)
    if kind == cp_runtime.ALL_TO_ALL:
        for name, node in (("query", query), ("key/value", key)):
            if _heads(node) % cp:
                raise _refusal(call, f"all-to-all context parallelism splits heads over "
                               f"{cp} ranks and it has {_heads(node)} {name} heads; plan "
                               "the ring instead")
    with graph.inserting_before(call):
        group = graph.get_attr(GROUP)
        new = graph.call_function(cp_runtime.attention, (group, query, key, value),
                                  {"scale": call.kwargs.get("scale"), "mask": mask.kind,
                                   "window": mask.window})
    for node in (group, new):
        _like(node, call)
    new.meta["val"] = call.meta.get("val")
    call.replace_all_uses_with(new)
    _erase_unused(graph, [call])


def _heads(node: fx.Node) -> int:
    return int(node.meta["val"].shape[1])


def _unrepeated(node: fx.Node) -> fx.Node:
    """The key/value heads before ``repeat_kv`` (``x[:, :, None].expand(b, g, r, s, d)
    .reshape(b, g * r, s, d)``), or ``node`` itself."""
    if op_name(node) not in ("reshape", "view", "_unsafe_view"):
        return node
    expand = node.args[0]
    if not isinstance(expand, fx.Node) or op_name(expand) != "expand":
        return node
    inner = expand.args[0]
    if not isinstance(inner, fx.Node) or op_name(inner) != "unsqueeze" or \
            inner.args[1] not in (2, -3):
        return node
    source = inner.args[0]
    shape = source.meta.get("val")
    if not isinstance(shape, torch.Tensor) or shape.dim() != 4:
        return node
    return source


def _is_position_arange(node: fx.Node, seq_local: int) -> bool:
    if node.op != "call_function" or op_name(node) != "arange" or not node.users:
        return False
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.shape != (seq_local,) or \
            value.dtype.is_floating_point:
        return False
    numbers = [a for a in node.args if not isinstance(a, fx.Node)]
    return numbers in ([seq_local], [0, seq_local], [0, seq_local, 1])


def _replace_positions(gm: fx.GraphModule, arange: fx.Node, seq_local: int) -> None:
    graph = gm.graph
    with graph.inserting_before(arange):
        group = graph.get_attr(GROUP)
        new = graph.call_function(cp_runtime.positions, (group, seq_local),
                                  {"device": arange.kwargs.get("device")})
    for node in (group, new):
        _like(node, arange)
    new.meta["val"] = arange.meta.get("val")
    arange.replace_all_uses_with(new)
    graph.erase_node(arange)


def reduced_shapes(gm: fx.GraphModule) -> dict[str, tuple[int, ...]]:
    """The shape each op of :data:`_ALONG` reads, by node name (on the trace at the
    whole length: a dim that is smaller on the shard's trace is the sequence)."""
    shapes = {}
    for node in gm.graph.nodes:
        value = _reads(node)
        if value is not None:
            shapes[node.name] = tuple(value.shape)
    return shapes


def _reads(node: fx.Node) -> torch.Tensor | None:
    """What an op of :data:`_ALONG` reduces (its first argument's value), else None."""
    if node.op not in ("call_function", "call_method") or op_name(node) not in _ALONG:
        return None
    source = node.args[0] if node.args else None
    value = source.meta.get("val") if isinstance(source, fx.Node) else None
    return value if isinstance(value, torch.Tensor) and value.dim() >= 2 else None


def _refuse_sequence_ops(gm: fx.GraphModule, seq_local: int,
                         whole: Mapping[str, tuple[int, ...]]) -> None:
    """An op of :data:`_ALONG` along the sequence, on values the batch reaches, outside
    the loss: refused (the module's doc). The sequence's dims are those whose size
    differs from the whole length's trace (``whole``); an op that trace lacks is judged
    by size: a dim of the shard's length."""
    reached = _batch_reaches(gm)
    for node in gm.graph.nodes:
        value = _reads(node)
        if value is None or node not in reached or meta.role(node) == meta.ROLE_LOSS:
            continue
        dims = [d for d in _reduced_dims(node, value.dim()) if d != 0]
        there = whole.get(node.name)
        if there is not None and len(there) == value.dim():
            along = [d for d in dims if there[d] != value.shape[d]]
        else:
            along = [d for d in dims if value.shape[d] == seq_local]
        if along:
            fix = ("attention written out is split only once fused: train with "
                   "TrainSpec(attention='fused'), or the model's SDPA attention"
                   if "softmax" in op_name(node) else "plan it with cp=1")
            raise _refusal(node, f"{op_name(node)} reads along the sequence (dim of "
                           f"{seq_local} tokens, this rank's shard), which context "
                           f"parallelism splits; {fix}")


def _reduced_dims(node: fx.Node, rank: int) -> list[int]:
    dim = _arg(node, 1, "dim")
    if op_name(node) in ("flip", "roll"):
        dim = _arg(node, 2 if op_name(node) == "roll" else 1, "dims")
    if dim is None:
        return list(range(rank)) if op_name(node) not in ("sort", "argsort", "topk") \
            else [rank - 1]
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return [d % rank for d in dims if isinstance(d, int)]


def _batch_reaches(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes whose value depends on a model input (not on shapes and weights only)."""
    reached: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" or any(a in reached for a in node.all_input_nodes):
            reached.add(node)
    return reached


def _like(node: fx.Node, like: fx.Node) -> None:
    """``node`` in ``like``'s layer and module."""
    if meta.LAYER in like.meta:
        meta.set_layer(node, meta.layer(like))
    if meta.MODULE_PATH in like.meta:
        meta.set_module_path(node, meta.module_path(like))


def _erase_unused(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase ``nodes``, then whatever only they read (a mask made from shapes), until
    nothing more goes."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    candidates, first = set(nodes), set(nodes)
    while candidates:
        gone = set()
        for node in sorted(candidates, key=order.__getitem__, reverse=True):
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            for user in [u for u in node.users if is_dtype_check(u)]:
                graph.erase_node(user)
            if node.users or (node not in first and node.is_impure()):
                continue
            gone |= set(node.all_input_nodes)
            graph.erase_node(node)
            gone.discard(node)
        candidates = {n for n in gone if n.graph is graph and n in order and not n.users
                      and n not in first}
        order = {node: i for i, node in enumerate(graph.nodes)}
        candidates = {n for n in candidates if n in order}


def shape_masks(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes whose every use ends in an SDPA call's mask (a mask made from shapes and
    what only it reads, dtype checks aside): what this pass erases with the calls, so
    under cp none of them crosses a pipeline cut (``partc.planner.assemble`` counts the
    messages without them)."""
    found: set[fx.Node] = set()
    for node in reversed(gm.graph.nodes):
        if node.op in ("placeholder", "get_attr", "output") or node.is_impure():
            continue
        kept = [user for user in node.users if not is_dtype_check(user)]
        if kept and all(user in found or _only_mask_of(user, node) for user in kept):
            found.add(node)
    return found


def _only_mask_of(call: fx.Node, node: fx.Node) -> bool:
    """Whether ``node`` is the mask of the SDPA ``call`` and none of its q, k, v."""
    return is_attention_call(call) and _arg(call, 3, "attn_mask") is node and \
        node not in [_arg(call, i, name) for i, name in enumerate(("query", "key", "value"))]


def _relayer(gm: fx.GraphModule) -> None:
    """Each layer's node list again, in graph order, after nodes came and went."""
    members: dict[int, list[str]] = {info.index: [] for info in meta.layers(gm)}
    for node in gm.graph.nodes:
        if meta.LAYER in node.meta and node.op not in ("placeholder", "output"):
            members.setdefault(meta.layer(node).index, []).append(node.name)
    meta.set_layers(gm, tuple(dataclasses.replace(info, nodes=tuple(members[info.index]))
                              for info in meta.layers(gm)))


def _refusal(node: fx.Node, why: str) -> ContextParallelError:
    where = meta.module_path(node) or "the model"
    return ContextParallelError(f"context parallelism cannot split the sequence at "
                                f"{node.name} ({op_name(node)} in {where}): {why}")
