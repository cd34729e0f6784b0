"""A plan is a function of its inputs: the same bytes on an idle and on a loaded CPU.

Every rank plans by itself, so two ranks that plan differently refuse to build; and the
same command must plan alike tomorrow on a busier machine. Each test here stops CP-SAT
by its work limit (``PlannerOptions.work_limit``, ``ShardingOptions.work_limit``:
deterministic seconds, :mod:`partc.cp_sat`), once on an idle CPU and once with every
core busy, and compares what came out. With a wall-clock limit, where the search stops
depends on how much CPU it was given.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import torch

from partc.compiler import plan_problem
from partc.options import PlannerOptions, ShardingOptions
from partc.passes.pipeline import analyze
from partc.passes.tp.chooser import choose
from samples.gpt import gpt_tiny, loss_fn
from tests.passes.test_tp_chooser import FAST_LINK
from tests.planner.plan_bytes_worker import hard_problem, plan_bytes

ROOT = Path(__file__).resolve().parents[2]
# The longest any busy loop may outlive its test, should the test's own end be missed.
BUSY_S = 60
BUSY_LOOP = (f"import time\nend = time.monotonic() + {BUSY_S}\n"
             "while time.monotonic() < end:\n    pass\n")


@contextlib.contextmanager
def busy_cpus() -> Iterator[None]:
    """A spinning process per core for the block (each ends by itself after ``BUSY_S``
    seconds; all are killed when the block ends): the planner gets half the CPU it had
    or less. (Every spinner's second is CPU time the suite pays.)"""
    loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
             for _ in range(os.cpu_count() or 1)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
        for loop in loops:
            loop.wait()


def _planned(hash_seed: str) -> str:
    """The plan's bytes from a process of its own, with ``hash_seed`` for str hashes."""
    env = dict(os.environ, PYTHONHASHSEED=hash_seed,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "tests.planner.plan_bytes_worker"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_plan_stopped_by_its_work_limit_is_the_same_on_a_loaded_cpu():
    idle = _planned("1")
    # The limit binds: CP-SAT, stopped, solved fewer schedules than it does unlimited.
    unlimited = plan_bytes(plan_problem(hard_problem(), options=PlannerOptions()))
    assert json.loads(idle)["solver"]["configs_solved"] \
        < json.loads(unlimited)["solver"]["configs_solved"]
    with busy_cpus():
        loaded = _planned("2")
    assert loaded == idle


def test_the_sharding_choice_stopped_by_its_work_limit_is_the_same_on_a_loaded_cpu(caplog):
    ids = torch.zeros(2, 16, dtype=torch.long)
    gm, _ = analyze(gpt_tiny(n_layer=3), (ids,), loss_fn=loss_fn, example_target=ids,
                    name="gpt")
    # A layer's search takes up to 0.0017 deterministic seconds: this stops some.
    options = ShardingOptions(work_limit=0.001)

    def chosen() -> list:
        sharding = choose(gm, 2, FAST_LINK, sequence_parallel=True, options=options)
        return [(layer.name, layer.choices, layer.collectives) for layer in sharding.layers]

    with caplog.at_level(logging.WARNING, logger="partc"):
        idle = chosen()
    assert "stopped at its work limit" in caplog.text   # the limit binds
    # Each warning names the variant its layer was searched for.
    assert "(tp=2, sequence parallel, time first): the sharding search stopped" \
        in caplog.text
    with busy_cpus():
        loaded = chosen()
    assert len(idle) > 3 and loaded == idle
