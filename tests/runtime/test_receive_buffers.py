"""The pipeline stage holds receive buffers only while a microbatch needs them.

torch's stage allocates one buffer per microbatch for every tensor it receives at its
first step and keeps them; partc's (``partc.runtime.pipeline_stage.CountingStage``)
makes a microbatch's buffers when their receive is posted and lets them go after its
backward, as Megatron does. Here one rank of a two-stage plan runs in this process
under a fake process group (``benchmarks/memory_check.py``: messages move nothing, every
tensor is allocated with its real shape), and every buffer the stage makes is watched
through a weak reference: how many are alive when each forward and backward starts, and
which are left after the step. That training is unchanged is the pipeline parity tests'
concern (``test_parity.py``, ``test_schedules.py``).
"""

from __future__ import annotations

import weakref
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from benchmarks.memory_check import (Case, compile_case, neighbour_messages,
                                      zero_integer_receives)
from partc.cost.pipeline_config import PipelineConfig
from partc.runtime import pipeline_stage
from partc.runtime.pipeline_stage import _ReceiveBuffers

M = 8


def _case(schedule: str) -> Case:
    return Case(name=f"gpt-pp2-{schedule}-m{M}", model="gpt", world=2, ranks=(0, 1),
                constraints=dict(pp=2, schedule=schedule, num_microbatches=M,
                                 recompute="none"),
                batch=M, seq=16, layers=2, width=32)


def _watch(stage, made: dict[str, list]) -> dict[str, list[int]]:
    """Record, at the start of each forward and backward of ``stage``, how many of the
    activation and gradient buffers it made are alive."""
    alive = defaultdict(list)

    def count(kind: str) -> None:
        for direction, refs in made.items():
            alive[f"{direction} at {kind}"].append(sum(r() is not None for r in refs))

    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def forward_watched(*args, **kwargs):
        count("forward")
        return forward(*args, **kwargs)

    def backward_watched(*args, **kwargs):
        count("backward")
        return backward(*args, **kwargs)
    stage.forward_one_chunk, stage.backward_one_chunk = forward_watched, backward_watched
    return alive


def _run_rank(schedule: str, rank: int, monkeypatch) -> tuple:
    """Two training steps and an evaluation of ``rank``: the plan, the stage, the
    buffers made in the second step (per direction) and how many were alive at each
    forward and backward start, what the stage holds after it and after the
    evaluation."""
    program, inputs, target = compile_case(_case(schedule))
    made: dict[str, list] = {"activation": [], "gradient": []}
    allocate = pipeline_stage._ReceiveBuffers.allocate

    def allocate_watched(self, infos, chunk):
        allocate(self, infos, chunk)
        made[self.direction] += [weakref.ref(info.buffer) for info in infos[chunk]
                                 if getattr(info, "buffer", None) is not None]
    monkeypatch.setattr(pipeline_stage._ReceiveBuffers, "allocate", allocate_watched)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    try:
        module = program.build()
        stage = module.parts.stages[0]
        microbatch = tuple(t[:program.plan.micro_batch_size] for t in inputs)
        stage._recv_meta = neighbour_messages(program, stage, microbatch)
        module.forward_backward(*inputs, target=target)     # shape inference
        for refs in made.values():
            refs.clear()
        alive = _watch(stage, made)
        module.forward_backward(*inputs, target=target)
        held_after_step = (_ReceiveBuffers.held(stage.args_recv_info),
                           _ReceiveBuffers.held(stage.grad_recv_info))
        step = ({direction: len(refs) for direction, refs in made.items()},
                {kind: list(counts) for kind, counts in alive.items()})
        module.evaluate(*inputs, target=target)
        held_after_eval = _ReceiveBuffers.held(stage.args_recv_info)
        return program.plan, stage, *step, held_after_step, held_after_eval
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_last_stage_holds_only_the_inputs_in_flight(schedule, monkeypatch):
    plan, stage, made, alive, (activations, gradients), after_eval = \
        _run_rank(schedule, 1, monkeypatch)
    # A buffer per microbatch, made in the step, none left after it: placeholders only.
    assert made == {"activation": M, "gradient": 0}
    assert activations == [] and gradients == [] and after_eval == []
    assert all(info.buffer.numel() == 0 for infos in stage.args_recv_info.values()
               for info in infos)
    # Alive when each forward starts: the microbatches in flight (the one starting
    # included), as the plan counts them; torch's stage held all M from the start.
    config = PipelineConfig(pp=2, dp=1, micro_batch_size=plan.micro_batch_size,
                            num_microbatches=M, schedule=schedule)
    assert max(alive["activation at forward"]) == config.inflight(1)
    assert max(alive["activation at backward"]) == config.inflight(1)
    assert config.inflight(1) == (1 if schedule == "1f1b" else M)


def test_the_first_stage_holds_one_gradient_at_a_time(monkeypatch):
    _, stage, made, alive, (activations, gradients), _ = _run_rank("1f1b", 0, monkeypatch)
    assert made == {"activation": 0, "gradient": M}
    assert activations == [] and gradients == []
    # The gradient coming back for the backward about to run, and no other.
    assert alive["gradient at backward"] == [1] * M
    assert all(info.buffer is None or info.buffer.numel() == 0
               for infos in stage.grad_recv_info.values() for info in infos)


def test_an_interleaved_rank_holds_its_runs_as_the_plan_counts(monkeypatch):
    """Rank 1 of interleaved 1F1B holds runs 1 and 3: the microbatches it holds per run
    (forwarded, not yet backwarded) as its schedule really runs peak where
    ``PipelineConfig.held`` says, the first run's warm-up more often than the last's;
    and each run's receive buffers alive are those plus at most the one whose receive
    the schedule posted ahead."""
    case = Case(name=f"gpt-pp2-interleaved-m{M}", model="gpt", world=2, ranks=(0, 1),
                constraints=dict(pp=2, schedule="interleaved-1f1b", virtual_stages=2,
                                 num_microbatches=M, recompute="none"),
                batch=M, seq=16, layers=4, width=32)
    program, inputs, target = compile_case(case)
    made: dict[int, list] = defaultdict(list)     # per run: its activation buffers
    allocate = pipeline_stage._ReceiveBuffers.allocate
    run_of = {}

    def allocate_watched(self, infos, chunk):
        allocate(self, infos, chunk)
        if self.direction == "activation":     # the hidden states, not the positions
            made[run_of[id(infos)]] += [weakref.ref(info.buffer) for info in infos[chunk]
                                        if getattr(info, "buffer", None) is not None
                                        and info.buffer.is_floating_point()]
    monkeypatch.setattr(pipeline_stage._ReceiveBuffers, "allocate", allocate_watched)
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        module = program.build()
        microbatch = tuple(t[:program.plan.micro_batch_size] for t in inputs)
        runs = [stage.stage_index for stage in module.parts.stages]
        holding = dict.fromkeys(runs, 0)
        moments, excess = set(), []

        def watch(stage, name: str, step: int) -> None:
            run, call = stage.stage_index, getattr(stage, name)

            def watched(*args, **kwargs):
                holding[run] += max(step, 0)
                if step > 0:
                    moments.add(tuple(holding[j] for j in runs))
                excess.extend(sum(r() is not None for r in made[j]) - holding[j]
                              for j in runs)
                result = call(*args, **kwargs)
                holding[run] += min(step, 0)
                return result
            setattr(stage, name, watched)

        for stage in module.parts.stages:
            run_of[id(stage.args_recv_info)] = stage.stage_index
            stage._recv_meta = neighbour_messages(program, stage, microbatch)
            zero_integer_receives(stage)    # positions: the fake group moves nothing
            watch(stage, "forward_one_chunk", 1)
            watch(stage, "backward_one_chunk", -1)
        module.forward_backward(*inputs, target=target)     # shape inference
        made.clear()
        moments.clear()
        excess.clear()
        module.forward_backward(*inputs, target=target)
    finally:
        dist.destroy_process_group()
    config = PipelineConfig(pp=2, dp=1, micro_batch_size=program.plan.micro_batch_size,
                            num_microbatches=M, schedule="interleaved-1f1b", chunks=2)
    assert runs == list(config.runs_of(1)) == [1, 3]
    peaks = {h for h in moments
             if not any(g != h and all(a >= b for a, b in zip(g, h)) for g in moments)}
    assert peaks == set(config.held(1))
    assert any(len(set(h)) > 1 for h in peaks)    # unequal: the average would not do
    assert min(excess) >= 0 and max(excess) == 1
