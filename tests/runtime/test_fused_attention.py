"""Fused attention (``TrainSpec(attention="fused")``) trains like the attention the model
writes, run on one process: Llama (grouped-query attention) with tp=2, whose fused calls
are sharded by heads; the sample GPT (symbolic_trace) with tp=2, sequence parallelism and
selective recompute; GPT-2 with pp=2, one block recomputed selectively and one in full;
gpt-oss, whose attention has sinks (one more key per call), with tp=2 (the sinks sharded
with their heads, the calls recomputed selectively) and pp=2; under torchrun with gloo.
Every block runs one ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import pytest

from .test_parity import assert_trains_like_one_process, launched, matrix

CASES = {"llama-tp2-fused": {"pp": 1, "dp": 1, "tp": 2},
         "gpt-tp2-sp-fused": {"pp": 1, "dp": 1, "tp": 2},
         "gpt2-pp2-fused-recompute": {"pp": 2, "dp": 1, "tp": 1},
         "hf-gpt-oss-tp2-fused": {"pp": 1, "dp": 1, "tp": 2},
         "hf-gpt-oss-pp2-fused": {"pp": 2, "dp": 1, "tp": 1}}

fused_two = launched("fused_two", 2, list(CASES))


# The default profile: fused attention under sequence parallelism and under pp with
# recompute, and attention with sinks under tp; Llama's grouped-query attention and
# gpt-oss under pp -m slow.
@pytest.mark.parametrize("name", matrix(list(CASES), {"gpt-tp2-sp-fused",
                                                      "gpt2-pp2-fused-recompute",
                                                      "hf-gpt-oss-tp2-fused"}))
def test_fused_attention_trains_like_one_process(fused_two: list[dict], name: str) -> None:
    mesh = CASES[name]
    for rank, results in enumerate(fused_two):
        result = results[name]
        assert_trains_like_one_process(rank, result)
        assert result["mesh"] == mesh
        # Both blocks of the 2-layer model on a tp rank; one per pipeline stage.
        assert result["fused_attention"] == 2 // mesh["pp"], (name, rank)
