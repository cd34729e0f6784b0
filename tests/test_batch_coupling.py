"""A loss that couples the samples of a batch (a router's load-balancing loss over the
whole batch) is found on the real model, and the plan keeps one replica and one
microbatch, or refuses pins that split the batch, unless each microbatch's loss is
declared its own (partc.batch_coupling)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import partc
from partc.batch_coupling import couples_samples
from samples import moe
from tests.hf_families import FAMILIES

BATCH, SEQ = 4, 16


def _mixtral(aux: bool) -> torch.nn.Module:
    family = FAMILIES["mixtral"]
    torch.manual_seed(0)
    return dataclasses.replace(family, fields={**family.fields, "output_router_logits": aux,
                                               "router_aux_loss_coef": 0.02}).build()


def _loss_with_aux(output, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy plus the router's load-balancing loss, as Mixtral's own
    ``loss`` adds it (its coefficient times ``aux_loss``)."""
    logits = output.logits
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
    return ce + 0.02 * output.aux_loss


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def test_the_probe_tells_a_batch_loss_from_a_per_sample_one_and_changes_nothing():
    mixtral = _mixtral(aux=True)
    ids, target = _batch(mixtral.config.vocab_size)
    before = {k: v.clone() for k, v in mixtral.state_dict().items()}
    assert couples_samples(mixtral, (ids,), _loss_with_aux, target) is True
    assert all(torch.equal(v, mixtral.state_dict()[k]) for k, v in before.items())
    # The sample's balance loss is per sequence, a mean over samples like the rest.
    sample = moe.moe_tiny()
    x, y = _batch(128)
    assert couples_samples(sample, (x,), moe.loss_fn, y) is False
    assert couples_samples(sample, (x[:1],), moe.loss_fn, y[:1]) is None   # one sample
    with torch.device("meta"):
        on_meta = moe.moe_tiny()
    assert couples_samples(on_meta, (x,), moe.loss_fn, y) is None


def _compile(model, ids, target, loss_fn, **pins) -> partc.Program:
    train = pins.pop("train", partc.TrainSpec(global_batch_size=BATCH))
    return partc.compile(model, (ids,), loss_fn=loss_fn, example_target=target,
                         budget=partc.DeviceBudget(num_devices=2, device="CPU"),
                         train=train, constraints=partc.Constraints(**pins), cache=None)


def test_a_batch_loss_plans_one_replica_or_is_declared_per_microbatch():
    mixtral = _mixtral(aux=True)
    ids, target = _batch(mixtral.config.vocab_size)
    plan = _compile(mixtral, ids, target, _loss_with_aux).plan
    assert plan.dp == 1 and plan.num_microbatches == 1
    with pytest.raises(partc.PartcError, match="loss_per_microbatch"):
        _compile(mixtral, ids, target, _loss_with_aux, dp=2)
    declared = partc.TrainSpec(global_batch_size=BATCH, loss_per_microbatch=True)
    program = _compile(mixtral, ids, target, _loss_with_aux, dp=2, train=declared)
    assert program.plan.dp == 2 and program.plan.train.loss_per_microbatch
    assert "each microbatch's loss is its own" in program.report()
    # Without the router's loss (output_router_logits off) nothing is restricted.
    plain = _mixtral(aux=False)
    assert _compile(plain, ids, target, _ce, dp=2).plan.dp == 2


def _ce(output, target: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))



def test_batch_normalisation_over_microbatches_is_said(caplog):
    """Seen before: a network with BatchNorm (training mode) planned in two microbatches
    normalised each over its own half of the batch (as gradient accumulation does, which
    the runtime matches: tests/runtime/test_side_effects.py), and its loss differed from
    one device's whole-batch step (1.4537 against 1.4126) without a word. Compiling it
    now says so, naming the layer and the sizes; one microbatch says nothing."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x, y = torch.randn(BATCH, 8), torch.randint(0, 3, (BATCH,))
    with caplog.at_level("WARNING", logger="partc"):
        _compile(model, x, y, F.cross_entropy, num_microbatches=2)
    said = [r.getMessage() for r in caplog.records if "BatchNorm" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("1 (BatchNorm, training mode) normalises "
                                                 "each microbatch of 2 samples"), said
    caplog.clear()
    with caplog.at_level("WARNING", logger="partc"):
        _compile(model, x, y, F.cross_entropy, num_microbatches=1)
        _compile(model.eval(), x, y, F.cross_entropy, num_microbatches=2)
    assert not [r for r in caplog.records if "BatchNorm" in r.getMessage()]
