"""Which tokens of a sequence each context-parallel rank holds: the load-balanced layout.

Under a causal mask the last tokens of a sequence attend to many keys and the first to
few, so cutting the sequence into ``cp`` contiguous pieces would give the last rank most
of the attention's work. As Megatron-Core and torchtitan do, the sequence is cut into
``2 * cp`` equal chunks and rank ``i`` holds chunks ``i`` and ``2 * cp - 1 - i``, one
early and one late: every rank then does the same work. One layout serves every mask
(none, causal, a sliding window), so the batch split, the positions and the attention
agree whatever the model's attention is::

    cp = 2, 8 tokens:  chunks [0 1] [2 3] [4 5] [6 7]
                       rank 0 holds 0 1 6 7, rank 1 holds 2 3 4 5

Each rank's tokens are kept in that order (its early chunk, then its late chunk), so
its positions are not contiguous: :func:`positions` gives them, and the model's rotary
tables, position embeddings and masks read them instead of ``arange``.
"""

from __future__ import annotations

import torch

from partc.errors import PartcError


def chunk_length(seq: int, cp: int) -> int:
    """The length of one of the ``2 * cp`` chunks of a sequence of ``seq`` tokens."""
    if seq % (2 * cp):
        raise PartcError(f"context parallelism over {cp} ranks cuts each sequence into "
                         f"{2 * cp} equal chunks, and {seq} tokens do not divide by "
                         f"{2 * cp}: pad the sequences to a multiple of {2 * cp}, or plan "
                         "another cp")
    return seq // (2 * cp)


def chunks_of(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks ``rank`` holds, in the order it holds them."""
    return rank, 2 * cp - 1 - rank


def positions(seq: int, cp: int, rank: int, device: torch.device | str | None = None
              ) -> torch.Tensor:
    """The positions in the whole sequence (``seq`` tokens) of the ``seq // cp`` tokens
    ``rank`` holds, in its order (int64)."""
    length = chunk_length(seq, cp)
    early, late = chunks_of(rank, cp)
    return torch.cat([torch.arange(early * length, (early + 1) * length, device=device),
                      torch.arange(late * length, (late + 1) * length, device=device)])


def shard(tensor: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """``rank``'s tokens of ``tensor`` along its sequence dim ``dim`` (contiguous)."""
    length = chunk_length(tensor.shape[dim], cp)
    early, late = chunks_of(rank, cp)
    return torch.cat([tensor.narrow(dim, early * length, length),
                      tensor.narrow(dim, late * length, length)], dim=dim)


def unshard(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every rank's shard (``pieces[r]``: rank ``r``'s, as
    :func:`shard` cut it): the inverse of :func:`shard` over all ranks."""
    cp = len(pieces)
    halves = [piece.chunk(2, dim=dim) for piece in pieces]
    ordered = [halves[r][0] for r in range(cp)] + [halves[r][1] for r in reversed(range(cp))]
    return torch.cat(ordered, dim=dim)
