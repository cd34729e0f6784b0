"""Activation offload against recompute as the host link's bandwidth changes.

A Llama-7B-shaped model (32 layers, hidden 4096, 32 heads, MLP 11008, vocabulary 32000,
2048-token sequences; built on the meta device; attention fused unless ``--attention
as_written``), bf16 AdamW, 64 sequences per step, on
one node of 8 H100s with less memory per device than its activations need (``--memory``,
default 20 GiB), the mesh pinned (pp=1, dp=8, ZeRO-3) so that only the per-layer choice
and the microbatches move. For each host-to-device bandwidth (each way, per GPU) it plans
again and prints a row: how many layers keep, recompute (selective, full) or offload
their activations, which layers offload, the host memory a node's ranks take, the
predicted step time, and that step against the plan with offload off
(``Constraints(offload=())``) at the same bandwidth. Only activations may go to the host
(``Constraints(offload=("activations",))``): the optimizer and the parameters stay.

    python benchmarks/offload_choice.py [--memory 20] [--bandwidths 5,10,...,450]
                                        [--attention fused|as_written]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import partc  # noqa: E402
from partc.compiler import build_problem, plan_problem  # noqa: E402
from partc.passes.pipeline import analyze  # noqa: E402
from tests.models import causal_lm_loss  # noqa: E402

GB, GiB = 10**9, 2**30
SEQ, BATCH, DEVICES = 2048, 64, 8
# GB/s each way per GPU: PCIe 4 and 5 x16 (25, 50-64 in practice), and a Grace Hopper's
# NVLink-C2C (450).
BANDWIDTHS = (5, 10, 20, 25, 50, 64, 100, 200, 450)
MODES = ("none", "selective", "full", "offload")


def llama_7b() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                         intermediate_size=11008, vocab_size=32000, num_hidden_layers=32,
                         max_position_embeddings=SEQ, use_cache=False,
                         attn_implementation="eager")
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def base_problem(memory_gib: float, attention: str):
    ids = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    graph, analysis = analyze(llama_7b(), (ids,), loss_fn=causal_lm_loss, example_target=ids,
                              name="llama-7b", attention=attention)
    budget = partc.DeviceBudget(num_devices=DEVICES, device="H100-80GB",
                                memory=f"{memory_gib}GiB")
    train = partc.TrainSpec(global_batch_size=BATCH, dtype=torch.bfloat16, optimizer="adamw",
                            attention=attention)
    return build_problem(analysis, budget, train,
                         partc.Constraints(pp=1, dp=DEVICES, zero_stage=3), graph)


def at_bandwidth(problem, gbps: float, **pins):
    devices = replace(problem.devices, host_to_device_bandwidth=gbps * GB,
                      device_to_host_bandwidth=gbps * GB)
    return replace(problem, devices=devices, pins=replace(problem.pins, **pins))


def offloaded(plan: partc.Plan) -> str:
    names = [name for name, mode in plan.recompute.items() if mode == "offload"]
    if not names:
        return "-"
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", type=float, default=20.0, help="GiB per device")
    parser.add_argument("--bandwidths", default=",".join(map(str, BANDWIDTHS)))
    parser.add_argument("--attention", choices=("as_written", "fused"), default="fused",
                        help="the attention as Hugging Face's eager code writes it (its "
                             "probabilities saved), or fused (SDPA, flash-style)")
    args = parser.parse_args()
    start = time.perf_counter()
    problem = base_problem(args.memory, args.attention)
    print(f"llama-7b shape, seq {SEQ}, batch {BATCH}, attention {args.attention}, "
          f"{DEVICES} x H100 at {args.memory} GiB, "
          f"pp=1 dp={DEVICES} ZeRO-3, bf16 AdamW; host memory per node "
          f"{problem.devices.host_memory / GiB:.0f} GiB; analysed in "
          f"{time.perf_counter() - start:.1f} s\n")
    print("| host link (GB/s each way) | none / selective / full / offload | offloaded "
          "| b x m | host per node | step (predicted) | without offload | offload saves |")
    print("|---|---|---|---|---|---|---|---|")
    for gbps in (float(b) for b in args.bandwidths.split(",")):
        plan = plan_problem(at_bandwidth(problem, gbps, offload=("activations",)))
        plain = plan_problem(at_bandwidth(problem, gbps, offload=()))
        modes = list(plan.recompute.values())
        counts = " / ".join(str(modes.count(mode)) for mode in MODES)
        step, without = plan.predicted.step_time_s, plain.predicted.step_time_s
        print(f"| {gbps:g} | {counts} | {offloaded(plan)} "
              f"| {plan.micro_batch_size} x {plan.num_microbatches} "
              f"| {plan.host_bytes_per_node / GiB:.1f} GiB | {step * 1e3:.0f} ms "
              f"| {without * 1e3:.0f} ms | {100 * (1 - step / without):.1f}% |")
    print(f"\n{time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
