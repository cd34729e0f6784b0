"""The emitted code of the sample GPT, kept as golden copies in tests/golden/.

After a deliberate change to code generation, regenerate them with
``PARTC_UPDATE_GOLDEN=1 python -m pytest tests/test_codegen.py`` and review the diff.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import partc
from samples.gpt import example_inputs, gpt_tiny, loss_fn

GOLDEN = Path(__file__).with_name("golden") / "gpt_tiny_pp2"


@pytest.fixture(scope="module")
def code() -> dict[str, str]:
    torch.manual_seed(0)
    model = gpt_tiny()
    ids, targets = example_inputs(model, batch=8, seq=16)
    program = partc.compile(
        model, (ids,), loss_fn=loss_fn, example_target=targets,
        budget=partc.DeviceBudget(num_devices=2, device="CPU"),
        train=partc.TrainSpec(global_batch_size=8),
        constraints=partc.Constraints(pp=2, num_microbatches=4, schedule="1f1b",
                                      recompute={"blocks.0": "full", "blocks.1": "selective"}))
    return program.code()


def test_emitted_code_matches_golden(code):
    if os.environ.get("PARTC_UPDATE_GOLDEN") == "1":
        GOLDEN.mkdir(parents=True, exist_ok=True)
        for name, source in code.items():
            (GOLDEN / name).write_text(source)
    assert sorted(code) == sorted(p.name for p in GOLDEN.glob("stage_*.py"))
    for name, source in code.items():
        assert source == (GOLDEN / name).read_text(), f"{name} differs from tests/golden"


def test_header_summarises_the_plan(code):
    first, last = code["stage_0.py"], code["stage_1.py"]
    assert "# Stage 0 of 2 (pp index 0), on rank 0." in first
    assert "# Schedule: 1f1b, 4 microbatches of 2 (global batch 8)." in first
    assert "# Recompute: blocks.0 (full)." in first
    assert "# Inputs: idx int64[2, 16]." in first
    assert "# Sends to stage 1, per microbatch: " in first and "float32[2, 16, 64]" in first
    assert "tied: tok_emb.weight = lm_head.weight with stage 1" in first
    assert "# Receives from stage 0, per microbatch: " in last
    assert "# Returns the model's output for the loss: " in last and "float32[2, 16, 128]" in last
    assert "# layer blocks.1 (recompute: selective)" in last


def test_emitted_code_compiles_and_calls_recompute(code):
    for name, source in code.items():
        compile(source, name, "exec")  # valid Python
    call = "partc_runtime_recompute_checkpoint_layer(recompute_blocks_0, 'full'"
    assert call in code["stage_0.py"]
    assert "from partc.runtime.recompute import checkpoint_layer as " \
           "partc_runtime_recompute_checkpoint_layer" in code["stage_0.py"]
