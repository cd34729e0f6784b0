"""The sample GPT and the batches that the benchmarks timing two programs side by side
train (``compiled.py``, ``param_gather.py``, ``runtime_overhead.py``, ``tp_overlap.py``):
the sizes from their ``--layers``, ``--width``, ``--seq`` and ``--batch``."""

from __future__ import annotations

import argparse

import torch

from samples.gpt import GPT, gpt_tiny

VOCAB = 1024


def model_and_batches(args: argparse.Namespace, heads: int, dropout: float = 0.0,
                      count: int = 4) -> tuple[GPT, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The model (torch's seed 0) and ``count`` batches of (token ids, next-token
    targets), the same on every rank; the benchmarks cycle through them."""
    torch.manual_seed(0)
    model = gpt_tiny(vocab_size=VOCAB, block_size=args.seq, n_layer=args.layers,
                     n_embd=args.width, n_head=heads, dropout=dropout)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        tokens = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=g)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return model, batches
