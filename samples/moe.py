"""A small GPT whose MLPs are Switch-style mixture-of-experts layers, for trying partc's
expert parallelism.

Each block's MLP is replaced by ``num_experts`` GELU MLPs and a router (Fedus et al.,
Switch Transformers): a linear gate scores every token, a softmax makes probabilities,
each token goes to its ``top_k`` best experts (top-1 by default) and their outputs are
summed weighted by those probabilities. The experts are batched weights (``w_in`` of
shape (experts, hidden, ffn), ``w_out`` of (experts, ffn, hidden)) run by one grouped
matmul over the tokens sorted by expert, dropless: every token is computed, however
unbalanced the routing.

The load-balancing loss is Switch's ``num_experts * sum_e f_e * P_e`` (f_e the fraction
of tokens routed to expert e, P_e its mean probability) computed per sequence and
averaged over the batch, as DeepSeek-V3's sequence-wise balance loss is: a mean over
samples, so it is the same however the batch is cut into microbatches or replicas.
``forward`` returns ``(logits, aux)``; ``loss_fn`` adds ``aux_weight * aux`` to the
cross entropy.

    torchrun --standalone --nproc-per-node=2 -m partc train samples/moe.py:factory \\
        --steps 20 --memory 10MiB --lr 3e-3 --ep 2
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from samples.gpt import CausalSelfAttention, GPTConfig, _init_weights


@dataclass(frozen=True)
class MoEConfig(GPTConfig):
    num_experts: int = 4
    top_k: int = 1
    expert_ffn: int = 128       # each expert's inner width
    aux_weight: float = 0.01    # the balance loss's weight in loss_fn


@torch.library.custom_op("partc_samples::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows ``ends[e-1]:ends[e]`` of ``x`` times ``weight[e]``: one matmul per expert
    over the tokens sorted by expert (``torch._grouped_mm``'s meaning, in any dtype and
    on any device; its own kernel takes bf16 on CUDA only)."""
    out = x.new_empty(x.shape[0], weight.shape[-1])
    start = 0
    for expert, end in enumerate(ends.tolist()):
        out[start:end] = x[start:end] @ weight[expert]
        start = end
    return out


@grouped_mm.register_fake
def _grouped_mm_shape(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[-1])


@torch.library.custom_op("partc_samples::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(x: torch.Tensor, grad: torch.Tensor, ends: torch.Tensor,
                           experts: int) -> torch.Tensor:
    """The gradient of ``grouped_mm``'s weight: ``x[rows_e].T @ grad[rows_e]`` per expert."""
    out = x.new_zeros(experts, x.shape[-1], grad.shape[-1])
    start = 0
    for expert, end in enumerate(ends.tolist()):
        out[expert] = x[start:end].T @ grad[start:end]
        start = end
    return out


@grouped_mm_weight_grad.register_fake
def _weight_grad_shape(x: torch.Tensor, grad: torch.Tensor, ends: torch.Tensor,
                       experts: int) -> torch.Tensor:
    return x.new_empty(experts, x.shape[-1], grad.shape[-1])


def _grouped_mm_backward(ctx, grad: torch.Tensor):
    x, weight, ends = ctx.saved_tensors
    grad_x = grouped_mm(grad, weight.transpose(1, 2).contiguous(), ends)
    grad_weight = grouped_mm_weight_grad(x, grad, ends, weight.shape[0])
    return grad_x, grad_weight, None


def _grouped_mm_save(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_save)
# Under autocast the grouped matmul computes in the low-precision dtype, as a matmul does
# (and as torch._grouped_mm takes bf16): its inputs are cast on entry.
for _device in ("cpu", "cuda"):
    torch.library.register_autocast("partc_samples::grouped_mm", _device, torch.bfloat16)


class Experts(nn.Module):
    """``num_experts`` GELU MLPs as two batched weights: ``forward(tokens, experts,
    weights)`` sends each token to its ``top_k`` experts (tokens sorted by expert, one
    grouped matmul per weight) and sums their outputs weighted by ``weights``."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.top_k
        self.w_in = nn.Parameter(torch.empty(config.num_experts, config.n_embd,
                                             config.expert_ffn))
        self.w_out = nn.Parameter(torch.empty(config.num_experts, config.expert_ffn,
                                              config.n_embd))
        if not self.w_in.is_meta:
            nn.init.normal_(self.w_in, std=0.02)
            nn.init.normal_(self.w_out, std=0.02)

    def forward(self, tokens: torch.Tensor, experts: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)                          # slots sorted by expert
        counts = F.one_hot(flat, self.num_experts).sum(0)          # tokens per expert
        ends = counts.cumsum(0).to(torch.int32)
        routed = tokens[order // self.top_k]
        hidden = F.gelu(grouped_mm(routed, self.w_in, ends))
        out = grouped_mm(hidden, self.w_out, ends)
        slots = torch.empty_like(out).index_copy(0, order, out)    # back in slot order
        return (slots.view(-1, self.top_k, tokens.shape[-1]) * weights.unsqueeze(-1)).sum(1)


class SwitchMLP(nn.Module):
    """A router (linear gate, softmax, top-k) in front of :class:`Experts`."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.top_k
        self.gate = nn.Linear(config.n_embd, config.num_experts, bias=False)
        self.experts = Experts(config)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Sizes read off x, but not its sequence length, which a sequence-parallel
        # rank holds a part of.
        batch, width = x.shape[0], x.shape[-1]
        tokens = x.reshape(-1, width)
        probs = F.softmax(self.gate(tokens), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)          # (tokens, top_k)
        y = self.experts(tokens, experts, weights)
        return y.view(batch, -1, width), self._balance_loss(probs, experts, batch)

    def _balance_loss(self, probs: torch.Tensor, experts: torch.Tensor,
                      batch: int) -> torch.Tensor:
        chosen = F.one_hot(experts, self.num_experts).sum(1).to(probs.dtype)
        fraction = chosen.view(batch, -1, self.num_experts).mean(1) / self.top_k
        mean_prob = probs.view(batch, -1, self.num_experts).mean(1)
        return self.num_experts * (fraction * mean_prob).sum(-1).mean()


class MoEBlock(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.moe = SwitchMLP(config)

    def forward(self, x: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.ln_1(x))
        y, balance = self.moe(self.ln_2(x))
        return x + y, aux + balance


class MoEGPT(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(MoEBlock(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if not self.tok_emb.weight.is_meta:
            self.apply(_init_weights)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        aux = x.new_zeros(())
        for block in self.blocks:
            x, aux = block(x, aux)
        return self.lm_head(self.ln_f(x)), aux / len(self.blocks)


def moe_tiny(**overrides) -> MoEGPT:
    """Small enough for unit tests: 2 layers, 64 wide, 4 heads, 4 experts of 128, vocab 128."""
    settings = dict(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64)
    return MoEGPT(MoEConfig(**{**settings, **overrides}))


def loss_fn(output: tuple[torch.Tensor, torch.Tensor], targets: torch.Tensor,
            aux_weight: float = 0.01) -> torch.Tensor:
    """Mean next-token cross entropy plus ``aux_weight`` times the balance loss."""
    logits, aux = output
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    return ce + aux_weight * aux


def factory(global_batch: int = 16, seq: int = 64, layers: int = 4, width: int = 128,
            experts: int = 4) -> dict:
    """What ``partc train samples/moe.py:factory`` trains: the byte-level data of
    ``samples/gpt.py:factory`` (this file's text) on a mixture-of-experts GPT."""
    import partc
    from samples import gpt

    base = gpt.factory(global_batch=global_batch, seq=seq)
    model = moe_tiny(vocab_size=256, block_size=seq, n_layer=layers, n_embd=width,
                     num_experts=experts, expert_ffn=2 * width)
    return {**base, "model": model, "loss_fn": loss_fn, "name": "moe-sample",
            "train": partc.TrainSpec(global_batch_size=global_batch)}
