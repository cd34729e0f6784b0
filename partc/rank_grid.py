"""Where each rank sits in the pp x dp x cp x tp mesh, and the ranks of each group.

Ranks are laid out as Megatron-Core lays them: tp innermost (a tensor-parallel group
is ``tp`` consecutive ranks, inside a node), cp next, then dp, pp outermost::

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

A context-parallel group holds the ``cp`` ranks that share one sequence's shards (same
pp, dp and tp index); the gradient-reduction group (``dp_cp``) holds the ``dp * cp``
ranks that hold the same parameters in a stage (same pp and tp index): they see
different tokens, so gradients are reduced over all of them, as Megatron-Core's
data-parallel group "with context parallelism" does. With cp = 1 everything is the
(pp, dp, tp) layout partc has always used. Pure and torch-free: the runtime builds its
process groups from :func:`rank_groups`, the cost model and the report read the same
layout.
"""

from __future__ import annotations

from dataclasses import dataclass

AXES = ("pp", "dp", "cp", "tp")   # outermost first


@dataclass(frozen=True, order=True)
class RankCoords:
    """A rank's index along each mesh axis."""

    pp: int
    dp: int
    cp: int
    tp: int


@dataclass(frozen=True)
class RankGroups:
    """Every group of each kind, as tuples of ranks in increasing order; each rank is in
    exactly one group of each kind."""

    pp: tuple[tuple[int, ...], ...]
    dp: tuple[tuple[int, ...], ...]
    cp: tuple[tuple[int, ...], ...]
    tp: tuple[tuple[int, ...], ...]
    dp_cp: tuple[tuple[int, ...], ...]   # gradient reduction: dp x cp ranks

    def of(self, kind: str, rank: int) -> tuple[int, ...]:
        """The group of ``kind`` (one of :data:`AXES` or "dp_cp") that holds ``rank``."""
        return next(group for group in getattr(self, kind) if rank in group)


def _check(pp: int, dp: int, cp: int, tp: int) -> None:
    for name, value in zip(AXES, (pp, dp, cp, tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"mesh axis {name} must be a positive int, got {value!r}")


def rank_of(coords: RankCoords, *, pp: int, dp: int, cp: int = 1, tp: int = 1) -> int:
    """The rank at ``coords`` in a pp x dp x cp x tp mesh."""
    _check(pp, dp, cp, tp)
    for name, index, size in zip(AXES, (coords.pp, coords.dp, coords.cp, coords.tp),
                                 (pp, dp, cp, tp)):
        if not 0 <= index < size:
            raise ValueError(f"{name} index {index} is outside 0..{size - 1}")
    return ((coords.pp * dp + coords.dp) * cp + coords.cp) * tp + coords.tp


def coordinates(rank: int, *, pp: int, dp: int, cp: int = 1, tp: int = 1) -> RankCoords:
    """The (pp, dp, cp, tp) indices of ``rank`` in a pp x dp x cp x tp mesh."""
    _check(pp, dp, cp, tp)
    world = pp * dp * cp * tp
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the mesh's {world} ranks "
                         f"(pp={pp} x dp={dp} x cp={cp} x tp={tp})")
    return RankCoords(pp=rank // (dp * cp * tp), dp=rank // (cp * tp) % dp,
                      cp=rank // tp % cp, tp=rank % tp)


def rank_groups(*, pp: int, dp: int, cp: int = 1, tp: int = 1) -> RankGroups:
    """The ranks of every pp, dp, cp, tp and dp x cp group of the mesh: a group of an
    axis varies that axis (those of ``dp_cp`` both dp and cp) and fixes the others."""
    _check(pp, dp, cp, tp)
    everyone = [coordinates(r, pp=pp, dp=dp, cp=cp, tp=tp) for r in range(pp * dp * cp * tp)]

    def grouped(varying: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank, coords in enumerate(everyone):
            key = tuple(getattr(coords, axis) for axis in AXES if axis not in varying)
            groups.setdefault(key, []).append(rank)
        return tuple(sorted(tuple(ranks) for ranks in groups.values()))

    return RankGroups(pp=grouped(("pp",)), dp=grouped(("dp",)), cp=grouped(("cp",)),
                      tp=grouped(("tp",)), dp_cp=grouped(("dp", "cp")))
