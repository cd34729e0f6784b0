"""Activation offload on one process: layers pinned to offload train like the model, and
the runtime's own count of the bytes it moved to the host and back, and held there, is
what the plan says (the host is the device on CPU: the copies are tensors apart)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import partc
from partc.runtime.activation_offload import ledgers
from samples.gpt import gpt_tiny, loss_fn
from tests.tolerances import FP32

B, T, STEPS = 8, 16, 2
# What the estimate measures a layer's ops saving (on fakes) and what its hooks copy
# differ by the odd small storage (a mask of a few hundred bytes): 0.1% of the tiny
# GPT's blocks.
ESTIMATE_SLACK = 0.01


def tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    data = torch.randint(0, 128, (B, T + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


@pytest.fixture
def process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_offloaded_blocks_train_like_the_model_and_move_what_the_plan_says(process_group):
    torch.manual_seed(0)
    model = gpt_tiny()
    reference = copy.deepcopy(model)
    x, y = tokens(0)
    program = partc.compile(
        model, (x,), loss_fn=loss_fn, example_target=y,
        budget=partc.DeviceBudget(num_devices=1, device="CPU", host_memory="1GiB"),
        train=partc.TrainSpec(global_batch_size=B),
        constraints=partc.Constraints(num_microbatches=4, schedule="gpipe", recompute={
            "blocks.0": "offload", "blocks.1": "offload"}))
    stage = program.plan.stages[0]
    assert stage.offloaded == ("blocks.0", "blocks.1")
    # GPipe holds all 4 microbatches: on the host, 4 times what one saves in the blocks.
    assert stage.host_traffic_bytes == stage.memory_bytes.host > 0
    assert program.plan.host_bytes_per_node == stage.memory_bytes.host

    module = program.build()
    telemetry = module.telemetry(console=False)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = tokens(step)
        loss = module.forward_backward(x, target=y)
        opt.step(); opt.zero_grad(); module.end_step()
        ref_loss = loss_fn(reference(x), y)
        ref_loss.backward(); ref_opt.step(); ref_opt.zero_grad()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=FP32)
    for fqn, param in module.named_parameters():
        torch.testing.assert_close(param, dict(reference.named_parameters())[fqn],
                                   rtol=FP32, atol=1e-6)

    counters = ledgers(module.module)[0].counters
    assert counters.resident == 0            # every copy came back and went
    assert counters.to_device == counters.to_host
    for record in telemetry.records[1:]:     # the first step also learns shapes
        assert record.host_traffic_bytes == pytest.approx(
            record.predicted_host_traffic_bytes, rel=ESTIMATE_SLACK)
        assert record.host_activation_bytes == pytest.approx(
            record.predicted_host_activation_bytes, rel=ESTIMATE_SLACK)
