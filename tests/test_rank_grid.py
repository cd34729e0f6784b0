"""The pp x dp x cp x tp rank layout (partc.rank_grid), against hand-written meshes and
brute force."""

from __future__ import annotations

import itertools

import pytest

from partc.rank_grid import RankCoords, coordinates, rank_groups, rank_of


def test_cp_sits_between_dp_and_tp_as_megatron_core_places_it():
    # 16 ranks: pp=2 x dp=2 x cp=2 x tp=2, written out by hand.
    shape = dict(pp=2, dp=2, cp=2, tp=2)
    assert coordinates(0, **shape) == RankCoords(pp=0, dp=0, cp=0, tp=0)
    assert coordinates(1, **shape) == RankCoords(pp=0, dp=0, cp=0, tp=1)
    assert coordinates(2, **shape) == RankCoords(pp=0, dp=0, cp=1, tp=0)
    assert coordinates(4, **shape) == RankCoords(pp=0, dp=1, cp=0, tp=0)
    assert coordinates(13, **shape) == RankCoords(pp=1, dp=1, cp=0, tp=1)
    groups = rank_groups(**shape)
    assert groups.tp[:2] == ((0, 1), (2, 3))
    assert groups.cp[:3] == ((0, 2), (1, 3), (4, 6))
    assert groups.dp[:2] == ((0, 4), (1, 5))
    assert groups.pp[:2] == ((0, 8), (1, 9))
    # Gradients are reduced over every rank holding the same parameters: dp x cp.
    assert groups.dp_cp == ((0, 2, 4, 6), (1, 3, 5, 7), (8, 10, 12, 14), (9, 11, 13, 15))
    assert groups.of("dp_cp", 11) == (9, 11, 13, 15) and groups.of("cp", 11) == (9, 11)


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 1, 1, 4), (1, 3, 2, 2), (2, 2, 4, 1),
                                   (3, 2, 2, 2)])
def test_groups_partition_the_ranks_and_agree_with_the_coordinates(shape):
    pp, dp, cp, tp = shape
    mesh = dict(pp=pp, dp=dp, cp=cp, tp=tp)
    world = pp * dp * cp * tp
    coords = {rank: coordinates(rank, **mesh) for rank in range(world)}
    assert sorted(coords.values()) == [RankCoords(*c) for c in itertools.product(
        range(pp), range(dp), range(cp), range(tp))]
    assert all(rank_of(c, **mesh) == rank for rank, c in coords.items())
    groups = rank_groups(**mesh)
    for kind, varying, size in (("pp", {"pp"}, pp), ("dp", {"dp"}, dp), ("cp", {"cp"}, cp),
                                ("tp", {"tp"}, tp), ("dp_cp", {"dp", "cp"}, dp * cp)):
        found = getattr(groups, kind)
        assert sorted(r for g in found for r in g) == list(range(world))
        for group in found:
            assert len(group) == size and list(group) == sorted(group)
            fixed = [{getattr(coords[r], a) for r in group}
                     for a in ("pp", "dp", "cp", "tp") if a not in varying]
            assert all(len(values) == 1 for values in fixed)


def test_cp_1_is_the_layout_partc_had():
    for rank in range(12):
        c = coordinates(rank, pp=2, dp=3, tp=2)
        assert (c.pp, c.dp, c.tp, c.cp) == (rank // 6, rank // 2 % 3, rank % 2, 0)


def test_ranks_and_axes_outside_the_mesh_are_refused():
    with pytest.raises(ValueError, match="rank 8 is outside the mesh's 8 ranks"):
        coordinates(8, pp=2, dp=1, cp=2, tp=2)
    with pytest.raises(ValueError, match="mesh axis cp must be a positive int"):
        rank_groups(pp=1, dp=1, cp=0, tp=1)
    with pytest.raises(ValueError, match="cp index 2 is outside 0..1"):
        rank_of(RankCoords(pp=0, dp=0, cp=2, tp=0), pp=1, dp=1, cp=2)
