"""Step time of partc's emitted program against a hand-written torchtitan-style FSDP2
program: the same model, mesh, batch, precision and optimizer, side by side in one run.

    python benchmarks/torchtitan_side.py                 # starts torchrun with 2 processes
    python benchmarks/torchtitan_side.py --models gpt --zero 3 2 1 --rounds 30
    torchrun --standalone --nproc-per-node=2 benchmarks/torchtitan_side.py [...]

The hand-written program is what torchtitan's ``parallelize_llama`` does for a 1-D data
parallel mesh: ``fully_shard`` on the token embedding, each transformer block, and the
final norm with the head (the last unit kept gathered after forward, its backward comes
next; a tied embedding and head stay with the root), then on the root, with
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``; each rank trains
on its rows of the global batch, the loss is computed in fp32 on the logits, and AdamW
steps the fp32 shards. partc's program is the same model compiled with the plan pinned
to that mesh (dp=2, one microbatch, no recompute, ``TrainSpec(dtype=torch.bfloat16)``)
at ZeRO-3 (and, with ``--zero``, ZeRO-2 and ZeRO-1: the reference then keeps every
block gathered after forward, ``reshard_after_forward=False``), trained with its
runtime (``program.build()``, ``module.optimizer``, ``forward_backward``).

Models: the sample GPT (``samples/gpt.py``; tied embedding and head) and a Llama built
from a ``transformers`` config (``tests/hf_families.py``), sized so that a step takes a
few tenths of a second on two CPU processes with one thread each.

Every pair trains from the same weights on the same batches. After ``--warmup`` steps
of each, rounds alternate the two (A, B in even rounds, B, A in odd ones) so that drift
in the machine's speed hits both alike; a step is ``forward_backward`` (or forward,
loss, backward), the optimizer step and ``zero_grad`` between barriers, timed as the
slowest rank's. Printed per pair: the median step times, the ratio partc /
hand-written (target <= 1.05), the median of each round's ratio (steadier on a shared
machine), the ratio of the median CPU times (the busiest rank's process, every
thread: what each program computes, without the waits other processes cause), and
both losses at every step with their largest relative difference. The two compute in
bf16 with different roundings (partc keeps softmax, norms and the loss in fp32 under
autocast; FSDP2 alone runs them in bf16), so their losses agree to bf16's tolerance,
``LOSS_RTOL``, not fp32's.

``--out FILE`` writes the figures as JSON (``tests/runtime/test_torchtitan_side.py``
runs a small case that way and checks the losses).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

import partc  # noqa: E402
from partc.runtime import topology  # noqa: E402
from benchmarks.torchrun_launch import run_under_torchrun  # noqa: E402
from samples.gpt import GPT, GPTConfig  # noqa: E402
from tests import hf_families  # noqa: E402

# Relative difference of the two programs' losses that bf16 compute allows over the
# default 23 steps (a bf16 value carries 8 bits of mantissa: 2^-8 = 0.4% per rounding;
# the two differ in which ops round, not in what they compute). The two trajectories
# drift apart as they train: seen at most 3.2e-3 over 23 steps, 9.3e-3 over 43 (GPT).
LOSS_RTOL = 1e-2


@dataclass(frozen=True)
class Case:
    """One model: how to build it, its modules as torchtitan shards them, its loss and
    its batches."""
    name: str
    build: Callable[[], nn.Module]
    blocks: Callable[[nn.Module], nn.ModuleList]
    # The token embedding and the (final norm, head), each a unit of its own when the
    # embedding and the head are not tied; None leaves them to the root unit.
    embedding: Callable[[nn.Module], nn.Module] | None
    head: Callable[[nn.Module], list[nn.Module]] | None
    loss: Callable[[object, torch.Tensor], torch.Tensor]   # (model output, target)
    vocab: int
    seq: int


def _gpt_logits_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # In fp32 whatever the logits' dtype, as torchtitan's cross_entropy_loss does.
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten(0, 1))


def _causal_lm_loss(output, target: torch.Tensor) -> torch.Tensor:
    return _gpt_logits_loss(output.logits, target)


def cases(size: str) -> dict[str, Case]:
    """The models at ``size``: "bench" (a step of a few tenths of a second on 2 CPU
    processes) or "test" (tiny)."""
    width, layers, vocab, seq = (256, 4, 2048, 128) if size == "bench" else (64, 2, 256, 32)

    def gpt() -> nn.Module:
        return GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=4,
                             n_embd=width, dropout=0.0))

    llama_family = hf_families.FAMILIES["llama"]
    llama_family = dataclasses.replace(llama_family, fields=dict(
        llama_family.fields, hidden_size=width, intermediate_size=(8 * width) // 3,
        num_hidden_layers=layers, vocab_size=vocab, max_position_embeddings=seq,
        num_attention_heads=4, num_key_value_heads=2))
    return {
        # The embedding is the head's weight: both stay with the root.
        "gpt": Case("gpt", gpt, lambda m: m.blocks, None, None, _gpt_logits_loss, vocab,
                    seq),
        "llama": Case("llama", llama_family.build, lambda m: m.model.layers,
                      lambda m: m.model.embed_tokens, lambda m: [m.model.norm, m.lm_head],
                      _causal_lm_loss, vocab, seq),
    }


# ---------------------------------------------------------------- the hand-written one

def apply_fsdp(model: nn.Module, case: Case, mesh, *, reshard_after_forward: bool) -> None:
    """torchtitan's ``apply_fsdp`` on a 1-D mesh: the token embedding, each block, and
    the final norm with the head are units, then the root takes the rest. The last
    unit is not resharded after forward: its backward runs right after, which would
    gather it again at once."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    units: list = []
    if case.embedding is not None:
        units.append(case.embedding(model))
    units += list(case.blocks(model))
    if case.head is not None:
        units.append(case.head(model))
    for index, unit in enumerate(units):
        fully_shard(unit, mesh=mesh, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward and index < len(units) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)


class HandWritten:
    """The reference program: FSDP2 over a dp mesh of every rank, AdamW, fp32 loss."""

    def __init__(self, case: Case, model: nn.Module, global_batch: int,
                 reshard_after_forward: bool, lr: float) -> None:
        self.model = copy.deepcopy(model)  # parameters of its own
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
        apply_fsdp(self.model, case, mesh, reshard_after_forward=reshard_after_forward)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.loss_fn = case.loss
        share = global_batch // dist.get_world_size()
        self.rows = slice(dist.get_rank() * share, (dist.get_rank() + 1) * share)

    def step(self, ids: torch.Tensor, target: torch.Tensor) -> float:
        """One training step on the global batch; returns its mean loss."""
        loss = self.loss_fn(self.model(ids[self.rows]), target[self.rows])
        loss.backward()  # FSDP reduce-scatters the mean gradient over dp, in fp32
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        return float(total)


# ----------------------------------------------------------------------- partc's one

class Emitted:
    """partc's program for the same model, plan pinned to the same mesh."""

    def __init__(self, case: Case, model: nn.Module, ids: torch.Tensor, target: torch.Tensor,
                 zero_stage: int, lr: float) -> None:
        program = partc.compile(
            model, (ids,), loss_fn=case.loss, example_target=target,
            budget=partc.DeviceBudget(num_devices=dist.get_world_size(), device="CPU"),
            train=partc.TrainSpec(global_batch_size=ids.shape[0], dtype=torch.bfloat16),
            constraints=partc.Constraints(pp=1, dp=dist.get_world_size(), tp=1,
                                          zero_stage=zero_stage, num_microbatches=1,
                                          recompute="none"))
        self.plan = program.plan
        self.module = program.build()
        self.optimizer = self.module.optimizer(torch.optim.AdamW, lr=lr)

    def step(self, ids: torch.Tensor, target: torch.Tensor) -> float:
        loss = self.module.forward_backward(ids, target=target)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss)


# ------------------------------------------------------------------------ the run

def batches(case: Case, global_batch: int, count: int) -> list[tuple[torch.Tensor, ...]]:
    """``count`` batches of (ids, next ids) with something to learn: half the tokens
    follow their predecessor (+1), the others are drawn at random, so that the loss
    falls from log(vocab) as the two programs train."""
    generator = torch.Generator().manual_seed(1)
    found = []
    for _ in range(count):
        tokens = torch.randint(1, case.vocab, (global_batch, case.seq + 1), generator=generator)
        follows = torch.rand(global_batch, case.seq + 1, generator=generator) < 0.5
        for position in range(1, case.seq + 1):
            successor = tokens[:, position - 1] % (case.vocab - 1) + 1
            tokens[:, position] = torch.where(follows[:, position], successor,
                                              tokens[:, position])
        found.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return found


def timed(run: Callable[[torch.Tensor, torch.Tensor], float], ids: torch.Tensor,
          target: torch.Tensor) -> tuple[float, float, float]:
    """(seconds of the slowest rank, CPU seconds of the busiest, loss) of one step
    between barriers. The CPU time (every thread of the process) does not count the
    waits that other programs on a shared machine inflict, which the wall time does."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    loss = run(ids, target)
    elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - cpu])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed[0]), float(elapsed[1]), loss


def compare(case: Case, zero_stage: int, args: argparse.Namespace) -> dict:
    """Train both programs side by side; their step times and losses."""
    torch.manual_seed(0)
    model = case.build()
    data = batches(case, args.batch, 4)
    programs = {"partc": Emitted(case, model, *data[0], zero_stage, args.lr).step,
                "hand-written": HandWritten(case, model, args.batch,
                                            reshard_after_forward=zero_stage >= 3,
                                            lr=args.lr).step}
    times: dict[str, list[float]] = {name: [] for name in programs}
    cpu_times: dict[str, list[float]] = {name: [] for name in programs}
    losses: dict[str, list[float]] = {name: [] for name in programs}
    for round_ in range(args.warmup + args.rounds):
        ids, target = data[round_ % len(data)]
        order = list(programs) if round_ % 2 == 0 else list(reversed(programs))
        for name in order:
            seconds, cpu_seconds, loss = timed(programs[name], ids, target)
            losses[name].append(loss)
            if round_ >= args.warmup:
                times[name].append(seconds)
                cpu_times[name].append(cpu_seconds)
    medians = {name: statistics.median(t) for name, t in times.items()}
    cpu_medians = {name: statistics.median(t) for name, t in cpu_times.items()}
    differences = [abs(a - b) / abs(b) for a, b in zip(losses["partc"], losses["hand-written"])]
    # The two steps of a round run back to back, under the same load: their ratio's
    # median shrugs off the load's swings, which the medians of each see apart.
    paired = statistics.median(a / b for a, b in zip(times["partc"], times["hand-written"]))
    return {"model": case.name, "zero_stage": zero_stage, "median_s": medians,
            "ratio": medians["partc"] / medians["hand-written"], "paired_ratio": paired,
            "cpu_median_s": cpu_medians,
            "cpu_ratio": cpu_medians["partc"] / cpu_medians["hand-written"],
            "losses": losses, "max_loss_rdiff": max(differences), "times_s": times}


def report(result: dict, args: argparse.Namespace) -> None:
    medians = result["median_s"]
    print(f"\n{result['model']}, dp=2, ZeRO-{result['zero_stage']} against FSDP2 "
          f"(reshard_after_forward={result['zero_stage'] >= 3}), bf16 params / fp32 "
          f"reduce, global batch {args.batch}, median of {args.rounds} steps each:")
    for name, seconds in medians.items():
        cpu = result["cpu_median_s"][name]
        print(f"  {name:13s} {seconds * 1e3:8.1f} ms   (CPU {cpu * 1e3:.1f} ms)")
    print(f"  ratio partc / hand-written: {result['ratio']:.3f}   (target <= 1.05; median "
          f"of the rounds' ratios {result['paired_ratio']:.3f}, of CPU times "
          f"{result['cpu_ratio']:.3f})")
    print("  step  " + "".join(f"{name:>15s}" for name in result["losses"]))
    for step, pair in enumerate(zip(*result["losses"].values())):
        print(f"  {step:4d}  " + "".join(f"{loss:15.6f}" for loss in pair))
    verdict = "agree" if result["max_loss_rdiff"] <= LOSS_RTOL else "DISAGREE"
    print(f"  largest relative loss difference {result['max_loss_rdiff']:.2e}: losses "
          f"{verdict} within {LOSS_RTOL:g} (bf16)")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["gpt", "llama"],
                        choices=("gpt", "llama"))
    parser.add_argument("--zero", nargs="*", type=int, default=[3], choices=(1, 2, 3),
                        help="partc's ZeRO stages to run against FSDP2")
    parser.add_argument("--rounds", type=int, default=20, help="timed steps per program")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each first")
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate")
    parser.add_argument("--size", default="bench", choices=("bench", "test"))
    parser.add_argument("--out", help="also write the results as JSON here (rank 0)")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    models = cases(args.size)
    results = []
    for name in args.models:
        for zero_stage in args.zero:
            result = compare(models[name], zero_stage, args)
            results.append(result)
            if dist.get_rank() == 0:
                report(result, args)
    if dist.get_rank() == 0 and args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    dist.barrier()
    topology.leave()


if __name__ == "__main__":
    run_under_torchrun(main)
