"""Process groups and meshes are made once per world: a second program built in the same
process reuses the first's (each gloo group adds threads that stay alive and, idle, still
take CPU from the compute: plan choice's 21 programs in one process measured 5-8% slower
each than 3 did), and a world destroyed and started again gets new ones."""

from __future__ import annotations

import torch.distributed as dist

from partc.runtime.topology import GROUPS, group_of


def _world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def test_groups_and_meshes_are_made_once_per_world():
    made = []

    def make():
        made.append(object())
        return made[-1]

    _world()
    try:
        first = group_of([0])
        assert group_of((0,)) is first and group_of(range(1)) is first
        assert dist.get_process_group_ranks(first) == [0]
        key = ("test", "cpu", (1, 1, 1))
        assert GROUPS.get(key, make) is GROUPS.get(key, make) is made[0]
        assert GROUPS.get(("test", "cpu", (1, 1, 2)), make) is made[1]
        assert len(made) == 2
    finally:
        dist.destroy_process_group()
    _world()
    try:
        again = group_of([0])
        assert again is not first
        assert dist.get_process_group_ranks(again) == [0]
        assert GROUPS.get(key, make) is made[2]
    finally:
        dist.destroy_process_group()
