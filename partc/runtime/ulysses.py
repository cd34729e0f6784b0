"""All-to-all context parallelism (DeepSpeed-Ulysses): heads, not sequence, around the
attention core.

Each of the ``cp`` ranks holds every head of its tokens (:mod:`.cp_layout`). Before the
core an all-to-all re-shards queries, keys and values from the sequence to the heads:
rank ``r`` then holds heads ``r * H / cp ..`` of the whole sequence, runs the model's
attention on them as one device would (``scaled_dot_product_attention``, its causal
kernel where the mask is causal), and a second all-to-all sends each token's output
back to the rank that holds the token. Each rank moves ``3 (cp - 1) / cp`` of its q, k, v
and ``(cp - 1) / cp`` of its output per layer, whatever the sequence length; the query
heads and the key/value heads must divide by ``cp``.

The whole sequence arrives in the ranks' order (rank 0's chunks, then rank 1's, ...):
it is put in position order before the core and back after.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from partc.runtime import cp_layout
from partc.runtime.ring_attention import CAUSAL, NONE, AttentionMask


def _exchange(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-to-all over dim 0 (one slice per rank); a stand-in (no group) keeps ``x``."""
    if group is None:
        return x
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _to_heads(x: torch.Tensor, cp: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(B, H, S/cp, D) sequence shard → (B, H/cp, S, D), the sequence in ranks' order."""
    b, h, s, d = x.shape
    sent = x.reshape(b, cp, h // cp, s, d).transpose(0, 1)
    got = _exchange(sent, group)            # got[j]: rank j's tokens of my heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _to_sequence(y: torch.Tensor, cp: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The inverse of :func:`_to_heads`: (B, H/cp, S, D) → (B, H, S/cp, D)."""
    b, h_part, s_all, d = y.shape
    s = s_all // cp
    sent = y.reshape(b, h_part, cp, s, d).permute(2, 0, 1, 3, 4)
    got = _exchange(sent, group)            # got[j]: head group j's output, my tokens
    return got.transpose(0, 1).reshape(b, h_part * cp, s, d)


class SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp: int, group):
        ctx.cp, ctx.group = cp, group
        return _to_heads(x, cp, group)

    @staticmethod
    def backward(ctx, grad):
        return _to_sequence(grad, ctx.cp, ctx.group), None, None


class HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, cp: int, group):
        ctx.cp, ctx.group = cp, group
        return _to_sequence(y, cp, group)

    @staticmethod
    def backward(ctx, grad):
        return _to_heads(grad, ctx.cp, ctx.group), None, None


def all_to_all_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                         scale: float, mask: AttentionMask, cp: int,
                         group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's queries' output (B, H, S/cp, D) of attention over the whole sequence,
    by the two all-to-alls of the module's doc."""
    for name, heads in (("query", q.shape[1]), ("key/value", k.shape[1])):
        if heads % cp:
            raise ValueError(f"all-to-all context parallelism splits heads over {cp} ranks: "
                             f"{heads} {name} heads do not divide by {cp}")
    seq = q.shape[2] * cp
    arrived = torch.cat([cp_layout.positions(seq, cp, r, q.device) for r in range(cp)])
    order = torch.argsort(arrived)
    q_all, k_all, v_all = (SequenceToHeads.apply(t, cp, group).index_select(2, order)
                           for t in (q, k, v))
    attn_mask = None
    if mask.kind not in (NONE, CAUSAL):
        every = torch.arange(seq, device=q.device)
        attn_mask = mask.keeps(every, every)
    out = F.scaled_dot_product_attention(
        q_all, k_all, v_all, attn_mask=attn_mask, is_causal=mask.kind == CAUSAL,
        scale=scale, enable_gqa=q_all.shape[1] != k_all.shape[1])
    return HeadsToSequence.apply(out.index_select(2, arrived), cp, group)
