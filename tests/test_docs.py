"""docs/architecture.md held to the code: its pass tables are the pipeline's lists, in
order, each pass in the file the table names; its list of process-wide state is what the
source holds (tests/test_architecture.py finds the state)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from partc.passes import pipeline
from partc.passes.context import Lowering

from tests.test_architecture import process_wide_state

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()

# Every optional pass on: the lists' longest form, which the tables show (an optional
# pass in brackets).
_EVERYTHING = Lowering(stages=(), recompute={}, tp=2, fsdp_units=True, attention="fused",
                       mixed=True, ep=2, cp=2, fp8_linears=("w.weight",))
LISTS = {
    "analysis": pipeline.analysis_passes("fused", mixed=True),
    "tp measurement": pipeline.tp_measurement_passes(),
    "lowering": pipeline.lowering_passes(_EVERYTHING),
    "stage": pipeline.stage_passes(_EVERYTHING),
}


def _section(title: str) -> str:
    match = re.search(rf"^## \d+\. {re.escape(title)}\n(.*?)(?=^## )", DOC, re.M | re.S)
    assert match, f"docs/architecture.md has no section {title!r}"
    return match.group(1)


def _table_rows(section: str) -> list[list[str]]:
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("|")]
    return [row for row in rows[2:]]   # past the header and its rule


def _documented_passes() -> dict[str, list[tuple[str, str]]]:
    """Each list's (pass, file) rows in order; a row naming several passes that are
    described above (no file) gives each with an empty file."""
    lists: dict[str, list[tuple[str, str]]] = {}
    current = None
    for row in _table_rows(_section("The pass lists")):
        current = row[0] or current
        names = re.findall(r"`(\w+)`", row[1])   # italic steps (*split*) are no Pass
        file = re.findall(r"`([\w/]+\.py)`", row[2])
        for name in names:
            lists.setdefault(current, []).append((name, file[0] if len(names) == 1 and file
                                                  else ""))
    return lists


def test_the_pass_tables_are_the_pipeline_lists():
    documented = _documented_passes()
    for name, passes in LISTS.items():
        assert [p for p, _ in documented.get(name, [])] == [p.name for p in passes], (
            f"docs/architecture.md's {name!r} list differs from passes/pipeline.py's")


def test_each_documented_pass_lives_in_the_file_named():
    documented = _documented_passes()
    for name, passes in LISTS.items():
        for (pass_name, file), graph_pass in zip(documented.get(name, []), passes):
            if not file:
                continue
            source = Path(inspect.getsourcefile(graph_pass.run)).resolve()
            assert source == (ROOT / file).resolve(), (
                f"docs/architecture.md puts {pass_name} in {file}; it is in "
                f"{source.relative_to(ROOT)}")


def test_every_file_the_doc_names_exists():
    for path in sorted(set(re.findall(r"`((?:partc|passes|tests|benchmarks|docs)/[\w/]+\.\w+)`",
                                      DOC))):
        assert (ROOT / path).exists(), f"docs/architecture.md names {path}, which is gone"


def test_the_process_wide_state_is_listed_once():
    listed = [tuple(cell.strip("`") for cell in row[:2])
              for row in _table_rows(_section("Process-wide state"))]
    assert len(listed) == len(set(listed)), "a state listed twice"
    assert sorted(listed) == sorted(process_wide_state()), (
        "docs/architecture.md's process-wide state differs from the source's: "
        f"listed {sorted(listed)}, found {sorted(process_wide_state())}")


def test_the_readme_starts_with_the_two_commands_and_stays_short():
    """The README: the two commands (.ci/run runs the second), a tour, pointers to docs/;
    the rest lives in docs/guide.md and docs/gpu.md."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0]
    assert ci in first_block and "torchrun --standalone --nproc-per-node=2 -m partc train" \
        in first_block
    assert len(readme.split()) < 800
    for doc in ("docs/guide.md", "docs/gpu.md", "docs/calibrate.md", "docs/architecture.md"):
        assert f"`{doc}`" in readme and (ROOT / doc).is_file(), doc


def test_the_guide_lists_the_exit_statuses_the_launcher_uses():
    from partc.cli.failures import EXIT_STATUSES

    guide = (ROOT / "docs" / "guide.md").read_text()
    section = guide.split("## How a failure ends\n", 1)[1].split("\n## ", 1)[0]
    rows = [row[:2] for row in _table_rows(section)]
    assert [(int(code), kind) for code, kind in rows] == list(EXIT_STATUSES)


def test_the_gpu_guide_names_the_nccl_settings_and_a_slurm_script():
    gpu = (ROOT / "docs" / "gpu.md").read_text()
    for name in ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_DEBUG",
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING", "#SBATCH", "srun", "--rdzv-endpoint"):
        assert name in gpu, name
