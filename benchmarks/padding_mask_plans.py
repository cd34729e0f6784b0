"""A Hugging Face causal LM planned as people call it, ``model(input_ids=...,
attention_mask=..., labels=...)``, with its padding mask kept as an input against left
out (``partc/runtime/padding.py``), side by side in one run.

    python benchmarks/padding_mask_plans.py [--cases 8192:8 32768:64 65536:64]

Llama-3.1-8B's shape on the meta device, H100-80GB (8 per node, 50 GB/s per GPU between
nodes), bf16 AdamW, 64 sequences a step; for each ``SEQ:GPUS`` case, three example
batches of the same shapes, planned with no pins:

- ``no mask``: ``{"input_ids", "labels"}``;
- ``mask left out``: ``{"input_ids", "attention_mask", "labels"}``, the mask on meta (no
  values to read: taken as unpadded rows, and the model, causal throughout, also takes
  rows padded at their end whose pads count no label);
- ``mask kept``: the same with a real mask that pads the first row at its start (left
  padding), which keeps it an input: the traced program builds the (seq x seq) mask,
  attention is priced non-causal, and context parallelism is refused.

Per plan: its mesh, ZeRO stage, predicted step and peak memory, or why there is none;
and the left-out plan's step against the kept one's (the ratio).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "samples"))
sys.path.insert(0, str(ROOT))

import partc  # noqa: E402
from plan_llama import LLAMA3_8B, build_llama  # noqa: E402

GLOBAL_BATCH = 64


def example(kind: str, seq: int) -> dict[str, torch.Tensor]:
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    if kind == "no mask":
        return {"input_ids": ids, "labels": ids}
    mask = torch.ones(1, seq, dtype=torch.long, device="meta")
    if kind == "mask kept":   # padded at the start of its row: values to read
        mask = torch.ones(1, seq, dtype=torch.long)
        mask[0, 0] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def plan(kind: str, seq: int, gpus: int) -> tuple[str, float | None]:
    """One line describing the plan of ``kind`` (or why there is none), and its step."""
    model = build_llama(dict(LLAMA3_8B, max_position_embeddings=max(seq, 8192)))
    budget = partc.DeviceBudget(num_devices=gpus, device="H100-80GB", devices_per_node=8,
                                inter_node_bandwidth="50GB/s")
    train = partc.TrainSpec(global_batch_size=GLOBAL_BATCH, dtype=torch.bfloat16,
                            optimizer="adamw")
    start = time.perf_counter()
    try:
        found = partc.compile(model, example(kind, seq), budget=budget, train=train,
                              cache=None).plan
    except partc.PlanInfeasibleError as error:
        return f"no plan ({str(error)[:90]}...)", None
    seconds = time.perf_counter() - start
    left = ", ".join(found.model.left_out) or "none"
    step = found.predicted.step_time_s
    return (f"{found.mesh}, ZeRO-{found.effective_zero_stage}, step {step:.2f} s, peak "
            f"{found.predicted.peak_memory_bytes / 2**30:.1f} GiB; left out: {left} "
            f"(planned in {seconds:.0f} s)"), step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["8192:8", "32768:64", "65536:64"],
                        help="SEQ:GPUS pairs")
    args = parser.parse_args()
    for case in args.cases:
        seq, gpus = (int(x) for x in case.split(":"))
        print(f"\nLlama-3.1-8B, {seq} tokens, {gpus} x H100-80GB, {GLOBAL_BATCH} sequences")
        steps = {}
        for kind in ("no mask", "mask left out", "mask kept"):
            line, steps[kind] = plan(kind, seq, gpus)
            print(f"  {kind:<14} {line}")
        if steps["mask left out"] and steps["mask kept"]:
            print(f"  left out / kept: {steps['mask left out'] / steps['mask kept']:.2f}x")


if __name__ == "__main__":
    main()
