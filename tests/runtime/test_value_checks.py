"""A model's checks on its batch's values stay in the program partc makes of it
(partc/runtime/value_checks.py): LLaVA checks that its ids hold one image token per
image feature. The trace captures that check as ops fake tensors cannot run; planning
drops them, and the program checks real batches with ``value_check`` instead, raising
where the model run on one device raises, rather than training on a batch it refuses."""

from __future__ import annotations

import pytest
import torch

import partc
from partc.runtime.value_checks import ValueCheckError, value_check
from tests import hf_families
from tests.tolerances import FP32

B, SEQ = 4, 16


def test_a_batch_the_model_refuses_is_refused_by_its_program():
    torch.manual_seed(0)
    model = hf_families.FAMILIES["llava"].build()
    (ids, images), target = hf_families.batch("vlm", model, B, SEQ,
                                              torch.Generator().manual_seed(0))
    expected = hf_families.causal_lm_loss(model(ids, images), target).item()
    program = partc.compile(model, (ids, images), loss_fn=hf_families.causal_lm_loss,
                            example_target=target,
                            budget=partc.DeviceBudget(num_devices=1, device="CPU"),
                            train=partc.TrainSpec(global_batch_size=B),
                            constraints=partc.Constraints(num_microbatches=2))
    module = program.build()
    try:
        checks = [n for m in module.module.modules() if isinstance(m, torch.fx.GraphModule)
                  for n in m.graph.nodes if n.target is value_check]
        assert checks
        loss = module.forward_backward(ids, images, target=target)
        assert loss.item() == pytest.approx(expected, rel=FP32)
        wrong = ids.clone()
        wrong[:, 1] = 1   # one image token fewer than the image's features
        with pytest.raises(ValueError):   # as the model itself refuses it
            model(wrong, images)
        with pytest.raises(ValueCheckError, match="image tokens must number"):
            module.forward_backward(wrong, images, target=target)
    finally:
        module.close()
