"""Every pipeline schedule against one process: the parity table, and step times.

    python benchmarks/schedule_parity.py                 # the whole matrix
    python benchmarks/schedule_parity.py --models gpt --combinations plain dp2
    python benchmarks/schedule_parity.py --timing 10     # median step time per schedule

Each case trains 3 SGD steps with partc (torchrun, gloo on CPU; pp=2 ranks, two virtual
stages each where the schedule has them) and the same model on one process, fp32, with
the global gradient norm clipped: ``loss`` is the largest relative difference of the
step losses, ``param`` the largest relative difference of a parameter after the steps,
``norm/eval`` that of the clipped norms and of ``evaluate()``'s loss after training,
over every rank. A case passes at 1e-5 on all three (and the whole model gathered and
loaded back unchanged); a combination the runtime refuses is printed with its reason.

``--timing N`` instead measures the median of N steps (after one warm-up) of the sample
GPT (8 blocks, 512 wide) for each schedule on 4 CPU processes (pp=2 x dp=2, one thread each).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.runtime.schedule_worker import (COMBINATIONS, MODELS, SCHEDULES,  # noqa: E402
                                           processes)

WORKER = ROOT / "tests" / "runtime" / "schedule_worker.py"
RTOL = 1e-5


def launch(nproc: int, cases: list[str], out: Path, env: dict | None = None) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", str(WORKER), str(out), *cases]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PARTC_TIMEOUT_S": "300",
           "PYTHONPATH": str(ROOT), **(env or {})}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    files = [out / f"rank{r}.json" for r in range(nproc)]
    if done.returncode != 0 or not all(f.exists() for f in files):
        raise SystemExit(f"torchrun exited with {done.returncode}:\n{done.stderr[-4000:]}")
    return [json.loads(f.read_text()) for f in files]


def summarise(ranks: list[dict], name: str) -> dict:
    """One row: pass / refused / error, and the worst loss and parameter differences."""
    seen = [results[name] for results in ranks]
    if "skipped" in seen[0]:
        return {"status": "skipped", "why": seen[0]["skipped"]}
    refused = next((s["refused"] for s in seen if "refused" in s), None)
    if refused is not None:
        return {"status": "refused", "why": refused}
    errors = [s["error"] for s in seen if "error" in s]
    if errors:
        return {"status": "error", "why": errors[0].splitlines()[0][:200]}
    loss = max(abs(a - b) / max(abs(b), 1e-12) for s in seen
               for a, b in zip(s["losses"], s["ref_losses"]))
    param = max((e for s in seen for e in s["param_errors"].values()), default=0.0)
    # The clipped gradient norm of every step, and the loss of evaluate() after them.
    other = max([abs(a - b) / max(abs(b), 1e-12) for s in seen
                 for a, b in zip(s["grad_norms"], s["ref_grad_norms"])]
                + [abs(s["eval_loss"] - s["ref_eval_loss"]) / abs(s["ref_eval_loss"])
                   for s in seen])
    ok = max(loss, param, other) <= RTOL and all(s["reloaded_unchanged"] for s in seen)
    return {"status": "pass" if ok else "FAIL", "loss": loss, "param": param,
            "other": other}


def parity(models: list[str], combinations: list[str], schedules: list[str]) -> None:
    cases = [f"{m}-{s}-{c}" for m in models for s in schedules for c in combinations]
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in sorted({processes(case) for case in cases}):
            mine = [case for case in cases if processes(case) == nproc]
            ranks = launch(nproc, mine, Path(tmp) / str(nproc))
            rows.update({case: summarise(ranks, case) for case in mine})
    print(f"{'schedule':<25} {'model':<6} {'combination':<13} {'max loss diff':>14} "
          f"{'max param diff':>15} {'norm/eval diff':>15}  result")
    for schedule in schedules:
        for model in models:
            for combination in combinations:
                row = rows[f"{model}-{schedule}-{combination}"]
                if row["status"] in ("pass", "FAIL"):
                    print(f"{schedule:<25} {model:<6} {combination:<13} {row['loss']:>14.2e} "
                          f"{row['param']:>15.2e} {row['other']:>15.2e}  {row['status']}")
                else:
                    print(f"{schedule:<25} {model:<6} {combination:<13} {'-':>14} {'-':>15} "
                          f"{'-':>15}  {row['status']}: {row['why']}")
    counts = {status: sum(r["status"] == status for r in rows.values())
              for status in ("pass", "refused", "skipped", "FAIL", "error")}
    print(f"\n{len(rows)} cases: " + ", ".join(f"{n} {s}" for s, n in counts.items()))


def timing(steps: int, schedules: list[str]) -> None:
    cases = [f"gpt8-{s}-dp2" for s in schedules]
    with tempfile.TemporaryDirectory() as tmp:
        ranks = launch(4, cases, Path(tmp), env={"PARTC_SCHEDULE_TIMING_STEPS": str(steps)})
    base = ranks[0]["gpt8-1f1b-dp2"]["median_s"] if "1f1b" in schedules else None
    print(f"{'schedule':<25} {'median step (s)':>16} {'vs 1f1b':>8}   "
          f"(sample GPT, 8 blocks of 512; pp=2 x dp=2 CPU processes, {steps} steps)")
    for schedule, case in zip(schedules, cases):
        seen = ranks[0][case]
        if "error" in seen:
            print(f"{schedule:<25} error: {seen['error'][:120]}")
            continue
        median = max(r[case]["median_s"] for r in ranks)
        ratio = f"{median / base:.2f}" if base else "-"
        print(f"{schedule:<25} {median:>16.4f} {ratio:>8}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--combinations", nargs="+", default=list(COMBINATIONS),
                        choices=list(COMBINATIONS))
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES),
                        choices=list(SCHEDULES))
    parser.add_argument("--timing", type=int, default=0, metavar="STEPS",
                        help="median step time per schedule instead of parity")
    args = parser.parse_args()
    if args.timing:
        timing(args.timing, args.schedules)
    else:
        parity(args.models, args.combinations, args.schedules)


if __name__ == "__main__":
    main()
