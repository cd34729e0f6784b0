"""The cost model's per-op roofline, against numbers worked out by hand.

Devices: 1e12 FLOP/s peak at efficiency 0.5 (5e11 achievable) and 1e11 bytes/s of HBM.
"""

import dataclasses

import pytest
import torch

import partc
from partc.cost.evaluate import evaluate
from partc.cost.layer_compute import roofline_seconds
from partc.cost.pipeline_config import PS_PER_S, PipelineConfig
from partc.cost.tables import build_cost_table
from partc.problem import HeavyOp
from samples.gpt import gpt_tiny, loss_fn
from tests.planner import instances

DEVICES = dataclasses.replace(instances.devices(1, 10**12), flops_efficiency=0.5,
                              hbm_bandwidth=1e11)


def test_compute_bound_op_takes_its_flops():
    # 4 samples: 4e9 FLOPs / 5e11 = 8 ms; (4 * 1e6 + 1e6) bytes / 1e11 = 50 us.
    op = HeavyOp(flops=1e9, activation_bytes=1e6, weight_bytes=1e6)
    assert roofline_seconds([op], DEVICES, 4, 1.0) == pytest.approx((8e-3, 0.0))


def test_memory_bound_op_takes_its_bytes():
    # 2 samples: 2e6 FLOPs / 5e11 = 4 us; 2e8 bytes / 1e11 = 2 ms. Three such ops: 6 ms;
    # in bf16 of an fp32 trace (scale 0.5), half the bytes.
    op = HeavyOp(flops=1e6, activation_bytes=1e8, weight_bytes=0.0, count=3)
    assert roofline_seconds([op], DEVICES, 2, 1.0) == pytest.approx((0.0, 6e-3))
    assert roofline_seconds([op], DEVICES, 2, 0.5) == pytest.approx((0.0, 3e-3))


def test_weight_is_read_once_per_microbatch():
    # A 1 GB weight: one sample is bound by reading it (1e9 + 1e3 bytes / 1e11 = 10.00001
    # ms against 0.2 ms of FLOPs); two samples read it once, not twice; a hundred samples
    # are bound by their FLOPs (20 ms against 10.001 ms of bytes).
    op = HeavyOp(flops=1e8, activation_bytes=1e3, weight_bytes=1e9)
    assert roofline_seconds([op], DEVICES, 1, 1.0) == pytest.approx((0.0, 10.00001e-3))
    assert roofline_seconds([op], DEVICES, 2, 1.0) == pytest.approx((0.0, 10.00002e-3))
    assert roofline_seconds([op], DEVICES, 100, 1.0) == pytest.approx((20e-3, 0.0))


def test_layer_rows_price_each_op_at_its_roofline():
    """A layer of a weight-bound matmul, two compute-bound attention-like ops and 1e7
    bytes per sample of light ops, micro-batch 2: backward is twice the forward, full
    recompute the forward again, selective only light bytes."""
    matmul = HeavyOp(flops=1e8, activation_bytes=1e3, weight_bytes=1e9)
    score = HeavyOp(flops=1e9, activation_bytes=1e6, weight_bytes=0.0, count=2)
    layer = dataclasses.replace(
        instances.layer("block", flops=2.1e9, selective=500.0, mem_bytes=1e7),
        heavy_ops=(matmul, score))
    problem = instances.problem([layer], [], DEVICES, batch=2)
    config = PipelineConfig(pp=1, dp=1, micro_batch_size=2, num_microbatches=1,
                            schedule="1f1b")
    row = build_cost_table(problem, config).layers[0]
    # matmul: memory-bound, 10.00002 ms; score: 2 x max(4 ms, 20 us) = 8 ms; light:
    # 2e7 bytes / 1e11 = 0.2 ms.
    forward = 10.00002e-3 + 8e-3 + 0.2e-3
    assert row.forward_ps == pytest.approx(forward * PS_PER_S, abs=2)
    assert row.backward_ps == pytest.approx(2 * forward * PS_PER_S, abs=2)
    assert row.recompute_ps["full"] == pytest.approx(forward * PS_PER_S, abs=2)
    # instances.layer's selective mode reruns half the light bytes and no heavy op.
    assert row.recompute_ps["selective"] == pytest.approx(0.1e-3 * PS_PER_S, abs=2)
    assert row.recompute_ps["none"] == 0


def test_heavy_ops_must_account_for_the_layers_flops():
    with pytest.raises(ValueError, match="heavy_ops"):
        dataclasses.replace(instances.layer("block", flops=1e9),
                            heavy_ops=(HeavyOp(flops=5e8, activation_bytes=0.0,
                                               weight_bytes=0.0),))


def test_a_fused_kernels_recomputed_scores_add_backward_flops():
    # Backward of a compute-bound op is its two gradient ops, 2 x 8 ms, plus what the fused
    # kernel recomputes: 5e8 FLOPs per sample, 4 samples at 5e11 FLOP/s = 4 ms more.
    op = HeavyOp(flops=1e9, activation_bytes=1e6, weight_bytes=1e6, bwd_extra_flops=5e8)
    assert roofline_seconds([op], DEVICES, 4, 1.0, backward=True) == pytest.approx(
        (20e-3, 0.0))


def test_op_and_matmul_overheads_make_small_microbatches_cost_more():
    """Per call and microbatch: 10 us per op forward, 20 us in backward, 5 us per matmul
    beyond its FLOPs. A layer of 30 ops, one of them the matmul, on 4 samples: one
    microbatch of 4 pays the overheads once, four of 1 four times; without overheads
    (the hand-built devices) the split costs autograd's accumulation of the 3 later
    microbatches' gradients into ``.grad`` only (each fp32 gradient read, ``.grad`` read
    and written)."""
    layer = dataclasses.replace(instances.layer("block", flops=1e9, selective=500.0),
                                num_nodes=30)
    slow = dataclasses.replace(DEVICES, op_overhead_s=10e-6, op_overhead_backward_s=20e-6,
                               matmul_overhead_s=5e-6)

    def step_s(devices, b: int, m: int) -> float:
        problem = instances.problem([layer], [], devices, batch=4)
        config = PipelineConfig(pp=1, dp=1, micro_batch_size=b, num_microbatches=m,
                                schedule="1f1b")
        row = build_cost_table(problem, config).layers[0]
        return m * (row.forward_ps + row.backward_ps) / PS_PER_S, row

    accumulate = 3 * layer.param_count * 12 / DEVICES.light_op_bandwidth
    assert step_s(DEVICES, 1, 4)[0] - step_s(DEVICES, 4, 1)[0] == pytest.approx(accumulate)
    whole, row = step_s(slow, 4, 1)
    # forward: 4e9 / 5e11 = 8 ms + 5 us (matmul) + 30 x 10 us; backward: 16 ms + 2 x 5 us
    # + 30 x 20 us.
    assert row.forward_ps / PS_PER_S == pytest.approx(8e-3 + 5e-6 + 300e-6)
    assert row.backward_ps / PS_PER_S == pytest.approx(16e-3 + 10e-6 + 600e-6)
    # Recompute replays the ops it reruns: full all 30, selective the 29 light ones.
    assert row.recompute_ps["full"] / PS_PER_S == pytest.approx(8e-3 + 5e-6 + 300e-6)
    assert row.recompute_ps["selective"] / PS_PER_S == pytest.approx(29 * 10e-6)
    split, _ = step_s(slow, 1, 4)
    assert split - whole == pytest.approx(3 * (15e-6 + 900e-6) + accumulate)


def test_a_gpu_pays_the_longer_of_its_kernels_and_their_dispatch():
    """Where the host dispatches ahead of the device (a GPU's launch queue) the op
    overhead is a floor, not a sum: a layer of 30 ops at 10 us (forward) and 20 us
    (backward) per op pays max(kernels, 300 us) forward and max(kernels, 600 us) in
    backward. On 4 samples its kernels (8 ms, 16 ms) hide the dispatch; on a layer 100x
    smaller, one sample at a time, the dispatch is the time."""
    layer = dataclasses.replace(instances.layer("block", flops=1e9, selective=500.0),
                                num_nodes=30)
    tiny = dataclasses.replace(instances.layer("block", flops=1e7, selective=5.0),
                               num_nodes=30)
    gpu = dataclasses.replace(DEVICES, op_overhead_s=10e-6, op_overhead_backward_s=20e-6,
                              dispatch_ahead=True)

    def row(devices, block, b: int):
        problem = instances.problem([block], [], devices, batch=4)
        config = PipelineConfig(pp=1, dp=1, micro_batch_size=b, num_microbatches=4 // b,
                                schedule="1f1b")
        return build_cost_table(problem, config).layers[0]

    plain, ahead = row(DEVICES, layer, 4), row(gpu, layer, 4)
    assert (ahead.forward_ps, ahead.backward_ps) == (plain.forward_ps, plain.backward_ps)
    assert ahead.recompute_ps["selective"] / PS_PER_S == pytest.approx(29 * 10e-6)
    small = row(gpu, tiny, 1)
    kernels = row(DEVICES, tiny, 1)
    assert kernels.forward_ps / PS_PER_S < 300e-6
    assert small.forward_ps / PS_PER_S == pytest.approx(300e-6)
    # Besides, autograd adds 3 of the 4 microbatches' gradients into .grad (12 bytes a
    # parameter each, at the element-wise rate).
    accumulate = 3 * tiny.param_count * 12 / gpu.light_op_bandwidth / 4
    assert small.backward_ps / PS_PER_S == pytest.approx(600e-6 + accumulate)
    assert small.recompute_ps["full"] / PS_PER_S == pytest.approx(300e-6)
    # On a CPU (dispatch_ahead False) the same overheads add to the kernels.
    cpu = row(dataclasses.replace(gpu, dispatch_ahead=False), tiny, 1)
    assert cpu.forward_ps == pytest.approx(kernels.forward_ps + 300e-6 * PS_PER_S, abs=2)


def test_a_gpu_pays_its_own_time_per_kernel_beside_the_dispatch():
    """DeviceNumbers.kernel_overhead_s, 3 us: a layer that launches 40 kernels forward, 90
    in backward and 12 again under selective recompute pays 120, 270 and 36 us more per
    microbatch, on the device, whatever its size; its gradients' adds into .grad one
    kernel per parameter tensor (2 of them) for each of 3 of the 4 microbatches. Being
    the device's own time, the dispatch floor is measured against the kernels with it. A
    layer whose kernels were not counted (built by hand) pays none."""
    counted = dataclasses.replace(instances.layer("block", flops=1e9, selective=500.0),
                                  num_nodes=30, forward_kernels=40, backward_kernels=90,
                                  recompute_kernels={"none": 0, "selective": 12, "full": 40},
                                  param_tensors=2)
    per_kernel = dataclasses.replace(DEVICES, kernel_overhead_s=3e-6)

    def row(devices, block):
        problem = instances.problem([block], [], devices, batch=4)
        config = PipelineConfig(pp=1, dp=1, micro_batch_size=1, num_microbatches=4,
                                schedule="1f1b")
        return build_cost_table(problem, config).layers[0]

    plain, paid = row(DEVICES, counted), row(per_kernel, counted)
    assert (paid.forward_ps - plain.forward_ps) / PS_PER_S == pytest.approx(120e-6)
    assert (paid.backward_ps - plain.backward_ps) / PS_PER_S == pytest.approx(
        270e-6 + 3 / 4 * 2 * 3e-6)
    assert {m: (paid.recompute_ps[m] - plain.recompute_ps[m]) / PS_PER_S
            for m in ("selective", "full")} == pytest.approx({"selective": 36e-6,
                                                              "full": 120e-6})
    by_hand = dataclasses.replace(counted, forward_kernels=None, backward_kernels=None,
                                  recompute_kernels={}, param_tensors=0)
    assert row(per_kernel, by_hand) == row(DEVICES, by_hand)
    # Behind a host that dispatches ahead, 30 ops at 10 us are a floor of 300 us that
    # a tiny layer's kernels, 40 x 3 us of their own time among them, now nearly reach.
    tiny = dataclasses.replace(counted, fwd_flops=1e6, heavy_ops=(
        HeavyOp(flops=1e6, activation_bytes=0.0, weight_bytes=0.0),),
        recompute_flops={"none": 0.0, "selective": 0.0, "full": 1e6})
    gpu = dataclasses.replace(per_kernel, op_overhead_s=10e-6, dispatch_ahead=True)
    assert row(gpu, tiny).forward_ps / PS_PER_S == pytest.approx(300e-6)
    many = dataclasses.replace(tiny, forward_kernels=200)
    assert row(gpu, many).forward_ps / PS_PER_S == pytest.approx(1e6 / 5e11 + 600e-6)


def test_the_gpu_presets_no_longer_tie_microbatch_splits():
    """On the GPU presets (dispatch measured on an H100's host, as a floor) a small GPT
    split into microbatches of one sequence is predicted slower than one microbatch of
    all of them, and the planner picks fewer, larger microbatches."""
    model = gpt_tiny(n_layer=2, n_embd=128, vocab_size=512)
    ids = torch.zeros(8, 64, dtype=torch.long)

    def plan(**pins):
        return partc.compile(model, (ids,), loss_fn=loss_fn, example_target=ids,
                             budget=partc.DeviceBudget(num_devices=1, device="H100"),
                             train=partc.TrainSpec(global_batch_size=8),
                             constraints=partc.Constraints(recompute="none", **pins)).plan

    whole, split = plan(num_microbatches=1), plan(num_microbatches=8)
    assert split.predicted.step_time_s > 2 * whole.predicted.step_time_s
    assert plan().num_microbatches == 1


def test_each_collective_kind_is_priced_by_its_own_link():
    """ZeRO-3 over dp=2 inside a node: the all-gather and reduce-scatter take their own
    fits, the other kinds the joint numbers (1e9 bytes/s, no latency)."""
    from partc.cost.collectives import Group, collective_seconds

    numbers = dataclasses.replace(
        instances.devices(2, 10**12), intra_node_links=(
            ("all_gather", 1e-3, 1e8), ("reduce_scatter", 2e-3, 5e7), ("send", 0.0, 2e9)))
    group = Group.over(numbers, 2, 2)
    assert collective_seconds("all_gather", 1e8, group) == pytest.approx(1e-3 + 0.5)
    assert collective_seconds("broadcast", 1e8, group) == pytest.approx(1e-3 + 0.5)
    assert collective_seconds("reduce_scatter", 1e8, group) == pytest.approx(2e-3 + 1.0)
    assert collective_seconds("all_reduce", 1e8, group) == pytest.approx(0.1)
    assert collective_seconds("send", 1e8, group) == pytest.approx(0.05)
    # Across nodes the network's numbers, whatever the kind.
    across = Group.over(numbers, 2, 16)
    assert collective_seconds("all_gather", 1e8, across) == pytest.approx(0.05)
    layer = instances.layer("block", flops=1e9, params=10**6)
    problem = instances.problem([layer], [], numbers, batch=2)
    config = PipelineConfig(pp=1, dp=2, micro_batch_size=1, num_microbatches=1,
                            schedule="1f1b", zero_stage=3)
    row = build_cost_table(problem, config).layers[0]
    # 4e6 bytes of fp32 weights gathered (1 ms + 20 ms) in forward, gathered again and
    # reduce-scattered (2 ms + 40 ms) in backward: each phase longer than its compute.
    assert row.forward_ps / PS_PER_S == pytest.approx(21e-3)
    assert row.backward_ps / PS_PER_S == pytest.approx(21e-3 + 42e-3)


def test_a_group_spanning_nodes_drives_the_nics_of_its_members_in_each_node():
    """NCCL spreads a collective's rings over the NICs of the group's members in a node:
    a data-parallel group of 48 over 6 nodes of 8 (tp = 1) moves bytes at 8 NICs' rate
    per rank, beside tp = 2 at 4 NICs', beside tp = 8 (one member per node) at one NIC's;
    never above NVLink's; a pipeline send crosses one NIC."""
    from partc.cost.collectives import Group, collective_seconds, members_per_node

    numbers = dataclasses.replace(instances.devices(8, 10**12), devices_per_node=8,
                                  intra_node_bandwidth=450e9, inter_node_bandwidth=50e9,
                                  link_latency_s=0.0)
    assert [members_per_node(48, 48 * tp, 8) for tp in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    nbytes = 48e8

    def seconds(tp: int) -> float:
        return collective_seconds("reduce_scatter", nbytes, Group.over(numbers, 48, 48 * tp))

    one_nic = 47 / 48 * nbytes / 50e9
    assert seconds(8) == pytest.approx(one_nic)
    assert seconds(2) == pytest.approx(one_nic / 4)
    assert seconds(1) == pytest.approx(47 / 48 * nbytes / 400e9)
    fast = dataclasses.replace(numbers, inter_node_bandwidth=100e9)
    assert Group.over(fast, 48, 48).bandwidth == 450e9
    assert Group.over(numbers, 2, 16).bandwidth == 50e9


def test_a_pipeline_transfer_costs_each_end_what_compute_does_not_hide():
    """A pipeline transfer (the activation out, its gradient back) costs the sending run
    and the receiving run all but ``comm_overlap`` of it each: gloo's threads copy on the
    cores both ranks compute on (a CPU's overlap is about 0.2), NCCL's kernels run beside
    both ends' compute (overlap 1: nothing; the transfer still delays the receiver, which
    the simulation plays). The V schedules' turn, two runs on one rank, passes the
    tensors on without a transfer."""
    layer = instances.layer("block", flops=1e9)

    def comm_ms(overlap: float, schedule: str = "1f1b", chunks: int = 1):
        numbers = instances.devices(2, 10**12, latency=1e-3, overlap=overlap)
        problem = instances.problem([layer] * 4, [1e6] * 3, numbers, batch=4)
        config = PipelineConfig(pp=2, dp=1, micro_batch_size=1, num_microbatches=4,
                                schedule=schedule, chunks=chunks)
        table = build_cost_table(problem, config)
        stage_of = [0, 0, 1, 1] if chunks == 1 else [0, 1, 2, 3]
        stages = evaluate(table, stage_of, ["none"] * 4).stages
        return table, [stage.comm_ps / PS_PER_S * 1e3 for stage in stages]

    # Each way 1 ms of latency and 1e6 bytes at 1e9 bytes/s: 4 ms a microbatch.
    assert comm_ms(1.0)[1] == pytest.approx([0.0, 0.0])
    assert comm_ms(0.2)[1] == pytest.approx([3.2, 3.2])
    assert comm_ms(0.0)[1] == pytest.approx([4.0, 4.0])
    # ZBV: rank 0 holds runs 0 and 3, rank 1 runs 1 and 2 (the turn: no transfer).
    table, ranks = comm_ms(0.2, "zbv-zero-bubble", 2)
    assert [table.cut_ps[cut][cut] / PS_PER_S * 1e3 for cut in range(3)] == \
        pytest.approx([4.0, 0.0, 4.0])
    assert ranks == pytest.approx([3.2 + 3.2, 3.2 + 3.2])


def test_a_zero_bubble_schedule_prices_backward_as_two_passes():
    """Under a schedule that splits backward into input and weight gradients, a layer's
    backward compute costs DeviceNumbers.split_backward_factor times one pass (autograd
    walks the graph twice); forward, and the other schedules, are unchanged."""
    layer = instances.layer("block", flops=1e9)
    split = dataclasses.replace(DEVICES, split_backward_factor=1.5)
    problem = instances.problem([layer, layer], [0.0], split, batch=4)

    def row(schedule: str, chunks: int = 1):
        config = PipelineConfig(pp=1, dp=1, micro_batch_size=1, num_microbatches=4,
                                schedule=schedule, chunks=chunks)
        return build_cost_table(problem, config).layers[0]

    whole, zero_bubble = row("1f1b"), row("zbv-zero-bubble", 2)
    assert zero_bubble.forward_ps == whole.forward_ps
    # The compute only: autograd's accumulation into .grad (3 of 4 microbatches) is not.
    accumulate = 3 * layer.param_count * 12 / split.light_op_bandwidth / 4 * PS_PER_S
    assert zero_bubble.backward_ps - accumulate == pytest.approx(
        1.5 * (whole.backward_ps - accumulate), rel=1e-9)
    assert row("interleaved-1f1b", 2).backward_ps == whole.backward_ps
