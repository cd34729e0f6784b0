"""Global gradient-norm clipping (``TrainSpec.max_grad_norm``) against one process.

The limit (0.5) is below the gradients' norm (about 1.3 to 1.7 here), so every step
scales them. Each case trains 3 SGD steps; the norm every rank reports must equal
``torch.nn.utils.clip_grad_norm_`` on the whole model in one process, and losses and
parameters must match. Covered: data parallelism (replicas counted once), a pipeline
with GPT-2's tied embedding on both stages (counted once), tensor parallelism with
sequence parallelism (shards summed, replicated norms counted once), and both combined.
"""

from __future__ import annotations

import pytest

from .test_parity import assert_trains_like_one_process, launched

TWO = ["gpt-dp2-clip", "gpt2-pp2-clip", "gpt-tp2-sp-clip"]
FOUR = ["llama-pp2-tp2-clip", "gpt-pp2-dp2-clip"]


clip2 = launched("clip2", 2, TWO)
clip4 = launched("clip4", 4, FOUR)


def _check(ranks: list[dict], name: str) -> None:
    for rank, results in enumerate(ranks):
        result = results[name]
        assert_trains_like_one_process(rank, result)
        assert len(result["grad_norms"]) == len(result["ref_grad_norms"]) == 3
        for ours, ref in zip(result["grad_norms"], result["ref_grad_norms"]):
            assert ref > 0.5  # clipping is active
            assert ours == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize("launch, name", [("clip2", n) for n in TWO]
                         + [("clip4", n) for n in FOUR])
def test_clipping_matches_one_process(request, launch, name):
    _check(request.getfixturevalue(launch), name)
