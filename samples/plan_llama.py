"""Plan a Hugging Face Llama built from a config: no weights are downloaded or allocated.

The model is built under ``torch.device("meta")``, so even the 8B configuration plans on a
laptop. Run:

    python samples/plan_llama.py                      # Llama-3-8B shape, 8 x H100-80GB
    python samples/plan_llama.py --tiny --devices 2 --device CPU
    partc plan samples/plan_llama.py:workload --devices 8 --device H100-80GB
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import partc

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                 max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5)
# Llama 3's larger published shapes (Meta's configs), for the benchmarks that plan them.
LLAMA3_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                  max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5)
LLAMA3_405B = dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                   num_attention_heads=128, num_key_value_heads=8, vocab_size=128000,
                   max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5)
TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            max_position_embeddings=128)


def build_llama(shape: dict, *, device: str = "meta") -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, use_cache=False, attn_implementation="sdpa",
                         tie_word_embeddings=False)
    with torch.device(device):
        return LlamaForCausalLM(config)


def causal_lm_loss(output, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over a Hugging Face CausalLMOutput's logits."""
    logits = output.logits if hasattr(output, "logits") else output[0]
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def workload(shape: dict = LLAMA3_8B, seq_len: int = 2048, global_batch: int = 64,
             dtype: torch.dtype = torch.bfloat16) -> dict:
    """What ``partc plan samples/plan_llama.py:workload`` plans."""
    model = build_llama(shape)
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    return {"model": model, "example_inputs": (ids,), "loss_fn": causal_lm_loss,
            "example_target": ids, "name": "llama",
            "train": partc.TrainSpec(global_batch_size=global_batch, dtype=dtype,
                                     optimizer="adamw")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a 4-layer Llama instead of 8B")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--device", default="H100-80GB")
    parser.add_argument("--memory", default=None, help="memory per device, e.g. 40GiB")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--global-batch", type=int, default=None)
    args = parser.parse_args()
    shape = TINY if args.tiny else LLAMA3_8B
    seq = args.seq_len or (64 if args.tiny else 2048)
    batch = args.global_batch or (8 if args.tiny else 64)
    work = workload(shape, seq, batch, torch.float32 if args.tiny else torch.bfloat16)
    budget = partc.DeviceBudget(num_devices=args.devices, device=args.device,
                                memory=args.memory)
    program = partc.compile(work["model"], work["example_inputs"], budget=budget,
                            train=work["train"], loss_fn=work["loss_fn"],
                            example_target=work["example_target"], name=work["name"])
    print(program.report())


if __name__ == "__main__":
    main()
