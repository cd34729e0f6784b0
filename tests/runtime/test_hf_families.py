"""Hugging Face families as users bring them (tests/hf_families.py) train like one
process under torchrun: a few in the default profile, one per kind of fix they needed;
``benchmarks/hf_coverage.py`` runs every family under pp=2 and tp=2 (docs/guide.md's table).

- T5 (pp=2): an encoder-decoder with two inputs, and a learned relative position bias
  passed to SDPA as its mask (a mask that needs a gradient);
- Gemma-2 (tp=2): soft-capped logits and attention scores, sliding-window layers
  alternating with global ones;
- Mixtral (pp=2): mixture-of-experts routing through transformers' grouped matmul;
- Falcon (pp=2): constants torch.export lifts out of the forward, positions sent between
  stages;
- Llama called as people call it (pp=2): ``model(**batch)`` with ``input_ids``,
  ``attention_mask`` (rows padded to different lengths), ``position_ids`` and
  ``labels`` (-100 under padding), no loss_fn: trained on its own loss, the mean over the
  whole batch's labels although each microbatch counts another number of them
  (tp=2 and dp=2 too, with ``-m slow``).
- DeBERTa-v2 (pp=2, zero-bubble "V" schedule): stages that send views on, and normed
  relative embeddings that one stage makes from its weights alone and sends to the next
  (the split backward's weight gradients, ``partc/runtime/split_backward.py``);
- ELECTRA (tp=2): a masked-LM head narrower than the encoder whose output is
  reduce-scattered by class: no ring along the features a linear maps;
- LLaVA (pp=2, zero-bubble "V"): ids and images, a vision tower whose features are
  scattered into the ids' image tokens after a check of their count on the values,
  which fake tensors cannot read: the program checks real batches only
  (``partc.runtime.value_checks``), not the made-up inputs pipelining learns a later
  stage's shapes from (the V puts the check on the second rank); and an output with
  fields that are None (the loss call keeps them in place).
"""

from __future__ import annotations

import pytest

from .test_parity import assert_trains_like_one_process, launch, launched

CASES = ["hf-t5-pp2", "hf-gemma2-tp2", "hf-mixtral-pp2", "hf-falcon-pp2",
         "hf-llama-own-loss-pp2", "hf-deberta-v2-pp2-zbv", "hf-electra-tp2", "hf-llava-pp2-zbv"]
OWN_LOSS_SLOW = ["hf-llama-own-loss-tp2", "hf-llama-own-loss-dp2"]

families = launched("families", 2, CASES)


@pytest.mark.parametrize("name", CASES)
def test_family_trains_like_one_process(families, name):
    for rank, results in enumerate(families):
        assert_trains_like_one_process(rank, results[name])
    mesh = families[0][name]["mesh"]
    assert (mesh["pp"], mesh["tp"]) == ((1, 2) if name.endswith("tp2") else (2, 1))
    if name.endswith("zbv"):
        assert families[0][name]["schedule"] == "zbv-zero-bubble"


@pytest.mark.slow
def test_own_loss_trains_like_one_process_under_tp_and_dp(tmp_path):
    ranks = launch(2, OWN_LOSS_SLOW, tmp_path)
    for name in OWN_LOSS_SLOW:
        for rank, results in enumerate(ranks):
            assert_trains_like_one_process(rank, results[name])
    assert ranks[0]["hf-llama-own-loss-dp2"]["mesh"]["dp"] == 2

