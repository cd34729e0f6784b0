"""partc's activation estimate against Korthikanti et al.'s equations (MLSys'23).

Per transformer layer and rank, GPT-2 blocks built as the paper's (``korthikanti.py``),
bf16 for H100s, at tensor-parallel degrees 1, 2 and 8, with and without sequence
parallelism, under no, selective (Megatron's: the attention core rerun) and full
recompute. The target is ±15% of the equations, and every row is within 2% of them
(LayerNorm statistics, the attention core's mask): without sequence parallelism partc
plans Megatron's plain tensor parallelism, whose layer keeps the paper's 10 s b h
replicated (both LayerNorms' inputs, the QKV and MLP inputs, two dropout masks). What is
asserted besides: that the estimate is what the emitted block keeps, measured on a
small GPT-2 built the same way; and the paper's memory verdicts. The 22B layer runs
in the default profile (about 10 s of measuring on fake tensors); the 175B and 530B
layers are slow-marked. ``benchmarks/validation.py`` prints
every row.
"""

from __future__ import annotations

import json

import pytest

import partc
from partc.compiler import build_problem, plan_problem
from tests.models import WHOLE_MEMORY
from tests.validation import korthikanti
from tests.validation.korthikanti import CONFIGS, MODES, config_named

TARGET = 0.15
EXACT = 0.02


def _rows():
    for config in CONFIGS:
        slow = [pytest.mark.slow] if config.name != "22B" else []
        for tp in (1, 2, 8):
            for sp in ((False,) if tp == 1 else (False, True)):
                for mode in MODES:
                    yield pytest.param(config.name, tp, sp, mode, marks=slow,
                                       id=f"{config.name}-tp{tp}{'-sp' if sp else ''}-{mode}")


ROWS = list(_rows())


@pytest.mark.parametrize("name, tp, sp, mode", ROWS)
def test_estimate_within_target_of_the_equations(name, tp, sp, mode):
    config = config_named(name)
    estimate = korthikanti.estimate_bytes(config, tp, sp, mode)
    equation = korthikanti.equation_bytes(config, tp, sp, mode)
    assert abs(estimate / equation - 1) <= TARGET, (
        f"{name} tp={tp} sp={sp} {mode}: {estimate / 2**30:.3f} GiB per layer, the paper "
        f"{equation / 2**30:.3f} GiB ({estimate / equation:.2f}x)")


@pytest.mark.parametrize("name, tp, sp, mode", ROWS)
def test_estimate_is_the_equation_term_by_term(name, tp, sp, mode):
    """Every row within 2% of the equation (LayerNorm statistics, the attention core's
    mask): with tensor but without sequence parallelism too, where partc once split the
    second half of the layer over the sequence and kept its 10 s b h as 4 + 6 / t."""
    config = config_named(name)
    estimate = korthikanti.estimate_bytes(config, tp, sp, mode)
    equation = korthikanti.equation_bytes(config, tp, sp, mode)
    assert estimate == pytest.approx(equation, rel=EXACT)


def test_equations_give_the_papers_figures():
    # The per-layer GiB the paper's section 5 derives for the 22B configuration (b = 4).
    config = config_named("22B")
    derived = {("none", False, 1): 6.59, ("none", False, 8): 1.23, ("none", True, 8): 0.82,
               ("selective", False, 8): 0.61, ("selective", True, 8): 0.20,
               ("full", False, 8): 0.09}
    for (mode, sp, tp), gib in derived.items():
        got = korthikanti.equation_bytes(config, tp, sp, mode) / 2**30
        assert got == pytest.approx(gib, abs=0.01), (mode, sp, tp)


@pytest.mark.parametrize("name", [
    "22B", pytest.param("175B", marks=pytest.mark.slow),
    pytest.param("530B", marks=pytest.mark.slow)])
def test_tensor_parallelism_alone_does_not_fit(name):
    config = config_named(name)
    assert not korthikanti.fits(config, False, "none", estimate=False)
    assert not korthikanti.fits(config, False, "none", estimate=True)


@pytest.mark.parametrize("name", [
    "22B", pytest.param("175B", marks=pytest.mark.slow),
    pytest.param("530B", marks=pytest.mark.slow)])
def test_sequence_parallelism_with_selective_recompute_fits(name):
    config = config_named(name)
    assert korthikanti.fits(config, True, "selective", estimate=False)
    assert korthikanti.fits(config, True, "selective", estimate=True)


@pytest.mark.parametrize("sp", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["tp2", "tp2-sp"])
def test_the_estimate_is_what_the_emitted_block_keeps(sp):
    """The estimate is the runtime's: on a small GPT-2 built the same way, one rank of the emitted stage keeps for backward exactly the bytes partc
    estimates for the block (Conv1D's regathered shards included)."""
    from benchmarks.saved_bytes import measured_saved_bytes

    small, program, _ = _small_gpt2(sp)
    option = program.problem.tp_option(2, sp, "time")
    [block] = [layer for layer in option.model.layers if layer.name == korthikanti.BLOCK]
    measured = measured_saved_bytes(program)[korthikanti.BLOCK]
    assert block.saved_bytes["none"] * small.micro_batch == measured


@pytest.mark.parametrize("sp", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["tp2", "tp2-sp"])
def test_the_bf16_estimate_is_what_the_runtime_keeps(sp):
    """The same small GPT-2 trained in bf16: one rank of the built module, under the
    runtime's mixed precision (bf16 parameters, CUDA's autocast policy, the loss in
    fp32), keeps for backward over a step what the plan estimates for all its layers,
    within 0.1%, but for the fp32 attention mask (b, 1, s, s): every block reads it, so
    the estimate holds it for the forward, charged to the layer that makes it; autograd
    keeps none of it (the scores' add saves nothing)."""
    import torch

    from benchmarks.saved_bytes import runtime_saved_bytes

    small, program, ids = _small_gpt2(sp, torch.bfloat16, num_microbatches=1)
    option = program.problem.tp_option(2, sp, "time")
    estimated = sum(layer.saved_bytes["none"] for layer in option.model.layers)
    kept = runtime_saved_bytes(program, (ids,), ids)
    mask = small.micro_batch * small.seq_len ** 2 * 4
    assert estimated * small.micro_batch == pytest.approx(sum(kept.values()) + mask, rel=1e-3)
    assert kept[torch.bfloat16] > kept[torch.float32]


def _small_gpt2(sp, dtype=None, **pins):
    """A GPT-2 layer built like the paper's, small, compiled for tp=2 (``sp``: with
    sequence parallelism) in ``dtype`` (fp32 by default): its config, program and ids."""
    import torch

    import partc

    small = korthikanti.Config(name="small", heads=4, hidden=128, layers=2, tp=2, pp=1,
                               micro_batch=2, seq_len=64, vocab=512)
    torch.manual_seed(0)
    model, ids, _ = korthikanti.gpt2_layer(small, device="cpu")
    ids = torch.randint(0, small.vocab, (small.micro_batch, small.seq_len))
    program = partc.compile(
        model, (ids,), loss_fn=korthikanti.loss, example_target=ids,
        budget=partc.DeviceBudget(num_devices=2, device="CPU"),
        train=partc.TrainSpec(global_batch_size=small.micro_batch,
                              dtype=dtype or torch.float32),
        constraints=partc.Constraints(pp=1, dp=1, tp=2, sequence_parallel=sp,
                                      tp_objective="time", recompute="none", **pins))
    return small, program, ids


def test_another_tables_configuration_is_estimated_as_the_papers(tmp_path):
    """A configuration from another table of the json's schema (``load_configs``;
    ``benchmarks/validation.py --korthikanti-table``), one the tables here do not hold
    (GPT-2 medium's width at a 1024-token sequence): its rows are within the target of
    the paper's equations (all but tp = 8 with sequence parallelism are exactly the
    paper's: at this width partc's layouts without sequence parallelism are
    Megatron's; the exception is the xfail below); the copied configurations load as
    they are; a configuration lacking a field is refused."""
    path = tmp_path / "table.json"
    fields = ("heads", "hidden", "layers", "tp", "pp", "micro_batch", "seq_len", "vocab",
              "interleave")
    rows = [{"params_b": float(c.name[:-1]), "gpus": 8} | {k: getattr(c, k) for k in fields}
            for c in CONFIGS]
    path.write_text(json.dumps({"configurations": rows}))
    assert korthikanti.load_configs(path) == CONFIGS
    path.write_text(json.dumps({"configurations": [
        {"params_b": 0.35, "heads": 16, "hidden": 1024, "layers": 24, "tp": 2, "pp": 1,
         "micro_batch": 2, "seq_len": 1024, "vocab": 50304, "notes": "not read"}]}))
    [config] = korthikanti.load_configs(path)
    assert config == OTHER_CONFIG
    for tp, sp, mode in ((1, False, "none"), (2, False, "selective"), (2, True, "none"),
                         (2, True, "selective"), (8, False, "none"), (8, True, "full")):
        estimate = korthikanti.estimate_bytes(config, tp, sp, mode)
        equation = korthikanti.equation_bytes(config, tp, sp, mode)
        assert abs(estimate / equation - 1) <= TARGET, (tp, sp, mode, estimate / equation)
    path.write_text(json.dumps({"configurations": [{"params_b": 1, "heads": 16}]}))
    with pytest.raises(ValueError, match="lacks"):
        korthikanti.load_configs(path)


# GPT-2 medium's width at a 1024-token sequence: a configuration the paper's tables do
# not hold.
OTHER_CONFIG = korthikanti.Config(name="0.35B", heads=16, hidden=1024, layers=24, tp=2,
                                  pp=1, micro_batch=2, seq_len=1024, vocab=50304)


@pytest.mark.xfail(strict=True, reason=(
    "at this width and tp = 8, two sequences a microbatch and memory to spare, the "
    "planner runs the fastest sharding, which finds three collectives (all-gather, two "
    "all-reduces: 61 us of 2 MiB each) faster than sequence parallelism's four (72 us, "
    "priced blocking: the chooser does not count the rings), so the block keeps its "
    "norms, dropouts and residuals whole: 1.6x the paper's bytes without recompute, "
    "3.1x with selective recompute. Where memory binds it runs the memory-first "
    "sharding, which keeps the paper's bytes (the two tests below)"))
def test_sequence_parallelism_at_tp8_on_a_narrow_layer():
    estimate = korthikanti.estimate_bytes(OTHER_CONFIG, 8, True, "none")
    equation = korthikanti.equation_bytes(OTHER_CONFIG, 8, True, "none")
    assert abs(estimate / equation - 1) <= TARGET


@pytest.mark.parametrize("mode", MODES)
def test_memory_first_sharding_keeps_the_papers_bytes_on_a_narrow_layer(mode):
    # Parameter bytes, then activation bytes, then time: the norms, dropouts and
    # residuals stay on sequence shards, at the cost of the fourth collective.
    layer = korthikanti.block(OTHER_CONFIG, 8, True, "memory")
    estimate = layer.saved_bytes.get(mode, layer.saved_bytes["none"]) * OTHER_CONFIG.micro_batch
    equation = korthikanti.equation_bytes(OTHER_CONFIG, 8, True, mode)
    assert abs(estimate / equation - 1) <= TARGET
    fastest = korthikanti.block(OTHER_CONFIG, 8, True, "time")
    assert layer.saved_bytes["none"] < fastest.saved_bytes["none"] / 1.5


def test_the_planner_takes_the_memory_first_sharding_where_memory_binds():
    graph, analysis = korthikanti.analysed(OTHER_CONFIG)
    train = korthikanti.train_spec(OTHER_CONFIG)

    def plan(memory: int, objective: str | None = None) -> partc.Plan:
        budget = partc.DeviceBudget(num_devices=8, device="H100-80GB", memory=memory,
                                    **WHOLE_MEMORY)
        return plan_problem(build_problem(analysis, budget, train, partc.Constraints(
            tp=8, sequence_parallel=True, pp=1, micro_batch_size=OTHER_CONFIG.micro_batch,
            recompute="none", tp_objective=objective), graph))

    fastest, leanest = plan(80 * 2**30, "time"), plan(80 * 2**30, "memory")
    assert fastest.predicted.step_time_s < leanest.predicted.step_time_s
    assert leanest.predicted.peak_memory_bytes < fastest.predicted.peak_memory_bytes
    assert plan(80 * 2**30).tp_objective == "time"
    between = (fastest.predicted.peak_memory_bytes + leanest.predicted.peak_memory_bytes) // 2
    assert plan(between).tp_objective == "memory"
