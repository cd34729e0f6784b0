"""The context-parallel lowering on real models' graphs: each attention's mask read at
the whole sequence's length, attention and positions put on the cp group, and what
cannot be split refused with the op named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from partc.errors import ContextParallelError
from partc.passes.context import Lowering
from partc.passes.context_parallel import attention_masks
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


def _lowered(model: nn.Module, kind: str, cp: int = 2, seq: int = SEQ):
    layers = ["model.embed_tokens", "model.rotary_emb", *(f"model.layers.{i}" for i in range(2)),
              "model.norm", "lm_head", "loss"]
    lowering = Lowering(stages=(tuple(layers),), recompute={}, cp=cp, cp_kind=kind)
    return lower(model, (_tokens(seq=seq),), lowering, loss_fn=causal_lm_loss,
                 example_target=_tokens(seq=seq)).stages[0].module


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
