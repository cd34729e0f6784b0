"""partc's cost model against published runs: the tables behind tests/validation.

1. Korthikanti et al. (MLSys'23): activation bytes per transformer layer and rank, partc's
   estimate for GPT-2 blocks built as the paper's (bf16, H100) against the paper's
   equations, at tp 1/2/8, with and without sequence parallelism, under no, selective
   and full recompute; the memory verdicts; with ``--breakdown``, what one block keeps
   node by node (in s*b*h units per rank) at tp=8 with sequence parallelism.
2. Megatron-Core's H100 weak scaling (Megatron-LM README, 2024): one H100 matmul
   efficiency fitted on the 32B row; partc's predicted TF/GPU for every published mesh
   (tp, pp, dp, batch and the distributed optimizer pinned, and a pipeline as
   Megatron-Core r0.8.0 can run it: plain 1F1B or interleaved 1F1B over an even split
   of the blocks, the faster within 80 GB, under "schedule"; "1f1b" is plain 1F1B's
   ratio), its ratio to the published one; under "partc schedule" the same mesh with
   the schedule and stages left to the planner, and that prediction's ratio; the
   planner's own plan for the same devices; and each step, as its schedule runs it,
   broken down by cause. With ``--interleavings``, the pipelined rows priced under each
   interleaved 1F1B Megatron-Core could have run, beside what partc's joint search
   priced on the same mesh (each schedule's virtual-stage counts, the fastest). With
   ``--efficiency E``, the table at that matmul efficiency instead of the fitted one
   (0.70: an H100's bf16 linears as ``partc calibrate`` measured them); with
   ``--micro-batch B``, every row's micro-batch size pinned (each row's batch is 4 pp
   dp sequences: 4 pp microbatches of one per replica, as Megatron's 1F1B needs them).
   Where no efficiency up to 100% of peak reaches the fitted row's throughput, the table
   is printed at the preset's efficiency and the fit says so.

    PYTHONPATH=. python benchmarks/validation.py [--only korthikanti|mcore] [--breakdown]
        [--rows 1.7B,32B] [--interleavings] [--efficiency 0.70] [--micro-batch 1]
        [--table other_table.json] [--fit-row 32B] [--korthikanti-table other.json]

``--table`` predicts another published table of the same schema as
``mcore_h100_weak_scaling.json`` (rows of heads, hidden, layers, tp, pp, dp, gpus,
batch and TF/GPU; the common vocabulary and sequence; the GPU, as a partc device
preset names it) the same way, fitted on ``--fit-row``; ``--korthikanti-table`` the
configurations of another table of ``korthikanti_activations.json``'s schema.

Everything is measured on the meta device (fake tensors): a few seconds per model.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from partc.device.presets import preset  # noqa: E402
from tests.validation import korthikanti, mcore  # noqa: E402
from tests.validation.megatron import breakdown, plan_assignment  # noqa: E402

GIB = 2**30


def korthikanti_table(show_breakdown: bool, configs: tuple = korthikanti.CONFIGS) -> None:
    print("Korthikanti et al.: activation bytes per layer and rank (GiB), partc vs paper")
    print(f"{'model':>5} {'tp':>3} {'sp':>3} {'recompute':>10} {'partc':>8} {'paper':>8} "
          f"{'ratio':>6}")
    for config in configs:
        for row in korthikanti.rows(config):
            outside = "" if abs(row.ratio - 1) <= 0.15 else "  outside ±15%"
            print(f"{row.config:>5} {row.tp:>3} {'on' if row.sequence_parallel else '-':>3} "
                  f"{row.mode:>10} {row.estimate / GIB:>8.3f} {row.equation / GIB:>8.3f} "
                  f"{row.ratio:>6.2f}{outside}")
    print("\nVerdicts: first pipeline stage, 16 bytes of state per parameter, 80 GB")
    print(f"{'model':>5} {'setting':>22} {'partc GB':>9} {'paper GB':>9} {'fits':>11}")
    for config in configs:
        for sp, mode, label in ((False, "none", "TP, no recompute"),
                                (True, "selective", "TP+SP, selective")):
            ours = korthikanti.peak_bytes(config, korthikanti.estimate_bytes(
                config, config.tp, sp, mode))
            paper = korthikanti.peak_bytes(config, korthikanti.equation_bytes(
                config, config.tp, sp, mode))
            fit = lambda b: "yes" if b <= korthikanti.DEVICE_BYTES else "no"  # noqa: E731
            print(f"{config.name:>5} {label:>22} {ours / 1e9:>9.1f} {paper / 1e9:>9.1f} "
                  f"{fit(ours) + ' / ' + fit(paper):>11}")
    if show_breakdown:
        block_breakdown(configs[0], 8, True)


def block_breakdown(config: korthikanti.Config, tp: int, sequence_parallel: bool) -> None:
    """What the first block keeps, node by node, for one rank (s*b*h units)."""
    from partc import meta
    from partc.compiler import device_numbers, tensor_parallel_links
    from partc.passes import pipeline
    from partc.passes.tp import chooser as tp_chooser
    from partc.passes.tp.rewrite import copy_module

    name = config.name
    graph, _ = korthikanti.analysed(config)
    ctx = graph.meta[meta.CONTEXT]
    devices = device_numbers(korthikanti.budget(config), korthikanti.train_spec(config).dtype)
    [link] = tensor_parallel_links(devices, [tp])
    chosen = tp_chooser.choose(graph, tp, link, sequence_parallel=sequence_parallel,
                               prefer="time")
    local, moved = copy_module(graph, chosen)
    local = pipeline.run_passes(pipeline.tp_measurement_passes(), local,
                                dataclasses.replace(ctx, sharding=moved))
    unit = config.seq_len * config.hidden  # per sample: s*h elements of one byte
    print(f"\n{name} block at tp={tp}{' with sequence parallelism' if sequence_parallel else ''}:"
          f" bytes kept by the node that made them, in s*b*h units per rank")
    for node in local.graph.nodes:
        if meta.LAYER in node.meta and meta.layer(node).name == korthikanti.BLOCK:
            saved = meta.cost(node).saved_bytes
            if saved:
                target = str(node.target)
                if callable(node.target) and not hasattr(node.target, "overloadpacket"):
                    target = f"{node.target.__module__}.{node.target.__name__}"
                print(f"  {node.name:>16} {target[-36:]:>36} {saved / unit:8.3f}")


def mcore_table(names: list[str], show_breakdown: bool, given: float | None = None,
                micro_batch_size: int | None = None, runs: tuple = mcore.RUNS,
                fit: mcore.Run = mcore.FIT_RUN) -> None:
    device = fit.device
    title = "Megatron-Core weak scaling" if runs == mcore.RUNS else "The table's runs"
    print(f"\n{title} on {device}: TF/GPU, partc's prediction vs published")
    if micro_batch_size is not None:
        print(f"micro-batch size pinned to {micro_batch_size}")
    try:
        if given is not None:
            efficiency = given
            print(f"{device} matmul efficiency given: {efficiency:.4f} (not fitted)")
        else:
            efficiency = mcore.fitted_efficiency(fit)
            print(f"{device} matmul efficiency fitted on {fit.name}: {efficiency:.4f}")
    except ValueError as error:
        efficiency = preset(device).flops_efficiency
        top = mcore.predict(fit, 1.0)
        print(f"no fit: {error} ({top.tflops_per_gpu:.1f} at 100% of peak); the table is "
              f"at the preset's efficiency, {efficiency}")
    print(f"{'model':>5} {'tp':>3} {'pp':>3} {'dp':>3} {'published':>9} {'partc':>7} "
          f"{'ratio':>6} {'GiB':>5} {'b':>2} {'m':>3} {'sp':>3} {'recompute':>16} "
          f"{'schedule':>12} {'1f1b':>6} {'partc schedule':>30} {'own plan':>18}")
    for run in runs:
        if names and run.name not in names:
            continue
        ours = mcore.predict(run, efficiency, micro_batch_size=micro_batch_size)
        own = mcore.predict(run, efficiency, own=True)
        plan = ours.plan
        modes = ",".join(sorted(set(plan.recompute.values())))
        mesh = f"{own.plan.tp}x{own.plan.pp}x{own.plan.dp} {own.tflops_per_gpu:.0f} TF"
        chosen = plain = "-"
        schedule = "-" if run.pp == 1 else \
            "1f1b" if ours.chunks == 1 else f"i1f1b v={ours.chunks}"
        if run.pp > 1:
            free = mcore.predict(run, efficiency, megatron_pipeline=False,
                                 micro_batch_size=micro_batch_size)
            chosen = f"{free.plan.schedule} v={free.plan.chunks} {free.ratio:.3f}"
            plain = f"{ours.planned_tflops_per_gpu / run.tflops_per_gpu:.3f}"
        print(f"{run.name:>5} {run.tp:>3} {run.pp:>3} {run.dp:>3} {run.tflops_per_gpu:>9.1f} "
              f"{ours.tflops_per_gpu:>7.1f} {ours.ratio:>6.3f} {ours.peak_bytes / GIB:>5.1f} "
              f"{plan.micro_batch_size:>2} {plan.num_microbatches:>3} "
              f"{'on' if plan.sequence_parallel else '-':>3} {modes:>16} {schedule:>12} "
              f"{plain:>6} {chosen:>30} {mesh:>18}")
        if show_breakdown:
            problem = mcore.problem(run, efficiency, micro_batch_size=micro_batch_size)
            parts = breakdown(problem, ours.assignment)
            print("      " + ", ".join(f"{k} {v:.3f}" for k, v in parts.terms.items())
                  + f" = {parts.step:.3f} s; published step "
                  + f"{mcore.step_flops(run) / (run.gpus * run.tflops_per_gpu * 1e12):.3f} s")


def interleavings_table(names: list[str], runs: tuple = mcore.RUNS,
                        fit: mcore.Run = mcore.FIT_RUN) -> None:
    print("\nThe pipelined rows under each interleaving Megatron-Core r0.8.0 could run "
          "(even split, v chunks per rank)")
    efficiency = mcore.fitted_efficiency(fit)
    for run in runs:
        if run.pp == 1 or names and run.name not in names:
            continue
        found = mcore.megatron_interleavings(run, efficiency)
        print(f"{run.name:>5}: " + ("; ".join(
            f"v={i.chunks} {i.tflops_per_gpu:.1f} TF {i.ratio:.3f} "
            f"{i.peak_bytes / GIB:.1f} GiB" for i in found) or "none"))
        fitting = [i for i in found if i.peak_bytes <= mcore.DEVICE_BYTES]
        if fitting:
            top = max(fitting, key=lambda i: i.tflops_per_gpu)
            print(f"       Megatron's fastest that fits: v={top.chunks} "
                  f"{mcore.step_flops(run) / (run.gpus * top.tflops_per_gpu * 1e12):.3f} s")
        searched_table(run, efficiency)


def searched_table(run: mcore.Run, efficiency: float) -> None:
    """What partc's joint search priced on the row's mesh (tp, pp, dp and ZeRO-1 pinned,
    the schedule, stages and micro-batch size its own): the plan, and per schedule the
    virtual-stage counts priced and the fastest of them."""
    free = mcore.predict(run, efficiency, megatron_pipeline=False)
    plan = free.plan
    print(f"       partc on the mesh: {plan.schedule} v={plan.chunks} "
          f"{plan.predicted.step_time_s:.3f} s {free.tflops_per_gpu:.1f} TF "
          f"{free.ratio:.3f} ({plan.solver.status})")
    by_schedule: dict[str, list] = {}
    for option in plan.schedules:
        by_schedule.setdefault(option.schedule, []).append(option)
    for name, options in by_schedule.items():
        priced = [o for o in options if o.step_time_s is not None]
        counts = sorted(o.virtual_stages for o in options)
        best = min(priced, key=lambda o: o.step_time_s) if priced else None
        print(f"         {name:<24} v {counts[0]}-{counts[-1]} ({len(options)} tried, "
              f"{len(priced)} priced)" + (f": fastest v={best.virtual_stages} "
                                         f"{best.step_time_s:.3f} s ({best.how})"
                                         if best else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("korthikanti", "mcore"))
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--rows", default="", help="mcore rows, e.g. 1.7B,32B (default all)")
    parser.add_argument("--interleavings", action="store_true",
                        help="mcore: price the pipelined rows' interleavings instead")
    parser.add_argument("--efficiency", type=float,
                        help="mcore: the table at this matmul efficiency instead of the "
                             "fitted one (e.g. 0.70, measured on an H100)")
    parser.add_argument("--micro-batch", type=int,
                        help="mcore: pin every row's micro-batch size (Megatron's: 1)")
    parser.add_argument("--table", type=Path,
                        help="mcore: another published table in the schema of "
                             "mcore_h100_weak_scaling.json instead of the copy in "
                             "tests/validation/mcore.py")
    parser.add_argument("--korthikanti-table", type=Path,
                        help="korthikanti: another table's configurations in the schema "
                             "of korthikanti_activations.json")
    parser.add_argument("--fit-row", help="mcore: the row (e.g. 32B) the efficiency is "
                                          "fitted on (default 32B)")
    args = parser.parse_args(argv)
    rows = [n for n in args.rows.split(",") if n]
    try:
        runs = mcore.load_runs(args.table) if args.table else mcore.RUNS
    except (OSError, ValueError, KeyError) as error:
        parser.error(f"--table: {error}")
    fit_name = args.fit_row or mcore.FIT_RUN.name
    fit = next((run for run in runs if run.name == fit_name), None)
    if fit is None:
        parser.error(f"no row {fit_name} to fit on: the table has "
                     f"{', '.join(run.name for run in runs)} (--fit-row)")
    if args.interleavings:
        interleavings_table(rows, runs, fit)
        return 0
    try:
        configs = korthikanti.load_configs(args.korthikanti_table) \
            if args.korthikanti_table else korthikanti.CONFIGS
    except (OSError, ValueError, KeyError) as error:
        parser.error(f"--korthikanti-table: {error}")
    if args.only in (None, "korthikanti") and (args.korthikanti_table or not args.table):
        korthikanti_table(args.breakdown, configs)
    if args.only in (None, "mcore"):
        mcore_table(rows, args.breakdown, args.efficiency, args.micro_batch, runs, fit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
