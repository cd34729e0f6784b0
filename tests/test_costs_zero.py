"""The memory model's ZeRO accounting against the ZeRO paper's worked example.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (SC'20), section 3.1 and Figure 1: a 7.5B-parameter model trained with mixed
precision Adam (2 bytes of fp16 weights, 2 of fp16 gradients and K = 12 of fp32 master
weights, momentum and variance per parameter) over N_d = 64 data-parallel devices needs
120, 31.4, 16.6 and 1.88 GB per device for plain data parallelism and ZeRO stages 1-3.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import partc
from partc.cost.evaluate import evaluate
from partc.cost.layer_compute import layer_work
from partc.cost.pipeline_config import PS_PER_S, PipelineConfig, overlapped, to_ps
from partc.cost.state_bytes import zero_state_bytes
from partc.cost.tables import build_cost_table
from tests.models import WHOLE_MEMORY

PSI, ND = 7.5e9, 64
PUBLISHED_GB = {0: 120, 1: 31.4, 2: 16.6, 3: 1.88}  # rounded as printed in the paper


@pytest.mark.parametrize("stage", sorted(PUBLISHED_GB))
def test_worked_example_per_device_memory(stage):
    train = partc.TrainSpec(global_batch_size=64, dtype=torch.float16, optimizer="adam")
    assert (train.weight_bytes, train.grad_bytes, train.optimizer_bytes) == (2, 2, 12.0)
    state = zero_state_bytes(PSI, train.weight_bytes, train.grad_bytes,
                             train.optimizer_bytes, dp=ND, stage=stage)
    gb = sum(state.values()) / 1e9
    # Exactly the paper's formula, and equal to its figure at the precision printed.
    exact = {0: 16 * PSI, 1: 4 * PSI + 12 * PSI / ND, 2: 2 * PSI + 14 * PSI / ND,
             3: 16 * PSI / ND}[stage] / 1e9
    assert gb == pytest.approx(exact, rel=1e-12)
    digits = 2 if stage == 3 else (1 if stage else 0)
    assert round(gb, digits) == PUBLISHED_GB[stage]


def test_zero_stage_checks_its_input():
    with pytest.raises(ValueError, match="ZeRO stage"):
        zero_state_bytes(1, 2, 2, 12, dp=2, stage=4)
    with pytest.raises(ValueError, match="dp must be positive"):
        zero_state_bytes(1, 2, 2, 12, dp=0, stage=1)
    # One device: every stage holds everything.
    assert len({tuple(zero_state_bytes(10, 2, 2, 12, dp=1, stage=s).values())
                for s in range(4)}) == 1


def _dp_program(memory: str, dtype: torch.dtype = torch.float32, **pins) -> partc.Program:
    from samples.gpt import gpt_tiny, loss_fn

    model = gpt_tiny(n_layer=2, n_embd=128, vocab_size=512)
    ids = torch.zeros(2, 32, dtype=torch.long)
    return partc.compile(model, (ids,), loss_fn=loss_fn, example_target=ids,
                         budget=partc.DeviceBudget(num_devices=2, device="A100-40GB",
                                                   memory=memory, **WHOLE_MEMORY),
                         train=partc.TrainSpec(global_batch_size=8, optimizer="adamw",
                                               dtype=dtype),
                         constraints=partc.Constraints(pp=1, tp=1, **{"offload": (),
                                                                      **pins}))


def test_bf16_zero1_holds_what_megatrons_distributed_optimizer_holds():
    from tests.test_compile import check

    # Per parameter: ZeRO-0 the fp32 master and the step's bf16 copy, 4 + 2, with the
    # fp32 gradient 4 and Adam's 8; ZeRO-1 bf16 weights and 1/dp of the master and of
    # the state, 2 + 4 + 12/dp (dp = 2: 12 bytes against 18).
    plain = check(_dp_program("1GiB", torch.bfloat16, zero_stage=0))
    zero1 = check(_dp_program("1GiB", torch.bfloat16, zero_stage=1))
    count = zero1.stages[0].param_count
    assert plain.stages[0].param_count == count
    for plan, per_param in ((plain, (6, 4, 8)), (zero1, (2 + 4 / 2, 4, 8 / 2))):
        held = plan.stages[0].memory_bytes
        assert (held.params, held.grads, held.optimizer) == pytest.approx(
            tuple(count * b for b in per_param), abs=8)


def test_zero1_lets_two_replicas_fit_where_plain_data_parallelism_does_not():
    from tests.test_compile import check

    # fp32 AdamW: 4 + 4 + 8 bytes per parameter; ZeRO-1 halves the 8 over dp=2.
    with pytest.raises(partc.PlanInfeasibleError):
        _dp_program("7MiB", zero_stage=0)
    program = _dp_program("7MiB")
    plan = check(program)
    assert plan.mesh.dp == 2 and plan.zero_stage == 1
    assert plan.predicted.peak_memory_bytes <= 7 * 2**20
    assert "ZeRO-1" in program.report()
    plain = check(_dp_program("1GiB", zero_stage=0))
    assert plain.stages[0].memory_bytes.optimizer == \
        pytest.approx(2 * plan.stages[0].memory_bytes.optimizer, abs=2)
    assert plain.stages[0].memory_bytes.params == plan.stages[0].memory_bytes.params


def test_zero2_and_zero3_state_as_fsdp_holds_it():
    from tests.test_compile import check

    # Microbatches of one sample, whose working set is smaller than a layer's gradient.
    plain = check(_dp_program("1GiB", zero_stage=0, num_microbatches=4)).stages[0].memory_bytes
    zero2 = check(_dp_program("1GiB", zero_stage=2, num_microbatches=4,
                              zero2_grad_sync="microbatch")).stages[0].memory_bytes
    zero3 = check(_dp_program("1GiB", zero_stage=3, num_microbatches=4)).stages[0].memory_bytes
    for zero in (zero2, zero3):
        assert zero.grads == pytest.approx(plain.grads / 2, abs=8)
        assert zero.optimizer == pytest.approx(plain.optimizer / 2, abs=8)
    # ZeRO-2: the gathered weights for the step, and beside them each rank's shard.
    assert zero2.params == pytest.approx(1.5 * plain.params, abs=8)
    # ZeRO-3: shards only, but the tied embedding (the root unit's, gathered for the
    # whole step, as under ZeRO-2) and, as a transient, a layer gathered while it runs
    # with the next one prefetched. ZeRO-2's transient: a layer's whole gradient and its
    # fp32 reduce-scatter input, as the layer's backward ends.
    assert plain.params / 2 < zero3.params < plain.params
    assert zero3.transient > zero2.transient > plain.transient
    assert zero3.peak < zero2.peak


def _small_buckets(problem):
    """``problem`` with buckets of 1/8 of the model's parameters
    (``TrainSpec.bucket_elements``), so that backward has buckets to hide besides the
    last one."""
    from dataclasses import replace

    params = sum(layer.param_count for layer in problem.layers) + sum(
        shared.param_count for shared in problem.model.shared)
    return replace(problem, train=replace(problem.train, bucket_elements=params // 8))


@pytest.mark.parametrize("bandwidth", [300e9, 1e8])
def test_dp_all_reduce_is_charged_only_past_the_last_backward(bandwidth):
    """The dp all-reduce overlaps the last microbatch's backward bucket by bucket, but the
    last bucket's starts as backward ends: charged whole, once a step, in the tail
    latency."""
    problem = _dp_program("1GiB", zero_stage=0).problem
    problem = replace(problem, devices=replace(problem.devices,
                                               intra_node_bandwidth=bandwidth))
    config = PipelineConfig(pp=1, dp=2, micro_batch_size=1, num_microbatches=4,
                            schedule="1f1b")
    # At the default size the model is one bucket: all of its reduction is exposed.
    table = build_cost_table(problem, config)
    sync = sum(r.sync_ps for r in (*table.layers, *table.shared))
    stage = evaluate(table, [0] * table.num_layers, ["none"] * table.num_layers).stages[0]
    assert table.last_sync_ps >= sync > 0 and table.tail_latency_ps >= table.last_sync_ps
    assert stage.tail_ps == sum(r.tail_ps for r in (*table.layers, *table.shared))
    problem = _small_buckets(problem)
    table = build_cost_table(problem, config)
    rows = [*table.layers, *table.shared]
    sync, last = sum(r.sync_ps for r in rows), table.last_sync_ps
    backward = sum(r.backward_ps for r in table.layers)
    step = sum(r.tail_ps for r in rows)
    stage = evaluate(table, [0] * table.num_layers, ["none"] * table.num_layers).stages[0]
    assert 0 < last < sync and table.tail_latency_ps >= last
    assert stage.tail_ps == max(0, sync - last - backward) + step
    # A fast link hides all but the last bucket; a slow one leaves part of the rest.
    assert (stage.tail_ps == step) == (sync - last <= backward)
    assert (sync - last <= backward) == (bandwidth > 1e9)


@pytest.mark.parametrize("overlap", [0.0, 0.5])
def test_comm_overlap_hides_only_its_share(overlap):
    """DeviceNumbers.comm_overlap: where a collective competes with compute for the cores
    (gloo on a CPU), the last backward hides only that share of the dp all-reduce, and a
    ZeRO-3 layer's gathers and reduce-scatters add to its compute instead of hiding
    behind it."""
    base = _small_buckets(_dp_program("1GiB", zero_stage=0).problem)
    whole = replace(base, devices=replace(base.devices, intra_node_bandwidth=300e9))
    partial = replace(whole, devices=replace(whole.devices, comm_overlap=overlap))
    config = PipelineConfig(pp=1, dp=2, micro_batch_size=1, num_microbatches=4,
                            schedule="1f1b")
    tails = []
    for problem in (whole, partial):
        table = build_cost_table(problem, config)
        rows = [*table.layers, *table.shared]
        # The last bucket's reduction is never hidden (the tail latency's): the rest.
        sync = sum(r.sync_ps for r in rows) - table.last_sync_ps
        backward = sum(r.backward_ps for r in table.layers)
        stage = evaluate(table, [0] * table.num_layers, ["none"] * table.num_layers).stages[0]
        tails.append(stage.tail_ps - sum(r.tail_ps for r in rows))
    assert 0 < sync <= backward and tails[0] == 0   # a fast link: all of it hidden at 1
    assert tails[1] == pytest.approx((1 - overlap) * sync, abs=1)
    # ZeRO-3: per layer and phase, compute + comm - overlap x the shorter of the two.
    zero3 = PipelineConfig(pp=1, dp=2, micro_batch_size=1, num_microbatches=4,
                           schedule="1f1b", zero_stage=3)
    rows = [build_cost_table(p, zero3).layers for p in (whole, partial)]
    assert all(s.forward_ps >= h.forward_ps for h, s in zip(rows[0], rows[1]))
    assert any(s.forward_ps > h.forward_ps for h, s in zip(rows[0], rows[1]))
    assert overlapped(2.0, 1.0, overlap) == pytest.approx(3.0 - overlap)
    assert overlapped(1.0, 2.0, 1.0) == 2.0 and PS_PER_S == 10**12


# FSDP's own work (DeviceNumbers.fsdp_*), chosen apart so each shows in the sums.
FSDP_WORK = dict(fsdp_unit_overhead_s=1e-4, fsdp_unit_overhead_backward_s=2e-4,
                 fsdp_gather_overhead_s=4e-4, fsdp_scatter_overhead_s=8e-4,
                 fsdp_step_overhead_s=16e-4, fsdp_copy_bandwidth=1e9)


def _fsdp_instance(work: dict):
    """Two layers of 100k parameters and one of 100 (under SMALL_UNITS_SHARE: no unit
    of its own), of 12, 2 and (not counted: one) parameter tensors, on two replicas; no
    link cost, so FSDP's work is all that differs."""
    from tests.planner.instances import devices, layer, problem

    numbers = replace(devices(2, 10**9, bandwidth=1e18, overlap=0.0), **work)
    layers = [replace(layer("a", params=100_000), param_tensors=12),
              replace(layer("norm", params=100), param_tensors=2),
              layer("b", params=100_000)]
    return problem(layers, [1e3, 1e3], numbers, batch=4, micro_batch_sizes=(1,))


@pytest.mark.parametrize("zero", [2, 3])
def test_fsdp_work_is_charged_per_unit_and_microbatch_and_reaches_the_step(zero):
    """ZeRO-2/3's FSDP work (hooks, fixed work and copies of each all-gather and
    reduce-scatter, the optimizer step's dispatch over DTensors) as
    :func:`partc.cost.communication.zero_overhead_seconds` says: per unit in every
    microbatch's forward and backward, once per step in the tail (the step's dispatch per
    tensor), and m times in the step time."""
    config = PipelineConfig(pp=1, dp=2, micro_batch_size=1, num_microbatches=4,
                            schedule="1f1b", zero_stage=zero)
    # Before: no FSDP work, copies free.
    tables = [build_cost_table(_fsdp_instance(work), config)
              for work in ({"fsdp_copy_bandwidth": 1e18}, FSDP_WORK)]
    # A unit's copies: its shard in and its whole weights (or gradient) out, 2 (1 + 1/2)
    # bytes moved per byte, fp32 here, at 1 GB/s.
    copies = {100_000: 2 * 1.5 * 4 * 100_000 / 1e9, 100: 2 * 1.5 * 4 * 100 / 1e9}
    names = ["a", "norm", "b"]
    for before, after in zip(*(table.layers for table in tables)):
        unit = after.param_count == 100_000
        work = {k: unit * v for k, v in FSDP_WORK.items() if k.endswith("_s")}
        gather = work["fsdp_gather_overhead_s"] + copies[after.param_count]
        scatter = work["fsdp_scatter_overhead_s"] + copies[after.param_count]
        forward = work["fsdp_unit_overhead_s"] + (gather if zero == 3 else 0.0)
        backward = work["fsdp_unit_overhead_backward_s"] + scatter + (
            gather if zero == 3 else 0.0)
        tensors = {"a": 12, "norm": 2, "b": 1}[names.pop(0)]
        tail = tensors * FSDP_WORK["fsdp_step_overhead_s"] + (gather if zero == 2 else 0.0)
        assert after.forward_ps - before.forward_ps == pytest.approx(to_ps(forward), abs=5)
        assert after.backward_ps - before.backward_ps == pytest.approx(
            to_ps(backward), abs=5)
        assert after.tail_ps - before.tail_ps == pytest.approx(to_ps(tail), abs=5)
    # One stage: every microbatch's forward and backward, then the tail.
    steps = [evaluate(table, [0, 0, 0], ["none"] * 3).step_ps for table in tables]
    per_microbatch = sum(a.forward_ps + a.backward_ps - b.forward_ps - b.backward_ps
                         for b, a in zip(tables[0].layers, tables[1].layers))
    per_step = sum(a.tail_ps - b.tail_ps
                   for b, a in zip(tables[0].layers, tables[1].layers))
    assert per_microbatch > 0 and steps[1] - steps[0] == 4 * per_microbatch + per_step


def test_fsdp_work_is_no_part_of_zero_0_or_1_and_gpus_run_it_ahead():
    for zero in (0, 1):
        config = PipelineConfig(pp=1, dp=2, micro_batch_size=1, num_microbatches=4,
                                schedule="1f1b", zero_stage=zero)
        assert build_cost_table(_fsdp_instance({}), config).layers == \
            build_cost_table(_fsdp_instance(FSDP_WORK), config).layers
    for name in ("H100", "A100-80GB", "H200"):
        figures = partc.DeviceBudget(num_devices=8, device=name).figures
        assert all(getattr(figures, key) == 0.0 for key in FSDP_WORK if key.endswith("_s"))
        assert figures.fsdp_copy_bandwidth is None   # HBM bandwidth


def test_the_cpu_preset_prices_fsdp_in_a_planned_zero3_step():
    """End to end: the sample GPT planned with ZeRO-3 on the CPU preset predicts a longer
    step than with FSDP's work set to nothing, by at least the preset's fixed work of
    its two blocks (units of their own) in each of the step's two microbatches: hooks,
    two all-gathers and a reduce-scatter."""
    budget = dict(num_devices=2, device="CPU", memory="1GiB")
    nothing = {key: 0.0 for key in FSDP_WORK if key.endswith("_s")}
    steps = [_dp_program_on(partc.DeviceBudget(**budget, **work)).plan.predicted.step_time_s
             for work in (nothing, {})]
    cpu = partc.PRESETS["CPU"]
    fixed = (cpu.fsdp_unit_overhead_s + cpu.fsdp_unit_overhead_backward_s
             + 2 * cpu.fsdp_gather_overhead_s + cpu.fsdp_scatter_overhead_s)
    assert fixed > 0 and steps[1] - steps[0] >= 2 * 2 * fixed


def _dp_program_on(budget: partc.DeviceBudget) -> partc.Program:
    from samples.gpt import gpt_tiny, loss_fn

    model = gpt_tiny(n_layer=2, n_embd=128, vocab_size=512)
    ids = torch.zeros(2, 32, dtype=torch.long)
    return partc.compile(model, (ids,), loss_fn=loss_fn, example_target=ids, budget=budget,
                         train=partc.TrainSpec(global_batch_size=8, optimizer="adamw"),
                         constraints=partc.Constraints(pp=1, tp=1, dp=2, zero_stage=3,
                                                       num_microbatches=2))


def test_offload_moves_the_state_to_the_host_and_prices_its_copies():
    """fp32 Adam, one device, 2 microbatches: offloaded, the device keeps the weights
    only (gradients streamed out), the host the master, a gradient and the state; each
    microbatch's backward streams its gradients out, the tail steps on the host and
    copies the weights back; the planner takes it only where it must."""
    from dataclasses import replace

    from partc.compiler import plan_problem
    from partc.cost.pipeline_config import PS_PER_S, PipelineConfig
    from partc.cost.tables import build_cost_table
    from tests.planner.instances import devices, layer, problem

    params = 10**6
    hand = problem([layer("a", params=params), layer("b", params=params)], [1.0],
                   replace(devices(1, 10**9), host_memory=10**9,
                           host_to_device_bandwidth=4e9, device_to_host_bandwidth=2e9,
                           host_adam_rate=1e8), batch=2)
    base = PipelineConfig(pp=1, dp=1, micro_batch_size=1, num_microbatches=2,
                          schedule="1f1b")
    plain, moved = (build_cost_table(hand, c).layers[0]
                    for c in (base, replace(base, offload_optimizer=True)))
    assert plain.state_bytes == {"params": 4 * params, "grads": 4 * params,
                                 "optimizer": 8 * params}
    assert moved.state_bytes == {"params": 4 * params, "grads": 0, "optimizer": 0}
    # Each microbatch's gradients out, and the host's adds into its buckets (at the
    # host's Adam rate times 28 bytes an update over 12 an add), one after the other.
    assert (moved.backward_ps - plain.backward_ps) / PS_PER_S == pytest.approx(
        4 * params / 2e9 + params * 12 / (28 * 1e8))
    # The weights back and the host's step, beside the device's passes over the
    # gradient buckets (microseconds at its 1 TB/s).
    assert moved.tail_ps / PS_PER_S == pytest.approx(4 * params / 4e9 + params / 1e8,
                                                     abs=2e-5)
    # Room on the device: no offload (it only adds time); none: offload, within the host.
    assert not plan_problem(hand).offload
    tight = replace(hand, devices=replace(hand.devices, memory_bytes=(20 * params,)))
    plan = plan_problem(tight)
    assert plan.offload == ("optimizer",) and plan.host_bytes_per_node == 32 * params
    small_host = replace(tight, devices=replace(tight.devices, host_memory=31 * params))
    with pytest.raises(partc.PlanInfeasibleError):
        plan_problem(small_host)


def test_offload_on_a_device_with_a_copy_stream_hides_what_the_runtime_overlaps():
    """As above, on a device that copies on a stream of its own: each microbatch's
    gradients (2 ms out, 0.86 ms of host adds) stream beside the layer's 2 ms backward,
    hidden; the step runs pipelined in chunks, the host's step (2 ms a layer) hiding the
    weights back (1 ms),
    but for one chunk's copy back once per step (the pipeline's fill). On the CPU above,
    every copy and add is paid."""
    from dataclasses import replace

    from partc.cost.host_offload import host_fill_seconds
    from partc.cost.pipeline_config import PS_PER_S, PipelineConfig
    from partc.cost.tables import build_cost_table
    from tests.planner.instances import devices, layer, problem

    params = 10**6
    hand = problem([layer("a", params=params), layer("b", params=params)], [1.0],
                   replace(devices(1, 10**9), host_memory=10**9, dispatch_ahead=True,
                           host_to_device_bandwidth=4e9, device_to_host_bandwidth=2e9,
                           host_adam_rate=5e8), batch=2)
    base = PipelineConfig(pp=1, dp=1, micro_batch_size=1, num_microbatches=2,
                          schedule="1f1b")
    offloaded = replace(base, offload_optimizer=True)
    plain, moved = (build_cost_table(hand, c) for c in (base, offloaded))
    assert moved.layers[0].backward_ps == plain.layers[0].backward_ps   # hidden
    assert moved.layers[0].tail_ps / PS_PER_S == pytest.approx(params / 5e8, abs=2e-5)
    # The fill: one chunk's copy back, the chunk all the rank steps (2M < the bucket)...
    assert (moved.tail_latency_ps - plain.tail_latency_ps) / PS_PER_S == pytest.approx(
        2 * 4 * params / 4e9)
    # ... or one bucket of 100k elements.
    small = replace(hand, train=replace(hand.train, bucket_elements=10**5))
    assert host_fill_seconds(small, offloaded) == pytest.approx(4 * 10**5 / 4e9)
    # A slow link: the copy beyond the backward is paid (8 ms out against 2 ms): the
    # backward lasts as long as the copy.
    slow = replace(hand, devices=replace(hand.devices, device_to_host_bandwidth=5e8))
    exposed = build_cost_table(slow, offloaded).layers[0].backward_ps
    assert exposed / PS_PER_S == pytest.approx(4 * params / 5e8, rel=1e-6)
def test_rows_share_their_parts_between_configurations_and_equal_rows_built_alone(
        monkeypatch):
    """A TableCache prices a layer's compute once per micro-batch size and schedule kind
    (whatever dp, pp, ZeRO stage or offload), and its parameters' figures once per
    data-parallel layout: every row still equals the row built without sharing."""
    import partc.cost.row_parts as row_parts
    import partc.cost.tables as tables

    problem = _dp_program("1GiB", zero_stage=0).problem
    configs = [PipelineConfig(pp=pp, dp=2 // pp, micro_batch_size=b,
                              num_microbatches=8 // (b * (2 // pp)), schedule=schedule,
                              chunks=chunks, zero_stage=zero, offload_optimizer=offload,
                              offload_params=offload and zero == 3)
               for pp in (1, 2) for b in (1, 2)
               for schedule, chunks in (("1f1b", 1), ("zbv-zero-bubble", 2)) if chunks <= pp
               for zero in range(4) for offload in (False, True)]
    alone = [build_cost_table(problem, config).layers for config in configs]
    priced = []
    monkeypatch.setattr(row_parts, "layer_work",
                        lambda *args, **kwargs: priced.append(1) or layer_work(*args, **kwargs))
    cache = tables.TableCache()
    shared = [build_cost_table(problem, config, cache).layers for config in configs]
    assert shared == alone
    kinds = {(c.micro_batch_size, c.schedule) for c in configs}   # 4 compute families
    distinct = len(cache._layer_groups(problem)[1])
    assert len(priced) == len(kinds) * distinct < len(configs) * distinct
