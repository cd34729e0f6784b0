"""Expert parallelism against one process: every case of tests/runtime/moe_worker.py
(the sample, Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3; ep over dp, with pp, with a
capacity factor, under ZeRO-0 to 3; experts in a module list, kept at ep=1), one table
of the worst relative loss and parameter differences and the all-to-alls of tokens per
step, counted at run time, against the plan's own count; then how many cases pass (fp32:
within 1e-5 relative) and the worst differences

    python benchmarks/moe_parity.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.runtime.test_moe import (AUX, DEFAULT, MODULE_LIST, RTOL, SLOW_FOUR,  # noqa: E402
                                    SLOW_TWO, check, launch)


def main() -> None:
    passed, failed, worst_loss, worst_param, worst_norm = 0, [], 0.0, 0.0, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        runs = [(4, DEFAULT + SLOW_FOUR), (2, SLOW_TWO + AUX + MODULE_LIST)]
        print(f"{'case':29s} {'pp dp tp ep zero':17s} {'loss rel':>9s} {'param rel':>9s} "
              f"{'norm rel':>9s} {'a2a/step run':>12s} {'plan':>5s} {'dropped':>7s}")
        for nproc, cases in runs:
            ranks = launch(nproc, cases, Path(tmp) / str(nproc))
            for name in cases:
                seen = [r[name] for r in ranks]
                if any("error" in s for s in seen):
                    print(f"{name:29s} error: {next(s for s in seen if 'error' in s)['error']}")
                    failed.append(name)
                    continue
                mesh = seen[0]["mesh"]
                loss = max(abs(a - b) / abs(b) for s in seen
                           for a, b in zip(s["losses"], s["ref_losses"]))
                param = max(max(s["param_errors"].values(), default=0.0) for s in seen)
                norm = max((abs(a - b) / abs(b) for s in seen
                            for a, b in zip(s["grad_norms"], s["ref_grad_norms"])),
                           default=0.0)
                run = sorted({m for s in seen for m in s["messages"][1:]})
                plan = sorted({s["expected_messages"] for s in seen})
                print(f"{name:29s} {mesh['pp']:2d} {mesh['dp']:2d} {mesh['tp']:2d} "
                      f"{mesh['ep']:2d} {mesh['zero']:4d}  {loss:9.1e} {param:9.1e} "
                      f"{norm:9.1e} {str(run):>12s} {str(plan):>5s} "
                      f"{sum(s['dropped'] for s in seen):7d}")
                worst_loss, worst_param = max(worst_loss, loss), max(worst_param, param)
                worst_norm = max(worst_norm, norm)
                try:
                    check(ranks, name, split=name not in MODULE_LIST)
                    passed += 1
                except AssertionError:
                    failed.append(name)
    print(f"\n{passed} passed, {len(failed)} failed{f' {failed}' if failed else ''} "
          f"(rtol {RTOL:g}); worst "
          f"relative difference: loss {worst_loss:.1e}, parameters {worst_param:.1e}, "
          f"gradient norm {worst_norm:.1e}")


if __name__ == "__main__":
    main()
