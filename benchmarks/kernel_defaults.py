"""Published step times against partc's plan with no switches: the Megatron-Core table and
Llama 3 405B, each on its published mesh.

    PYTHONPATH=. python benchmarks/kernel_defaults.py [--rows 177B,405B] [--switches]
        [--comm-overlap 0.5]

Each model is written as Hugging Face writes it (``GPT2LMHeadModel`` from a
``GPT2Config`` of the row's shape, its default attention and tied embeddings; Llama 3
405B as ``LlamaForCausalLM``), built on the meta device, and planned for H100-80GB with
only what the published run fixes: its tensor-, pipeline- and data-parallel degrees, its
global batch and bf16. Everything else (schedule, ZeRO stage, recompute, micro-batch,
and the kernel choices: ``torch.compile``, the attention kernel, the fused optimizer) is
the planner's. Printed per row: the published step, partc's predicted step, their ratio,
and what the planner chose. ``--switches`` adds the same plan with the kernel choices
pinned off (``compile=False, attention="as_written", fused_optimizer=False``: the
defaults before they were the planner's) and pinned on, side by side. ``--comm-overlap``
replaces the preset's share of a collective that hides behind compute (1: all of it,
not measured on a GPU), to see how much of a row's prediction rests on it.

Published steps: Megatron-Core's rows as ``tests/validation/mcore.py`` counts them
(Megatron's model FLOPs over the published TF/GPU); Llama 3 405B from the Llama 3 paper
(Dubey et al. 2024, table 4: 8,192 H100, tp 8, pp 16, dp 64, 16M tokens of 8,192 per
step, 430 TF/GPU), its FLOPs counted 6 N T plus attention's 12 l h s T: 12.6 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "samples"))
sys.path.insert(0, str(ROOT))

import partc  # noqa: E402
from plan_llama import LLAMA3_405B  # noqa: E402
from tests.validation import llama3, mcore  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    build: object          # () -> (model, ids, loss_fn)
    mesh: dict
    gpus: int
    batch: int
    published_s: float


def _causal_lm_loss(output, target):
    logits = output.logits if hasattr(output, "logits") else output[0]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def _gpt2(run: mcore.Run):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=run.layers, n_embd=run.hidden, n_head=run.heads,
                        vocab_size=run.vocab, n_positions=run.seq_len, use_cache=False)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
        ids = torch.zeros(1, run.seq_len, dtype=torch.long)
    return model, ids, _causal_lm_loss


def _llama405b():
    from plan_llama import build_llama

    model = build_llama(LLAMA3_405B)
    ids = torch.zeros(1, llama3.SEQ_LEN, dtype=torch.long, device="meta")
    return model, ids, _causal_lm_loss


def rows() -> list[Row]:
    found = [Row(name=run.name, build=lambda run=run: _gpt2(run),
                 mesh=dict(tp=run.tp, pp=run.pp, dp=run.dp), gpus=run.gpus, batch=run.batch,
                 published_s=mcore.step_flops(run) / (run.gpus * run.tflops_per_gpu * 1e12))
             for run in mcore.RUNS]
    found.append(Row(name="405B", build=_llama405b, mesh=dict(llama3.MESH), gpus=llama3.GPUS,
                     batch=llama3.BATCH, published_s=llama3.published_step_s()))
    return found


KERNELS = {
    "no switches": {},
    "pinned off": dict(compile=False, attention="as_written", fused_optimizer=False),
    "pinned on": dict(compile=True, attention="fused", fused_optimizer=True),
}


def _train(row: Row, kernels: dict) -> partc.TrainSpec | None:
    fields = {f.name for f in dataclasses.fields(partc.TrainSpec)}
    if not set(kernels) <= fields:     # an older partc without these choices
        return None
    return partc.TrainSpec(global_batch_size=row.batch, dtype=torch.bfloat16, **kernels)


def plan_row(row: Row, kernels: dict, figures: dict) -> partc.Plan | None:
    train = _train(row, kernels)
    if train is None:
        return None
    model, ids, loss_fn = row.build()
    budget = partc.DeviceBudget(num_devices=row.gpus, device="H100-80GB", **figures)
    return partc.compile(model, (ids,), loss_fn=loss_fn, example_target=ids, budget=budget,
                         train=train, constraints=partc.Constraints(**row.mesh),
                         name=f"bench-{row.name}").plan


def describe(plan: partc.Plan) -> str:
    train = plan.train
    fused = getattr(train, "fused_optimizer", None)
    return (f"{plan.schedule} v={plan.chunks} ZeRO-{plan.zero_stage} "
            f"{plan.micro_batch_size}x{plan.num_microbatches} compile={train.compile} "
            f"attention={train.attention}" + ("" if fused is None else f" fused_opt={fused}"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="", help="e.g. 177B,405B (default: all)")
    parser.add_argument("--switches", action="store_true",
                        help="also the kernel choices pinned off and on")
    parser.add_argument("--comm-overlap", type=float,
                        help="the H100 preset's comm_overlap replaced (a diagnostic: the "
                             "share of a collective beside compute that hides; preset 1)")
    args = parser.parse_args(argv)
    figures = {} if args.comm_overlap is None else {"comm_overlap": args.comm_overlap}
    wanted = [n for n in args.rows.split(",") if n]
    settings = list(KERNELS) if args.switches else ["no switches"]
    print(f"{'row':>5} {'mesh':>14} {'published':>9} " + " ".join(
        f"{label:>18}" for label in settings) + "  chosen (no switches)")
    for row in rows():
        if wanted and row.name not in wanted:
            continue
        start = time.perf_counter()
        cells, chosen = [], ""
        for label in settings:
            plan = plan_row(row, KERNELS[label], figures)
            if plan is None:
                cells.append(f"{'-':>18}")
                continue
            step = plan.predicted.step_time_s
            cells.append(f"{step:>8.2f} s {step / row.published_s:>5.2f}x")
            if label == "no switches":
                chosen = describe(plan)
        mesh = f"{row.mesh['tp']}x{row.mesh['pp']}x{row.mesh['dp']}"
        print(f"{row.name:>5} {mesh:>14} {row.published_s:>7.2f} s " + " ".join(cells)
              + f"  {chosen} ({time.perf_counter() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
