"""The emitted stage code, kept as golden copies in tests/golden/<case>/stage_<k>.py.

Cases: the sample GPT at pp=2 with recompute, at tp=2 with sequence parallelism, under
ZeRO-3 over dp=2, and a Hugging Face Llama (traced by torch.export) at pp=2.

After a deliberate change to code generation (or to what a pass puts in the graph),
regenerate every golden with one command and review the diff before committing::

    PARTC_UPDATE_GOLDEN=1 python -m pytest tests/passes/test_codegen.py -p no:cacheprovider

(``-k tp2`` and the like regenerate one case), then run it again without the variable:
the checks on the files themselves are collected from the files on disk. The Llama case
prints the installed transformers' modelling code as torch.export traced it, so a
transformers or torch upgrade can change it too. Every golden file must also import on
its own, define its stage's class and use no undefined name (a pyflakes-like check below).
"""

from __future__ import annotations

import ast
import builtins
import difflib
import importlib.util
import os
import symtable
from pathlib import Path
from typing import Callable

import pytest
import torch

import partc
from samples.gpt import example_inputs, gpt_tiny, loss_fn
from tests import models

GOLDEN = Path(__file__).parents[1] / "golden"
UPDATE = os.environ.get("PARTC_UPDATE_GOLDEN") == "1"


def _gpt(**constraints) -> partc.Program:
    torch.manual_seed(0)
    model = gpt_tiny()
    ids, targets = example_inputs(model, batch=8, seq=16)
    return partc.compile(model, (ids,), loss_fn=loss_fn, example_target=targets,
                         budget=partc.DeviceBudget(num_devices=2, device="CPU"),
                         train=partc.TrainSpec(global_batch_size=8),
                         constraints=partc.Constraints(**constraints))


def _llama(**constraints) -> partc.Program:
    torch.manual_seed(0)
    ids = torch.zeros(8, 16, dtype=torch.long)
    return partc.compile(models.llama(n_layer=2), (ids,), loss_fn=models.causal_lm_loss,
                         example_target=ids,
                         budget=partc.DeviceBudget(num_devices=2, device="CPU"),
                         train=partc.TrainSpec(global_batch_size=8),
                         constraints=partc.Constraints(**constraints))


CASES: dict[str, Callable[[], partc.Program]] = {
    "gpt_tiny_pp2": lambda: _gpt(
        pp=2, num_microbatches=4, schedule="1f1b",
        recompute={"blocks.0": "full", "blocks.1": "selective"}),
    # tp_objective="memory": the fastest choice for so small a model shards nothing.
    "gpt_tiny_tp2_sp": lambda: _gpt(tp=2, sequence_parallel=True, tp_objective="memory",
                                    num_microbatches=2),
    "gpt_tiny_zero3": lambda: _gpt(dp=2, zero_stage=3, num_microbatches=2),
    "llama_tiny_pp2": lambda: _llama(pp=2, num_microbatches=4, schedule="1f1b",
                                     recompute={"model.layers.1": "selective"}),
}


@pytest.fixture(scope="module")
def emitted() -> Callable[[str], dict[str, str]]:
    """The code of a case, compiled once per test module."""
    done: dict[str, dict[str, str]] = {}

    def code(case: str) -> dict[str, str]:
        if case not in done:
            done[case] = CASES[case]().code()
        return done[case]

    return code


@pytest.mark.parametrize("case", sorted(CASES))
def test_emitted_code_matches_golden(emitted, case):
    code, folder = emitted(case), GOLDEN / case
    if UPDATE:
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("stage_*.py"):
            old.unlink()
        for name, source in code.items():
            (folder / name).write_text(source)
    assert sorted(code) == sorted(p.name for p in folder.glob("stage_*.py"))
    for name, source in code.items():
        golden = (folder / name).read_text()
        diff = "".join(difflib.unified_diff(
            golden.splitlines(keepends=True), source.splitlines(keepends=True),
            f"tests/golden/{case}/{name}", f"emitted {name}"))
        assert source == golden, f"{case}/{name} differs from its golden copy " \
            f"(PARTC_UPDATE_GOLDEN=1 regenerates it):\n{diff}"


GOLDEN_FILES = sorted(GOLDEN.glob("*/stage_*.py"))


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_golden_file_imports_and_defines_its_stage(path):
    spec = importlib.util.spec_from_file_location(f"golden_{path.parent.name}_{path.stem}",
                                                  path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    stage = getattr(module, f"Stage{path.stem.removeprefix('stage_')}")
    assert issubclass(stage, torch.nn.Module)


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_golden_file_names_only_what_it_defines(path):
    source = path.read_text()
    assert undefined_names(source, str(path)) == set()
    # Nothing of the machine that planned it, none of export's metadata assertions.
    assert "device(type=" not in source and "_assert_" not in source


def undefined_names(source: str, filename: str = "<emitted>") -> set[str]:
    """The names ``source`` reads but neither defines, imports nor gets from builtins,
    and any string annotation (pyflakes reads those as code too)."""
    top = symtable.symtable(source, filename, "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}
    defined |= set(dir(builtins))
    missing: set[str] = set()
    tables = [top]
    while tables:
        table = tables.pop()
        missing |= {s.get_name() for s in table.get_symbols()
                    if s.is_referenced() and s.is_global() and s.get_name() not in defined}
        tables += table.get_children()
    for node in ast.walk(ast.parse(source, filename)):
        annotation = getattr(node, "annotation", None)
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            missing.add(f"annotation {annotation.value!r}")
    return missing


def test_undefined_names_finds_what_pyflakes_would():
    source = 'import torch\n\nclass S(torch.nn.Module):\n    def forward(self, x: "f32[2]"):\n' \
             '        y: "f32[2]" = x + offset\n        return torch.relu(y), len(y)\n'
    assert undefined_names(source) == {"offset", "annotation 'f32[2]'"}


def test_pp2_header_summarises_the_plan(emitted):
    code = emitted("gpt_tiny_pp2")
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


def test_pp2_calls_recompute_and_shows_shapes_as_comments(emitted):
    code = emitted("gpt_tiny_pp2")
    call = "partc_runtime_recompute_checkpoint_layer(recompute_blocks_0, 'full'"
    assert call in code["stage_0.py"]
    assert "from partc.runtime.recompute import checkpoint_layer as " \
           "partc_runtime_recompute_checkpoint_layer" in code["stage_0.py"]
    assert "        ln_f_weight = self.ln_f.weight  # f32[64]\n" in code["stage_1.py"]
    assert "    def forward(self, add_2):\n        # add_2: f32[2, 16, 64]\n" in code["stage_1.py"]
    assert "wrap(" not in "".join(code.values())  # fx's retracing hook: refused in a class


def test_tp2_header_and_collectives(emitted):
    [source] = emitted("gpt_tiny_tp2_sp").values()
    assert "# Tensor parallel: tp=2, sequence parallel;" in source
    # Each layer that meets the other ranks reads the stage's group once and calls it.
    assert "        tp = self.tp\n" in source
    assert ".gather_from_tp(" in source and ".reduce_scatter_to_tp(" in source


def test_zero3_header(emitted):
    [source] = emitted("gpt_tiny_zero3").values()
    assert "# ZeRO-3: FSDP2 over 2 replicas, one unit per layer" in source
    assert "(global batch 8 over 2 replicas)" in source
    # Lowering made each block an FSDP unit; its code follows the stage's.
    assert 'getattr(self.blocks, "0")(' in source
    assert "# FSDP unit blocks.0:" in source and "class blocks_0(torch.nn.Module):" in source


def test_exported_model_reads_the_device_of_its_input(emitted):
    code = emitted("llama_tiny_pp2")
    first = code["stage_0.py"]
    assert "        input_device = input_ids.device\n" in first
    assert "device = input_device" in first
    assert "# layer model.layers.0" in first and "# layer model.rotary_emb" in first
    for source in code.values():
        assert undefined_names(source) == set()


def test_user_names_cannot_write_live_code():
    """A model name with a newline stays inside the header's comment, and a layer named
    as nn.Sequential names them ("0") gets a class name Python accepts."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8)
    program = partc.compile(model, (x,), loss_fn=lambda out, target: out.pow(2).mean(),
                            example_target=x, name="odd\nimport os  # <b>",
                            budget=partc.DeviceBudget(num_devices=2, device="CPU"),
                            train=partc.TrainSpec(global_batch_size=4),
                            constraints=partc.Constraints(dp=2, zero_stage=3))
    source = program.code()["stage_0.py"]
    assert "for odd\\nimport os  # <b> (model hash" in source
    assert "\nimport os" not in source and "class _0(torch.nn.Module):" in source
    tree = ast.parse(source)
    assert {type(s).__name__ for s in tree.body} <= {"Import", "ImportFrom", "ClassDef",
                                                     "Assign"}
    assert undefined_names(source) == set()


def test_emitted_code_that_would_run_is_refused():
    from passes.codegen import _check_only_definitions

    _check_only_definitions("import torch\ninf = float('inf')\nclass A:\n    pass\n", 0)
    with pytest.raises(partc.PartcError, match="stage 3 would run line 2 at import"):
        _check_only_definitions("import torch\nimport os; os.getcwd()\n", 3)
    with pytest.raises(partc.PartcError, match="stage 1 is not valid Python"):
        _check_only_definitions("class 0(torch.nn.Module):\n    pass\n", 1)


def test_rank_ranges_read_at_any_count():
    from passes.codegen import _group_lines, name_runs, rank_ranges

    assert rank_ranges([0, 1]) == "0, 1"
    assert rank_ranges(list(range(1024))) == "0-1023"
    assert rank_ranges(list(range(3, 1024, 4))) == "3-1023 step 4"
    assert rank_ranges([0, 1, 2, 5, 9, 13, 20]) == "0-2, 5-13 step 4, 20"
    assert _group_lines(list(range(128, 256)), dp=16, tp=8) == [
        "# Groups: tensor parallel, 8 consecutive ranks (128-135, ...); data parallel, "
        "the 16 ranks of one tp rank (128-248 step 8, ...)."]
    assert name_runs(["embed", "layers.0", "layers.1", "layers.2", "norm"]) == \
        "embed, layers.0 .. layers.2, norm"
    assert name_runs(["blocks.0", "blocks.1", "l1", "l3"]) == "blocks.0, blocks.1, l1, l3"


def test_a_large_plan_emits_short_files():
    """1,024 ranks in the header as one range; six like blocks under ZeRO-3 printed once."""
    torch.manual_seed(0)
    model = gpt_tiny(n_layer=6)
    ids, targets = example_inputs(model, batch=1024, seq=16)
    program = partc.compile(model, (ids,), loss_fn=loss_fn, example_target=targets,
                            budget=partc.DeviceBudget(num_devices=1024, device="CPU"),
                            train=partc.TrainSpec(global_batch_size=1024),
                            constraints=partc.Constraints(pp=1, dp=1024, zero_stage=3))
    source = program.code()["stage_0.py"]
    assert "on ranks 0-1023 (1,024 ranks)." in source
    assert max(len(line) for line in source.splitlines()[:20]) < 200
    assert source.count("class blocks_") == 1
    assert "# Layers: tok_emb, pos_emb, drop, blocks.0 .. blocks.5, ln_f, lm_head, loss." \
        in source
    assert "# The same code runs as FSDP units blocks.1 .. blocks.5 (5), each with its own " \
           "parameters.\nclass blocks_0(torch.nn.Module):" in source
    assert undefined_names(source) == set()
