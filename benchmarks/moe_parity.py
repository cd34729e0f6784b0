"""Expert parallelism against one process: every case of tests/runtime/moe_worker.py
(the sample, Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3; ep over dp, with pp, with a
capacity factor; experts in a module list, kept at ep=1), one table of the worst
relative loss and parameter differences and the all-to-alls of tokens per step, counted
at run time, against the plan's own count

    python benchmarks/moe_parity.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.runtime.test_moe import (AUX, DEFAULT, MODULE_LIST, SLOW_FOUR, SLOW_TWO,  # noqa: E402
                                    launch)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        runs = [(4, DEFAULT + SLOW_FOUR), (2, SLOW_TWO + AUX + MODULE_LIST)]
        print(f"{'case':26s} {'pp dp tp ep':12s} {'loss rel':>9s} {'param rel':>9s} "
              f"{'a2a/step run':>12s} {'plan':>5s} {'dropped':>7s}")
        for nproc, cases in runs:
            ranks = launch(nproc, cases, Path(tmp) / str(nproc))
            for name in cases:
                seen = [r[name] for r in ranks]
                if any("error" in s for s in seen):
                    print(f"{name:26s} error: {next(s for s in seen if 'error' in s)['error']}")
                    continue
                mesh = seen[0]["mesh"]
                loss = max(abs(a - b) / abs(b) for s in seen
                           for a, b in zip(s["losses"], s["ref_losses"]))
                param = max(max(s["param_errors"].values(), default=0.0) for s in seen)
                run = sorted({m for s in seen for m in s["messages"][1:]})
                plan = sorted({s["expected_messages"] for s in seen})
                print(f"{name:26s} {mesh['pp']:2d} {mesh['dp']:2d} {mesh['tp']:2d} "
                      f"{mesh['ep']:2d}  {loss:9.1e} {param:9.1e} {str(run):>12s} "
                      f"{str(plan):>5s} {sum(s['dropped'] for s in seen):7d}")


if __name__ == "__main__":
    main()
