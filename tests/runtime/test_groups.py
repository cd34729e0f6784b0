"""Process groups and meshes are made once per world: a second program built in the same
process reuses the first's (each gloo group adds threads that stay alive and, idle, still
take CPU from the compute: plan choice's 21 programs in one process measured 5-8% slower
each than 3 did), and a world destroyed and started again gets new ones. Leaving the
world (``topology.leave``) frees them, their gloo threads joined before the interpreter
shuts down."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from partc.runtime.topology import GROUPS, group_of, leave

TASKS = Path("/proc/self/task")


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


def _gloo_workers() -> int:
    """The gloo worker threads alive in this process (each group runs two)."""
    return sum(1 for comm in TASKS.glob("*/comm")
               if comm.read_text().strip() == "pt_gloo_runloop")


@pytest.mark.skipif(not TASKS.is_dir(), reason="reads thread names from /proc (Linux)")
def test_leaving_joins_the_groups_threads_before_the_interpreter_shuts_down():
    """``destroy_process_group`` leaves the worker threads of a group something still
    refers to (``GROUPS`` does) running into interpreter shutdown, where one releasing
    its last collective's tensor aborts the process; ``leave`` frees the groups, and
    their destructors join those threads."""
    GROUPS.forget()   # earlier worlds' groups go first
    gc.collect()
    before = _gloo_workers()
    _world()
    dist.all_reduce(torch.ones(1), group=group_of([0]))   # its threads run
    assert _gloo_workers() >= before + 2
    leave()
    assert not dist.is_initialized()
    assert _gloo_workers() == before
    _world()   # a world started again makes its groups again
    try:
        assert dist.get_process_group_ranks(group_of([0])) == [0]
    finally:
        leave()
