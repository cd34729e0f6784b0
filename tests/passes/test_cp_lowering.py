"""The context-parallel lowering on real models' graphs: each attention's mask read at
the whole sequence's length, attention and positions put on the cp group, and what
cannot be split refused with the op named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partc.errors import ContextParallelError
from partc.passes.context import Lowering
from partc.passes.context_parallel import attention_masks, shape_masks
from partc.passes.layers import crossing_tensors
from partc.passes.pipeline import _whole_length_facts, lower
from partc.runtime import cp_group as cp_runtime
from partc.runtime.ring_attention import AttentionMask
from tests.hf_families import FAMILIES, causal_lm_loss, logits_loss

SEQ = 16


def _tokens(batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(1, 100, (batch, seq), device="meta")


@pytest.mark.parametrize("family, mask", [("llama", AttentionMask("causal")),
                                          ("mistral", AttentionMask("sliding", 8))])
def test_masks_are_read_at_the_whole_length(family, mask):
    # Mistral's window (8) is longer than a cp=4 shard (4 tokens): only the whole
    # length shows it.
    model = FAMILIES[family].build()
    masks, _ = _whole_length_facts(model, (_tokens(),), "as_written",
                                   loss_fn=causal_lm_loss, example_target=_tokens())
    assert masks == (mask,) * model.config.num_hidden_layers


@pytest.mark.parametrize("family, mask", [("llama", AttentionMask("causal")),
                                          ("mistral", AttentionMask("sliding", 8))])
def test_a_long_mask_is_read_tile_by_tile(monkeypatch, family, mask):
    """Above BLOCK_ELEMENTS a mask made from shapes is judged from its tiles' bounds:
    two rows read (the first and the last, which name the kind and the window), then
    only tiles mixing kept and dropped positions made (at most LEAF_SIDE a side), never
    every row."""
    from partc.passes.helpers import mask_rows

    from partc.passes import context_parallel

    made = {"rows": 0, "tiles": []}
    keeps, tile = context_parallel._keeps, mask_rows.RowBlocks.tile

    def counted_rows(value, start, stop):
        made["rows"] += stop - start
        return keeps(value, start, stop)

    def counted_tile(self, along, across):
        made["tiles"].append((along[1] - along[0]) * (across[1] - across[0]))
        return tile(self, along, across)

    monkeypatch.setattr(mask_rows, "BLOCK_ELEMENTS", 2 * SEQ)
    monkeypatch.setattr(mask_rows, "LEAF_SIDE", 2)
    monkeypatch.setattr(context_parallel, "_keeps", counted_rows)
    monkeypatch.setattr(mask_rows.RowBlocks, "tile", counted_tile)
    model = FAMILIES[family].build()
    masks, _ = _whole_length_facts(model, (_tokens(),), "as_written",
                                   loss_fn=causal_lm_loss, example_target=_tokens())
    assert masks == (mask,) * model.config.num_hidden_layers
    calls = model.config.num_hidden_layers
    assert made["rows"] <= 2 * calls and max(made["tiles"]) <= 4


LAYERS = ("model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1",
          "model.norm", "lm_head", "loss")


def _lowered(model: nn.Module, kind: str, cp: int = 2, seq: int = SEQ):
    return _lower(model, (LAYERS,), kind, cp, seq).stages[0].module


def _lower(model: nn.Module, stages, kind: str | None, cp: int, seq: int = SEQ, only=None):
    lowering = Lowering(stages=stages, recompute={}, cp=cp, cp_kind=kind)
    return lower(model, (_tokens(seq=seq),), lowering, loss_fn=causal_lm_loss,
                 example_target=_tokens(seq=seq), only=only)


def test_the_masks_a_cut_carries_are_those_cp_erases():
    # Mistral's sliding-window mask, made from shapes before the layers, crosses the cut
    # after the first layer; under cp each rank's attention makes its own, so the plan
    # counts one message fewer there (partc.planner.assemble.p2p_messages).
    model, stages = FAMILIES["mistral"].build(), (LAYERS[:3], LAYERS[3:])
    whole, split = (_lower(model, stages, kind, cp, only=()) for kind, cp in ((None, 1),
                                                                              ("ring", 2)))
    sent = set(whole.stages[0].sends)
    erased = sent - set(split.stages[0].sends)
    assert erased and erased == sent & {n.name for n in shape_masks(whole.graph)}
    tensors, _, masks = crossing_tensors(whole.graph, len(LAYERS))[2]
    assert (tensors, masks) == (len(sent), len(erased))


def test_attention_and_positions_run_on_the_cp_group():
    module = _lowered(FAMILIES["llama"].build(), "ring")
    calls = [n for n in module.graph.nodes if n.op == "call_function"]
    attention = [n for n in calls if n.target is cp_runtime.attention]
    assert len(attention) == 2
    assert all(n.kwargs["mask"] == "causal" for n in attention)
    # Grouped-query attention: the ring passes the 2 key/value heads, not 4 copies.
    assert all(n.args[2].meta["val"].shape[1] == 2 for n in attention)
    positions = [n for n in calls if n.target is cp_runtime.positions]
    assert [n.args[1] for n in positions] == [SEQ // 2]
    assert not any("scaled_dot_product" in str(n.target) for n in calls)
    assert isinstance(module.cp, cp_runtime.ContextParallelGroup) and module.cp.size == 2


def test_a_width_equal_to_the_shard_is_not_the_sequence():
    # 128 tokens over cp=2: a shard of 64, Llama's width. Its norms' means over the
    # width are 64 wide on the whole sequence's trace too: not along the sequence.
    module = _lowered(FAMILIES["llama"].build(), "all-to-all", seq=128)
    assert sum(n.target is cp_runtime.attention for n in module.graph.nodes) == 2


class CumulativeMean(nn.Module):
    """A running mean along the sequence: right on the whole, wrong on a shard."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 8)
        self.head = nn.Linear(8, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.head(x.cumsum(1) / torch.arange(1, ids.shape[1] + 1)[:, None])


def test_an_op_along_the_sequence_is_refused_by_name():
    lowering = Lowering(stages=(("embed", "head", "loss"),), recompute={}, cp=2)
    with pytest.raises(ContextParallelError, match=r"cumsum.*reads along the sequence"):
        lower(CumulativeMean(), (_tokens(),), lowering, loss_fn=logits_loss,
              example_target=_tokens())
