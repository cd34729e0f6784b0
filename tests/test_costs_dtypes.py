"""The bytes the cost model prices for pipeline sends and tensor-parallel collectives
against the bytes the lowered program moves when it runs, in mixed precision as the
runtime runs it (bf16 parameters under CUDA's autocast policy, which CPU ranks apply
too): the residual stream a stage sends is bf16, a row-parallel matmul's partial sums
are bf16, a norm's output all-gathered under sequence parallelism is fp32; and the casts
autocast makes beside the ops, which no graph node shows.

One process: a stage's outputs are what pipelining sends (and their gradients what comes
back); the stage's simulated tensor-parallel group (``TensorParallelGroup`` without a
process group) records the bytes of every collective it runs, forward and backward.
"""

import dataclasses
from collections import Counter

import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode

import partc
from partc import meta
from partc.autocast_policy import cuda_autocast
from partc.passes.tp.rewrite import GROUP
from samples.gpt import gpt_tiny, loss_fn

BATCH, SEQ = 4, 32
# Attention as written on every device: its softmax is what these tests count (a GPU's
# default runs it fused, inside SDPA).
TRAIN = partc.TrainSpec(global_batch_size=BATCH, dtype=torch.bfloat16, attention="as_written")
BUDGET = partc.DeviceBudget(num_devices=2, device="CPU")


def _compile(**pins) -> partc.Program:
    torch.manual_seed(0)
    model = gpt_tiny()
    ids = torch.randint(0, 128, (BATCH, SEQ))
    return partc.compile(model, (ids,), loss_fn=loss_fn, budget=BUDGET, train=TRAIN,
                         constraints=partc.Constraints(num_microbatches=1, **pins),
                         cache=None)


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
    group.all_gather = counting("all_gather", group.all_gather,
                                lambda x: x.numel() * group.size)
    group.reduce_scatter = counting("reduce_scatter", group.reduce_scatter,
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


class _Casts(TorchDispatchMode):
    """The dtype casts a forward runs, as (bytes read and written, of a parameter?)."""

    def __init__(self, params: set) -> None:
        super().__init__()
        self.params, self.seen = params, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and out.dtype != args[0].dtype:
            self.seen.append((args[0].numel() * args[0].element_size()
                              + out.numel() * out.element_size(),
                              args[0].untyped_storage().data_ptr() in self.params))
        return out


def test_autocasts_casts_are_priced_as_the_stage_runs_them():
    """The casts CUDA's autocast policy makes beside the ops (a norm's bf16 input and
    weights widened to fp32, a linear's fp32 input narrowed, the fp32 probabilities
    narrowed for the next matmul): no graph node shows them, each is a kernel. The
    estimate counts as many as the stage's forward runs, and their bytes (the norm
    weights' casts, a few hundred bytes, scale with the batch in the estimate)."""
    program = _compile(pp=1)
    plan, problem = program.plan, program.problem
    stage = _in_bf16(program.lower(only=(0,)).stages[0].module)
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    casts = _Casts(params)
    ids = torch.randint(0, 128, (plan.micro_batch_size, SEQ))
    with cuda_autocast(torch.bfloat16), casts:
        stage(ids)
    costs = [meta.cost(node) for node in program.graph.graph.nodes
             if meta.cost(node) is not None and meta.role(node) != meta.ROLE_LOSS]
    assert sum(c.casts for c in costs) == len(casts.seen) > 0
    weights = sum(nbytes for nbytes, param in casts.seen if param)
    activations = sum(nbytes for nbytes, param in casts.seen if not param)
    per_sample = (sum(c.cast_bytes for c in costs) - weights) / BATCH
    assert per_sample * plan.micro_batch_size == pytest.approx(activations)
    # The layers' op counts (what dispatch is paid for) include them.
    calls = sum(1 for node in program.graph.graph.nodes if node.op.startswith("call_")
                and meta.role(node) != meta.ROLE_LOSS and meta.LAYER in node.meta)
    loss = next(layer for layer in problem.layers if layer.name == "loss")
    assert sum(layer.num_nodes for layer in problem.layers) - loss.num_nodes == \
        calls + len(casts.seen)


def test_full_precision_runs_no_casts():
    program = partc.compile(gpt_tiny(), (torch.randint(0, 128, (BATCH, SEQ)),),
                            loss_fn=loss_fn, budget=BUDGET,
                            train=partc.TrainSpec(global_batch_size=BATCH),
                            constraints=partc.Constraints(pp=1, num_microbatches=1),
                            cache=None)
    assert not any(meta.cost(node).casts for node in program.graph.graph.nodes
                   if meta.cost(node) is not None)


def test_only_an_fp16_softmax_input_is_widened_inside_cudas_kernel():
    """Softmax in fp32 of a 16-bit input: ATen's CUDA kernel reads an fp16 input and
    writes fp32 in one pass, but a bf16 input is widened by a cast of its own first, as
    on a CPU. Either way the runtime's softmax narrows its output once to keep it for
    backward (partc.runtime.softmax)."""
    counts = {}
    for device, dtype in (("CPU", torch.bfloat16), ("H100", torch.bfloat16),
                          ("H100", torch.float16)):
        program = partc.compile(gpt_tiny(), (torch.randint(0, 128, (BATCH, SEQ)),),
                                loss_fn=loss_fn, train=dataclasses.replace(TRAIN, dtype=dtype),
                                budget=partc.DeviceBudget(num_devices=1, device=device),
                                cache=None)   # the graph, which a cached plan lacks
        counts[device, dtype] = {meta.cost(node).casts for node in program.graph.graph.nodes
                                 if node.name.startswith("softmax")}
    assert counts == {("CPU", torch.bfloat16): {2}, ("H100", torch.bfloat16): {2},
                      ("H100", torch.float16): {1}}
