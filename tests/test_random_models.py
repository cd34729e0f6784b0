"""Property-based tests on one process (issue 16, item 7): every random model
(``tests/random_models.py``) compiles for 2 devices under its mesh (every pipeline
schedule, zero-bubble ones included; sequence parallelism pinned on or not), its plan
passes the solver-independent validator and keeps the pins, and every stage's code is
generated. The models train against one process under torchrun in
``tests/runtime/test_random_models.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings

import partc
from partc.planner.validate import validate_plan
from tests import random_models
from tests.random_models import Case
from tests.runtime.random_worker import compile_case

# Derandomized: the suite draws the same models on every run. No shrinking: each example
# compiles a model (seconds), and a failure prints its spec, which replays it.
SETTINGS = settings(deadline=None, derandomize=True, database=None,
                    phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=[HealthCheck.too_slow])


@settings(SETTINGS, max_examples=10)
@given(random_models.cases())
def test_every_random_model_compiles_and_its_stages_generate(case: Case) -> None:
    model = random_models.build(case.model)
    program = compile_case(case, model)
    plan = program.plan
    pins = case.constraints()
    assert (plan.mesh.pp, plan.mesh.dp, plan.mesh.tp) == (pins["pp"], pins["dp"], pins["tp"])
    if case.mesh == "pp2":
        assert plan.schedule == case.schedule
    if case.sequence_parallel:
        assert plan.sequence_parallel
    validate_plan(program.problem, plan)
    code = program.code()
    assert len(code) == sum(len(stage.runs) or 1 for stage in plan.stages)  # virtual ones
    for source in code.values():
        compile(source, "<stage>", "exec")  # the emitted code is Python
    # In-place ops nobody reads are still in the program.
    for op in {b.in_place for b in case.model.blocks} - {"none", "ReLU(inplace=True)"}:
        assert any(f".{op}(" in source or f"{op}." in source for source in code.values()), op


@settings(SETTINGS, max_examples=6)
@given(random_models.model_specs())
def test_every_random_model_trains_like_eager_on_one_device(spec) -> None:
    """One device, two microbatches: the traced, lowered program against the model."""
    case = Case(model=spec, mesh="dp2")  # only the data and the spec are read here
    model = random_models.build(spec)
    reference = random_models.build(spec)
    program = partc.compile(model, (random_models.batch(case, 0)[0],), loss_fn=F.mse_loss,
                            example_target=random_models.batch(case, 0)[1],
                            budget=partc.DeviceBudget(num_devices=1, device="CPU"),
                            train=partc.TrainSpec(global_batch_size=random_models.BATCH),
                            constraints=partc.Constraints(num_microbatches=2))
    module = program.build()
    try:
        x, y = random_models.batch(case, 1)
        loss = module.forward_backward(x, target=y)
        expected = sum(F.mse_loss(reference(xs), ys) / 2
                       for xs, ys in zip(x.chunk(2), y.chunk(2)))
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
        grads = dict(reference.named_parameters(remove_duplicate=False))
        for name, param in module.named_parameters():
            torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-5, atol=1e-6,
                                       msg=name)
    finally:
        module.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
