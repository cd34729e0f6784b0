"""The bytes the cost model prices for pipeline sends and tensor-parallel collectives
against the bytes the lowered program moves when it runs, in mixed precision as the
runtime runs it (bf16 parameters under CUDA's autocast policy, which CPU ranks apply
too): the residual stream a stage sends is bf16, a row-parallel matmul's partial sums
are bf16, a norm's output all-gathered under sequence parallelism is fp32.

One process: a stage's outputs are what pipelining sends (and their gradients what comes
back); the stage's simulated tensor-parallel group (``TensorParallelGroup`` without a
process group) records the bytes of every collective it runs, forward and backward.
"""

from collections import Counter

import pytest
import torch

import partc
from partc.autocast_policy import cuda_autocast
from partc.passes.tp_rewrite import GROUP
from samples.gpt import gpt_tiny, loss_fn

BATCH, SEQ = 4, 32
TRAIN = partc.TrainSpec(global_batch_size=BATCH, dtype=torch.bfloat16)
BUDGET = partc.DeviceBudget(num_devices=2, device="CPU")


def _compile(**pins) -> partc.Program:
    torch.manual_seed(0)
    model = gpt_tiny()
    ids = torch.randint(0, 128, (BATCH, SEQ))
    return partc.compile(model, (ids,), loss_fn=loss_fn, budget=BUDGET, train=TRAIN,
                         constraints=partc.Constraints(num_microbatches=1, **pins))


def _in_bf16(module: torch.nn.Module) -> torch.nn.Module:
    """The stage's floating parameters in bf16, as the runtime computes with them."""
    for param in module.parameters():
        if param.is_floating_point():
            param.data = param.data.to(torch.bfloat16)
    return module


def test_a_pipeline_send_is_priced_in_the_dtype_the_stage_makes():
    program = _compile(pp=2, schedule="1f1b")   # stage 0 is the first run of layers
    plan, problem = program.plan, program.problem
    first = program.lower(only=(0,)).stages[0]
    ids = torch.randint(0, 128, (plan.micro_batch_size, SEQ))
    with cuda_autocast(torch.bfloat16):
        outputs = _in_bf16(first.module)(ids)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    sent = sum(t.numel() * t.element_size() for t in outputs if isinstance(t, torch.Tensor))
    assert {t.dtype for t in outputs if t.is_floating_point()} == {torch.bfloat16}
    cut = len(plan.stages[0].layers) - 1
    priced = problem.model.cut_bytes[cut] * plan.micro_batch_size \
        * problem.train.measured_scale
    assert priced == pytest.approx(sent)


def test_tensor_parallel_collectives_are_priced_in_the_dtypes_they_move():
    program = _compile(pp=1, tp=2, sequence_parallel=True)
    plan, problem = program.plan, program.problem
    stage = program.lower(only=(0,)).stages[0]
    group = stage.module.get_submodule(GROUP)
    moved: Counter = Counter()
    phase = ["forward"]

    def counting(kind, primitive, whole):
        def run(x, *args):
            moved[kind, phase[0]] += whole(x) * x.element_size()
            return primitive(x, *args)
        return run

    group.all_reduce = counting("all_reduce", group.all_reduce, lambda x: x.numel())
    group._all_gather = counting("all_gather", group._all_gather,
                                 lambda x: x.numel() * group.size)
    group._reduce_scatter = counting("reduce_scatter", group._reduce_scatter,
                                     lambda x: x.numel())
    ids = torch.randint(0, 128, (plan.micro_batch_size, SEQ))
    with cuda_autocast(torch.bfloat16):
        logits, = _in_bf16(stage.module)(ids)
    loss = loss_fn(logits.float(), torch.randint(0, 128, (plan.micro_batch_size, SEQ)))
    phase[0] = "backward"
    loss.backward()
    option = problem.tp_option(2, True, plan.tensor_parallel.objective)
    priced: Counter = Counter()
    for layer in option.model.layers:
        for kind, when, nbytes in layer.tp_comm:
            priced[kind, when] += nbytes * plan.micro_batch_size * problem.train.measured_scale
    assert set(priced) == set(moved)
    for key in moved:
        assert priced[key] == pytest.approx(moved[key]), key
