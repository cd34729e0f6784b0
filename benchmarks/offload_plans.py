"""Offload as a plan: models that have no plan on their GPUs without it, planned with and
without (``Constraints(offload=())``), side by side.

1. ZeRO-Offload's headline (Ren et al., 2021: a 13B GPT-2-style model trained on one
   32 GB V100, about 40 TFLOPS on a 10B model): a 13B GPT (40 layers, hidden 5120,
   sequence 1024, samples/gpt.py on the meta device) on one 32 GiB V100-like GPU (125
   TFLOP/s fp16, 900 GB/s, PCIe Gen3 at 12 GB/s each way, a guessed 2e9 host Adam
   updates per second) with 256 GiB of host memory, fp16 planned (not run);
2. Llama-2 7B and 70B shapes (Hugging Face configs on the meta device, sequence 2048,
   bf16, AdamW) on 1 and 8 H100-80GB with the preset's host (2 TB per node, 50 GB/s).

Each row: whether a plan exists, what it offloads, its mesh, ZeRO stage and recompute,
the predicted step time and model TFLOP/s per GPU (6 x parameters x tokens plus
attention, no recompute: the plan's MFU times the peak), device peak and host bytes per
node.

3. ``--sweep``: Llama-2 7B on 2 H100s of ``--sweep-memory`` at several host link rates, nothing pinned:
   which rates make the planner offload (and recompute less).

    python benchmarks/offload_plans.py [--only gpt13b,llama7b-1,...] [--sweep 2GB/s,50GB/s]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import partc  # noqa: E402
from partc.device.budget import dtype_key  # noqa: E402
from samples.gpt import GPT, GPTConfig, loss_fn  # noqa: E402
from samples.plan_llama import build_llama, causal_lm_loss  # noqa: E402

V100 = dict(device="A100-40GB", memory="32GiB", hbm_bandwidth="900GB/s",
            peak_flops={"float16": 125e12, "bfloat16": 125e12, "float32": 15.7e12},
            host_memory="256GiB", host_to_device_bandwidth="12GB/s",
            device_to_host_bandwidth="12GB/s", host_adam_rate=2e9)
LLAMA2_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)
LLAMA2_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8, vocab_size=32000)


def gpt13b():
    config = GPTConfig(n_layer=40, n_head=40, n_embd=5120, vocab_size=50257,
                       block_size=1024, dropout=0.0)
    with torch.device("meta"):
        model = GPT(config)
    ids = torch.zeros(1, 1024, dtype=torch.long, device="meta")
    return model, ids, loss_fn


def llama(shape: dict):
    ids = torch.zeros(1, 2048, dtype=torch.long, device="meta")
    return build_llama(shape), ids, causal_lm_loss


CASES = {
    "gpt13b": (gpt13b, dict(num_devices=1, **V100), 64, torch.float16, "adam"),
    "gpt13b-b512": (gpt13b, dict(num_devices=1, **V100), 512, torch.float16, "adam"),
    "llama7b-1": (lambda: llama(LLAMA2_7B), dict(num_devices=1, device="H100"), 64,
                  torch.bfloat16, "adamw"),
    "llama7b-8": (lambda: llama(LLAMA2_7B), dict(num_devices=8, device="H100"), 64,
                  torch.bfloat16, "adamw"),
    "llama70b-1": (lambda: llama(LLAMA2_70B), dict(num_devices=1, device="H100"), 64,
                   torch.bfloat16, "adamw"),
    "llama70b-8": (lambda: llama(LLAMA2_70B), dict(num_devices=8, device="H100"), 64,
                   torch.bfloat16, "adamw"),
}


def describe(plan: partc.Plan) -> str:
    modes = sorted({str(m) for m in plan.recompute.values()})
    peak = plan.budget.figures.peak_flops
    if isinstance(peak, dict):
        peak = peak[dtype_key(plan.train.dtype)]
    peak *= plan.predicted.mfu
    return (f"offload={','.join(plan.offload) or 'none'} {plan.mesh} ZeRO-{plan.zero_stage} "
            f"b x m={plan.micro_batch_size}x{plan.num_microbatches} recompute={'/'.join(modes)} "
            f"step {plan.predicted.step_time_s:.2f} s, {peak / 1e12:.1f} TFLOP/s per GPU "
            f"(MFU {plan.predicted.mfu:.2f}), device peak "
            f"{plan.predicted.peak_memory_bytes / 2**30:.1f} GiB, host "
            f"{plan.host_bytes_per_node / 2**30:.0f} GiB/node, tail "
            f"{plan.predicted.tail_time_s:.2f} s")


def plan_case(name: str) -> None:
    build, budget, batch, dtype, optimizer = CASES[name]
    model, ids, loss = build()
    params = sum(p.numel() for p in model.parameters())
    print(f"{name}: {params / 1e9:.2f}B parameters, {budget['num_devices']} GPU(s), "
          f"global batch {batch} x {ids.shape[1]} tokens")
    for label, offload in (("planner's choice", None), ("without offload", ())):
        start = time.perf_counter()
        try:
            program = partc.compile(model, (ids,), loss_fn=loss, example_target=ids,
                                    budget=partc.DeviceBudget(**budget),
                                    train=partc.TrainSpec(global_batch_size=batch,
                                                          dtype=dtype, optimizer=optimizer),
                                    constraints=partc.Constraints(offload=offload),
                                    cache=None)
            what = describe(program.plan)
        except partc.PlanInfeasibleError as error:
            what = f"no plan: {str(error).splitlines()[0][:160]}"
        print(f"  {label:<17} {what} [{time.perf_counter() - start:.0f} s to plan]",
              flush=True)


def sweep(rates: list[str], memory: str) -> None:
    """Llama-2 7B on 2 H100s of ``memory`` at each host link rate (both ways): where offload's
    copies are cheap the planner offloads and recomputes less; where they are dear it
    keeps the state on the devices (ZeRO) and recomputes more."""
    model, ids, loss = llama(LLAMA2_7B)
    print(f"llama7b on 2 x H100 of {memory}, global batch 64 x 2048, by host link rate")
    for entry in rates:   # LINK or LINK@ADAM_RATE
        link, _, adam = entry.partition("@")
        budget = partc.DeviceBudget(num_devices=2, device="H100", memory=memory,
                                    host_to_device_bandwidth=link,
                                    device_to_host_bandwidth=link,
                                    host_adam_rate=float(adam) if adam else None)
        program = partc.compile(model, (ids,), loss_fn=loss, example_target=ids,
                                budget=budget,
                                train=partc.TrainSpec(global_batch_size=64,
                                                      dtype=torch.bfloat16, optimizer="adamw"),
                                cache=None)
        print(f"  {entry:>14}: {describe(program.plan)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(CASES))
    parser.add_argument("--sweep", default="", help="host link rates for the sweep, each with "
                        "the host's Adam rate if not the preset's, e.g. "
                        "2GB/s,50GB/s,50GB/s@4e10 (none: no sweep)")
    parser.add_argument("--sweep-memory", default="64GiB")
    args = parser.parse_args()
    for name in filter(None, args.only.split(",")):
        plan_case(name)
    if args.sweep:
        sweep(args.sweep.split(","), args.sweep_memory)


if __name__ == "__main__":
    main()
