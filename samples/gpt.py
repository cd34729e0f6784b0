"""A small GPT (decoder-only transformer) in plain PyTorch, for trying partc.

The architecture follows GPT-2 / nanoGPT: token and learned position embeddings, a stack
of pre-LayerNorm blocks (causal self-attention, then a GELU MLP, each with a residual),
a final LayerNorm and a language-model head whose weight *is* the token embedding's
(tied). Attention is written out as matmul + softmax rather than a fused kernel, so
that partc can see — and selectively recompute — the attention probabilities.

Use it like this::

    import torch, partc
    from samples.gpt import gpt_small, example_inputs, loss_fn

    with torch.device("meta"):          # plan without allocating the 124M weights
        model = gpt_small()
    ids, targets = example_inputs(model, batch=8, seq=1024)
    program = partc.compile(model, example_inputs=(ids,), loss_fn=loss_fn,
                            budget=partc.DeviceBudget(num_devices=8, device="A100-80GB"),
                            train=partc.TrainSpec(global_batch_size=64))

``forward(idx)`` takes token ids of shape (batch, seq) and returns logits of shape
(batch, seq, vocab_size); ``loss_fn(logits, targets)`` is the mean cross entropy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64
    block_size: int = 1024   # longest sequence the position embedding covers
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be a multiple of n_head"
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, channels = x.size(0), x.size(1), x.size(2)
        head_dim = channels // self.n_head
        q, k, v = self.c_attn(x).split(channels, dim=2)
        # (batch, seq, channels) -> (batch, head, seq, head_dim)
        q = q.view(batch, seq, self.n_head, head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.n_head, head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.n_head, head_dim).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head_dim))
        # Built per call rather than kept as a buffer: it is tiny next to the scores, and
        # its size then follows the sequence even when the model is traced symbolically.
        causal = x.new_ones(seq, seq, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = self.attn_dropout(F.softmax(scores, dim=-1))
        y = (probs @ v).transpose(1, 2).contiguous().view(batch, seq, channels)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: the head scores tokens with their own embeddings, which saves
        # vocab_size * n_embd parameters and trains better at this size.
        self.lm_head.weight = self.tok_emb.weight
        if not self.tok_emb.weight.is_meta:
            self.apply(_init_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def gpt_small(**overrides) -> GPT:
    """The GPT-2 124M configuration (12 layers, 768 wide, 12 heads, 1024 positions)."""
    return GPT(GPTConfig(**overrides))


def gpt_tiny(**overrides) -> GPT:
    """A GPT small enough for unit tests: 2 layers, 64 wide, 4 heads, vocab 128."""
    settings = dict(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64)
    return GPT(GPTConfig(**{**settings, **overrides}))


def example_inputs(model: GPT, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids and next-token targets of shape (batch, seq), on the model's device."""
    if seq > model.config.block_size:
        raise ValueError(f"seq {seq} exceeds block_size {model.config.block_size}")
    device = model.tok_emb.weight.device
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq + 1), device=device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every position of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def workload(global_batch: int = 32, seq: int = 1024) -> dict:
    """What ``partc plan samples/gpt.py:workload`` plans: GPT-2 124M on the meta device."""
    import partc

    with torch.device("meta"):
        model = gpt_small()
    ids, targets = example_inputs(model, batch=1, seq=seq)
    return {"model": model, "example_inputs": (ids,), "loss_fn": loss_fn,
            "example_target": targets, "name": "gpt-124m",
            "train": partc.TrainSpec(global_batch_size=global_batch)}


def factory(global_batch: int = 16, seq: int = 64, layers: int = 4, width: int = 128) -> dict:
    """What ``partc train samples/gpt.py:factory`` trains: a small character-level GPT
    learning this file's own text, so that the loss visibly falls in a few steps::

        torchrun --standalone --nproc-per-node=2 -m partc train samples/gpt.py:factory \\
            --steps 20 --memory 10MiB --lr 3e-3 --log-dir out/telemetry

    ``data(step)`` draws ``global_batch`` windows of ``seq`` + 1 bytes from the first 90%
    of the text, seeded by the step (the same batch on every rank); ``data(-1)``, the
    held-out batch ``--eval-every`` evaluates, draws from the last 10%.
    """
    from pathlib import Path

    import partc

    text = torch.tensor(list(Path(__file__).read_bytes()), dtype=torch.int64)
    split = len(text) * 9 // 10
    parts = {"train": text[:split], "held_out": text[split:]}
    if len(parts["held_out"]) <= seq + 1:
        raise ValueError(f"seq {seq} is too long for the held-out tenth of {Path(__file__).name}")

    def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        source = parts["held_out"] if step < 0 else parts["train"]
        generator = torch.Generator().manual_seed(abs(step))
        starts = torch.randint(0, len(source) - seq - 1, (global_batch,), generator=generator)
        windows = torch.stack([source[s:s + seq + 1] for s in starts.tolist()])
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    model = gpt_tiny(vocab_size=256, block_size=seq, n_layer=layers, n_embd=width, n_head=4)
    ids, targets = data(0)
    return {"model": model, "example_inputs": (ids,), "loss_fn": loss_fn,
            "example_target": targets, "name": "gpt-sample", "data": data,
            "train": partc.TrainSpec(global_batch_size=global_batch)}
