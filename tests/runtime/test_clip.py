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

from .test_parity import assert_trains_like_one_process, launched, matrix

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


# The default profile clips across pipeline stages and tensor-parallel shards (across
# data-parallel replicas: test_zero's "-clip" case); the rest -m slow.
DEFAULT = {"gpt2-pp2-clip", "gpt-tp2-sp-clip"}


@pytest.mark.parametrize("name", matrix(TWO, DEFAULT))
def test_clipping_matches_one_process(clip2, name):
    _check(clip2, name)


@pytest.mark.parametrize("name", matrix(FOUR, set()))
def test_clipping_on_four_processes_matches_one_process(clip4, name):
    _check(clip4, name)
