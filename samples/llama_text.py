"""A tiny Hugging Face Llama for ``partc train --data``: byte-level ids (vocabulary 256),
so that it trains on any text or byte token file with no tokenizer to download::

    torchrun --standalone --nproc-per-node=2 -m partc train samples/llama_text.py:factory \\
        --data samples/declaration.txt --steps 20 --lr 3e-3

The model is ``transformers.LlamaForCausalLM`` from a config (random weights, seeded by
``--seed``); the factory gives no ``data``: ``--data`` packs the file into sequences of
the example inputs' length (``seq``), inputs and next-token targets.
``benchmarks/data_llama.py`` trains it from a token file on 1 and 2 processes.
"""

from __future__ import annotations

import torch

import partc
from plan_llama import build_llama, causal_lm_loss

SHAPE = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
             max_position_embeddings=256)


def factory(global_batch: int = 16, seq: int = 64) -> dict:
    """What ``partc train samples/llama_text.py:factory --data PATH`` trains."""
    model = build_llama(SHAPE, device="cpu")
    ids = torch.zeros(global_batch, seq, dtype=torch.long)
    return {"model": model, "example_inputs": (ids,), "loss_fn": causal_lm_loss,
            "example_target": ids, "name": "llama-bytes",
            "train": partc.TrainSpec(global_batch_size=global_batch)}
