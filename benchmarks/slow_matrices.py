"""The slow profile: every parity matrix the default suite samples one case per feature
from (``@pytest.mark.slow``), run file by file, with each file's outcome counts, wall
time and CPU time (its torchrun children included), then the totals.

    python benchmarks/slow_matrices.py [tests/runtime/test_zero.py ...] [-- PYTEST ARGS]

Without files: every test file holding a slow test. Each file runs in its own pytest
process (``-n 0``: one file, its launches one after another), so a file's figures are
its own. Expect hours on 2 cores.
"""

from __future__ import annotations

import re
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COUNTS = re.compile(r"(\d+) (passed|failed|error|errors|skipped|xfailed|xpassed|deselected)")


def slow_files() -> list[str]:
    """The test files that mark anything slow, in name order."""
    return sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("test_*.py")
                  if re.search(r"mark\.slow|matrix\(", path.read_text()))


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(path: str, extra: list[str]) -> tuple[dict[str, int], float, float, int]:
    """``path``'s slow tests: (outcome counts, wall s, CPU s, exit status)."""
    before, start = children_cpu(), time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "slow",
                           "-p", "no:cacheprovider", path, *extra], cwd=ROOT,
                          capture_output=True, text=True)
    wall, cpu = time.monotonic() - start, children_cpu() - before
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    counts = {kind: int(n) for n, kind in COUNTS.findall(summary)}
    if done.returncode not in (0, 5):   # 5: nothing selected
        print(done.stdout[-3000:], done.stderr[-2000:], sep="\n", file=sys.stderr)
    return counts, wall, cpu, done.returncode


def main() -> None:
    args = sys.argv[1:]
    extra = args[args.index("--") + 1:] if "--" in args else []
    files = (args[:args.index("--")] if "--" in args else args) or slow_files()
    print(f"{'file':52s} {'passed':>6s} {'failed':>6s} {'wall s':>8s} {'CPU s':>8s}")
    totals = [0, 0, 0.0, 0.0]
    for path in files:
        counts, wall, cpu, _ = run(path, extra)
        failed = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
        print(f"{path:52s} {counts.get('passed', 0):6d} {failed:6d} {wall:8.1f} {cpu:8.1f}",
              flush=True)
        totals = [totals[0] + counts.get("passed", 0), totals[1] + failed,
                  totals[2] + wall, totals[3] + cpu]
    print(f"{'total':52s} {totals[0]:6d} {totals[1]:6d} {totals[2]:8.1f} {totals[3]:8.1f}")
    sys.exit(1 if totals[1] else 0)


if __name__ == "__main__":
    main()
