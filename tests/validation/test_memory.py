"""Predicted memory per rank against a measurement of the same rank (CPU, fake group).

Each case compiles a small model, runs one rank of its plan for two training steps in
this process under a fake process group and measures the second with ``MemTracker``
(``benchmarks/memory_check.py``, which prints every case and category:
``python benchmarks/memory_check.py``). The peak must be within ±10% of
``plan.stages[k].memory_bytes["peak"]`` where the cost model is right; where it is known
to be off, the case is a strict xfail naming why, so that a fix shows up as an XPASS
(then drop the mark).
"""

from __future__ import annotations

import functools

import pytest

from benchmarks.memory_check import (TOLERANCE, Measured, case_named, compile_case,
                                     measure_rank, stage_of_rank)


@functools.lru_cache(maxsize=None)
def _compiled(name: str):
    return compile_case(case_named(name))


@functools.lru_cache(maxsize=None)
def _measured(name: str, rank: int) -> tuple[dict[str, int], Measured]:
    program, inputs, target = _compiled(name)
    stage = stage_of_rank(program.plan, rank)
    measured = measure_rank(program, inputs, target, rank, case_named(name).world)
    return dict(program.plan.stages[stage].memory_bytes), measured


def _off(reason: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, reason=reason)


PEAKS = [
    pytest.param("gpt-pp2-1f1b-m4", 0, id="gpt-pp2-1f1b-m4-stage0"),
    pytest.param("gpt-pp2-gpipe-m4", 1, id="gpt-pp2-gpipe-m4-stage1"),
    pytest.param("gpt-tp2", 0, id="gpt-tp2"),
    pytest.param("gpt-dp2-zero2", 0, id="gpt-dp2-zero2"),
    # The last stage once kept every microbatch's logits (1.19x): the runtime now steps
    # with return_outputs=False. Receive buffers per microbatch remain unmodelled.
    pytest.param("gpt-pp2-1f1b-m8", 1, id="gpt-pp2-1f1b-m8-stage1"),
    # Selective recompute keeps every compute-heavy op's output (the runtime's MUST_SAVE
    # policy); the estimate once kept only those autograd would save (1.26x).
    pytest.param("gpt-pp2-1f1b-m4-selective", 0, id="gpt-pp2-1f1b-m4-selective-stage0"),
    pytest.param("llama-pp1", 0, id="llama-pp1", marks=_off(
        "the estimate makes every float input of a layer require grad, so Llama's "
        "rotary cos/sin make the rotary products save q and k twice over")),
    pytest.param("llama-pp2-gpipe-m4-full", 1, id="llama-pp2-gpipe-m4-full-stage1",
                 marks=_off(
        "over: full recompute keeps a layer's inputs, and inputs shared by consecutive "
        "layers (Llama's attention mask, rotary cos/sin) are counted once per layer; "
        "under GPipe the gradients do not exist yet when every microbatch is in flight")),
    pytest.param("llama-pp1-bf16", 0, id="llama-pp1-bf16", marks=_off(
        "bf16 activations are the fp32 ones halved, but under autocast norms, softmax, "
        "the residual stream and casts stay or are made in fp32")),
]


@pytest.mark.parametrize("name, rank", PEAKS)
def test_peak_memory_within_tolerance(name, rank):
    predicted, measured = _measured(name, rank)
    ratio = measured.peak / predicted["peak"]
    assert abs(ratio - 1) <= TOLERANCE, (
        f"{name} rank {rank}: measured peak {measured.peak:,} B ({measured.phase}) is "
        f"{ratio:.2f} x the predicted {predicted['peak']:,} B; at the peak "
        f"{measured.at_peak}, predicted {predicted}")


STATE = [
    pytest.param("gpt-pp2-1f1b-m4", 0, id="gpt-pp2-1f1b-m4-stage0"),
    pytest.param("gpt-pp2-1f1b-m4", 1, id="gpt-pp2-1f1b-m4-stage1"),
    pytest.param("llama-pp1", 0, id="llama-pp1"),
    pytest.param("gpt-pp2-1f1b-m4-bf16-small", 0, id="gpt-bf16-stage0"),
    pytest.param("gpt-dp2-zero2", 0, id="gpt-dp2-zero2"),
]


@pytest.mark.parametrize("name, rank", STATE)
def test_parameters_and_optimizer_state(name, rank):
    """Parameters and optimizer state are held through the step: at the peak they
    equal the prediction (to 1%: AdamW's step counters, a rotary buffer, FSDP's padding).
    Under ZeRO-2 the whole weights FSDP gathers for the step are parameters to the plan
    and forward allocations to the tracker: the shards alone are compared."""
    predicted, measured = _measured(name, rank)
    for category in ("params", "optimizer"):
        got, want = measured.at_peak[category], predicted[category]
        if category == "params" and _gathered(name):
            want -= _gathered_bytes(name, rank)
        assert abs(got / want - 1) <= 0.01, f"{name} rank {rank} {category}: {got:,} vs {want:,}"


def _gathered(name: str) -> bool:
    return case_named(name).constraints.get("zero_stage", 0) >= 2


def _gathered_bytes(name: str, rank: int) -> int:
    """What the plan counts of ZeRO-2's parameters beyond the fp32 shards: the stage's
    weights gathered whole, in the compute dtype."""
    program, _, _ = _compiled(name)
    stage = program.plan.stages[stage_of_rank(program.plan, rank)]
    return stage.param_count * case_named(name).dtype.itemsize
