"""How long ``partc.passes.analyze`` takes on big models built on the meta device.

    python benchmarks/analyze_time.py [--seq 2048] [--layers 32]

Prints the time of each pass for a Llama-3-8B configuration and for GPT-2 small (124M);
nothing is allocated: the weights live on the meta device.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from partc import meta  # noqa: E402
from partc.passes import analyze  # noqa: E402
from samples.gpt import gpt_small, loss_fn  # noqa: E402
from tests.models import gpt2, llama3_8b_config  # noqa: E402


def timed(name: str, build, ids: torch.Tensor, loss=None) -> None:
    with torch.device("meta"):
        model = build()
    started = time.perf_counter()
    gm, analysis = analyze(model, (ids,), loss_fn=loss, name=name)
    total = time.perf_counter() - started
    passes = ", ".join(f"{p} {s:.2f}s" for p, s in meta.pass_times(gm))
    print(f"{name}: {total:.2f}s ({passes}); {len(analysis.layers)} layers, "
          f"{analysis.summary.num_params / 1e6:.0f}M params, "
          f"{sum(l.fwd_flops for l in analysis.layers) / 1e12:.2f} TFLOP/sample")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()
    from transformers import LlamaForCausalLM

    def cross_entropy(output, target):
        logits = output.logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    config = llama3_8b_config()
    config.num_hidden_layers = args.layers
    ids = torch.zeros(1, args.seq, dtype=torch.long, device="meta")
    timed("llama3-8b", lambda: LlamaForCausalLM(config), ids, cross_entropy)
    ids = torch.zeros(8, 1024, dtype=torch.long, device="meta")
    timed("gpt2-hf-124m", lambda: gpt2(n_layer=12, n_embd=768, vocab=50257,
                                       positions=1024), ids, cross_entropy)
    timed("samples.gpt_small", gpt_small, ids, loss_fn)


if __name__ == "__main__":
    main()
