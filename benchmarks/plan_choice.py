"""Plan choice against measured reality: every 2-process plan of the sample GPT, predicted
by partc's cost model and timed on this machine.

    partc calibrate --quick --out /tmp/cm-profile.json      # or a full run
    python benchmarks/plan_choice.py --profile /tmp/cm-profile.json [--rounds 3]
    python benchmarks/plan_choice.py --profile ... --set schedules   # every schedule
    python benchmarks/plan_choice.py --profile ... --set zero2   # ZeRO-2's gradient sync

The parent process compiles the sample GPT (``samples/gpt.py``) on a 2-process CPU budget
from the profile once unpinned (the plan partc picks) and once per variant, each pinned
with ``Constraints``: pipeline (pp=2, 1F1B or GPipe, 1 to 4 microbatches), data
parallelism (dp=2, ZeRO 0 to 3, 1 or 2 microbatches), tensor parallelism (tp=2, with and
without sequence parallelism), and recompute (full, selective). Plans that come out the
same are kept once. It saves them, then starts ``torchrun --nproc-per-node=2`` on itself:
every rank loads and builds every plan, then trains them in interleaved rounds (in round
r each plan in turn runs a warm-up step and ``--steps`` timed steps; a step is
``forward_backward`` and the AdamW step, its time the slowest rank's, between barriers),
so that drift in the machine's speed hits all plans alike. A plan's figure is the median
of its timed steps over all rounds.

It prints per plan the predicted and measured step time and their ratio, and:

- the Spearman rank correlation of predicted against measured,
- the regret of partc's own (unpinned) pick: its measured time over the best measured,
- the median of |predicted / measured - 1|,
- the predicted and the measured order, and whether the fastest predicted is fastest.

``--set schedules`` times every pipeline schedule instead, on one mesh (pp=2, 4
microbatches of 2; 2 virtual stages per rank where a schedule takes any), each pinned,
beside partc's pick with the schedule left to it: the same model and sizes for what is
predicted and what is measured.

``--set zero2`` times ZeRO-2's two gradient syncs on dp=2 with 4 microbatches of 1:
reduce-scatter after every microbatch, or accumulate whole gradients and reduce-scatter
once per step (``Constraints.zero2_grad_sync``), beside partc's pick with the sync left
to it.

with the machine's load average before and after: on a shared machine the times are
noisy; the rounds interleave so that noise spreads over all plans.

``--compare OTHER.json`` predicts the same plans again with a second profile (every
decision of each plan pinned: mesh, stages, recompute, microbatches, schedule, ZeRO) and
prints its figures against the same measurements: two cost models, or two profiles,
judged on one set of timings (e.g. a profile with ``elementwise_bandwidth`` and
``optimizer_bandwidth`` nulled, which prices as the cost model did before them).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import partc  # noqa: E402
from samples.gpt import GPT, GPTConfig, loss_fn  # noqa: E402

CONFIG = GPTConfig(vocab_size=512, block_size=128, n_layer=4, n_head=4, n_embd=192,
                   dropout=0.0)
BATCH, SEQ = 8, 128


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


# ``--set schedules``: every pipeline schedule on one mesh (pp=2 on the 2 processes, 4
# microbatches of 2), each pinned with the virtual stages it runs (2 where it takes any),
# and partc's pick with the same mesh and microbatches but the schedule left to it.
SCHEDULE_MESH = dict(pp=2, dp=1, tp=1, num_microbatches=4, recompute="none")


def schedule_variants() -> dict[str, dict]:
    from partc.cost.schedules import SCHEDULE_TABLE, refusal

    found = {}
    for name, info in SCHEDULE_TABLE.items():
        v = info.virtual_stages[0] if info.virtual_stages else 2
        if refusal(name, 2, v, SCHEDULE_MESH["num_microbatches"]) is None:
            found[name] = dict(SCHEDULE_MESH, schedule=name, virtual_stages=v)
    return found


# ``--set zero2``: dp=2 under ZeRO-2, 4 microbatches per replica, each gradient sync
# pinned, and partc's pick of the sync on the same mesh and microbatches.
ZERO2_MESH = dict(pp=1, dp=2, tp=1, zero_stage=2, num_microbatches=4, recompute="none")


def zero2_variants() -> dict[str, dict]:
    return {f"dp2-zero2-m4-{sync}": dict(ZERO2_MESH, zero2_grad_sync=sync)
            for sync in ("microbatch", "step")}


def variants() -> dict[str, dict]:
    """Constraints of every variant, by name."""
    found: dict[str, dict] = {}
    for schedule in ("1f1b", "gpipe"):
        for m in (1, 2, 4):
            found[f"pp2-{schedule}-m{m}"] = dict(pp=2, schedule=schedule, num_microbatches=m)
    found["pp2-1f1b-m2-full"] = dict(pp=2, schedule="1f1b", num_microbatches=2,
                                     recompute="full")
    for zero in (0, 1, 2, 3):
        for m in (1, 2):
            found[f"dp2-zero{zero}-m{m}"] = dict(dp=2, zero_stage=zero, num_microbatches=m)
    found["dp2-zero0-m1-selective"] = dict(dp=2, zero_stage=0, num_microbatches=1,
                                           recompute="selective")
    found["dp2-zero0-m1-full"] = dict(dp=2, zero_stage=0, num_microbatches=1,
                                      recompute="full")
    for sp in (False, True):
        name = f"tp2{'-sp' if sp else ''}"
        found[f"{name}-m1"] = dict(tp=2, sequence_parallel=sp, num_microbatches=1)
        found[f"{name}-m2"] = dict(tp=2, sequence_parallel=sp, num_microbatches=2)
    return found


def _decisions(plan: partc.Plan) -> str:
    """What makes two plans the same program."""
    return json.dumps({"mesh": [plan.pp, plan.dp, plan.tp], "m": plan.num_microbatches,
                       "b": plan.micro_batch_size, "schedule": plan.schedule,
                       "zero": plan.effective_zero_stage, "once": plan.reduces_once,
                       "sp": plan.sequence_parallel,
                       "stages": [list(s.layers) for s in plan.stages],
                       "recompute": sorted(plan.recompute.items())}, sort_keys=True)


def pins_of(plan: partc.Plan) -> dict:
    """Constraints that pin every decision of ``plan``."""
    return dict(pp=plan.pp, dp=plan.dp, tp=plan.tp, sequence_parallel=plan.sequence_parallel
                if plan.tp > 1 else None, stages=[list(s.layers) for s in plan.stages],
                recompute=dict(plan.recompute), num_microbatches=plan.num_microbatches,
                micro_batch_size=plan.micro_batch_size, schedule=plan.schedule,
                virtual_stages=plan.chunks if plan.chunks > 1 else None,
                zero_stage=plan.zero_stage if plan.dp > 1 else None,
                zero2_grad_sync=plan.zero2_grad_sync if plan.effective_zero_stage == 2
                else None)


def repredict(profile: str, plans: dict[str, dict]) -> dict[str, dict]:
    """``plans`` with each one's step time predicted with ``profile`` instead, every
    decision pinned; a plan the other profile cannot price pinned so is left out."""
    budget = partc.DeviceBudget(num_devices=2, profile=profile)
    train = partc.TrainSpec(global_batch_size=BATCH)
    ids, _ = batch()
    again = {}
    for name, info in plans.items():
        try:
            program = partc.compile(model(), (ids,), loss_fn=loss_fn, budget=budget,
                                    train=train,
                                    constraints=partc.Constraints(**info["pins"]))
        except (partc.PartcError, ValueError) as error:
            print(f"  {name}: not re-predicted ({str(error).splitlines()[0]})", flush=True)
            continue
        again[name] = info | {"predicted_s": program.plan.predicted.step_time_s}
    return again


def compile_all(profile: str, out: Path, only: list[str] | None = None,
                which: str = "plans") -> dict[str, dict]:
    budget = partc.DeviceBudget(num_devices=2, profile=profile)
    train = partc.TrainSpec(global_batch_size=BATCH)
    ids, _ = batch()
    plans: dict[str, dict] = {}
    seen: dict[str, str] = {}
    named = {"schedules": {"partc": dict(SCHEDULE_MESH), **schedule_variants()},
             "zero2": {"partc": dict(ZERO2_MESH), **zero2_variants()},
             "plans": {"partc": {}, **variants()}}[which]
    if only:
        named = {name: pins for name, pins in named.items() if name == "partc" or name in only}
    for name, pins in named.items():
        start = time.perf_counter()
        try:
            program = partc.compile(model(), (ids,), loss_fn=loss_fn, budget=budget,
                                    train=train, constraints=partc.Constraints(**pins))
        except partc.PartcError as error:
            print(f"  {name}: no plan ({str(error).splitlines()[0]})", flush=True)
            continue
        plan = program.plan
        key = _decisions(plan)
        if key in seen:
            print(f"  {name}: same plan as {seen[key]}", flush=True)
            if name != "partc":
                plans[seen[key]]["also"].append(name)
            continue
        seen[key] = name
        program.save(out / name, code=False)
        plans[name] = {"predicted_s": plan.predicted.step_time_s, "also": [],
                       "v": plan.chunks,
                       "mesh": f"pp{plan.pp} dp{plan.dp} tp{plan.tp}",
                       "m": plan.num_microbatches, "b": plan.micro_batch_size,
                       "zero": f"{plan.effective_zero_stage}"
                               + ("s" if plan.reduces_once else ""),
                       "sp": plan.sequence_parallel, "schedule": plan.schedule,
                       "pins": pins_of(plan)}
        print(f"  {name}: predicted {plan.predicted.step_time_s * 1e3:.1f} ms "
              f"({time.perf_counter() - start:.1f} s to compile)", flush=True)
    return plans


# ------------------------------------------------------------------ under torchrun

def worker(folder: Path, names: list[str], rounds: int, steps: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    built = {}
    for name in names:
        program = partc.load(folder / name, model(), loss_fn=loss_fn)
        module = program.build()
        built[name] = (module, module.optimizer(torch.optim.AdamW, lr=1e-4))
    ids, target = batch()
    times: dict[str, list[float]] = {name: [] for name in names}

    def step(name: str) -> float:
        module, optimizer = built[name]
        dist.barrier()
        start = time.perf_counter()
        module.forward_backward(ids, target=target)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)

    for round_ in range(rounds):
        for name in names:
            step(name)   # warm-up: caches, the pipeline's first-step shape inference
            times[name] += [step(name) for _ in range(steps)]
        if dist.get_rank() == 0:
            print(f"round {round_ + 1}/{rounds} done", flush=True)
    if dist.get_rank() == 0:
        (folder / "measured.json").write_text(json.dumps(times))
    dist.destroy_process_group()


# ---------------------------------------------------------------------- the figures

def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        i = 0
        while i < len(order):   # ties share their mean rank
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                result[order[k]] = (i + j) / 2
            i = j + 1
        return result

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def report(plans: dict[str, dict], measured: dict[str, list[float]]) -> None:
    rows = []
    for name, info in plans.items():
        seconds = statistics.median(measured[name])
        rows.append((name, info, info["predicted_s"], seconds))
    rows.sort(key=lambda row: row[3])
    print("\n(zero: the ZeRO stage; 2s: ZeRO-2 reduce-scattering once per step)")
    print(f"{'plan':<26}{'mesh':<14}{'b x m':<7}{'zero':<5}{'schedule':<28}"
          f"{'predicted':>11}{'measured':>11}{'pred/meas':>11}")
    for name, info, predicted, seconds in rows:
        also = f"  (= {', '.join(info['also'])})" if info["also"] else ""
        schedule = info["schedule"] + (f", v={info['v']}" if info.get("v", 1) > 1 else "")
        print(f"{name:<26}{info['mesh']:<14}{info['b']}x{info['m']:<5}{info['zero']:<5}"
              f"{schedule:<28}{predicted * 1e3:>9.1f}ms{seconds * 1e3:>9.1f}ms"
              f"{predicted / seconds:>11.2f}{also}")
    predicted = [r[2] for r in rows]
    seconds = [r[3] for r in rows]
    best = min(seconds)
    pick = next(r for r in rows if r[0] == "partc")
    errors = [abs(p / s - 1) for p, s in zip(predicted, seconds)]
    print(f"\nplans: {len(rows)}")
    print(f"Spearman rank correlation, predicted vs measured: {spearman(predicted, seconds):.2f}")
    print(f"regret of partc's pick ({pick[1]['mesh']}, {pick[1]['b']}x{pick[1]['m']}): "
          f"{pick[3] / best:.2f} (measured / best measured)")
    print(f"median |predicted/measured - 1|: {statistics.median(errors):.2f}")
    by_prediction = [r[0] for r in sorted(rows, key=lambda row: row[2])]
    print(f"predicted order, fastest first: {', '.join(by_prediction)}")
    print(f"measured order, fastest first:  {', '.join(r[0] for r in rows)}")
    print(f"fastest predicted is fastest measured: {by_prediction[0] == rows[0][0]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="/tmp/cm-profile.json",
                        help="a device profile from `partc calibrate --processes 2`")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per plan and round")
    parser.add_argument("--only", nargs="*", help="these variants (and partc's pick) only")
    parser.add_argument("--set", dest="which", choices=("plans", "schedules", "zero2"),
                        default="plans",
                        help="plans: the pp/dp/ZeRO/tp/recompute/microbatch variants; "
                             "schedules: every pipeline schedule on pp=2 x 4 microbatches; "
                             "zero2: ZeRO-2's gradient sync per microbatch or per step "
                             "on dp=2 x 4 microbatches")
    parser.add_argument("--compare", metavar="OTHER.json",
                        help="also predict the same plans with this profile, against the "
                             "same measurements")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--names", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.worker), args.names, args.rounds, args.steps)
        return
    if not Path(args.profile).is_file():
        sys.exit(f"no profile at {args.profile}: run `partc calibrate --quick --out "
                 f"{args.profile}` first")
    before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="partc-plan-choice-") as tmp:
        folder = Path(tmp)
        print(f"compiling the variants on a 2-process budget from {args.profile}", flush=True)
        plans = compile_all(args.profile, folder, args.only, args.which)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        command = ["torchrun", "--standalone", "--nproc-per-node=2", __file__,
                   "--worker", str(folder), "--rounds", str(args.rounds), "--steps",
                   str(args.steps), "--names", *plans]
        print(f"timing {len(plans)} plans: {args.rounds} rounds of {args.steps} steps each",
              flush=True)
        subprocess.run(command, check=True, env=env, cwd=ROOT)
        measured = json.loads((folder / "measured.json").read_text())
    report(plans, measured)
    if args.compare:
        print(f"\nthe same plans predicted with {args.compare}:")
        again = repredict(args.compare, plans)
        if "partc" in again:
            report(again, {name: measured[name] for name in again})
    print(f"load average (1 min) before {before:.1f}, after {os.getloadavg()[0]:.1f}, "
          f"on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
