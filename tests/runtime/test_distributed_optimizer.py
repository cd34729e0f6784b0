"""ZeRO 0/1's gradient buckets and distributed optimizer, and mixed precision with fp32
master weights, against one process (``optimizer_worker.py``, one torchrun of 2 ranks,
Adam through ``module.optimizer``, buckets of 4096 elements so that every model spans
many).

fp32: losses, parameters and gradient norms within 1e-5 of ``torch.optim.Adam`` on one
process. bf16: against one process running the same recipe (bf16 copies of the fp32
parameters made once per step, fp32 gradient accumulation, fp32 Adam), within bf16's
unit roundoff for losses and norms (``tests.tolerances.BF16``; seen: 5e-5, and 1.0e-3 on
the MoE's gradient norm on one CPU) and 5e-2 for each parameter tensor (the
program and the eager model round differently in bf16; seen: 2e-3 on the sample GPT,
up to 2.7e-2 on GPT-2's attention output bias, which starts at zero and stays small,
under ZeRO 0/1, 2e-3 under ZeRO-2/3). Under ZeRO 0/1 the bytes this rank allocates
for weights, gradients and optimizer state are those the plan's ``Precision`` prices,
within 5% (ZeRO-1's buckets pad each parameter's dp shard to whole rows).

Cases ending ``-sgd`` or ``-adamw`` run the loop people write instead: a plain
``torch.optim`` optimizer over ``module.parameters()``. Under ZeRO 0/2/3 it trains as on
one process; under ZeRO-1 its first ``step()`` is refused on every rank with a
:class:`partc.PlanMismatchError` naming ``module.optimizer``, before any parameter
changed.
"""

from __future__ import annotations

from pathlib import Path

import gc

import pytest
import torch

from partc.errors import PlanMismatchError
from partc.passes.helpers.op_bytes import MovedBytes
from partc.runtime.optimizer import GradBuckets
from partc.runtime.rank_optimizer import PLAIN_STEPS
from tests import tolerances

from .test_parity import launch as launch_worker
from .test_parity import launched, matrix

WORKER = Path(__file__).with_name("optimizer_worker.py")
CASES = ["gpt-zero0-fp32", "gpt-zero1-fp32", "gpt2-zero1-fp32-clip", "gpt-zero0-bf16",
         "gpt-zero1-bf16-clip", "gpt-zero3-bf16", "moe-ep2-zero1-bf16-clip",
         "gpt-zero1-fp32-adamw"]
SLOW_CASES = ["gpt2-zero0-fp32-clip", "gpt-zero2-fp32", "gpt-zero3-fp32", "gpt2-zero1-bf16",
              "gpt2-zero2-bf16", "moe-ep2-zero1-fp32", "moe-ep2-zero3-bf16"]
# A batch poisoned at step 3 (optimizer_worker.run_nonfinite_case): the default raises,
# "skip" skips; under ZeRO-1's distributed optimizer over dp=2, a pipeline of 2 stages
# and FSDP2 (ZeRO-3).
NONFINITE_CASES = ["gpt-zero1-fp32-nan-raise", "gpt-zero1-fp32-nan-skip",
                   "gpt-pp2-zero0-fp32-nan-raise", "gpt-pp2-zero0-fp32-gradnan-skip",
                   "gpt-zero3-fp32-nan-skip"]
# At step 3 the last stage is given another batch's targets (a loader seeded by rank):
# refused by the batch digest (partc/runtime/batch_digest.py).
BATCH_CASE = "gpt-pp2-zero0-fp32-rankbatch-raise"
FOUR_CASES = ["gpt-pp2-zero1-fp32", "gpt-pp2-zero0-bf16", "gpt-pp2-zero1-bf16-clip",
              "gpt2-pp2-zero1-fp32-clip"]  # pp=2 x dp=2
# The plain loop under every ZeRO stage: dp=2 (with the 2-rank slow cases), pp=2 x dp=2
# and the MoE at ep=2 x pp=2 (a launch of their own: with FOUR_CASES it would outlast
# the launch's time limit on 2 cores).
_STAGES_AND_OPTIMIZERS = [f"zero{zero}-fp32-{name}" for zero in range(4)
                          for name in ("sgd", "adamw")]
SLOW_CASES += [f"qwen2-{case}" for case in _STAGES_AND_OPTIMIZERS] + ["gpt-zero1-bf16-sgd"]
PLAIN_FOUR_CASES = [f"{mesh}-{case}" for mesh in ("qwen2-pp2", "qwen3moe-pp2-ep2")
                    for case in _STAGES_AND_OPTIMIZERS]
# The default profile: ZeRO-0, 1 and 3, bf16 and fp32, clipping, AdamW, the MoE's
# expert-dp shards; the rest -m slow.
DEFAULT = {"gpt-zero0-bf16", "gpt-zero1-bf16-clip", "moe-ep2-zero1-bf16-clip",
           "gpt-zero1-fp32-adamw", "gpt-zero3-bf16"}
RTOL = {"fp32": (tolerances.FP32, tolerances.FP32),   # (losses and norms, parameters)
        "bf16": (tolerances.BF16, 5e-2)}


def _launch(cases: list[str], out: Path, nproc: int = 2) -> list[dict]:
    return launch_worker(nproc, cases, out, worker=WORKER)


ranks = launched("ranks", 2, CASES + NONFINITE_CASES + [BATCH_CASE], worker="optimizer_worker")


@pytest.fixture(scope="module")
def slow_ranks(tmp_path_factory) -> list[dict]:
    return _launch(SLOW_CASES, tmp_path_factory.mktemp("optimizer_slow"))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[dict]:
    return _launch(FOUR_CASES, tmp_path_factory.mktemp("optimizer_four"), nproc=4)


@pytest.fixture(scope="module")
def plain_four_ranks(tmp_path_factory) -> list[dict]:
    return _launch(PLAIN_FOUR_CASES, tmp_path_factory.mktemp("optimizer_plain"), nproc=4)


# The sample MoE's top-1 router is discontinuous: a bf16 rounding that moves a near-tied
# token to another expert moves that token's gradient with it, which the near-zero norm
# biases feel most (seen: 7e-2 on a LayerNorm bias after 3 steps, losses within 3e-5).
MOE_BF16_PARAM_RTOL = 1e-1


PLAIN = ("sgd", "adamw")  # a case's last word: a plain torch optimizer


def _check(ranks: list[dict], name: str) -> None:
    words = name.split("-")
    dtype = next(word for word in words if word in RTOL)
    rtol, param_rtol = RTOL[dtype]
    if name.startswith("moe-") and "-bf16" in name:
        param_rtol = MOE_BF16_PARAM_RTOL
    for rank, results in enumerate(ranks):
        seen = results[name]
        assert "error" not in seen, f"rank {rank}: {seen['traceback']}"
        if words[-1] in PLAIN and seen["zero_stage"] == 1:
            _check_refused(seen, rank)
            continue
        assert "refused" not in seen, f"rank {rank}: {seen}"
        for ours, ref in zip(seen["losses"], seen["ref_losses"], strict=True):
            assert ours == pytest.approx(ref, rel=rtol)
        for ours, ref in zip(seen["grad_norms"], seen["ref_grad_norms"], strict=True):
            assert ours == pytest.approx(ref, rel=rtol)
        worst = max(seen["param_errors"].items(), key=lambda item: item[1])
        assert worst[1] < param_rtol, f"rank {rank}: {worst}"
        if seen["zero_stage"] < 2:  # FSDP's allocations are its own
            for kind, planned in seen["planned"].items():
                assert seen["measured"][kind] == pytest.approx(planned, rel=0.05), (kind, seen)


def _check_refused(seen: dict, rank: int) -> None:
    """A plain optimizer under ZeRO-1: refused at its first step, on this rank, naming
    the fix, with every parameter as it was."""
    assert "refused" in seen, f"rank {rank} trained on: {seen}"
    assert seen["step"] == 0 and seen["changed"] == 0, (rank, seen)
    assert seen["refused"].startswith("PlanMismatchError: "), seen["refused"]
    assert f"rank {rank} " in seen["refused"] and "module.optimizer(torch.optim." \
        in seen["refused"], seen["refused"]


@pytest.mark.parametrize("name", matrix(CASES, DEFAULT & set(CASES)))
def test_trains_like_one_process(ranks, name):
    _check(ranks, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_CASES)
def test_trains_like_one_process_slow(slow_ranks, name):
    _check(slow_ranks, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", FOUR_CASES)
def test_pipeline_trains_like_one_process(four_ranks, name):
    _check(four_ranks, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", PLAIN_FOUR_CASES)
def test_plain_optimizer_trains_like_one_process_or_is_refused(plain_four_ranks, name):
    _check(plain_four_ranks, name)


# -- non-finite steps ----------------------------------------------------------------------

POISONED_STEP = 3   # module.step of the poisoned batch (optimizer_worker.POISONED + 1)


@pytest.mark.parametrize("name", matrix([n for n in NONFINITE_CASES if n.endswith("-raise")],
                                        {"gpt-zero1-fp32-nan-raise"}))
def test_nonfinite_step_raises_before_any_parameter_changes(ranks, name):
    """Every rank raises NonFiniteError at the poisoned step, naming it, what was
    non-finite, the loss's stage and rank (the first replica's first microbatch: rank 0,
    or under pp the last stage's rank); the parameters and Adam's state are those of the
    step before."""
    pipelined = "-pp2-" in name
    loss_rank = len(ranks) - 1 if pipelined else 0
    for rank, results in enumerate(ranks):
        seen = results[name]
        assert "traceback" not in seen, f"rank {rank}: {seen['traceback']}"
        error = seen["error"]
        assert error is not None, f"rank {rank}: no error"
        assert error["step"] == POISONED_STEP and f"step {POISONED_STEP}:" in error["message"]
        assert error["what"] == ["loss", "gradient norm"]
        assert error["ranks"] == [loss_rank], error["message"]
        stage = len(ranks) - 1 if pipelined else 0
        assert f"the loss on stage {stage} (rank {loss_rank})" in error["message"]
        assert "no parameter has changed" in error["message"]
        assert error["unchanged"], f"rank {rank}: the state changed at the raising step"
        assert error["parameters"], "the rank's non-finite gradients are named"
        assert seen["changed"] == [True] * (POISONED_STEP - 1)   # trained until then
    if pipelined:
        assert ranks[0][name]["error"]["stages"] == [0, 1]


@pytest.mark.parametrize("name", matrix([n for n in NONFINITE_CASES if n.endswith("-skip")],
                                        {"gpt-pp2-zero0-fp32-gradnan-skip",
                                         "gpt-zero3-fp32-nan-skip"}))
def test_nonfinite_step_is_skipped_on_every_rank(ranks, name):
    """With on_nonfinite="skip" the poisoned step changes no parameter and no optimizer
    state on any rank, is counted once (module and telemetry), and training goes on
    finite, as one process trained on the other batches."""
    poisoned = POISONED_STEP - 1
    for rank, results in enumerate(ranks):
        seen = results[name]
        assert "traceback" not in seen, f"rank {rank}: {seen['traceback']}"
        assert seen["error"] is None
        assert seen["skipped"] == [step == poisoned for step in range(len(seen["skipped"]))]
        assert seen["changed"] == seen["stepped"] == [not s for s in seen["skipped"]]
        assert seen["skipped_steps"] == seen["telemetry_skipped"] == 1
        assert seen["telemetry_flags"] == seen["skipped"]
        finite = seen["losses"][:poisoned] + seen["losses"][poisoned + 1:]
        for ours, ref in zip(finite, seen["ref_losses"], strict=True):
            assert ours == pytest.approx(ref, rel=tolerances.FP32)
        worst = max(seen["param_errors"].items(), key=lambda item: item[1])
        assert worst[1] < tolerances.FP32, f"rank {rank}: {worst}"


@pytest.mark.reads(BATCH_CASE)
def test_a_stage_given_another_batch_is_refused_naming_both_ranks_and_the_step(ranks):
    """pp=2: the last stage's targets are another batch's at step 3. Every rank raises
    BatchMismatchError naming ranks 0 and 1 and the step, before the optimizer stepped;
    steps 1 and 2, the same batch on both, trained."""
    for rank, results in enumerate(ranks):
        seen = results[BATCH_CASE]
        assert "traceback" not in seen, f"rank {rank}: {seen['traceback']}"
        error = seen["error"]
        assert error is not None and error["type"] == "BatchMismatchError", seen
        assert error["step"] == POISONED_STEP and error["ranks"] == [0, 1]
        assert error["message"].startswith(
            f"step {POISONED_STEP}: rank 0 (stage 0) and rank 1 (stage 1) were given "
            "different batches"), error["message"]
        assert error["unchanged"] and seen["changed"] == [True] * (POISONED_STEP - 1)


# -- the buckets' layout, in one process ------------------------------------------------

class _Shapes(torch.nn.Module):
    """Parameters whose rows divide dp, do not, are fewer than dp ranks, or are none."""

    def __init__(self) -> None:
        super().__init__()
        for name, shape in (("square", (12, 5)), ("odd", (7, 3)), ("few", (2, 4)),
                            ("vector", (11,)), ("scalar", ()), ("tall", (48, 2))):
            self.register_parameter(name, torch.nn.Parameter(torch.randn(shape)))


@pytest.mark.parametrize("dp", [1, 2, 3, 5, 8, 48])
def test_buckets_take_each_rank_its_rows(dp):
    """A gradient added into the sharded buckets lands, for every rank, in the rows that
    rank holds (FSDP's ``chunk(dp)`` of dim 0; a 0-dim parameter in every region), and an
    all-gather's output goes back into every parameter row for row: the same as placing
    each rank's part one by one, with at most two kernels per parameter whatever dp is."""
    torch.manual_seed(0)
    module = _Shapes()
    for rank in {0, dp - 1}:
        buckets = GradBuckets(module, None, dp, rank, sharded=True, elements=8)
        assert len(buckets.buckets) > 1
        grads = [(bucket, slot, slot.param.detach() * 2) for bucket, slot in buckets.slots()]
        launches = MovedBytes(set(), cuda=True)   # the kernels the cost model counts
        with launches:
            for bucket, slot, grad in grads:
                buckets._add(bucket, slot, grad)
        assert launches.kernels <= 2 * len(list(module.parameters()))
        for bucket, slot in buckets.slots():
            whole = slot.param.detach().reshape(-1) * 2
            for other in range(dp):
                start, end = slot.ranges[other]
                if slot.param.dim() == 0:
                    start, end = 0, 1
                torch.testing.assert_close(
                    slot.rank_view(bucket.region_of(other), other)[:end - start],
                    whole[start:end], rtol=0, atol=0)
        # The bucket's buffer stands for an all-gather's output: every rank's rows back.
        before = {name: p.detach().clone() for name, p in module.named_parameters()}
        with torch.no_grad():
            for p in module.parameters():
                if p.dim():
                    p.zero_()
        for bucket in buckets.buckets:
            buckets._scatter_rows(bucket, bucket.buffer / 2)
        for name, p in module.named_parameters():
            torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0)


# -- a plain optimizer under ZeRO-1, in one process ---------------------------------------

class _Stage(torch.nn.Module):
    """Stands for a ZeRO-1 DistributedModule: it holds the parameters the guard watches,
    and counts steps."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)
        self.step = 2


def test_plain_optimizer_over_zero1_parameters_is_refused_before_it_steps():
    """Every torch optimizer stepping a watched parameter is refused before it changes
    any (AdamW's decoupled decay would change one before reading its gradient); one over
    other parameters, or over new parameters viewing the same rows as
    DistributedOptimizer's shards do, steps; an optimizer that passed is checked again
    once a watched parameter joins it; nothing is refused once the module is gone."""
    stage = _Stage()
    PLAIN_STEPS.watch(stage, stage.named_parameters(), "rank 3 (stage 1)")
    for param in stage.parameters():
        param.grad = torch.ones_like(param)
    before = [p.detach().clone() for p in stage.parameters()]
    for optimizer in (torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9),
                      torch.optim.AdamW([stage.proj.bias], lr=0.1, weight_decay=0.1)):
        with pytest.raises(PlanMismatchError) as refused:
            optimizer.step()
        name = type(optimizer).__name__
        assert str(refused.value).startswith(f"rank 3 (stage 1): torch.optim.{name}.step() "
                                             f"at step 2 would update 'proj.")
        assert f"module.optimizer(torch.optim.{name}, " in str(refused.value)
        assert all(torch.equal(b, p) for b, p in zip(before, stage.parameters()))
    other = torch.nn.Linear(2, 2)
    shards = [torch.nn.Parameter(p.detach().view(-1)[:2]) for p in stage.parameters()]
    for params in (other.parameters(), shards):
        params = list(params)
        for param in params:
            param.grad = torch.ones_like(param)
        passing = torch.optim.SGD(params, lr=0.1)
        passing.step()
        passing.step()
    passing.add_param_group({"params": [stage.proj.weight]})
    with pytest.raises(PlanMismatchError, match="would update 'proj.weight'"):
        passing.step()
    kept = stage.proj.weight
    del stage, passing, refused  # the traceback's frames hold the stage too
    gc.collect()
    torch.optim.SGD([kept], lr=0.1).step()


def test_a_split_backwards_last_weight_pass_reduces_the_buckets_it_fills():
    """A zero-bubble schedule's weight pass sets ``.grad`` outside autograd's accumulation
    hooks; handed to the buckets (``take``), they are added as the hooks add them, and in
    the stage's last weight pass a bucket made full is reduced at once, not left for
    ``finish``: what lets the cost model hide the reduction behind the rank's later
    backwards (``partc.cost.timeline.overlap_windows``)."""
    torch.manual_seed(0)
    module = _Shapes()
    buckets = GradBuckets(module, None, 1, 0, sharded=False, elements=8)
    params = list(module.parameters())
    for last in (False, True):
        buckets.begin(last=last)
        for p in params:
            p.grad = torch.ones_like(p)
        buckets.take(params)
        buckets.end()
        assert all(p.grad is None for p in params)   # taken into the buckets
        assert all((bucket.work is not None) == last for bucket in buckets.buckets)
    buckets.finish(scale=2)
    for p in params:   # two microbatches of ones, divided by the microbatches
        torch.testing.assert_close(p.grad, torch.ones_like(p), rtol=0, atol=0)
