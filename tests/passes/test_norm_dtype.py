"""The ``norm_dtype`` pass: under mixed precision a LayerNorm that only matmuls read runs
as :func:`partc.runtime.norm.layer_norm` (bf16 output, its bf16 input kept); one read
by anything that computes on its fp32 output stays autocast's."""

from __future__ import annotations

import pytest
import torch

from partc.passes import analyze
from partc.runtime.norm import layer_norm
from samples.gpt import gpt_tiny, loss_fn
from tests import models

B, T = 2, 16


def _norms(build, loss, autocast=torch.bfloat16) -> tuple[int, list[str]]:
    """(LayerNorms left as they were, names of those rewritten) in the analysed graph."""
    ids = torch.zeros(B, T, dtype=torch.long)
    gm, _ = analyze(build(), (ids,), loss_fn=loss, example_target=ids if loss else None,
                    autocast=autocast)
    rewritten = [n.name for n in gm.graph.nodes if n.target is layer_norm]
    left = sum(1 for n in gm.graph.nodes if n.op == "call_function"
               and n.target in (torch.nn.functional.layer_norm, torch.layer_norm,
                                torch.ops.aten.layer_norm.default))
    return left, rewritten


def test_the_sample_gpts_norms_all_feed_matmuls():
    # ln_1 -> c_attn, ln_2 -> c_fc per block, ln_f -> lm_head (ln_1's size is read too).
    assert _norms(gpt_tiny, loss_fn) == (0, ["layer_norm", "layer_norm_1", "layer_norm_2",
                                             "layer_norm_3", "layer_norm_4"])


def test_gpt2s_norms_reach_conv1ds_matmul_through_views():
    # Exported: each norm's output is viewed flat for Conv1D's addmm (ln_f: the lm head).
    left, rewritten = _norms(lambda: models.gpt2(n_layer=2), models.causal_lm_loss)
    assert left == 0 and len(rewritten) == 5


def test_a_post_ln_residual_stream_keeps_autocasts_norm():
    # BERT's norms are its residual stream (the next block's residual add reads them)
    # or feed a dropout: none is read by matmuls alone.
    left, rewritten = _norms(lambda: models.bert(n_layer=2), None)
    assert rewritten == [] and left == 5


def test_fp32_training_keeps_every_norm():
    assert _norms(gpt_tiny, loss_fn, autocast=None) == (5, [])
