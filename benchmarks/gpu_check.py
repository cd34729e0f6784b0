"""partc on one GPU: the NCCL path, and the plan's predictions against what runs.

    python benchmarks/gpu_check.py --out DIR            # on a machine with a CUDA GPU
    python benchmarks/gpu_check.py --out DIR --smoke    # the same parts on CPU, tiny sizes
    python benchmarks/gpu_check.py --out DIR --part train --part memory
    python benchmarks/gpu_check.py --prepare            # plan everything, train nothing

Four parts, each in its own processes (one failing part does not hide the others), each
writing ``DIR/<part>.json`` and printing a table:

- ``parity``: ``torchrun --nproc-per-node=1`` on this file's worker, the process group
  NCCL (gloo on CPU): the sample GPT and a Llama from a config, compiled for one device
  and trained 4 steps (SGD with momentum) in fp32, against the same model trained by plain PyTorch on
  the same device (TF32 off): the largest relative difference of the losses and of the
  parameters. Then the same in bf16 (partc's mixed precision against the fp32 reference:
  how far bf16 moves the losses, not a parity).
- ``train``: ``partc train`` under ``torchrun --nproc-per-node=1`` for a GPT of 12 layers
  1536 wide (about 0.4 B parameters), 32 sequences of 1024 tokens a step in bf16, as
  partc plans it for the GPU's preset (compiled, the GPU default), pinned three ways
  (full recompute with one microbatch, no recompute with 8 microbatches of 4, selective
  recompute with 4 of 8), in eager mode (``--no-compile``) and with FP8 linears
  (``--fp8``: torchao's float8, where the plan says they pay). Per plan: the median step
  time after the first two steps against the plan's prediction, the step's
  ``torch.cuda.max_memory_allocated`` against the plan's peak (the telemetry's own
  records, ``DIR/train/<plan>/rank0.jsonl``), and the first step (compiling) against
  the plan's estimate of the compile. ``--plan NAME`` runs only the plans named.
- ``memory``: ``benchmarks/memory_check.py``'s measurement at GPU sizes, on the GPU: one
  rank at a time of plans for 2 or 4 GPUs (pipeline, ZeRO-1/3, tensor and sequence
  parallel, bf16 and fp32), joined to a fake process group (collectives move nothing;
  every tensor is allocated with its real shape): ``max_memory_allocated`` of a training
  step against the plan's peak for that rank; and what ``partc.device.usable`` keeps
  back, as the GPU shows it: the total CUDA reports, the context before the first
  tensor, and the allocator's peak reserved against its peak allocated (fragmentation).
  With ``PARTC_GPU_SNAPSHOT=<case>``, that case's allocations are recorded with their
  Python stacks (``DIR/memory/<case>.pickle``, ``torch.cuda.memory._dump_snapshot``).
- ``calibrate``: ``partc calibrate`` on this GPU, then the ``train`` part's plans
  predicted again from that profile (pinned to what ran) against the same measurements.

- ``profile``: two of the ``train`` part's plans (8 microbatches of 4, and one of 32
  with full recompute, also with telemetry on as ``partc train`` steps: its syncs and
  gradient norm) built through the API under ``torchrun --nproc-per-node=1``, two
  steps under ``torch.profiler``: the step's wall time (and two steps' without the
  profiler) against the time the GPU spent in
  kernels (their sum, and the union of their intervals), the number of kernels and of
  CPU-side aten calls, and the kernels that took longest: where a step's time goes that
  the plan does not predict. The attention kernels by backend (FlashAttention-2, cuDNN,
  memory-efficient), and the 8 x 4 plan again with scaled_dot_product_attention
  preferring cuDNN (``none-m8-cudnn``): its step and attention kernels, and its losses
  beside the default's (the same weights and batches).

``--case NAME`` (repeatable) runs only those memory and profile cases.

``--prepare`` compiles what the parts compile without running anything, so that a cache
directory (``PARTC_CACHE_DIR``) carried to the GPU machine spares its planning time.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from partc.cost.layer_compute import layer_work  # noqa: E402

PARTS = ("parity", "train", "memory", "calibrate", "profile")
SMOKE = os.environ.get("PARTC_GPU_CHECK_SMOKE") == "1"
# The train part's model and batch: layers, width, heads, sequence, global batch, vocab.
TRAIN_GPU = dict(layers=12, width=1536, heads=12, seq=1024, batch=32, vocab=50304)
TRAIN_SMOKE = dict(layers=2, width=64, heads=4, seq=32, batch=8, vocab=128)
# (name, partc train flags): the planner's pick, then three pinned plans.
TRAIN_PLANS = (
    ("planned", ()),
    ("full-m1", ("--recompute", "full", "--micro-batch", "{batch}")),
    ("none-m8", ("--recompute", "none", "--micro-batch", "{batch8}")),
    ("selective-m4", ("--recompute", "selective", "--micro-batch", "{batch4}")),
    # The kernel choices: the planner's pick in eager mode (compile is the GPU default),
    # and with FP8 linears allowed (torchao float8, where the plan says they pay).
    ("eager", ("--no-compile",)),
    ("fp8", ("--fp8",)),
)
STEPS = 10


def _sizes() -> dict[str, int]:
    return TRAIN_SMOKE if SMOKE else TRAIN_GPU


def _preset() -> str:
    """The preset the plans are made for: the GPU's own (an H200 is planned as one), the
    CPU's with --smoke; ``PARTC_GPU_CHECK_PRESET`` names another (--prepare on a machine
    without the GPU); H100-80GB where none is known."""
    from partc.calibrate.machine import known_preset

    if SMOKE:
        return "CPU"
    if os.environ.get("PARTC_GPU_CHECK_PRESET"):
        return os.environ["PARTC_GPU_CHECK_PRESET"]
    if torch.cuda.is_available():
        return known_preset("cuda", torch.cuda.get_device_name(0)) or "H100-80GB"
    return "H100-80GB"


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    return env


DEADLINE = [float("inf")]   # perf_counter time by which every part must end (--budget)
CASES: list[str] = []       # --case: the memory and profile cases to run (empty: all)
PLANS: list[str] = []       # --plan: the train part's plans to run (empty: all)


def _wanted(name: str) -> bool:
    return not CASES or name in CASES


def _run(command: list[str], timeout: float, log: Path) -> int:
    """Run ``command``, its output to ``log`` (and the end of it printed); its exit code,
    124 when it ran past ``timeout`` or the deadline of ``--budget``."""
    started = time.perf_counter()
    timeout = min(timeout, DEADLINE[0] - started)
    if timeout <= 1:
        print(f"  [{' '.join(command[:6])} ...] skipped: --budget spent")
        return 124
    with open(log, "w") as out:
        try:
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=_env(),
                                  timeout=timeout, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            code = 124
    tail = log.read_text().splitlines()[-6:]
    print(f"  [{' '.join(command[:6])} ...] exit {code} in {time.perf_counter() - started:.0f} s")
    if code:
        print("    " + "\n    ".join(tail))
    return code


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node=1", *args]


# ---------------------------------------------------------------------------- the model

def factory() -> dict[str, Any]:
    """What the ``train`` part trains (``partc train benchmarks/gpu_check.py:factory``):
    a GPT of :data:`TRAIN_GPU`'s sizes on random tokens, a new batch each step."""
    from samples import gpt

    s = _sizes()
    model = gpt.gpt_tiny(n_layer=s["layers"], n_embd=s["width"], n_head=s["heads"],
                         block_size=s["seq"], vocab_size=s["vocab"])

    def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(abs(step) + 1)
        tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1), generator=generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    ids, _ = data(0)
    return {"model": model, "example_inputs": (ids,), "loss_fn": gpt.loss_fn, "data": data}


def _plan_flags(flags: tuple[str, ...]) -> list[str]:
    batch = _sizes()["batch"]
    names = dict(batch=batch, batch4=max(1, batch // 4), batch8=max(1, batch // 8))
    return [flag.format(**names) for flag in flags]


# ---------------------------------------------------------------------------- parity

def parity_worker(out: Path) -> None:
    """Under torchrun, one process: partc against plain PyTorch on the same device."""
    import torch.distributed as dist

    import partc
    from samples import gpt
    from tests import models

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results: dict[str, Any] = {}
    builders = {"gpt": (lambda: gpt.gpt_tiny(n_layer=4, n_embd=128, block_size=64), gpt.loss_fn),
                "llama": (lambda: models.llama(n_layer=4, hidden=128, intermediate=256),
                          models.causal_lm_loss)}
    for name, (build, loss_fn) in builders.items():
        for dtype in (torch.float32, torch.bfloat16):
            key = f"{name}-{str(dtype).removeprefix('torch.')}"
            try:
                results[key] = _parity_case(build, loss_fn, dtype, device, partc)
            except Exception as error:  # recorded: one failure must not hide the rest
                import traceback
                results[key] = {"error": f"{type(error).__name__}: {error}",
                                "trace": traceback.format_exc()[-3000:]}
    results["backend"] = dist.get_backend() if dist.is_initialized() else None
    results["device"] = str(device)
    (out / "parity.json").write_text(json.dumps(results, indent=1))


def _parity_case(build: Any, loss_fn: Any, dtype: torch.dtype, device: torch.device,
                 partc: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model).to(device)
    batch, seq, steps = 8, 32, 4
    vocab = 128

    def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    x, y = data(0)
    program = partc.compile(model, (x,), loss_fn=loss_fn, example_target=y,
                            budget=partc.DeviceBudget(num_devices=1, device=_preset()),
                            train=partc.TrainSpec(global_batch_size=batch, dtype=dtype,
                                                  optimizer="sgd"),
                            constraints=partc.Constraints(num_microbatches=2))
    module = program.build()
    # SGD with momentum, as the runtime tests: Adam turns the rounding noise of gradients
    # that are mathematically zero (a key projection's bias) into full-size steps.
    optimizer = module.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    losses, ref_losses = [], []
    for step in range(steps):
        x, y = data(step)
        losses.append(float(module.forward_backward(x, target=y)))
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = sum(loss_fn(reference(xs.to(device)), ys.to(device)) / 2
                       for xs, ys in zip(x.chunk(2), y.chunk(2)))
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        ref_losses.append(float(ref_loss))
    ref_params = dict(reference.named_parameters())
    param_error = 0.0
    for name, param in module.named_parameters():
        truth = module.master_of(param) if module.master_of(param) is not None else param
        want = ref_params.get(name)
        if want is None:
            continue
        error = ((truth.detach().float().to(device) - want.detach().float()).norm()
                 / max(want.detach().float().norm().item(), 1e-3)).item()
        param_error = max(param_error, error)
    loss_error = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(losses, ref_losses))
    parameter_device = next(module.parameters()).device
    module.close()
    return {"losses": losses, "ref_losses": ref_losses, "max_loss_rel_diff": loss_error,
            "max_param_rel_diff": param_error, "param_device": str(parameter_device),
            "plan": {"microbatches": program.plan.num_microbatches,
                     "recompute": program.plan.stages[0].recompute}}


def run_parity(out: Path) -> dict[str, Any]:
    code = _run(_torchrun(str(Path(__file__)), "--worker", "parity", "--out", str(out)),
                600, out / "parity.log")
    path = out / "parity.json"
    results = json.loads(path.read_text()) if path.exists() else {"exit": code}
    print(f"  backend {results.get('backend')}, device {results.get('device')}")
    for key, row in results.items():
        if not isinstance(row, dict):
            continue
        if "error" in row:
            print(f"  {key:18s} FAILED {row['error']}")
            continue
        bound = 1e-5 if key.endswith("float32") else None
        verdict = ("" if bound is None else
                   " ok" if max(row["max_loss_rel_diff"], row["max_param_rel_diff"]) <= bound
                   else " OFF")
        print(f"  {key:18s} losses {row['max_loss_rel_diff']:.1e}  parameters "
              f"{row['max_param_rel_diff']:.1e}{verdict}   (partc {row['losses'][-1]:.5f}, "
              f"one device {row['ref_losses'][-1]:.5f} at step {len(row['losses'])})")
    return results


# ---------------------------------------------------------------------------- train

def _records(log_dir: Path) -> list[dict[str, Any]]:
    path = log_dir / "rank0.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("event") == "step"]


def run_train(out: Path, prepare: bool = False) -> dict[str, Any]:
    results: dict[str, Any] = {}
    target = f"{Path(__file__)}:factory"
    for name, flags in TRAIN_PLANS:
        if PLANS and name not in PLANS:
            continue
        directory = out / "train" / name
        directory.mkdir(parents=True, exist_ok=True)
        common = ["--device", _preset(), "--dtype", "bf16", "-q",
                  *_plan_flags(flags)]
        if prepare:
            command = [sys.executable, "-m", "partc", "plan", target, "--devices", "1",
                       *common, "--out", str(directory / "program")]
            _run(command, 900, directory / "plan.log")
            continue
        command = _torchrun("-m", "partc", "train", target, *common, "--steps", str(STEPS),
                            "--lr", "3e-4", "--log-dir", str(directory),
                            "--out", str(directory / "program"))
        code = _run(command, 300, directory / "train.log")
        records = _records(directory)
        if not records:
            results[name] = {"exit": code}
            print(f"  {name:14s} no step records (exit {code}); see {directory / 'train.log'}")
            continue
        timed = records[2:] or records[-1:]
        measured_s = statistics.median(r["step_time_s"] for r in timed)
        predicted_s = timed[-1]["predicted_step_time_s"]
        memory = max(r["memory_bytes"] for r in timed)
        predicted_memory = timed[-1]["predicted_memory_bytes"]
        plan = _plan_summary(directory / "program" / "plan.json")
        results[name] = {"exit": code, "measured_step_s": measured_s,
                         "predicted_step_s": predicted_s, "memory_bytes": memory,
                         "predicted_memory_bytes": predicted_memory,
                         "memory_measure": timed[-1]["memory_measure"],
                         "losses": [r["loss"] for r in records], "plan": plan,
                         "mfu": statistics.median(r["mfu"] for r in timed),
                         "first_step_s": records[0]["step_time_s"],
                         "reserved_bytes": max(r.get("reserved_bytes") or 0 for r in timed)}
        print(f"  {name:14s} {plan.get('summary', ''):40s} step {measured_s * 1e3:7.1f} ms "
              f"(predicted {predicted_s * 1e3:7.1f}, ratio {predicted_s / measured_s:4.2f})  "
              f"peak {memory / 2**30:6.2f} GiB (predicted {predicted_memory / 2**30:6.2f}, "
              f"ratio {memory / predicted_memory:4.2f})  loss {records[0]['loss']:.3f} -> "
              f"{records[-1]['loss']:.3f}")
        reserved = results[name]["reserved_bytes"]
        if reserved:   # the allocator under partc train's setting (expandable segments)
            print(f"  {'':14s} reserved {reserved / 2**30:6.2f} GiB at the peak: "
                  f"{100 * (reserved - memory) / reserved:.1f}% beside the tensors "
                  f"(the plan reserves {100 * _fragmentation():.0f}%)")
        if plan.get("compile_time_s") is not None or plan.get("fp8"):
            print(f"  {'':14s} first step {records[0]['step_time_s']:.1f} s (compiling: "
                  f"estimated {plan.get('compile_time_s') or 0:.1f} s); FP8 linears "
                  f"{plan.get('fp8', 0)}")
    return results


def _fragmentation() -> float:
    """The share of memory the preset keeps back for the allocator's fragmentation."""
    from partc.device.budget import PRESETS

    preset = PRESETS.get(_preset())
    return (preset.memory_fragmentation or 0.0) if preset is not None else 0.0


def _plan_summary(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    plan = json.loads(path.read_text())
    stage = plan["stages"][0]
    recompute = stage.get("recompute")
    modes = sorted(set(recompute.values())) if isinstance(recompute, dict) else [recompute]
    micro = plan.get("micro_batch_size")
    count = plan.get("num_microbatches")
    fp8 = plan.get("fp8")
    return {"microbatches": count, "micro_batch": micro, "recompute": modes,
            "compile_time_s": (plan.get("predicted") or {}).get("compile_time_s"),
            "fp8": len(fp8.get("linears", ())) if isinstance(fp8, dict) else len(fp8 or ()),
            "summary": f"{count} x {micro}, recompute {'/'.join(map(str, modes))}"}


# ---------------------------------------------------------------------------- memory

def memory_cases() -> list[Any]:
    """memory_check's cases at GPU sizes: activations of GiBs, so that allocator
    rounding and library workspaces (cuBLAS's) are small beside what the plan counts."""
    from benchmarks import memory_check as mc

    bf16 = torch.bfloat16
    if SMOKE:
        size = dict(batch=8, seq=32, layers=4, width=64, heads=4, vocab=128, device="CPU")
    else:
        size = dict(batch=16, seq=1024, layers=8, width=1024, heads=8, vocab=50304,
                    device=_preset())
    pipeline = dict(world=2, ranks=(0, 1), pp=2, schedule="1f1b", num_microbatches=4)

    def case(name: str, model: str = "gpt", **rest: Any) -> Any:
        fields = {**size, **rest}
        constraints = {k: v for k, v in fields.items() if k not in mc.Case.__dataclass_fields__}
        kept = {k: v for k, v in fields.items() if k in mc.Case.__dataclass_fields__}
        return mc.Case(name=name, model=model, constraints=constraints, **kept)

    return [
        case("gpt-pp1-m2-fp32", pp=1, num_microbatches=2, recompute="none"),
        case("gpt-pp1-m2-bf16", dtype=bf16, pp=1, num_microbatches=2, recompute="none"),
        case("gpt-pp2-1f1b-m4-bf16", dtype=bf16, **pipeline, recompute="none"),
        case("gpt-pp2-1f1b-m4-full-bf16", dtype=bf16, **pipeline, recompute="full"),
        case("gpt-dp2-zero1-bf16", dtype=bf16, world=2, pp=1, dp=2, zero_stage=1,
             num_microbatches=1, recompute="none"),
        case("gpt-dp2-zero3-bf16", dtype=bf16, world=2, pp=1, dp=2, zero_stage=3,
             num_microbatches=1, recompute="none"),
        case("gpt-tp2-sp-bf16", dtype=bf16, world=2, pp=1, tp=2, sequence_parallel=True,
             num_microbatches=1, recompute="selective"),
        case("llama-pp1-bf16", "llama", dtype=bf16, pp=1, num_microbatches=1,
             recompute="none"),
    ]


def memory_worker(out: Path, name: str, prepare: bool) -> None:
    """One case in this process (a fresh CUDA context and allocator per case)."""
    from benchmarks import memory_check as mc

    case = next(c for c in memory_cases() if c.name == name)
    if prepare:
        mc.compile_case(case)
        return
    device = _device_memory_before()
    snapshot = torch.cuda.is_available() and os.environ.get("PARTC_GPU_SNAPSHOT") == name
    if snapshot:   # every allocation with its Python stack: what the peak holds
        torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
    rows = mc.check_case(case)
    if snapshot:
        torch.cuda.memory._dump_snapshot(str(out / "memory" / f"{name}.pickle"))
        torch.cuda.memory._record_memory_history(enabled=None)
    result = [{"case": row.case, "rank": row.rank, "stage": row.stage,
               "predicted_peak": row.predicted["peak"], "tracked_peak": row.measured.peak,
               "cuda_peak": row.measured.cuda_peak, "phase": row.measured.phase,
               "predicted": row.predicted, "tracked": row.measured.at_peak,
               "device": _device_memory_after(device)}
              for row in rows]
    (out / "memory" / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(mc.table(rows))


def _device_memory_before() -> dict[str, Any]:
    """What partc.device.usable keeps back, as this GPU shows it: the total CUDA reports,
    and what the context takes before the first tensor (total - free - reserved)."""
    if not torch.cuda.is_available():
        return {}
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    return {"total_memory": torch.cuda.get_device_properties(0).total_memory,
            "context": total - free - torch.cuda.memory_reserved()}


def _device_memory_after(device: dict[str, Any]) -> dict[str, Any]:
    """... and the allocator's peak reserved beside its peak allocated: the share lost
    to fragmentation (one process: no NCCL communicator)."""
    if not device:
        return {}
    reserved, allocated = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
    return {**device, "max_reserved": reserved, "max_allocated": allocated,
            "fragmentation": (reserved - allocated) / reserved if reserved else 0.0}


def run_memory(out: Path, prepare: bool = False) -> dict[str, Any]:
    (out / "memory").mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for case in filter(lambda case: _wanted(case.name), memory_cases()):
        command = [sys.executable, str(Path(__file__)), "--worker", "memory",
                   "--case", case.name, "--out", str(out)] + (["--prepare"] if prepare else [])
        code = _run(command, 300, out / "memory" / f"{case.name}.log")
        path = out / "memory" / f"{case.name}.json"
        if prepare:
            continue
        if not path.exists():
            results[case.name] = {"exit": code}
            continue
        for row in json.loads(path.read_text()):
            results[f"{case.name}/rank{row['rank']}"] = row
            measured = row["cuda_peak"] if row["cuda_peak"] is not None else row["tracked_peak"]
            what = "cuda max allocated" if row["cuda_peak"] is not None else "tracked"
            ratio = measured / row["predicted_peak"]
            print(f"  {case.name:28s} rank {row['rank']} predicted "
                  f"{row['predicted_peak'] / 2**30:7.3f} GiB  {what} {measured / 2**30:7.3f} "
                  f"GiB  ratio {ratio:4.2f} {'ok' if abs(ratio - 1) <= 0.10 else 'OFF'}  "
                  f"(tracked {row['tracked_peak'] / 2**30:.3f}, peak in {row['phase']})")
            if row.get("device"):
                device = row["device"]
                print(f"  {'':28s} CUDA reports {device['total_memory']:,} bytes; context "
                      f"{device['context'] / 2**20:.0f} MiB; reserved/allocated at peak "
                      f"{device['max_reserved'] / 2**30:.3f}/{device['max_allocated'] / 2**30:.3f}"
                      f" GiB (fragmentation {100 * device['fragmentation']:.1f}%)")
    return results


# ---------------------------------------------------------------------------- calibrate

def run_calibrate(out: Path, trained: dict[str, Any]) -> dict[str, Any]:
    profile = out / "profile.json"
    command = [sys.executable, "-m", "partc", "calibrate", "--out", str(profile), "-q",
               "--processes", "1"] + ([] if torch.cuda.is_available() else ["--quick"])
    code = _run(command, 300, out / "calibrate.log")
    if code or not profile.exists():
        return {"exit": code}
    results: dict[str, Any] = {"profile": json.loads(profile.read_text()).get("budget")}
    target = f"{Path(__file__)}:factory"
    for name, row in trained.items():
        plan = row.get("plan") if isinstance(row, dict) else None
        if not plan or "measured_step_s" not in row:
            continue
        recompute = plan["recompute"][0] if len(plan["recompute"]) == 1 else None
        pins = ["--micro-batch", str(plan["micro_batch"])]
        if recompute is not None:
            pins += ["--recompute", recompute]
        directory = out / "calibrated" / name
        command = [sys.executable, "-m", "partc", "plan", target, "--devices", "1",
                   "--profile", str(profile), "--dtype", "bf16", "-q", *pins,
                   "--out", str(directory)]
        (out / "calibrated").mkdir(parents=True, exist_ok=True)
        _run(command, 300, out / "calibrated" / f"{name}.log")
        plan_json = directory / "plan.json"
        if not plan_json.exists():
            continue
        predicted = json.loads(plan_json.read_text())["predicted"]["step_time_s"]
        measured = row["measured_step_s"]
        results[name] = {"predicted_step_s": predicted, "measured_step_s": measured}
        print(f"  {name:14s} calibrated prediction {predicted * 1e3:7.1f} ms, measured "
              f"{measured * 1e3:7.1f} ms, ratio {predicted / measured:4.2f}")
    return results


# ---------------------------------------------------------------------------- profile

PROFILE_PLANS = {"none-m8": dict(recompute="none", micro=8),
                 "full-m1": dict(recompute="full", micro=1),
                 # As `partc train` steps: telemetry's syncs and its gradient norm.
                 "full-m1-telemetry": dict(recompute="full", micro=1, telemetry=True),
                 # none-m8 with scaled_dot_product_attention preferring cuDNN's kernel
                 # (torch's default order tries FlashAttention-2 first; the Hopper
                 # presets price cuDNN's rate): its speed, and its losses beside none-m8's.
                 "none-m8-cudnn": dict(recompute="none", micro=8, cudnn=True)}
# Attention kernels by the backend that launched them, by name: torch's
# FlashAttention-2, cuDNN's fused attention, the memory-efficient (CUTLASS) kernels.
ATTENTION_KERNELS = {"flash": ("flash_fwd", "flash_bwd", "flash::"),
                     "cudnn": ("cudnn", "sdpa"),
                     "efficient": ("fmha_cutlass", "efficient_attention")}


def _attention_context(pins: dict[str, Any]) -> Any:
    """cuDNN first where the case asks for it, torch's order otherwise."""
    import contextlib

    if not pins.get("cudnn"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(order, set_priority=True)


def _attention_backend(name: str) -> str | None:
    lowered = name.lower()
    return next((backend for backend, keys in ATTENTION_KERNELS.items()
                 if any(key in lowered for key in keys)), None)


def profile_worker(out: Path, name: str, prepare: bool = False) -> None:
    """Under torchrun, one process: build plan ``name`` and profile two steps (with
    ``prepare``: only plan it)."""
    from torch.profiler import ProfilerActivity, profile

    import partc

    torch.manual_seed(0)   # the same weights in every case: their losses compare
    workload = factory()
    pins = PROFILE_PLANS[name]
    batch = _sizes()["batch"]
    program = partc.compile(
        workload["model"], workload["example_inputs"], loss_fn=workload["loss_fn"],
        budget=partc.DeviceBudget(num_devices=1, device=_preset()),
        train=partc.TrainSpec(global_batch_size=batch, dtype=torch.bfloat16),
        constraints=partc.Constraints(recompute=pins["recompute"], num_microbatches=pins["micro"]))
    if prepare:
        return
    module = program.build()
    if pins.get("telemetry"):
        module.telemetry(console=False)
    optimizer = module.optimizer(torch.optim.AdamW, lr=3e-4)
    data = workload["data"]
    on_gpu = torch.cuda.is_available()

    losses: list[float] = []

    def step(i: int) -> None:
        x, y = data(i)
        with _attention_context(pins):   # the first step compiles under it too
            losses.append(float(module.forward_backward(x, target=y)))
        optimizer.step()
        optimizer.zero_grad()

    for i in range(3):
        step(i)
    if on_gpu:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    steps = 2
    with profile(activities=activities, record_shapes=True) as prof:
        started = time.perf_counter()
        for i in range(steps):
            step(3 + i)
        if on_gpu:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - started) / steps
    started = time.perf_counter()
    for i in range(steps):
        step(3 + steps + i)
    if on_gpu:
        torch.cuda.synchronize()
    unprofiled = (time.perf_counter() - started) / steps
    events = prof.events()
    kernels = [e for e in events if getattr(e, "device_type", None) is not None
               and str(e.device_type).endswith("CUDA") and e.time_range.elapsed_us() > 0]
    busy_sum = sum(e.time_range.elapsed_us() for e in kernels) / 1e6 / steps
    intervals = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    union, end = 0.0, float("-inf")
    for start, stop in intervals:
        if stop > end:
            union += stop - max(start, end)
            end = stop
    aten = sum(1 for e in events if e.name.startswith("aten::")
               and str(getattr(e, "device_type", "CPU")).endswith("CPU"))
    sort = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60)
    shapes = prof.key_averages(group_by_input_shape=True).table(
        sort_by=sort, row_limit=40, max_name_column_width=40, max_shapes_column_width=80)
    launched_by = _optimizer_launches(events)
    heavy_s = light_s = optimizer_s = 0.0
    attention_s: dict[str, float] = {}
    for kernel in kernels:
        seconds = kernel.time_range.elapsed_us() / 1e6 / steps
        backend = _attention_backend(kernel.name)
        if backend is not None:
            attention_s[backend] = attention_s.get(backend, 0.0) + seconds
        if launched_by(kernel):
            optimizer_s += seconds
        elif _is_heavy_kernel(kernel.name):
            heavy_s += seconds
        else:
            light_s += seconds
    result = {"plan": name, "wall_step_s": wall, "unprofiled_step_s": unprofiled,
              "kernel_time_sum_s": busy_sum,
              "kernel_busy_s": union / 1e6 / steps, "kernels_per_step": len(kernels) / steps,
              "aten_calls_per_step": aten / steps,
              "predicted_step_s": program.plan.predicted.step_time_s,
              "measured_kernels_s": {"heavy": heavy_s, "light": light_s,
                                     "optimizer": optimizer_s},
              "predicted_parts_s": predicted_parts(program),
              "attention_kernels_s": attention_s, "losses": losses}
    (out / f"profile-{name}.json").write_text(json.dumps(result, indent=1))
    (out / f"profile-{name}.txt").write_text(table + "\n\nby input shape\n" + shapes)
    module.close()


def _optimizer_launches(events: Any) -> Any:
    """Whether a kernel was launched by the optimizer's step: the op that launched it
    (the profiler's correlation, ``linked_correlation_id``) runs inside
    ``Optimizer.step``. Not whether it ran during the step's host time: the host runs
    ahead of the GPU, and backward's last kernels run while it is inside the step (on
    the H100, 50 ms of a step's 63 were backward's). Where the profiler links no op
    (older torch), the kernel's start inside the step's host time decides."""
    ops = {e.id: e for e in events if str(getattr(e, "device_type", "CPU")).endswith("CPU")}
    ranges = [e.time_range for e in events if e.name.startswith("Optimizer.step")]

    def launched_by(kernel: Any) -> bool:
        op = ops.get(getattr(kernel, "linked_correlation_id", 0) or None)
        if op is None:
            return any(r.start <= kernel.time_range.start <= r.end for r in ranges)
        while op is not None:
            if op.name.startswith("Optimizer.step"):
                return True
            op = op.cpu_parent
        return False

    return launched_by


def _is_heavy_kernel(name: str) -> bool:
    """A matmul or attention kernel (cuBLAS's, CUTLASS's, flash attention's)."""
    lowered = name.lower()
    return any(key in lowered for key in ("gemm", "nvjet", "xmma", "cutlass", "flash",
                                          "fmha", "attention"))


def predicted_parts(program: Any) -> dict[str, float]:
    """The plan's step on one stage split as the cost model prices it: the heavy ops'
    compute-bound seconds, the rest (memory-bound ops, the device's time per kernel and
    the dispatch floor; ``light_bytes`` the bytes alone), every microbatch's forward,
    backward and recompute together; the kernels the estimate counts them launching
    (the gradients' adds into their buckets among them: one per parameter tensor and
    microbatch), and their device time; and the tail."""
    problem, plan = program.problem, program.plan
    stage = plan.stages[0]
    count, micro = plan.num_microbatches, plan.micro_batch_size
    undispatched = dataclasses.replace(problem.devices, op_overhead_s=0.0,
                                       op_overhead_backward_s=0.0, kernel_overhead_s=0.0)
    parts = {"heavy": 0.0, "light": 0.0, "light_bytes": 0.0, "kernels": 0}
    for layer in problem.model.layers:
        if layer.name not in stage.layers:
            continue
        mode = stage.recompute.get(layer.name, "none")
        for devices, light in ((problem.devices, "light"), (undispatched, "light_bytes")):
            work = layer_work(layer, devices, micro, problem.train.measured_scale,
                              plan.train.compile)
            phases = (work["forward"], work["backward"], work["recompute"][mode])
            parts[light] += count * sum(memory for _, memory in phases)
        parts["heavy"] += count * sum(compute for compute, _ in phases)
        kernels = layer.kernels
        parts["kernels"] += count * (kernels["forward"] + kernels["backward"]
                                     + kernels["recompute"][mode] + layer.param_tensors)
    parts["kernel_time"] = parts["kernels"] * problem.devices.kernel_overhead_s
    parts["tail"] = stage.time_s.tail
    parts["stage_time"] = {"forward": stage.time_s.forward, "backward": stage.time_s.backward,
                           "recompute": stage.time_s.recompute, "comm": stage.time_s.comm,
                           "tail": stage.time_s.tail}
    return parts


def run_profile(out: Path, prepare: bool = False) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in filter(_wanted, PROFILE_PLANS):
        worker = [str(Path(__file__)), "--worker", "profile", "--case", name, "--out", str(out)]
        if prepare:
            _run([sys.executable, *worker, "--prepare"], 900, out / f"profile-{name}.log")
            continue
        code = _run(_torchrun(*worker), 300, out / f"profile-{name}.log")
        path = out / f"profile-{name}.json"
        if not path.exists():
            results[name] = {"exit": code}
            continue
        row = results[name] = json.loads(path.read_text())
        print(f"  {name:10s} wall {row['wall_step_s'] * 1e3:7.1f} ms/step (unprofiled "
              f"{row['unprofiled_step_s'] * 1e3:7.1f}), GPU busy "
              f"{row['kernel_busy_s'] * 1e3:7.1f} ms (kernels' sum "
              f"{row['kernel_time_sum_s'] * 1e3:7.1f}), {row['kernels_per_step']:.0f} "
              f"kernels ({row['predicted_parts_s'].get('kernels', 0):.0f} counted by the "
              f"estimate) and {row['aten_calls_per_step']:.0f} aten calls a step; predicted "
              f"{row['predicted_step_s'] * 1e3:7.1f} ms")
        kernels, parts = row["measured_kernels_s"], row["predicted_parts_s"]
        print(f"  {'':10s} matmul/attention kernels {kernels['heavy'] * 1e3:7.1f} ms "
              f"(priced {parts['heavy'] * 1e3:7.1f} compute-bound), other kernels "
              f"{kernels['light'] * 1e3:7.1f} ms (priced {parts['light'] * 1e3:7.1f} "
              f"memory-bound and dispatch; {parts['light_bytes'] * 1e3:.1f} without the "
              f"dispatch floor), optimizer {kernels['optimizer'] * 1e3:6.1f} ms "
              f"(tail priced {parts['tail'] * 1e3:6.1f})")
        backends = ", ".join(f"{backend} {seconds * 1e3:.1f} ms"
                             for backend, seconds in row.get("attention_kernels_s", {}).items())
        print(f"  {'':10s} attention kernels: {backends or 'none found by name'}")
    _compare_losses(results, "none-m8", "none-m8-cudnn")
    return results


def _compare_losses(results: dict[str, Any], base: str, other: str) -> None:
    """The same steps' losses of two cases (one attention kernel against another): their
    largest relative difference, which bf16 rounding alone keeps near 1e-3."""
    first, second = (results.get(name, {}).get("losses") for name in (base, other))
    if not first or not second:
        return
    difference = max(abs(a - b) / max(abs(a), 1e-6) for a, b in zip(first, second))
    results[f"{other}-vs-{base}"] = {"max_loss_rel_diff": difference}
    print(f"  {other} against {base}: losses within {difference:.1e} over {len(first)} steps")


# ---------------------------------------------------------------------------- main

def environment() -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0],
                            "cuda": torch.version.cuda, "gpu": None}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        info["gpu_memory"] = torch.cuda.get_device_properties(0).total_memory
    info["preset"] = _preset()
    try:
        import ortools
        info["ortools"] = ortools.__version__
    except ImportError as error:
        info["ortools"] = f"missing: {error}"
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "gpu_check")
    parser.add_argument("--part", action="append", choices=PARTS,
                        help="a part to run (default: all, in order)")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, tiny sizes: check the script itself")
    parser.add_argument("--prepare", action="store_true",
                        help="only plan (fills PARTC_CACHE_DIR for a later run)")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="end every part within this many seconds from the start")
    parser.add_argument("--worker", choices=("parity", "memory", "profile"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--case", action="append",
                        help="only this memory or profile case (repeatable)")
    parser.add_argument("--plan", action="append", choices=[name for name, _ in TRAIN_PLANS],
                        help="only this train plan (repeatable)")
    args = parser.parse_args()
    if args.smoke:
        os.environ["PARTC_GPU_CHECK_SMOKE"] = "1"
        global SMOKE
        SMOKE = True
    args.out.mkdir(parents=True, exist_ok=True)
    if args.worker == "parity":
        return parity_worker(args.out)
    if args.worker == "memory":
        return memory_worker(args.out, args.case[0], args.prepare)
    if args.worker == "profile":
        return profile_worker(args.out, args.case[0], args.prepare)
    CASES[:] = args.case or []
    PLANS[:] = args.plan or []
    if args.budget is not None:
        DEADLINE[0] = time.perf_counter() + args.budget
    info = environment()
    print("environment:", json.dumps(info))
    (args.out / "environment.json").write_text(json.dumps(info, indent=1))
    parts = args.part or list(PARTS)
    if args.prepare:
        parts = [p for p in parts if p in ("train", "memory", "profile")]
    trained: dict[str, Any] = {}
    for part in parts:
        started = time.perf_counter()
        print(f"\n== {part}")
        if part == "parity":
            results = run_parity(args.out)
        elif part == "train":
            results = trained = run_train(args.out, args.prepare)
        elif part == "memory":
            results = run_memory(args.out, args.prepare)
        elif part == "profile":
            results = run_profile(args.out, args.prepare)
        else:
            if not trained and (args.out / "train.json").exists():
                trained = json.loads((args.out / "train.json").read_text())
            results = run_calibrate(args.out, trained)
        if not args.prepare:
            (args.out / f"{part}.json").write_text(json.dumps(results, indent=1, default=str))
        print(f"== {part}: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
