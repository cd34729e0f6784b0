"""Ring attention: exact attention over a sequence that ``cp`` ranks hold in pieces.

Each rank holds the queries, keys and values of its tokens (the load-balanced layout of
:mod:`.cp_layout`: two chunks, one early, one late). The keys and values go around the
context-parallel group: at step ``s`` rank ``r`` holds those of rank ``r - s``; while it
computes its queries against them, the next block is already on its way
(``batch_isend_irecv`` posted before the compute, waited on after). Each block's
result is merged into the running output by its log-sum-exp (the online softmax of
FlashAttention)::

    lse = logaddexp(lse, lse_b)
    out = out * exp(lse_old - lse) + out_b * exp(lse_b - lse)

Backward goes around the ring again: each rank recomputes each block's probabilities
from the saved final log-sum-exp, adds the block's query gradient to its own, and adds
the block's key and value gradients to accumulators that travel with the keys and
values; after ``cp`` steps one last shift brings each accumulator home.

Blocks are computed chunk by chunk (two query chunks against two key chunks), each
pair classified from the chunks' positions: hidden by the mask (skipped: under a causal
mask half of the pairs off the diagonal), fully visible (no mask), or cut by it (a mask
made from the positions; the diagonal under a causal mask, the edge of a sliding
window). The masks are those a model's attention means at the whole sequence's length:
``"none"``, ``"causal"`` (key position at most the query's) and ``"sliding"`` (causal,
and fewer than ``window`` positions back: Mistral's). Grouped-query attention passes the
key/value heads as they are (``heads`` a multiple of them): query heads ``g * r ..
g * r + r - 1`` read key/value head ``g``, as Hugging Face's ``repeat_kv`` repeats them.

The block products are plain matmuls and a softmax in the inputs' dtype (fp32 on the
CPU where parity is checked); a kernel returning the log-sum-exp could take their
place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

NONE, CAUSAL, SLIDING = "none", "causal", "sliding"
_KV_TAG, _GRAD_TAG = 17, 18  # the two streams each step may have in flight to one peer


@dataclass(frozen=True)
class AttentionMask:
    """What the attention's mask keeps, in whole-sequence positions ``i`` (query) and
    ``j`` (key): everything (``none``), ``j <= i`` (``causal``), or ``j <= i`` and
    ``i - j < window`` (``sliding``)."""

    kind: str = CAUSAL
    window: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in (NONE, CAUSAL, SLIDING):
            raise ValueError(f"unknown attention mask kind {self.kind!r}")
        if (self.kind == SLIDING) != (self.window is not None):
            raise ValueError("a window is given with a sliding mask, and only then")

    def keeps(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """(len(query), len(key)) bool: which keys each query sees (positions given)."""
        back = query[:, None] - key[None, :]
        keep = back >= 0 if self.kind != NONE else torch.ones_like(back, dtype=torch.bool)
        if self.kind == SLIDING:
            keep = keep & (back < self.window)
        return keep

    def visibility(self, query: range, key: range) -> str:
        """``"all"``, ``"none"`` or ``"part"``: how much of the (query, key) block of
        contiguous position ranges the mask keeps."""
        if self.kind == NONE:
            return "all"
        nearest, farthest = query.start - (key.stop - 1), (query.stop - 1) - key.start
        if farthest < 0 or (self.kind == SLIDING and nearest >= self.window):
            return "none"
        if nearest >= 0 and (self.kind == CAUSAL or farthest < self.window):
            return "all"
        return "part"


@dataclass(frozen=True)
class Ring:
    """A context-parallel group as the ring sees it: its size, this rank's index in it,
    the global ranks of its neighbours, and the process group (None: one rank alone)."""

    size: int
    rank: int
    next: int = 0
    previous: int = 0
    group: dist.ProcessGroup | None = None

    def shift(self, tensors: list[torch.Tensor], tag: int) -> tuple[list, list]:
        """Post sends of ``tensors`` to the next rank and receives of as many from the
        previous one; returns (requests, receive buffers)."""
        sent = [t.contiguous() for t in tensors]  # held until the requests are waited on
        received = [torch.empty_like(t) for t in sent]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in sent]
        ops += [dist.P2POp(dist.irecv, t, self.previous, self.group, tag) for t in received]
        return (dist.batch_isend_irecv(ops), sent), received


def _wait(posted: tuple[list, list]) -> None:
    for request in posted[0]:
        request.wait()


def chunk_ranges(seq_local: int, cp: int, rank: int) -> tuple[range, range]:
    """The whole-sequence positions of ``rank``'s two chunks (``seq_local`` tokens)."""
    length = seq_local // 2
    early, late = rank, 2 * cp - 1 - rank
    return (range(early * length, (early + 1) * length),
            range(late * length, (late + 1) * length))


def _pairs(mask: AttentionMask, queries: tuple[range, range], keys: tuple[range, range]):
    """(query chunk, key chunk, keep or None) for each pair of chunks not hidden."""
    for qi, q_range in enumerate(queries):
        for ki, k_range in enumerate(keys):
            seen = mask.visibility(q_range, k_range)
            if seen == "none":
                continue
            keep = None
            if seen == "part":
                keep = mask.keeps(torch.tensor(q_range), torch.tensor(k_range))
            yield qi, ki, keep


def _scores(q5: torch.Tensor, k: torch.Tensor, scale: float, keep: torch.Tensor | None
            ) -> torch.Tensor:
    """(B, G, r, Sq, Sk) scaled scores of grouped queries ``q5`` against ``k``."""
    scores = torch.matmul(q5, k.unsqueeze(2).transpose(-1, -2)) * scale
    if keep is not None:
        scores = scores.masked_fill(~keep.to(scores.device), float("-inf"))
    return scores


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with rows that see nothing (-inf) at 0, so exp(scores - lse) is 0 there."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The online-softmax merge of a block's (output, log-sum-exp) into the running one."""
    merged = torch.logaddexp(lse, block_lse)
    safe = _finite(merged)
    out = out * torch.exp(lse - safe).unsqueeze(-1) \
        + block_out * torch.exp(block_lse - safe).unsqueeze(-1)
    return out, merged


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, s, d = q.shape
    return q.view(b, kv_heads, h // kv_heads, s, d)


def _chunks(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    first, second = x.chunk(2, dim=dim)
    return first, second


class RingAttention(torch.autograd.Function):
    """``attention(q, k, v)`` over the ring: q (B, H, S/cp, D), k and v (B, G, S/cp, D)
    with H a multiple of G; returns (B, H, S/cp, D), this rank's queries' output."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, mask: AttentionMask, ring: Ring):
        kv_heads = k.shape[1]
        q5 = _grouped(q, kv_heads)
        queries = chunk_ranges(q.shape[2], ring.size, ring.rank)
        q_parts = _chunks(q5, 3)
        outs = [torch.zeros_like(part) for part in q_parts]
        lses = [torch.full(part.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
                for part in q_parts]
        block = [k, v]
        for step in range(ring.size):
            pending = ring.shift(block, _KV_TAG) if step < ring.size - 1 else None
            source = (ring.rank - step) % ring.size
            keys = chunk_ranges(k.shape[2], ring.size, source)
            k_parts, v_parts = _chunks(block[0], 2), _chunks(block[1], 2)
            for qi, ki, keep in _pairs(mask, queries, keys):
                scores = _scores(q_parts[qi], k_parts[ki], scale, keep)
                block_lse = torch.logsumexp(scores, dim=-1)
                probs = torch.exp(scores - _finite(block_lse).unsqueeze(-1))
                block_out = torch.matmul(probs, v_parts[ki].unsqueeze(2))
                outs[qi], lses[qi] = _merge(outs[qi], lses[qi], block_out, block_lse)
            if pending is not None:
                _wait(pending[0])
                block = pending[1]
        out5, lse = torch.cat(outs, dim=3), torch.cat(lses, dim=3)
        ctx.save_for_backward(q, k, v, out5, lse)
        ctx.scale, ctx.mask, ctx.ring = scale, mask, ring
        return out5.reshape(q.shape)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out5, lse = ctx.saved_tensors
        scale, mask, ring = ctx.scale, ctx.mask, ctx.ring
        kv_heads = k.shape[1]
        q5, dout5 = _grouped(q, kv_heads), _grouped(grad_out.contiguous(), kv_heads)
        delta = (dout5 * out5).sum(-1)  # rowsum(dO * O): softmax's backward term
        queries = chunk_ranges(q.shape[2], ring.size, ring.rank)
        q_parts, dout_parts = _chunks(q5, 3), _chunks(dout5, 3)
        lse_parts, delta_parts = _chunks(_finite(lse), 3), _chunks(delta, 3)
        dq_parts = [torch.zeros_like(part) for part in q_parts]
        block, grads, grads_pending = [k, v], None, None
        for step in range(ring.size):
            pending = ring.shift(block, _KV_TAG) if step < ring.size - 1 else None
            source = (ring.rank - step) % ring.size
            keys = chunk_ranges(k.shape[2], ring.size, source)
            k_parts, v_parts = _chunks(block[0], 2), _chunks(block[1], 2)
            dk_parts = [torch.zeros_like(part) for part in k_parts]
            dv_parts = [torch.zeros_like(part) for part in v_parts]
            for qi, ki, keep in _pairs(mask, queries, keys):
                scores = _scores(q_parts[qi], k_parts[ki], scale, keep)
                probs = torch.exp(scores - lse_parts[qi].unsqueeze(-1))
                dv_parts[ki] += torch.matmul(probs.transpose(-1, -2), dout_parts[qi]).sum(2)
                dprobs = torch.matmul(dout_parts[qi], v_parts[ki].unsqueeze(2).transpose(-1, -2))
                dscores = probs * (dprobs - delta_parts[qi].unsqueeze(-1)) * scale
                dq_parts[qi] += torch.matmul(dscores, k_parts[ki].unsqueeze(2))
                dk_parts[ki] += torch.matmul(dscores.transpose(-1, -2), q_parts[qi]).sum(2)
            block_grads = [torch.cat(dk_parts, dim=2), torch.cat(dv_parts, dim=2)]
            if grads_pending is None:
                grads = block_grads
            else:
                _wait(grads_pending[0])
                grads = [mine + theirs for mine, theirs in zip(block_grads, grads_pending[1])]
            # The accumulators follow the keys and values to the next rank; after the
            # last step this shift brings each home.
            grads_pending = ring.shift(grads, _GRAD_TAG) if ring.size > 1 else None
            if pending is not None:
                _wait(pending[0])
                block = pending[1]
        if grads_pending is not None:
            _wait(grads_pending[0])
            grads = grads_pending[1]
        dq = torch.cat(dq_parts, dim=3).reshape(q.shape)
        return dq, grads[0], grads[1], None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                   mask: AttentionMask, ring: Ring) -> torch.Tensor:
    """Exact attention of this rank's queries over the whole sequence's keys and values
    (:class:`RingAttention`)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} "
                         "key/value heads")
    if q.shape[2] % 2:
        raise ValueError(f"a rank's {q.shape[2]} tokens are not two equal chunks")
    return RingAttention.apply(q, k, v, scale, mask, ring)
