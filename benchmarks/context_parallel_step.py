"""Step time of context parallelism's two kinds, ring and all-to-all, at cp=2 on CPU,
beside the plan's predicted step time.

    python benchmarks/context_parallel_step.py             # starts torchrun with 2 processes
    torchrun --standalone --nproc-per-node=2 benchmarks/context_parallel_step.py \\
        [--seqs 256 512 1024] [--steps 5]

A small Llama (Hugging Face's, SDPA attention, grouped-query: 8 heads, 4 key/value
heads) trains on one sequence split over the two ranks, each kind in turn, at each
length: the median of ``--steps`` steps (``forward_backward`` and an SGD step) after
one warm-up. The prediction is the plan's (``plan.predicted.step_time_s``) for
``Constraints(cp=2, cp_kind=...)`` on a budget of 2 CPU devices (the preset's figures,
or a calibration profile's with ``--profile``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import partc  # noqa: E402
from partc.runtime import topology  # noqa: E402
from benchmarks.torchrun_launch import run_under_torchrun  # noqa: E402

KINDS = ("ring", "all-to-all")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=192)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--profile", default=None,
                        help="a calibration profile (partc calibrate) for the budget")
    return parser.parse_args()


def llama(hidden: int, layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, num_attention_heads=8, num_key_value_heads=4,
                         intermediate_size=2 * hidden, vocab_size=1000,
                         num_hidden_layers=layers, max_position_embeddings=8192,
                         use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config)


def loss_fn(output, target: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def program_for(model: torch.nn.Module, ids: torch.Tensor, kind: str,
                profile: str | None) -> partc.Program:
    """The cp=2 program of ``kind``, planned for 2 CPU devices."""
    budget = partc.DeviceBudget(num_devices=2, device="CPU", **(
        {"profile": profile} if profile else {}))
    return partc.compile(model, ids, loss_fn=loss_fn, example_target=ids, budget=budget,
                         train=partc.TrainSpec(global_batch_size=1, optimizer="sgd"),
                         constraints=partc.Constraints(pp=1, cp=2, cp_kind=kind,
                                                       recompute="none"))


def measure(program: partc.Program, ids: torch.Tensor, steps: int) -> float:
    module = program.build()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    times = []
    for step in range(steps + 1):
        dist.barrier()
        started = time.perf_counter()
        module.forward_backward(ids, target=ids)
        optimizer.step()
        optimizer.zero_grad()
        if step:  # the first builds the schedule's buffers
            times.append(time.perf_counter() - started)
    module.close()
    return statistics.median(times)


def main() -> None:
    args = arguments()
    dist.init_process_group("gloo")
    model = llama(args.hidden, args.layers)
    rows = []
    for seq in args.seqs:
        ids = torch.randint(1, 1000, (1, seq), generator=torch.Generator().manual_seed(seq))
        for kind in KINDS:
            program = program_for(model, ids, kind, args.profile)
            rows.append((seq, kind, measure(program, ids, args.steps),
                         program.plan.predicted.step_time_s))
    if dist.get_rank() == 0:
        print(f"Llama hidden {args.hidden}, {args.layers} layers, 8 heads / 4 KV heads, one "
              f"sequence a step, cp=2 on 2 gloo CPU processes (1 thread each); median of "
              f"{args.steps} steps")
        print(f"  {'seq':>6s} {'kind':>10s} {'measured':>10s} {'predicted':>10s} "
              f"{'ring/a2a':>8s}")
        measured = {(seq, kind): t for seq, kind, t, _ in rows}
        for seq, kind, took, predicted in rows:
            guess = f"{predicted * 1e3:7.1f} ms"
            ratio = (f"{measured[(seq, 'ring')] / measured[(seq, 'all-to-all')]:8.2f}"
                     if kind == "all-to-all" else "")
            print(f"  {seq:6d} {kind:>10s} {took * 1e3:7.1f} ms {guess:>10s} {ratio}")
    dist.barrier()
    topology.leave()


if __name__ == "__main__":
    run_under_torchrun(main)
