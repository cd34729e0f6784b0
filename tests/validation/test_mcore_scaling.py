"""partc's cost model and planner against Megatron-Core's published H100 weak scaling.

One H100 matmul efficiency is fitted on the 32B row (``mcore.FIT_RUN``: tp = 8, no
pipeline) with its published mesh as partc plans it; at that efficiency partc must
predict every other row's TF/GPU within 15%, and its own plan for the same devices and
batch must be at least as fast as its prediction of the published mesh, within 80 GiB.
A pipelined row runs a schedule Megatron-Core r0.8.0 can run over its even split of
the blocks, the faster of plain 1F1B and its interleavings (``mcore.predict``; the
schedules partc would choose instead, such as 119B's interleaved zero-bubble chunks of
unequal blocks, are ones that release cannot run).
The default profile fits the constant and checks the smallest row (a few seconds of
tracing on the meta device each); the other rows are slow-marked. The slow profile also
predicts every row at an H100's measured matmul efficiency, nothing fitted, which
names what the fitted constant absorbs (``mcore``'s docstring).
``benchmarks/validation.py`` prints the whole table with each step's breakdown.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.validation import mcore
from tests.validation.mcore import FIT_RUN, run_named
from tests.validation.megatron import breakdown, plan_assignment

# The fit reaches the 32B row since the sequence-parallel collectives run as rings
# beside their linears' matmuls (TrainSpec.tp_overlap: the tensor-parallel term of the
# 32B step fell from 0.37 s to 0.03 s) and ZeRO-1 in bf16 is Megatron's distributed
# optimizer (its tail 0.31 s -> 0.16 s).
TARGET = 0.15
_FAST = {"1.7B", "7.1B"}


def _rows(names):
    return [pytest.param(name, marks=[] if name in _FAST else [pytest.mark.slow])
            for name in names]


OTHER_ROWS = _rows(run.name for run in mcore.RUNS if run is not FIT_RUN)


def test_step_flops_give_the_published_iteration_times():
    for name, seconds in (("1.7B", 0.45), ("70B", 2.18), ("462B", 12.72)):
        run = run_named(name)
        iteration = mcore.step_flops(run) / (run.gpus * run.tflops_per_gpu * 1e12)
        assert iteration == pytest.approx(seconds, abs=0.005), name


def test_pipelined_rows_are_pinned_to_megatrons_split_and_schedule():
    constraints = mcore.published(run_named("119B"))
    assert constraints.schedule == "1f1b"
    blocks = [[name for name in stage if name.startswith("blocks.")]
              for stage in constraints.stages]
    assert [len(stage) for stage in blocks] == [23] * 4
    assert constraints.stages[0][:3] == ("tok_emb", "pos_emb", "drop")
    assert constraints.stages[-1][-3:] == ("ln_f", "lm_head", "loss")
    assert mcore.published(FIT_RUN).stages is None


def test_the_fitted_efficiency_reproduces_the_fitted_row():
    efficiency = mcore.fitted_efficiency()
    assert 0.3 < efficiency <= 1.0
    predicted = mcore.predict(FIT_RUN.name, efficiency)
    assert predicted.ratio == pytest.approx(1.0, rel=0.02)


def test_the_fitted_row_hides_the_sync_that_microbatches_of_one_expose():
    """What the fitted constant absorbs, measured on the fitted row: partc plans 32B as one
    microbatch of four sequences per replica, whose backward hides the whole fp32
    reduce-scatter of ZeRO-1's gradients and whose forward the bf16 all-gather; the same
    plan run as the four microbatches of one sequence that the published batches imply
    (4 pp dp sequences: 4 pp microbatches per replica) overlaps them with one
    microbatch's backward and forward only, and exposes 0.35 s of them (26% of its
    step), which the constant fitted on the first plan never sees."""
    fit_problem = mcore.problem(FIT_RUN.name, None)
    planned = plan_assignment(mcore.plan(fit_problem))
    assert (planned.config.micro_batch_size, planned.config.num_microbatches) == (4, 1)
    problem = mcore.with_efficiency(fit_problem, mcore.fitted_efficiency())
    ones = dataclasses.replace(planned, config=dataclasses.replace(
        planned.config, micro_batch_size=1, num_microbatches=4))
    hidden, exposed = breakdown(problem, planned), breakdown(problem, ones)
    assert hidden.dp_sync < 0.01 < 0.3 < exposed.dp_sync
    assert exposed.dp_sync / exposed.step > 0.2


@pytest.mark.parametrize("name", OTHER_ROWS)
def test_published_mesh_within_target(name):
    predicted = mcore.predict(name)
    plan = predicted.plan
    assert abs(predicted.ratio - 1) <= TARGET, (
        f"{name}: predicted {predicted.tflops_per_gpu:.1f} TF/GPU, published "
        f"{predicted.run.tflops_per_gpu} ({predicted.ratio:.3f}x) with b="
        f"{plan.micro_batch_size}, m={plan.num_microbatches}, sp={plan.sequence_parallel}")
    assert predicted.peak_bytes <= mcore.DEVICE_BYTES


PIPELINED = [pytest.param(run.name, marks=pytest.mark.slow) for run in mcore.RUNS
             if run.pp > 1]
UNPIPELINED = [pytest.param(run.name, marks=pytest.mark.slow) for run in mcore.RUNS
               if run.pp == 1]


# Open finding (slow profile), strict so that a fix shows.
# With the sends and each virtual stage's gradient reduction priced as the runtime runs
# them, the measured efficiency predicts more than Megatron-Core reached (1.17-1.38x):
# the charges removed had stood in for losses the model lacks (mcore.py's docstring).
_MEASURED_FAST = pytest.mark.xfail(strict=True, reason=(
    "at the measured matmul efficiency the pipelined rows are predicted 1.17-1.38x: losses "
    "the model lacks, likely NCCL's contention with compute (comm_overlap 1, unmeasured)"))
MEASURED = [pytest.param(run.name, marks=[pytest.mark.slow, _MEASURED_FAST])
            for run in mcore.RUNS if run.pp > 1]


def _measured(name: str, micro_batch_size: int | None) -> mcore.Prediction:
    return mcore.predict(name, mcore.MEASURED_EFFICIENCY, micro_batch_size=micro_batch_size)


@pytest.mark.parametrize("name", MEASURED)
def test_pipelined_rows_within_target_at_the_measured_efficiency(name):
    """Nothing fitted: matmuls at an H100's measured share of peak, attention at the
    preset's, the micro-batch size partc plans (one sequence, 70B two) and the faster
    schedule Megatron-Core can run (1.17-1.38x: an open finding, above)."""
    predicted = _measured(name, None)
    assert abs(predicted.ratio - 1) <= TARGET, f"{name}: {predicted.ratio:.3f}x"
    assert predicted.peak_bytes <= mcore.DEVICE_BYTES


@pytest.mark.parametrize("name", UNPIPELINED)
def test_unpipelined_rows_lie_between_microbatches_of_one_and_partcs_own(name):
    """At the measured efficiency, a row without a pipeline is predicted above its
    published throughput as the microbatch partc chooses (four sequences: the
    data-parallel sync hidden) and below it as four microbatches of one (the sync
    exposed beside one microbatch) where its data-parallel group has one or two ranks
    per node (16B, 32B: a NIC each); 1.7B's and 7.1B's rings run over 8 and 4 NICs a
    node and hide it either way. The micro-batch size the table does not give decides
    the larger rows."""
    run = run_named(name)
    ones = _measured(name, mcore.MICROBATCH_OF_THE_BATCHES)
    chosen = _measured(name, None)
    assert chosen.plan.micro_batch_size > 1
    assert ones.ratio < chosen.ratio and chosen.ratio > 1, \
        f"{name}: {ones.ratio:.3f}x, {chosen.ratio:.3f}x"
    if run.tp >= 4:
        assert ones.ratio < 1, f"{name}: {ones.ratio:.3f}x"


@pytest.mark.parametrize("name", PIPELINED)
def test_a_pipelined_row_runs_a_schedule_megatron_can_run(name):
    """The predicted schedule is plain 1F1B or one of Megatron-Core r0.8.0's
    interleavings of the plan (v chunks per rank dividing the blocks per stage, the
    microbatches a multiple of pp), the fastest that fits, and never slower than plain
    1F1B's plan."""
    run = run_named(name)
    predicted = mcore.predict(name)
    plain = predicted.planned_tflops_per_gpu
    assert predicted.plan.schedule == "1f1b"
    assert predicted.tflops_per_gpu >= plain * (1 - 1e-9)
    found = [i for i in mcore.megatron_interleavings(name)
             if i.peak_bytes <= mcore.DEVICE_BYTES]
    assert all((run.layers // run.pp) % i.chunks == 0 for i in found)
    if predicted.chunks > 1:
        assert predicted.plan.num_microbatches % run.pp == 0
        assert predicted.tflops_per_gpu == max(i.tflops_per_gpu for i in found)
        config = predicted.assignment.config
        assert (config.schedule, config.chunks) == (predicted.schedule, predicted.chunks)
    else:
        assert all(i.tflops_per_gpu <= plain for i in found)


@pytest.mark.slow
def test_119b_interleaves_only_as_one_block_chunks():
    # 23 blocks per stage interleave only as one-block chunks in Megatron-Core.
    (only,) = mcore.megatron_interleavings("119B")
    assert only.chunks == 23
    assert only.peak_bytes <= mcore.DEVICE_BYTES


# -m slow (55 s for the smallest row): the same check on the SC'21 table runs by default
# (tests/validation/test_megatron.py).
@pytest.mark.slow
@pytest.mark.parametrize("name", ["1.7B", "32B", "70B"])
def test_own_plan_is_at_least_as_fast_and_fits(name):
    published = mcore.predict(name)
    own = mcore.predict(name, own=True)
    assert own.tflops_per_gpu >= published.tflops_per_gpu * (1 - 1e-9)
    assert own.peak_bytes <= mcore.DEVICE_BYTES


def _table(tmp_path, rows, gpu="H100-80GB SXM", **common):
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"hardware": {"gpu": gpu}, "common": common, "rows": rows}))
    return path


def test_a_published_table_loads_as_the_rows_it_holds(tmp_path):
    """Another table in the schema of the shared json (``benchmarks/validation.py
    --table``): the copied rows come back as they are, a table's own vocabulary,
    sequence and GPU reach the model, its FLOPs and its budget, and a row lacking a
    field or a GPU no preset names is refused with the reason."""
    rows = [{key: getattr(run, key) for key in ("params_b", "heads", "hidden", "layers",
                                                "tp", "pp", "dp", "gpus", "batch",
                                                "tflops_per_gpu", "mfu")}
            | {"note": "described, not read"} for run in mcore.RUNS]
    loaded = mcore.load_runs(_table(tmp_path, rows, vocab_size=mcore.VOCAB,
                                    seq_len=mcore.SEQ_LEN))
    assert loaded == mcore.RUNS
    other = mcore.load_runs(_table(tmp_path, rows[:1], gpu="A100 80GB", vocab_size=51200,
                                   seq_len=2048))[0]
    assert (other.device, other.vocab, other.seq_len) == ("A100-80GB", 51200, 2048)
    assert mcore.budget(other).device == "A100-80GB"
    model, ids, _ = mcore.gpt(other)
    assert ids.shape == (1, 2048) and model.lm_head.weight.shape == (51200, other.hidden)
    # Megatron's count: the FLOPs follow the sequence and vocabulary given.
    ratio = mcore.step_flops(other) / mcore.step_flops(mcore.RUNS[0])
    s, h, l = 2048, other.hidden, other.layers
    assert ratio == pytest.approx(
        s * (1 + s / (6 * h) + 51200 / (12 * l * h))
        / (4096 * (1 + 4096 / (6 * h) + mcore.VOCAB / (12 * l * h))))
    with pytest.raises(ValueError, match="lacks"):
        mcore.load_runs(_table(tmp_path, [{k: v for k, v in rows[0].items() if k != "tp"}]))
    with pytest.raises(ValueError, match="no device preset"):
        mcore.load_runs(_table(tmp_path, rows, gpu="MI300X"))


def test_the_published_table_is_the_one_copied():
    """The published table as released (tests/data/mcore_h100_weak_scaling.json, kept in
    the repository so that a fresh clone checks it): every row is in RUNS."""
    published = Path(__file__).resolve().parents[1] / "data" / "mcore_h100_weak_scaling.json"
    assert set(mcore.load_runs(published)) <= set(mcore.RUNS)


@pytest.mark.parametrize("name", PIPELINED)
def test_the_joint_search_is_at_least_as_fast_as_the_published_mesh_and_its_interleavings(name):
    """partc's own plan (nothing pinned but the devices and batch) is never predicted
    slower than its plan of the published mesh (tp, pp, dp, ZeRO-1 pinned, the
    schedule its own), which is never slower than the published 1F1B split nor than any
    interleaving of it Megatron-Core could run that fits."""
    own = mcore.predict(name, own=True)
    mesh = mcore.predict(name, megatron_pipeline=False)
    published = mcore.predict(name)
    assert own.plan.predicted.step_time_s <= mesh.plan.predicted.step_time_s * (1 + 1e-9)
    assert mesh.plan.predicted.step_time_s <= published.plan.predicted.step_time_s * (1 + 1e-9)
    fitting = [i for i in mcore.megatron_interleavings(name)
               if i.peak_bytes <= mcore.DEVICE_BYTES]
    assert all(mesh.tflops_per_gpu >= i.tflops_per_gpu * (1 - 1e-9) for i in fitting), name
