"""The command line: answers without torch, checks before the model, a flag per pin,
progress on stderr, the report and train subcommands."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import types
from importlib.metadata import version
from pathlib import Path

import pytest

import partc
from partc import progress
from partc.cli.choices import REPORT_FORMATS
from partc.cli.main import BUDGET_FLAGS, PIN_FLAGS, TRAIN_FLAGS, _parser, main
from partc.cli.main import _budget, _constraints, _top_level_names

ROOT = Path(__file__).resolve().parents[1]
FACTORY = ("import torch\n"
           "from samples.gpt import gpt_tiny, loss_fn\n"
           "def make():\n"
           # A batch no other test plans: the session's plan cache has not seen it.
           "    return gpt_tiny(), (torch.zeros(6, 16, dtype=torch.long),), loss_fn\n"
           "def never():\n"
           "    raise SystemExit('the model was built')\n")


@pytest.fixture(scope="module")
def factory(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "work.py"
    path.write_text(FACTORY)
    return path


def test_help_and_version_import_no_torch():
    script = ("import sys\n"
              "from partc.cli.main import main\n"
              "for argv in (['--help'], ['plan', '--help'], ['report', '--help'], "
              "['--version']):\n"
              "    try:\n"
              "        main(argv)\n"
              "    except SystemExit as done:\n"
              "        assert done.code == 0, (argv, done.code)\n"
              "assert main(['train', '--help']) == 0\n"
              "assert main(['train', 'x.py:f', '--steps', '1', '--memory', '4G']) == 2\n"
              "bad = ['plan', 'x.py:f', '--devices', '2', '--device', 'H100-80G']\n"
              "assert main(bad) == 2\n"
              "heavy = [m for m in ('torch', 'ortools', 'networkx') if m in sys.modules]\n"
              "assert not heavy, heavy\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: partc plan" in done.stdout and "GiB" in done.stdout
    assert f"partc {version('partc')}" in done.stdout
    assert "did you mean 'H100-80GB'" in done.stderr
    assert "usage: partc train" in done.stdout and "--checkpoint-dir" in done.stdout
    assert "partc train: error: argument --memory: '4G' is ambiguous" in done.stderr


def test_public_names_are_there_without_importing_them_first():
    assert set(partc.__all__) <= set(dir(partc))
    for name in partc.__all__:
        assert getattr(partc, name) is not None
    from partc import Constraints, compile
    assert Constraints is partc.spec.Constraints and compile is partc.compiler.compile
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        partc.nothing


@pytest.mark.parametrize("cls, flags", [(partc.Constraints, PIN_FLAGS),
                                        (partc.TrainSpec, TRAIN_FLAGS),
                                        (partc.DeviceBudget, BUDGET_FLAGS)])
def test_every_field_has_a_flag(cls, flags):
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    assert fields == set(flags), f"{cls.__name__} fields without a flag: " \
                                 f"{sorted(fields - set(flags))}"
    plan = _parser()._subparsers._group_actions[0].choices["plan"]
    known = {option for action in plan._actions for option in action.option_strings}
    assert set(flags.values()) <= known


def test_report_formats_are_the_renderers():
    from partc.report.text import FORMATS
    assert FORMATS == REPORT_FORMATS


def _args(*argv: str):
    return _parser().parse_args(["plan", "x.py:f", *argv])


def test_flags_reach_the_pins_and_the_budget():
    args = _args("--devices", "8", "--pp", "2", "--dp", "2", "--tp", "2",
                 "--no-sequence-parallel", "--tp-objective", "memory", "--stage", "a,b",
                 "--stage", "c", "--recompute-layer", "a=full", "--recompute-layer",
                 "c=selective", "--microbatches", "4", "--micro-batch", "2",
                 "--schedule", "gpipe", "--zero", "1", "--cp", "2", "--cp-kind", "ring")
    assert _constraints(args) == partc.Constraints(
        pp=2, dp=2, tp=2, sequence_parallel=False, tp_objective="memory",
        stages=(("a", "b"), ("c",)), recompute={"a": "full", "c": "selective"},
        num_microbatches=4, micro_batch_size=2, schedule="gpipe", zero_stage=1, cp=2,
        cp_kind="ring")
    assert _constraints(_args("--devices", "2", "--recompute", "full")).recompute == "full"
    budget = _budget(_args("--devices", "2", "--device", "a100-80gb", "--memory", "40GiB,40GB",
                           "--hbm-bandwidth", "1TB/s", "--peak-tflops", "100",
                           "--link-latency", "1e-5"))
    assert budget.device == "A100-80GB" and budget.memory_bytes == (40 * 2**30, 40 * 10**9)
    assert budget.figures.hbm_bandwidth == 1e12 and budget.figures.link_latency_s == 1e-5
    assert budget.peak_flops_for(partc.TrainSpec(global_batch_size=1).dtype) == 100e12


@pytest.mark.parametrize("argv, says", [
    (["--device", "H100-80G"], "did you mean 'H100-80GB'"),
    (["--device", "a100"], "a100 is ambiguous: A100-40GB, A100-80GB"),
    (["--memory", "40G"], "'40G' is ambiguous: write '40GiB'"),
    (["--memory", "40Gb"], "reads as bits"),
    (["--memory", "40GiB,40GiB,40GiB"], "3 sizes for 2 devices"),
    (["--hbm-bandwidth", "fast"], "cannot read 'fast' as a size"),
    (["--pp", "0"], "argument --pp: must be a positive whole number, got '0'"),
    (["--tp", "two"], "argument --tp: must be a positive whole number, got 'two'"),
    (["--flops-efficiency", "1.5"], "must be a number in (0, 1], got '1.5'"),
    (["--recompute-layer", "h.0"], "write LAYER=MODE"),
    (["--recompute", "full", "--recompute-layer", "h.0=none"], "not allowed with"),
    (["--global-batch", "6", "--micro-batch", "4"], "does not divide"),
    (["--profile", "missing.json"], "no device profile at missing.json"),
    (["--tp", "1", "--sequence-parallel"], "sequence parallelism needs tensor parallelism"),
    (["--cp-kind", "zigzag"], "argument --cp-kind: invalid choice: 'zigzag'"),
    (["--cp", "1", "--cp-kind", "ring"], "cp_kind='ring' needs context parallelism"),
    (["--dp", "1", "--cp", "1", "--zero", "3"], "dp=1 and cp=1 were pinned"),
    (["--pp", "3", "--stage", "a", "--stage", "b"], "pp=3 but 2 stages"),
])
def test_bad_arguments_fail_before_the_model_is_built(factory, capsys, argv, says):
    code = main(["plan", f"{factory}:never", "--devices", "2", *argv])
    err = capsys.readouterr().err
    assert code == 2 and says in err and "the model was built" not in err
    assert err.count("\n") == 1, err


@pytest.mark.parametrize("target, says", [
    ("nowhere.py:make", "no such file: nowhere.py"),
    ("{factory}", "expected path/to/file.py:factory"),
    ("{factory}:mkae", "has no function 'mkae' (did you mean 'make'?)"),
])
def test_the_factory_is_checked_before_it_runs(factory, capsys, target, says):
    code = main(["plan", target.format(factory=factory), "--devices", "2"])
    assert code == 2 and says in capsys.readouterr().err


def test_names_a_module_may_bind_unseen():
    import ast

    def read(source):
        return _top_level_names(ast.parse(source).body)

    assert read("import a.b as c\nfrom d import e\nif x:\n    def f(): pass\n"
                "try:\n    g = 1\nexcept E:\n    h: int = 2\n") == ({"c", "e", "f", "g", "h"},
                                                                  False)
    assert read("from m import *")[1] and read("globals()['f'] = g")[1]
    assert read("def __getattr__(name): pass")[1]


@pytest.fixture(scope="module")
def planned(factory, tmp_path_factory):
    """``partc plan --progress`` on a tiny GPT: its exit code, what it wrote to stdout and
    stderr, the progress events it drew, the --out directory."""
    from partc.cli.main import _Bars

    out, captured, events = tmp_path_factory.mktemp("planned"), {}, []

    class Recording(_Bars):
        def __call__(self, event):
            events.append(event)
            super().__call__(event)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("partc.cli.main._Bars", Recording)
        patch.setattr(sys, "stderr", _Capture(captured, "err"))
        patch.setattr(sys, "stdout", _Capture(captured, "out"))
        code = main(["plan", f"{factory}:make", "--devices", "2", "--device", "CPU",
                     "--progress", "--format", "json", "--out", str(out)])
    return code, captured, events, out


class _Capture:
    def __init__(self, into: dict, key: str):
        self.into, self.key = into, key
        into[key] = ""

    def write(self, text: str) -> int:
        self.into[self.key] += text
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def test_plan_draws_progress_and_prints_the_report(planned):
    code, captured, events, out = planned
    assert code == 0
    assert json.loads(captured["out"]) == json.loads((out / "plan.json").read_text())
    assert "wrote" in captured["err"]
    phases = {}
    for event in events:
        phases.setdefault(event.phase, []).append(event)
    # "schedules" where the chosen plan has a pipeline to choose a schedule for.
    assert {"trace", "tensor parallelism", "search"} <= set(phases) <= {
        "trace", "tensor parallelism", "search", "schedules"}
    for phase, seen in phases.items():
        assert f"{phase}: " in captured["err"]
        assert seen[0].done == 0 and seen[-1].done == seen[-1].total > 0
        assert all(a.done <= b.done for a, b in zip(seen, seen[1:]))
    last = phases["search"][-1]
    assert last.incumbent_s > 0 and 0 < last.bound_s <= last.incumbent_s
    assert 0 <= last.gap < 1
    assert [e.detail for e in phases["tensor parallelism"][:3]] == [
        "tp=2, time first: choosing", "tp=2, time first: measuring",
        "tp=2, memory first: choosing"]
    progress.update("search", 0, 1)   # outside partc plan: nobody listens, nothing fails


def test_the_search_bar_shows_the_incumbent_and_the_gap():
    from partc.cli.main import _postfix

    event = progress.Event(phase="search", done=3, total=9, detail="pp=2 dp=1 tp=1",
                           incumbent_s=0.1, bound_s=0.08)
    assert _postfix(event) == "pp=2 dp=1 tp=1, best 100.00 ms, bound 80.00 ms, gap 20.0%"


def test_report_renders_a_saved_plan(planned, capsys, tmp_path):
    from partc.report.text import FORMATS

    out = planned[3]
    assert main(["report", str(out), "--format", "markdown"]) == 0
    assert capsys.readouterr().out == (out / "report.md").read_text() + "\n"
    for format in FORMATS:
        target = tmp_path / f"report.{format}"
        assert main(["report", str(out / "plan.json"), "--format", format,
                     "--out", str(target)]) == 0
        assert target.read_text().strip()
        if format == "html":
            assert "<html" in target.read_text().lower()
    (tmp_path / "bad.json").write_text("{}")
    assert main(["report", str(tmp_path / "bad.json")]) == 2
    assert "PlanFileError" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert "holds no plan.json" in capsys.readouterr().err


def test_train_goes_to_the_launcher(monkeypatch, capsys):
    seen = []
    launcher = types.ModuleType("partc.cli.launcher")
    launcher.main = lambda argv: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, "partc.cli.launcher", launcher)
    assert main(["train", "x.py:f", "--steps", "3", "--help"]) == 7
    assert seen == [["x.py:f", "--steps", "3", "--help"]]
    monkeypatch.setitem(sys.modules, "partc.cli.launcher", None)   # as if it were missing
    assert main(["train", "--help"]) == 2
    assert "has no launcher" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["plan", "train"])
def test_help_is_short_with_examples_and_help_all_has_every_flag(capsys, command):
    """``--help``: the common flags and examples, in under 80 lines; ``--help-all``: every
    flag, each cost-model figure's among them. Every flag parses either way."""
    def shown(flag: str) -> str:
        if command == "train":
            assert main(["train", flag]) == 0
        else:
            with pytest.raises(SystemExit) as done:
                main([command, flag])
            assert done.value.code == 0
        return capsys.readouterr().out

    short, everything = shown("--help"), shown("--help-all")
    assert len(short.splitlines()) < 80 and "examples:" in short and "--help-all" in short
    figures = [flag for name, flag in BUDGET_FLAGS.items()
               if name not in ("num_devices", "device", "profile", "memory")]
    assert not [flag for flag in figures if flag in short]
    assert not [flag for flag in figures if flag not in everything]
    default = "default CPU where torch sees no GPU" if command == "train" else \
        "default H100-80GB"
    assert default in short and default in everything


def test_log_lines_name_the_library_they_come_from():
    """Seen before: ``partc train -q`` printed "partc: Failed to load .../torchao/..._C.so"
    and "partc: Warning: Detected no triton": torchao's import warnings under partc's name.
    A line is its source's (``torchao: ...``); under -q only partc's lines and other
    libraries' errors pass."""
    import io
    import logging

    from partc.cli.main import stderr_handler

    def shown(quiet: bool) -> list[str]:
        stream = io.StringIO()
        handler = stderr_handler(quiet, stream)
        for name, level in (("torchao.kernel", logging.WARNING),
                            ("partc.runtime", logging.WARNING), ("torchao", logging.ERROR)):
            record = logging.LogRecord(name, level, __file__, 1, "said %s", ("this",), None)
            if handler.filter(record):
                handler.emit(record)
        return stream.getvalue().splitlines()

    assert shown(False) == ["torchao: said this", "partc: said this", "torchao: said this"]
    assert shown(True) == ["partc: said this", "torchao: said this"]
