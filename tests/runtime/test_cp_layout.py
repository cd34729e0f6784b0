"""The load-balanced sequence layout and the attention block math, in one process (the
ring and all-to-all over two ranks: ``test_parity.py``'s ``cp-attention``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from partc.errors import PartcError
from partc.runtime import cp_layout
from partc.runtime.ring_attention import AttentionMask, Ring, ring_attention


def test_each_rank_holds_an_early_and_a_late_chunk():
    assert cp_layout.positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_layout.positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    whole = torch.arange(24).reshape(2, 12)
    pieces = [cp_layout.shard(whole, 1, 3, rank) for rank in range(3)]
    assert pieces[2].tolist()[0] == [4, 5, 6, 7]
    assert torch.equal(cp_layout.unshard(pieces, 1), whole)
    with pytest.raises(PartcError, match="do not divide by 4"):
        cp_layout.chunk_length(10, 2)


@pytest.mark.parametrize("mask", [AttentionMask("causal"), AttentionMask("none"),
                                  AttentionMask("sliding", 3)])
def test_blocks_merged_by_log_sum_exp_are_attention(mask):
    # One rank's two chunks, skipped, whole or cut by the mask, merged online; four
    # query heads over two key/value heads.
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 8, 8, dtype=torch.float64, generator=g, requires_grad=True)
            for _ in "kv")
    out = ring_attention(q, k, v, scale=0.3, mask=mask, ring=Ring(size=1, rank=0))
    every = torch.arange(8)
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1),
                                              v.repeat_interleave(2, 1),
                                              attn_mask=mask.keeps(every, every), scale=0.3)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
    for ours, theirs in zip(grads, expected_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
