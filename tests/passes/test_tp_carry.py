"""A plan's tensor-parallel choices carried to a trace at another batch size, where the
model's code takes another branch (partc.passes.tp.carry)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from partc.cost.collectives import Group
from partc.passes.context import Lowering
from partc.passes.pipeline import _planned_graph
from partc.passes.tp import chooser as tp_chooser
from tests import models

LINK = tp_chooser.Link(group=Group(ranks=2, bandwidth=1e11, latency_s=1e-6), flops=1e12,
                       hbm_bandwidth=1e12)


def _loss(output, target):
    return F.cross_entropy(output.logits.flatten(0, 1).float(), target.flatten())


def _graphs():
    """A Hugging Face Llama grouped into layers as lowering groups it, traced at a batch
    of 1 (as the planner measured it) and of 4 (a micro-batch): its mask code expands
    the position ids to the batch only when the batch is not 1."""
    torch.manual_seed(0)
    model = models.llama(n_layer=1, attention="sdpa")
    lowering = Lowering(stages=(), recompute={}, tp=2)

    def at(batch: int):
        ids = torch.zeros(batch, 16, dtype=torch.long)
        return _planned_graph(model, ((ids,), {}, ids), lowering, _loss)

    return at(1), at(4)


def test_choices_made_at_one_batch_size_apply_at_another():
    planned, micro = _graphs()
    chosen = tp_chooser.choose(planned, 2, LINK, sequence_parallel=False, prefer="time")
    choices = {layer.name: layer.choices for layer in chosen.layers}
    # The embedding layer has a node more at a batch of 4: the plan's choices do not
    # fit it as they are (the crash Llama-3-70B's lowering met).
    with pytest.raises(ValueError, match="model.embed_tokens: the plan's sharding has"):
        tp_chooser.apply(micro, 2, False, choices)
    carried = tp_chooser.apply(micro, 2, False, choices, made_on=lambda: planned)
    # Every layer keeps the plan's placements of its parameters and its collectives
    # (their bytes are the micro-batch's).
    def kinds(sharding):
        return [(l.name, l.params, [(c.kind, c.phase) for c in l.collectives])
                for l in sharding.layers]

    assert kinds(carried) == kinds(chosen)
    assert any(l.params for l in chosen.layers) and any(l.collectives for l in chosen.layers)
    # A graph that fits the choices is never traced again.
    again = tp_chooser.apply(planned, 2, False, choices, made_on=lambda: pytest.fail())
    assert [l.choices for l in again.layers] == [l.choices for l in chosen.layers]
