"""The graph facts context parallelism reads: each layer's attention cores as shapes,
and the op that keeps a model from splitting its sequence."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from partc.passes.pipeline import analyze
from tests import models


class Mixer(nn.Module):
    """Attention, then (optionally) a running sum over the sequence: a scan that a
    sequence shard cannot compute alone."""

    def __init__(self, scan: bool | int, width: int = 16) -> None:
        super().__init__()
        self.scan = scan   # True: along the sequence (dim 1); an int: along that dim
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, width = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = self.out(y.transpose(1, 2).reshape(b, s, width))
        return y.cumsum(dim=1 if self.scan is True else self.scan) if self.scan else y


def test_attention_cores_are_read_as_heads_and_key_value_heads():
    ids = torch.randint(1, 128, (2, 16))
    _, analysis = analyze(models.llama(heads=4, kv_heads=2), (ids,))
    cores = [layer.attention for layer in analysis.layers if layer.attention is not None]
    assert len(cores) == 2   # one per block
    core = cores[0]
    assert (core.cores, core.heads, core.kv_heads, core.head_dim, core.tokens) == (1, 4, 2, 16, 16)
    # Two products of (16 x 16) scores over 16-wide heads, 4 heads, per sample.
    assert core.flops == 4 * 2 * 2 * 16 * 16 * 16
    assert analysis.summary.context_parallel_blocker == ""


def test_an_op_reading_along_the_sequence_outside_attention_is_named():
    x = torch.randn(2, 8, 16)
    _, plain = analyze(Mixer(scan=False), (x,))
    _, scanned = analyze(Mixer(scan=True), (x,))
    assert plain.summary.context_parallel_blocker == ""
    assert scanned.summary.context_parallel_blocker.startswith("cumsum (")


def test_a_width_equal_to_the_sequence_is_not_taken_for_it():
    # 16 tokens of width 16: a running sum over the width reads no other position, and
    # is told apart from one over the sequence as lowering tells it (dims whose size
    # differs on a trace at another length), not by size.
    x = torch.randn(2, 16, 16)
    _, across = analyze(Mixer(scan=2), (x,))
    _, along = analyze(Mixer(scan=True), (x,))
    assert across.summary.context_parallel_blocker == ""
    assert along.summary.context_parallel_blocker.startswith("cumsum (")
