"""Small models for the tests: Hugging Face models from tiny configs, and hand-built ones.

The Hugging Face builders use ``use_cache=False`` (a KV cache makes forward return
state that torch.export cannot trace) and eager attention (plain matmul + softmax).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# A budget whose memory is the plan's whole limit: no CUDA context, NCCL or fragmentation
# kept back (partc.device.usable), for tests whose memory is a tight limit set by hand.
WHOLE_MEMORY = dict(context_memory=0, communicator_memory=0, memory_fragmentation=0.0)


def gpt2(n_layer: int = 2, n_embd: int = 64, vocab: int = 128, positions: int = 32,
         dropout: float = 0.1):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=vocab,
                        n_positions=positions, bos_token_id=0, eos_token_id=0,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                        use_cache=False, attn_implementation="eager")
    return GPT2LMHeadModel(config)


def llama(n_layer: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
          intermediate: int = 128, vocab: int = 128, positions: int = 64,
          attention: str = "eager"):
    """Llama with grouped-query attention (fewer key/value heads than query heads);
    ``attention="sdpa"`` for Hugging Face's scaled_dot_product_attention instead."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=intermediate,
                         vocab_size=vocab, num_hidden_layers=n_layer,
                         max_position_embeddings=positions, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0, use_cache=False,
                         attn_implementation=attention)
    return LlamaForCausalLM(config)


def falcon(n_layer: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 128):
    """Falcon: its attention makes a constant tensor that torch.export lifts."""
    from transformers import FalconConfig, FalconForCausalLM

    config = FalconConfig(hidden_size=hidden, num_attention_heads=heads, vocab_size=vocab,
                          num_hidden_layers=n_layer, use_cache=False,
                          attn_implementation="eager")
    return FalconForCausalLM(config)


def llama3_8b_config():
    """Llama-3-8B's shapes: 32 layers, 4096 wide, 32 heads / 8 KV heads, vocab 128256."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=14336, vocab_size=128256, num_hidden_layers=32,
                       max_position_embeddings=8192, rope_theta=500000.0,
                       bos_token_id=0, eos_token_id=0, use_cache=False,
                       attn_implementation="eager")


def bert(n_layer: int = 2, hidden: int = 64, vocab: int = 128, positions: int = 64,
         dropout: float = 0.1):
    from transformers import BertConfig, BertModel

    config = BertConfig(hidden_size=hidden, num_attention_heads=4, num_hidden_layers=n_layer,
                        intermediate_size=4 * hidden, vocab_size=vocab,
                        max_position_embeddings=positions, pad_token_id=0,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                        use_cache=False, attn_implementation="eager")
    return BertModel(config)


class MLP(nn.Module):
    """Two linears and a ReLU: every cost can be worked out by hand."""

    def __init__(self, d_in: int = 8, d_hidden: int = 16, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class LongSkip(nn.Module):
    """A stack of blocks whose input is added back after the last one (skips 3 blocks)."""

    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.stem(x)
        h = skip
        for block in self.blocks:
            h = torch.relu(block(h))
        return self.head(h + skip)


class SharedScale(nn.Module):
    """A value no parameter feeds, made once and read by every block (like Llama's rotary
    cos/sin): each block multiplies its linear's output by it."""

    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        scale = torch.cos(x)
        for block in self.blocks:
            h = block(h) * scale
        return h


class CalledTwice(nn.Module):
    """One module applied twice with another in between: three layers, shared weights."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.shared = nn.Linear(width, width)
        self.middle = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(self.middle(self.shared(x)))


class SharedEmbedding(nn.Module):
    """One position embedding read before every block (a module called from several
    layers): its weight's get_attr sits in the first reader's layer, the other readers
    fetch it from there."""

    def __init__(self, vocab: int = 128, seq: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, seq)
        self.position = nn.Embedding(seq, seq)
        self.blocks = nn.ModuleList(nn.Linear(seq, seq) for _ in range(depth))
        self.head = nn.Linear(seq, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        h = self.embed(ids)
        for block in self.blocks:
            h = torch.tanh(block(h + self.position(positions)))
        return self.head(h)


class CalledTwiceInARow(nn.Module):
    """The model's one module applied twice, a ReLU between: no other module, so graph
    cuts make the layers, and both read the same weight and bias."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.shared = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(torch.relu(self.shared(x)))


class Flat(nn.Module):
    """No submodules: every op at the root, so only graph cuts can split it."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(width, width))
        self.w2 = nn.Parameter(torch.randn(width, width))
        self.w3 = nn.Parameter(torch.randn(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.tanh(x @ self.w1)
        b = torch.relu(a @ self.w2) + a  # a crosses the second matmul: no cut inside
        return (b @ self.w3).sum(-1)


class DataDependent(nn.Module):
    """Python control flow on a tensor's value: neither tracer can capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.fc(x)
        return F.relu(x)


def causal_lm_loss(output, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy on a Hugging Face causal LM's output (a ModelOutput)."""
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))



class InPlaceScale(nn.Module):
    """Each block scales its output in place and nothing reads the in-place op's result
    (``y.mul_(0.5)``): dead-code elimination must keep it."""

    def __init__(self, width: int = 8, depth: int = 3, d_out: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            y = torch.sin(block(x))
            y.mul_(0.5)
            x = x + y
        return self.head(x)


def in_place_relu(width: int = 8) -> nn.Module:
    """``nn.ReLU(inplace=True)`` as a child of its own: a layer that writes to the
    previous layer's output."""
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(inplace=True),
                         nn.Linear(width, width), nn.ReLU(inplace=True), nn.Linear(width, 4))


class SliceZero(nn.Module):
    """Slice assignment (``y[:, 0] = 0``) in each block, in a forward only torch.export
    captures (it branches on a shape): export lifts the 0 as a constant tensor
    attribute the model does not have."""

    def __init__(self, width: int = 8, depth: int = 2, d_out: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError("x must be (batch, width)")
        for block in self.blocks:
            y = block(x)
            y[:, 0] = 0
            x = x + y
        return self.head(x)


class Normed(nn.Module):
    """Blocks of a linear and a BatchNorm1d: a forward that writes buffers (the running
    statistics)."""

    def __init__(self, width: int = 8, depth: int = 2, d_out: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width),
                                                  nn.BatchNorm1d(width))
                                    for _ in range(depth))
        self.head = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)


class Handoff(nn.Module):
    """What a pipeline hands from stage to stage besides one contiguous activation: token
    positions every block looks up in an embedding (integers), a padding mask expanded
    to (batch, seq, seq) (a stride-0 view), and blocks that return a transpose, so that
    the activation sent on and the gradient sent back are both strided."""

    def __init__(self, vocab: int = 128, seq: int = 16, depth: int = 4) -> None:
        super().__init__()
        # The width is the sequence length, so that the (seq, seq) mask scales a block.
        self.embed = nn.Embedding(vocab, seq)
        self.blocks = nn.ModuleList(HandoffBlock(seq) for _ in range(depth))
        self.head = nn.Linear(seq, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        mask = (ids > 0).unsqueeze(1).expand(-1, ids.shape[1], -1)
        h = self.embed(ids).transpose(1, 2)
        for block in self.blocks:
            h = block(h, positions, mask)
        return self.head(h.transpose(1, 2))


class HandoffBlock(nn.Module):
    """(batch, width, seq) in and out, as transposes of (batch, seq, width)."""

    def __init__(self, seq: int) -> None:
        super().__init__()
        self.position = nn.Embedding(seq, seq)
        self.linear = nn.Linear(seq, seq)

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        h = h.transpose(1, 2) + self.position(positions)
        return (torch.tanh(self.linear(h)) * mask).transpose(1, 2)


class Residual(nn.Module):
    """An MLP block with its residual: ``x + fc2(relu(fc1(x)))``."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class SkipAfterFifth(nn.Module):
    """Eight like MLP blocks; after the fifth, the model's own loop adds the second
    block's output back (``x = x + skip``). The blocks are alike, the code around them
    is not: the add joins the fifth block's layer."""

    def __init__(self, width: int = 8, depth: int = 8) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Residual(width) for _ in range(depth))
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        skip = x
        for index, block in enumerate(self.blocks):
            x = block(x)
            if index == 1:
                skip = x
            if index == 4:
                x = x + skip
        return self.head(x)


class ListMoEConfig:
    """Sizes of :class:`ListMoEModel` (``vocab_size`` read by the MoE test workers)."""

    def __init__(self, vocab_size: int = 64, width: int = 32, ffn: int = 64,
                 num_experts: int = 4, top_k: int = 2, depth: int = 2) -> None:
        self.vocab_size, self.width, self.ffn = vocab_size, width, ffn
        self.num_experts, self.top_k, self.depth = num_experts, top_k, depth


class ExpertMLP(nn.Module):
    def __init__(self, width: int, ffn: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, ffn)
        self.down = nn.Linear(ffn, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class ListMoE(nn.Module):
    """A router (linear gate, softmax, top-k) and experts held as an ``nn.ModuleList``,
    each called on its own, as Hugging Face's older MoE models hold them.

    ``dispatch="dense"`` runs every expert on every token and weights its output by the
    router (zero for the experts a token was not routed to): static shapes.
    ``dispatch="indexed"`` is Mixtral's older loop: per expert, ``torch.where`` over the
    routing mask picks its tokens, whose number depends on the router's values."""

    def __init__(self, config: ListMoEConfig, dispatch: str = "dense") -> None:
        super().__init__()
        self.num_experts, self.top_k, self.dispatch = config.num_experts, config.top_k, dispatch
        self.gate = nn.Linear(config.width, config.num_experts, bias=False)
        self.experts = nn.ModuleList(ExpertMLP(config.width, config.ffn)
                                     for _ in range(config.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.gate(tokens), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.dispatch == "indexed":
            out = self._indexed(tokens, weights, chosen)
        else:
            routing = torch.zeros_like(probs).scatter(1, chosen, weights)
            out = sum(routing[:, i:i + 1] * expert(tokens)
                      for i, expert in enumerate(self.experts))
        # Not x's sequence length, which a sequence-parallel rank holds a part of.
        return out.view(x.shape[0], -1, x.shape[-1])

    def _indexed(self, tokens: torch.Tensor, weights: torch.Tensor,
                 chosen: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(tokens)
        mask = F.one_hot(chosen, self.num_experts).permute(2, 1, 0)
        for i, expert in enumerate(self.experts):
            slot, rows = torch.where(mask[i])
            out = out.index_add(0, rows, expert(tokens[rows]) * weights[rows, slot, None])
        return out


class ListMoEModel(nn.Module):
    """Token embedding, ``depth`` pre-norm blocks of :class:`ListMoE` with a residual, a
    head: logits of shape (batch, seq, vocab)."""

    def __init__(self, config: ListMoEConfig | None = None, dispatch: str = "dense") -> None:
        super().__init__()
        self.config = config = config or ListMoEConfig()
        self.embed = nn.Embedding(config.vocab_size, config.width)
        self.norms = nn.ModuleList(nn.LayerNorm(config.width) for _ in range(config.depth))
        self.moes = nn.ModuleList(ListMoE(config, dispatch) for _ in range(config.depth))
        self.head = nn.Linear(config.width, config.vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for norm, moe in zip(self.norms, self.moes):
            h = h + moe(norm(h))
        return self.head(h)


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy of (batch, seq, vocab) logits against (batch, seq) classes."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))
