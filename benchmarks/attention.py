"""Attention as written against fused, on a Llama-3-8B-shaped model at long sequences.

    python benchmarks/attention.py                          # seq 4096 and 8192, 8 x H100
    python benchmarks/attention.py --seq 2048 --devices 16 --device A100-80GB

The model is Hugging Face Llama with Llama-3-8B's shapes and eager attention (matmul +
softmax, as ``tests/models.llama3_8b_config``), built on the meta device. For each
sequence length, and with ``TrainSpec(attention="as_written")`` and ``"fused"``
(``partc.passes.fuse_attention``: one ``scaled_dot_product_attention`` per block):

- what one decoder layer keeps for backward per sequence, at the training dtype (bf16),
  without recompute: the written attention keeps the (seq x seq) probabilities of its
  32 heads, the fused one q, k, v, the output and a log-sum-exp per row;
- its forward and backward FLOPs per sequence (backward of the fused kernel recomputes
  the scores: 2.5x its forward instead of 2x) and forward memory traffic of the ops
  that are not matrix products (softmax, mask, scale and dropout go with fusion);
- the plan partc makes for a global batch of 64 sequences on the budget, recompute and
  mesh chosen by the planner: predicted step time, peak memory, mesh, recompute modes.

The last column is fused / as written. Figures are the cost model's, not measurements.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import partc  # noqa: E402
from partc.units import format_bytes, format_seconds  # noqa: E402
from tests import models  # noqa: E402

GLOBAL_BATCH = 64
ATTENTION = ("as_written", "fused")


def build() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(models.llama3_8b_config())


def compile_one(seq: int, attention: str, budget: partc.DeviceBudget) -> partc.Program:
    model = build()
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    return partc.compile(model, (ids,), loss_fn=models.causal_lm_loss, example_target=ids,
                         budget=budget, name=f"llama3-8b-seq{seq}", cache=None,
                         train=partc.TrainSpec(global_batch_size=GLOBAL_BATCH,
                                               dtype=torch.bfloat16, attention=attention))


def decoder_layer(program: partc.Program):
    return next(layer for layer in program.problem.model.layers
                if layer.name == "model.layers.0")


def rows(programs: dict[str, partc.Program]) -> list[tuple[str, str, str, str]]:
    scale = {a: p.problem.train.activation_scale for a, p in programs.items()}
    layer = {a: decoder_layer(p) for a, p in programs.items()}
    plan = {a: p.plan for a, p in programs.items()}

    def row(name: str, value, show) -> tuple[str, str, str, str]:
        written, fused = value(ATTENTION[0]), value(ATTENTION[1])
        ratio = f"{fused / written:.3f}" if written else "-"
        return name, show(written), show(fused), ratio

    def modes(a: str) -> str:
        counts: dict[str, int] = {}
        for stage in plan[a].stages:
            for mode in stage.recompute.values():
                counts[mode] = counts.get(mode, 0) + 1
        return ", ".join(f"{n} {m}" for m, n in sorted(counts.items()))

    return [
        row("saved per layer (no recompute)",
            lambda a: layer[a].saved_bytes["none"] * scale[a], format_bytes),
        row("saved per layer (selective)",
            lambda a: layer[a].saved_bytes.get("selective", layer[a].saved_bytes["none"])
            * scale[a], format_bytes),
        row("layer forward FLOPs", lambda a: layer[a].fwd_flops, lambda v: f"{v / 1e12:.2f} T"),
        row("layer backward FLOPs", lambda a: layer[a].bwd_flops, lambda v: f"{v / 1e12:.2f} T"),
        row("layer fwd traffic, light ops", lambda a: layer[a].fwd_mem_bytes * scale[a],
            format_bytes),
        row("predicted step time", lambda a: plan[a].predicted.step_time_s, format_seconds),
        row("predicted peak memory", lambda a: plan[a].predicted.peak_memory_bytes,
            format_bytes),
        row("MFU", lambda a: plan[a].predicted.mfu, lambda v: f"{100 * v:.1f}%"),
        ("mesh (pp, dp, tp)", *(str((plan[a].pp, plan[a].dp, plan[a].tp)) for a in ATTENTION),
         ""),
        ("microbatches x size", *(f"{plan[a].num_microbatches} x {plan[a].micro_batch_size}"
                                  for a in ATTENTION), ""),
        ("recompute", *(modes(a) for a in ATTENTION), ""),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, action="append",
                        help="sequence length (repeatable; default 4096 and 8192)")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--device", default="H100-80GB")
    args = parser.parse_args()
    budget = partc.DeviceBudget(num_devices=args.devices, device=args.device)
    for seq in args.seq or [4096, 8192]:
        started = time.perf_counter()
        programs = {a: compile_one(seq, a, budget) for a in ATTENTION}
        print(f"\nLlama-3-8B shapes, seq {seq}, global batch {GLOBAL_BATCH}, bf16, "
              f"{args.devices} x {args.device} (compiled both in "
              f"{time.perf_counter() - started:.0f} s)")
        table = [("", *ATTENTION, "ratio")] + rows(programs)
        widths = [max(len(r[i]) for r in table) for i in range(4)]
        for line in table:
            print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                            for i, (cell, w) in enumerate(zip(line, widths))))


if __name__ == "__main__":
    main()
