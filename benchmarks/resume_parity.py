"""Resume on another budget trains like one process: the sample GPT, Hugging Face Llama
and Hugging Face GPT-2 (tied embeddings), tiny configs, AdamW, 6 steps.

Each move trains 3 steps under plan A (``torchrun`` with gloo on CPU); then one rank gets
a SIGTERM, every rank sees ``module.stop_requested()`` from that step and saves a
checkpoint (``module.save_checkpoint``) as a suspended job does, and goes on to step 6
(the uninterrupted run), then a
second ``torchrun`` under plan B loads it (``module.load_checkpoint``) and trains steps
4-6. Moves:

- ``pp2-dp2>tp2``: 4 processes pp=2 x dp=2 -> 2 processes tp=2;
- ``dp2-zero3>pp2-dp2-zero1``: 2 processes dp=2 ZeRO-3 -> 4 processes pp=2 x dp=2 ZeRO-1;
- ``dp2-zero1>dp2-zero1``: 2 -> 2 processes, the same plan: bit-identical to the
  uninterrupted run;
- ``dp2-tp2-zero3>pp2``: 4 processes dp=2 x tp=2 ZeRO-3 (FSDP shards of tensor-parallel
  shards, fused projections cut in chunks) -> 2 processes pp=2.

Mixture-of-experts models (``--models moe,mixtral``: the sample's Switch-style layers,
Hugging Face Mixtral) take expert-parallel moves instead (``EXPERT_MOVES``): experts cut
over 4 ranks -> 2, over 2 -> none (a pipeline), none -> 2, and 2 of 4 replicas' experts
-> a pipeline with expert parallelism; and under ZeRO, experts sharded over the ranks
holding the same ones: ZeRO-1 over expert-dp 2 -> a pipeline, none -> ZeRO-3 over
expert-dp 2, ZeRO-3 over expert-dp 2 -> ZeRO-1 with each rank's experts its own, and
ZeRO-3 over expert-dp 2 resumed under the same plan (bit-identical).

Printed per move: the worst relative difference of the 6 losses (3 before the save, 3
after the load) from one process, the final parameters' worst relative error from one
process (per tensor, against its norm floored at 1e-3), the largest absolute difference
of the resumed run's final parameters from the uninterrupted run's, and whether the
resumed losses are bit-identical to the uninterrupted ones. Four ``torchrun`` launches
(first runs on 4 and on 2 processes, resumed runs on 2 and on 4).

    python benchmarks/resume_parity.py [--models gpt,llama,gpt2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.runtime.ckpt_worker import PLANS, SAVE_AT, STEPS  # noqa: E402

WORKER = ROOT / "tests" / "runtime" / "ckpt_worker.py"
MOVES = ["pp2-dp2>tp2", "dp2-zero3>pp2-dp2-zero1", "dp2-zero1>dp2-zero1",
         "dp2-tp2-zero3>pp2"]
EXPERT_MOVES = ["dp4-ep4>dp2-ep2", "dp2-ep2>pp2", "pp2>dp2-ep2", "dp4-ep2>pp2-dp2-ep2",
                "dp4-ep2-zero1>pp2", "dp2-ep2>dp4-ep2-zero3", "dp4-ep2-zero3>dp2-ep2-zero1",
                "dp4-ep2-zero3>dp4-ep2-zero3"]
EXPERT_MODELS = ("moe", "mixtral")
RTOL = 1e-5


def launch(out: Path, phase: str, nproc: int, moves: list[str]) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", str(WORKER), str(out), phase, *moves]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PARTC_TIMEOUT_S": "300"}
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    print(f"  {phase} on {nproc} processes: {len(moves)} moves, "
          f"{time.perf_counter() - started:.0f} s", file=sys.stderr)
    files = [out / f"{phase}-rank{r}.json" for r in range(nproc)]
    if done.returncode != 0 or not all(f.exists() for f in files):
        raise SystemExit(f"torchrun exited with {done.returncode}:\n{done.stderr[-4000:]}")
    results = [json.loads(f.read_text()) for f in files]
    for f in files:
        f.rename(f.with_name(f"{phase}-{nproc}-{f.name}"))
    return results


def _relative(ours: list[float], ref: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(ours, ref))


def row(name: str, first: list[dict], resumed: list[dict]) -> dict:
    errors = [r[name]["error"] for r in first + resumed if "error" in r[name]]
    if errors:
        return {"move": name, "error": errors[0]}
    before, after = first[0][name], resumed[0][name]
    losses = before["losses"][:after["start"]] + after["losses"]
    return {"move": name, "losses": _relative(losses, after["ref_losses"]),
            "params_first": max(r[name]["param_error"] for r in first),
            "params": max(r[name]["param_error"] for r in resumed),
            "to_uninterrupted": max(r[name]["max_abs_diff_to_first"] for r in resumed),
            "bit_identical": after["losses"] == before["losses"][after["start"]:],
            "stopped_at": sorted({r[name].get("stopped_at") for r in first}, key=str),
            "steps": len(losses)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,llama,gpt2,moe,mixtral")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="resume_parity_"))
    names = [f"{model}:{move}" for model in args.models.split(",")
             for move in (EXPERT_MOVES if model in EXPERT_MODELS else MOVES)]

    def processes(name: str, which: int) -> int:
        return PLANS[name.split(":")[1].split(">")[which]][0]

    first, resumed = {}, {}
    for phase, which, results in (("first", 0, first), ("resume", 1, resumed)):
        for nproc in sorted({processes(n, which) for n in names}, reverse=True):
            group = [n for n in names if processes(n, which) == nproc]
            ranks = launch(out, phase, nproc, group)
            results.update({n: ranks for n in group})
    rows = [row(n, first[n], resumed[n]) for n in names]
    print("| move | saved at step (SIGTERM) | losses vs 1 process | "
          "params vs 1 process (A, uninterrupted) | params vs 1 process (resumed) | "
          "resumed vs uninterrupted (max abs) | losses bit-identical |")
    print("|---|---|---|---|---|---|---|")
    failed = 0
    for r in rows:
        if "error" in r:
            failed += 1
            print(f"| {r['move']} | error: {r['error'].splitlines()[0][:120]} | | | | | |")
            continue
        ok = r["losses"] <= RTOL and r["params"] <= RTOL and r["steps"] == STEPS \
            and r["stopped_at"] == [SAVE_AT]
        failed += not ok
        stopped = ", ".join(map(str, r["stopped_at"]))
        print(f"| {r['move']} | {stopped} | {r['losses']:.1e} | {r['params_first']:.1e} | "
              f"{r['params']:.1e} | {r['to_uninterrupted']:.1e} | "
              f"{'yes' if r['bit_identical'] else 'no'} |")
    print(f"\n{len(rows) - failed} of {len(rows)} moves within {RTOL:g} (losses and "
          f"parameters, fp32, AdamW); results in {out}")


if __name__ == "__main__":
    main()
