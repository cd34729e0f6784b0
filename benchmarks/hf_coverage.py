"""Which Hugging Face model families partc traces, plans and trains like one process.

For every family of ``tests/hf_families.py`` (tiny configs of the installed transformers):

- trace: torch.fx / torch.export of the model and its loss, one process;
- plan pp2 / plan tp2: ``partc.compile`` pinned to two pipeline stages / a
  tensor-parallel pair on a 2-process CPU budget;
- parity pp2 / parity tp2: that program trained 3 SGD steps under ``torchrun`` with
  gloo on 2 processes, against the model trained on one process: every loss and every
  parameter within 1e-5 relative (against the parameter's norm, floored at 1e-3);
- parity pp2 zbv: the same under the zero-bubble "V" schedule (two virtual stages per
  rank, backward split into input and weight gradients).

A parameter's tolerance is 1e-5 or, for a family whose training amplifies rounding
more, ``FLOOR_FACTOR`` times its own noise floor (:func:`noise_floor`: the one-process
run in fp32 against the same run in fp64, the largest parameter error), whichever is
larger: two fp32 programs that sum in another order are each about that far from the
exact step, so up to about twice it from each other.

A failed cell shows the first line of its error. Prints a Markdown table and how many
families pass each column; ``--write`` also writes the families' rows into the table in
docs/guide.md between its coverage markers, keeping the other families' rows, so the
table can be made a few families at a time.

    python benchmarks/hf_coverage.py [--families llama,opt] [--write]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tests import hf_families  # noqa: E402
from tests.runtime import worker  # noqa: E402

COLUMNS = ["trace", "plan pp2", "plan tp2", "parity pp2", "parity tp2", "parity pp2 zbv"]
PARITY = {"parity pp2": "pp2", "parity tp2": "tp2", "parity pp2 zbv": "pp2-zbv"}
RTOL = 1e-5
# How many of a family's noise floors (fp32 against fp64, one process) a parameter may be
# off by: two fp32 runs each about a floor from the exact step, and a margin as wide for
# another rounding pattern (Gemma 4's first key projection, three steps on other batches:
# 8.2e-6 from fp64, and 1.9e-5 once its initial weights were moved by 1e-7 relative,
# 2.3 floors; on the worker's batches its floor is 1.6e-5, its tp2 run 1.5e-5 off).
FLOOR_FACTOR = 4
MARKERS = ("<!-- hf-coverage:start -->", "<!-- hf-coverage:end -->")


def first_line(error: str) -> str:
    line = next((s for s in str(error).splitlines() if s.strip()), str(error))
    return line.strip()[:160]


def one_process(family: str) -> dict[str, str]:
    """trace / plan pp2 / plan tp2 in this process: "ok" or the first line of the error."""
    from partc.passes.trace import trace

    cells: dict[str, str] = {}
    spec = hf_families.FAMILIES[family]
    torch.manual_seed(0)
    model = spec.build()
    case = worker.CASES[f"hf-{family}-pp2"]
    inputs, _ = worker.batch(case, model, 0)
    try:
        trace(model, inputs)
        cells["trace"] = "ok"
    except Exception as error:  # recorded in the table
        cells["trace"] = f"{type(error).__name__}: {first_line(error)}"
    for mode in ("pp2", "tp2"):
        try:
            worker.compile_case(worker.CASES[f"hf-{family}-{mode}"], model, 2)
            cells[f"plan {mode}"] = "ok"
        except Exception as error:
            cells[f"plan {mode}"] = f"{type(error).__name__}: {first_line(error)}"
    return cells


def noise_floor(family: str) -> float:
    """The largest relative parameter error (as the worker measures it) between the
    family's one-process training (the worker's model, batches, steps and optimizer) in
    fp32 and the same in fp64: how far rounding alone moves this family's parameters in
    those steps. Where the model computes parts in fp32 whatever its dtype (rotary
    tables, norms), the fp64 run rounds there too, so the floor is if anything low."""
    case = worker.CASES[f"hf-{family}-tp2"]
    torch.manual_seed(0)
    model = hf_families.FAMILIES[family].build()
    trained = []
    for dtype in (torch.float32, torch.float64):
        trainee = copy.deepcopy(model).to(dtype)
        opt = worker.optimizer(trainee.parameters())
        for step in range(worker.STEPS):
            x, y = worker.batch(case, model, step)
            x = [t.to(dtype) if t.is_floating_point() else t for t in x]
            y = y.to(dtype) if y.is_floating_point() else y
            case.loss_fn(trainee(*x), y).backward()
            opt.step()
            opt.zero_grad()
        trained.append(dict(trainee.named_parameters()))
    single, double = trained
    return max(((single[k].double() - v).norm() / max(v.norm().item(), 1e-3)).item()
               for k, v in double.items())


def parity(family: str, out: Path) -> dict[str, str]:
    """Train the family's pp2, tp2 and pp2-zbv cases, each in its own torchrun on 2
    processes (a rank that dies in one case would otherwise fail the others), each held
    to the family's parameter tolerance (:func:`noise_floor`)."""
    try:
        floor = noise_floor(family)
    except Exception as error:  # noqa: BLE001 - the fixed tolerance then
        print(f"{family}: no noise floor ({first_line(error)}); parameters held to {RTOL}")
        floor = 0.0
    return {column: _parity_run(f"hf-{family}-{mode}", out / mode, floor)
            for column, mode in PARITY.items()}


def _parity_run(case: str, out: Path, floor: float = 0.0) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", str(ROOT / "tests/runtime/worker.py"), str(out), case]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PARTC_WATCHDOG_S": "120"}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    except subprocess.TimeoutExpired:
        return "timed out after 900 s"
    files = [out / f"rank{r}.json" for r in range(2)]
    ranks = [json.loads(f.read_text()) for f in files if f.exists()]
    if done.returncode != 0 or len(ranks) < len(files):
        # A rank that wrote its results says why; else torchrun's last line.
        errors = [r[case]["error"] for r in ranks if "error" in r.get(case, {})]
        if errors:
            return first_line(errors[0])
        tail = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
        return f"torchrun exited {done.returncode}: {first_line(tail)}"
    return verdict([r[case] for r in ranks], floor)


def verdict(results: list[dict], floor: float = 0.0) -> str:
    """"ok" when every rank trained like one process, else what differed first: every
    loss within ``RTOL``, every parameter within ``RTOL`` or ``FLOOR_FACTOR`` times the
    family's noise ``floor`` (:func:`noise_floor`), whichever is larger."""
    tolerance = max(RTOL, FLOOR_FACTOR * floor)
    for rank, result in enumerate(results):
        if "error" in result:
            return first_line(result["error"])
        for step, (ours, ref) in enumerate(zip(result["losses"], result["ref_losses"])):
            if abs(ours - ref) > RTOL * abs(ref):
                return f"loss of step {step}: {ours:.7g} vs {ref:.7g} (rank {rank})"
        worst = max(result["param_errors"].items(), key=lambda kv: kv[1], default=("", 0.0))
        if worst[1] >= tolerance:
            return (f"parameter {worst[0]} off by {worst[1]:.1e} relative (rank {rank}; "
                    f"fp32 against fp64 in one process: {floor:.1e})")
    return "ok"


def table(rows: dict[str, dict[str, str]]) -> str:
    lines = ["| family | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for family, cells in rows.items():
        shown = ["✓" if cells.get(c) == "ok" else f"✗ {cells.get(c, 'not run')}"
                 .replace("|", "\\|") for c in COLUMNS]
        lines.append(f"| {family} | " + " | ".join(shown) + " |")
    passing = [sum(cells.get(c) == "ok" for cells in rows.values()) for c in COLUMNS]
    lines.append(f"| **{len(rows)} families** | "
                 + " | ".join(f"**{n}**" for n in passing) + " |")
    return "\n".join(lines)


def guide_rows(body: str) -> dict[str, dict[str, str]]:
    """The rows of the table docs/guide.md holds now, as ``table`` wrote them (a cell
    "✓" is "ok", "✗ why" is why; a column the table lacks is not in the row)."""
    start, end = MARKERS
    found = re.search(re.escape(start) + "(.*?)" + re.escape(end), body, re.S)
    lines = [line for line in (found.group(1) if found else "").splitlines()
             if line.startswith("|")]
    if len(lines) < 2:
        return {}
    header = _cells(lines[0])[1:]
    rows: dict[str, dict[str, str]] = {}
    for line in lines[2:]:
        family, *cells = _cells(line)
        if family.startswith("**"):
            continue
        rows[family] = {column: "ok" if cell == "✓" else cell.removeprefix("✗ ")
                        for column, cell in zip(header, cells)}
    return rows


def _cells(line: str) -> list[str]:
    parts = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [part.strip().replace("\\|", "|") for part in parts]


def write_table(rows: dict[str, dict[str, str]]) -> str:
    """Write ``rows`` into docs/guide.md over the rows of the same families, keeping the
    others (so the table can be made a few families at a time); returns the table."""
    guide = ROOT / "docs" / "guide.md"
    start, end = MARKERS
    body = guide.read_text()
    if start not in body:
        raise SystemExit(f"docs/guide.md has no {start} marker")
    merged = {**guide_rows(body), **rows}
    order = list(hf_families.FAMILIES)
    merged = dict(sorted(merged.items(),
                         key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))
    text = table(merged)
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    guide.write_text(pattern.sub(lambda _: f"{start}\n{text}\n{end}", body))
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", help="comma-separated (default: all)")
    parser.add_argument("--write", action="store_true",
                        help="write these families' rows into docs/guide.md's table, "
                             "keeping the other families' rows")
    args = parser.parse_args()
    families = args.families.split(",") if args.families else list(hf_families.FAMILIES)
    unknown = sorted(set(families) - set(hf_families.FAMILIES))
    if unknown:
        raise SystemExit(f"unknown families {unknown}; known: {sorted(hf_families.FAMILIES)}")
    warnings.filterwarnings("ignore")
    rows: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            began = time.perf_counter()
            cells = one_process(family)
            cells.update(parity(family, Path(tmp) / family))
            rows[family] = cells
            print(f"{family}: {time.perf_counter() - began:.0f} s  "
                  + "  ".join(f"{c}={'ok' if cells[c] == 'ok' else 'FAIL'}" for c in COLUMNS),
                  flush=True)
    text = table(rows)
    print()
    print(text)
    if args.write:
        merged = write_table(rows)
        if merged != text:
            print("\ndocs/guide.md now holds (the other families' rows kept):\n")
            print(merged)


if __name__ == "__main__":
    main()
