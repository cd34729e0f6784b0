"""Planning time of big models on the meta device: Llama-3-70B on 1024 H100s, a 1T GPT on
3072 A100s (and Llama-3-8B on 64 H100s), everything decided jointly.

For each workload, ``--repeats`` cold runs (``partc.compile`` without a cache, as a user
calls it) print the wall time of each of its phases as ``partc.progress`` names them —
``trace`` (finding the repeated blocks, tracing, the analysis passes), ``tensor
parallelism`` (measuring the options: tp 2, 4, 8 inside a node, with and without sequence
parallelism), ``search`` (the joint search over every (pp, dp, tp), micro-batch size,
microbatch count and ZeRO stage), ``schedules`` (every schedule of the meshes it keeps)
— and their median. Then re-planning: ``partc.compile`` again with a cache holding the
measured model, after the memory per device changes (80 GiB -> 60 GiB, then 40 GiB),
which skips tracing and measuring; and once more with the first budget, which returns
the stored plan.

The target for Llama-3-70B, cold: at most half of one ``torch.export`` of the same model
(``--versus-export``). Seen on a quiet 2-core machine: 12.5 CPU-s against 7.1 (1.77x;
one run of each moves by about a CPU-second; 13.7-14.7 before the forward of a model on
meta was recorded on meta tensors rather than fakes and the pipeline simulation read
pre-encoded orders), 16.2-16.6 before Python's full
garbage collections were held off while partc plans (``partc.heap``: eight of them
walked its million live objects, 2.9 CPU-s; paired whole-process runs, 21.9 -> 20.0 CPU-s,
a ratio of 0.918); the stored plan returned in 0.2 s; a re-plan after a memory change
(which reuses the measured model) 9.3 s of wall at 60 GiB and 12.0 s at 40 GiB (38.6 and
30.0 s while CP-SAT re-solved every schedule of the chosen mesh whose greedy split played
out near the fastest plan, with all the work left: ``partc.planner.joint.FIRST_SHARE``).

    python benchmarks/plan_time.py [--repeats 3]
        [--workloads llama3-70b gpt-1t llama3-8b qwen3.5-9b]
        [--work-limit W] [--profile] [--no-replan] [--versus-export]

``--versus-export``: instead, for each workload, one cold ``partc.compile`` (no cache)
and one plain ``torch.export`` of the same model, each in a fresh process, in CPU
seconds (the call alone, and the whole process with its imports and the model's
building), side by side with their ratio: CPU time, which a busy machine inflates less
than wall time. Then the cold plan's CPU seconds per phase as ``partc.progress`` names
them: ``trace`` (finding the repeated blocks, tracing, the analysis passes),
``tensor parallelism`` (choosing and measuring each variant), ``search`` (the cost
tables, bounds and CP-SAT over every configuration), ``schedules`` (the other schedules
on the chosen configuration, and the plan made from it). ``--no-replan``: cold runs
only, without the re-planning with a cache.

Workloads:

- ``llama3-70b``: Hugging Face LlamaForCausalLM with Llama-3-70B's shape (80 layers,
  hidden 8192, GQA 64/8 heads, FFN 28672, vocab 128256), bf16 AdamW, sequence 4096,
  1024 sequences per step (4M tokens), 128 nodes of 8 H100-80GB (NVLink 450 GB/s inside
  a node, one 400 Gb/s NIC per GPU between nodes).
- ``gpt-1t``: the sample GPT with the 1T row of Megatron-LM's Table 1 (Narayanan et al.,
  SC'21: 128 layers, hidden 25600, 160 heads, vocab 51200, sequence 2048), 3072
  sequences per step, 384 DGX A100-80GB nodes (8 x 200 Gb/s InfiniBand per node).
- ``llama3-8b``: 32 layers, 8192-token sequences, 512 per step, 8 nodes of 8 H100s.
- ``qwen3.5-9b``: Hugging Face Qwen3_5ForCausalLM of transformers' default config (32
  layers, three gated delta-rule layers to one of softmax attention, each delta rule a
  loop over 64-token chunks that the trace unrolls into about 1,000 nodes), 8 sequences
  of 4,096 tokens per step, bf16, on one node of 8 H100s (as ``partc plan qwen3_5``).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "samples"))
sys.path.insert(0, str(ROOT))

import partc  # noqa: E402
from partc import progress  # noqa: E402
from plan_llama import LLAMA3_70B  # noqa: E402
from partc.planner import PlannerOptions  # noqa: E402



@dataclass(frozen=True)
class Workload:
    name: str
    devices: int
    device: str
    inter_node: str

    def build(self) -> dict:
        """model, example_inputs, loss_fn, example_target, train — on the meta device."""
        if self.name == "qwen3.5-9b":
            from partc.cli import hf_config
            work = hf_config.workload("qwen3_5", meta=True)
            return {**work, "train": partc.TrainSpec(global_batch_size=8,
                                                     dtype=torch.bfloat16)}
        if self.name.startswith("llama3"):
            from plan_llama import LLAMA3_8B, workload
            shape, seq, batch = ((LLAMA3_70B, 4096, 1024) if self.name == "llama3-70b"
                                 else (LLAMA3_8B, 8192, 512))
            return workload(shape, seq, batch)
        from gpt import GPT, GPTConfig, loss_fn
        with torch.device("meta"):
            model = GPT(GPTConfig(n_layer=128, n_head=160, n_embd=25600, vocab_size=51200,
                                  block_size=2048))
        ids = torch.zeros(1, 2048, dtype=torch.long, device="meta")
        return {"model": model, "example_inputs": (ids,), "loss_fn": loss_fn,
                "example_target": ids, "name": "gpt-1t",
                "train": partc.TrainSpec(global_batch_size=3072, dtype=torch.bfloat16,
                                         optimizer="adam")}

    def budget(self, memory: str | None = None) -> partc.DeviceBudget:
        return partc.DeviceBudget(num_devices=self.devices, device=self.device,
                                  memory=memory, devices_per_node=8,
                                  inter_node_bandwidth=self.inter_node)


WORKLOADS = {
    "llama3-70b": Workload("llama3-70b", 1024, "H100-80GB", "50GB/s"),
    "gpt-1t": Workload("gpt-1t", 3072, "A100-80GB", "25GB/s"),
    "llama3-8b": Workload("llama3-8b", 64, "H100-80GB", "50GB/s"),
    "qwen3.5-9b": Workload("qwen3.5-9b", 8, "H100-80GB", "50GB/s"),
}


def cold_run(workload: Workload, options: PlannerOptions) -> tuple[dict, partc.Plan]:
    """One ``partc.compile`` without any cache, as a user calls it (the device's kernel
    choices made, ``TrainSpec.for_device``): the wall seconds of building the model and
    of each of the plan's phases (as ``partc.progress`` names them), and the plan."""
    times = {}
    start = time.perf_counter()
    work = workload.build()
    times["build model on meta"] = time.perf_counter() - start
    phases = PhaseClock(time.perf_counter)
    with progress.listening(phases.event):
        program = partc.compile(work["model"], work["example_inputs"],
                                budget=workload.budget(), train=work["train"],
                                loss_fn=work["loss_fn"], example_target=work["example_target"],
                                name=work["name"], options=options, cache=None)
    times.update(phases.stop())
    times["trace + plan"] = sum(t for name, t in times.items() if name != "build model on meta")
    return times, program.plan


def replans(workload: Workload, options: PlannerOptions) -> list[tuple[str, float, partc.Plan]]:
    """compile() with a cache: once to fill it, then after memory changes, then again."""
    work = workload.build()
    cache = partc.PlanCache()
    results = []
    for memory, what in ((None, "first compile (fills the cache)"),
                         ("60GiB", "memory 80 -> 60 GiB"), ("40GiB", "memory 60 -> 40 GiB"),
                         (None, "first budget again (stored plan)")):
        start = time.perf_counter()
        program = partc.compile(work["model"], work["example_inputs"],
                                budget=workload.budget(memory), train=work["train"],
                                loss_fn=work["loss_fn"], example_target=work["example_target"],
                                name=work["name"], options=options, cache=cache)
        results.append((what, time.perf_counter() - start, program.plan))
    return results


def describe(plan: partc.Plan) -> str:
    sp = " SP" if plan.sequence_parallel else ""
    solver = plan.solver
    recompute = {}
    for mode in plan.recompute.values():
        recompute[mode] = recompute.get(mode, 0) + 1
    return (f"pp={plan.pp} dp={plan.dp} tp={plan.tp}{sp} ZeRO-{plan.zero_stage} "
            f"{plan.schedule} b={plan.micro_batch_size} x m={plan.num_microbatches}, "
            f"recompute {recompute}; step {plan.predicted.step_time_s:.3f} s, MFU "
            f"{100 * plan.predicted.mfu:.1f}%, peak "
            f"{plan.predicted.peak_memory_bytes / 2**30:.1f} GiB; solver {solver.status}, "
            f"gap {100 * solver.gap:.2f}%, {solver.configs_total} configurations, "
            f"{solver.configs_solved} solved, {solver.configs_pruned} pruned")


def run(workload: Workload, args) -> None:
    options = PlannerOptions(work_limit=args.work_limit)
    print(f"\n{workload.name}: {workload.devices} x {workload.device} (8 per node, "
          f"{workload.inter_node} per GPU between nodes); cold runs: {args.repeats}")
    runs = [cold_run(workload, options) for _ in range(args.repeats)]
    for phase in runs[0][0]:
        values = [times[phase] for times, _ in runs]
        print(f"  {phase:<26} median {statistics.median(values):7.2f} s   runs "
              + " ".join(f"{v:.2f}" for v in values))
    print(f"  plan: {describe(runs[-1][1])}")
    if args.no_replan:
        return
    print("  re-planning with a cache (partc.compile):")
    for what, seconds, plan in replans(workload, options):
        print(f"    {what:<34} {seconds:6.2f} s   {describe(plan)}")


def one_call(workload: Workload, what: str) -> None:
    """In this process: one cold plan or one torch.export; prints the CPU s of each of
    the plan's phases (as ``partc.progress`` names them), then the call's."""
    work = workload.build()
    phases = PhaseClock()
    start = time.process_time()
    if what == "export":
        inputs = work["example_inputs"]
        args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
        torch.export.export(work["model"], args, kwargs=kwargs, strict=False)
    else:
        with progress.listening(phases.event):
            partc.compile(work["model"], work["example_inputs"], budget=workload.budget(),
                          train=work["train"], loss_fn=work["loss_fn"],
                          example_target=work["example_target"], name=work["name"],
                          cache=None)
    for phase, seconds in phases.stop().items():
        print(f"phase\t{phase}\t{seconds:.3f}")
    print(f"{time.process_time() - start:.3f}")


class PhaseClock:
    """Seconds per phase of ``partc.compile`` (CPU seconds, or those of ``clock``), from
    its progress events: the time up to an event is its phase's, unless the phase before
    had ended (``done == total``): then it is the next phase's work before its first
    report (the search builds every configuration's cost table before it reports); after
    the last phase, "the rest"."""

    def __init__(self, clock=time.process_time) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = {}
        self.phase: str | None = None   # the phase under way; None: between phases
        self.since = clock()

    def event(self, event: progress.Event) -> None:
        self._charge(self.phase or event.phase)
        self.phase = event.phase if event.done < event.total else None

    def stop(self) -> dict[str, float]:
        self._charge(self.phase or "the rest")
        return self.seconds

    def _charge(self, phase: str) -> None:
        now = self.clock()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.since
        self.since = now


def versus_export(workload: Workload) -> None:
    """One cold plan against one torch.export, each in a fresh process, in CPU s."""
    figures = {}
    for what in ("export", "plan"):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run([sys.executable, __file__, "--one", what, "--workloads",
                               workload.name], capture_output=True, text=True, check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        process = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        lines = done.stdout.split("\n")
        figures[what] = (float(done.stdout.split()[-1]), process,
                         [line.split("\t")[1:] for line in lines if line.startswith("phase\t")])
    (export_call, export_all, _), (plan_call, plan_all, phases) = (figures["export"],
                                                                   figures["plan"])
    print(f"{workload.name}: cold plan {plan_call:.1f} CPU-s (process {plan_all:.1f}), "
          f"torch.export {export_call:.1f} CPU-s (process {export_all:.1f}): "
          f"{plan_call / export_call:.2f}x (process {plan_all / export_all:.2f}x)")
    print("  the plan's phases: " + ", ".join(
        f"{phase} {float(seconds):.2f}" for phase, seconds in phases))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=["llama3-70b", "gpt-1t"],
                        choices=sorted(WORKLOADS))
    parser.add_argument("--work-limit", type=float, default=PlannerOptions().work_limit,
                        help="the planner's work limit, deterministic seconds of CP-SAT work")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the first workload's cold run")
    parser.add_argument("--no-replan", action="store_true",
                        help="cold runs only, no re-planning with a cache")
    parser.add_argument("--versus-export", action="store_true",
                        help="CPU s of one cold plan against one torch.export, instead")
    parser.add_argument("--one", choices=("plan", "export"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one_call(WORKLOADS[args.workloads[0]], args.one)
        return
    if args.versus_export:
        for name in args.workloads:
            versus_export(WORKLOADS[name])
        return
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(cold_run, WORKLOADS[args.workloads[0]],
                        PlannerOptions(work_limit=args.work_limit))
        pstats.Stats(profile).sort_stats("cumulative").print_stats(25)
    for name in args.workloads:
        run(WORKLOADS[name], args)


if __name__ == "__main__":
    main()
