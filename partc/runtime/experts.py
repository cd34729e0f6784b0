"""Expert parallelism: a mixture-of-experts layer's routed experts split over an
expert-parallel group, tokens sent to their experts and back by all-to-all.

The lowering (``partc.passes.moe.lower_experts``) replaces a recognised experts call
``experts(tokens, indices, weights)`` by a :class:`ExpertParallel` module that computes
``out[t] = sum_j weights[t, j] * expert[indices[t, j]](tokens[t])`` as the model does:
the model's router stays in the graph, and the experts' own compute (``body``: the
graph's grouped ops from the tokens sorted by expert and the experts' end offsets) runs
on this rank's experts. Per call, on a group of ``ep`` ranks holding experts
``[e * E/ep, (e+1) * E/ep)`` each:

1. the slots (token, choice) are sorted by expert; each rank's count per expert is
   exchanged first (one ``all_to_all_single`` of ``E`` counts);
2. the tokens go to the ranks holding their experts (``all_to_all_single`` with the
   variable split sizes the counts give), are sorted by local expert and run;
3. the outputs come back by the reverse all-to-all and are combined with the weights.

Backward runs the two token all-to-alls in reverse (autograd), so each call posts three
all-to-alls forward and two backward (``messages`` counts those of tokens as they are
posted: a recomputed forward's two, and no reverse for them).

**Capacity** (``capacity_factor``; None is dropless): each sample's slots routed to one
expert are kept up to ``ceil(capacity_factor * tokens_per_sample * top_k / E)``, earliest
slot first (token order, then choice order); a dropped slot adds nothing to its token's
output. The rule depends only on the sample, so one process and any split of the batch
over microbatches, replicas and expert-parallel ranks drop the same slots.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import fx, nn


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` of ``rows`` (``send`` rows to each rank, ``recv`` from
    each), whose backward sends each row's gradient back the way it came: the reverse
    exchange, ``send`` and ``recv`` swapped. (torch's autograd-aware one,
    ``torch.distributed.nn.functional.all_to_all_single``, is deprecated.)"""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, recv: list[int], send: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        output = rows.new_empty(sum(recv), *rows.shape[1:])
        dist.all_to_all_single(output, rows, recv, send, group=group)
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


class ExpertParallel(nn.Module):
    """One mixture-of-experts layer's routed experts over an expert-parallel group.

    ``forward(tokens, indices, weights, *expert_weights)``: tokens (T, hidden), the
    router's expert indices and weights (T, top_k), and this rank's slice of each routed
    expert weight (experts first), or none when the module holds them (``owned``)."""

    def __init__(self, body: fx.GraphModule, *, num_experts: int, top_k: int,
                 tokens_per_sample: int, capacity_factor: float | None,
                 ends_dtype: torch.dtype, weight_names: tuple[str, ...]) -> None:
        super().__init__()
        self.body = body
        self.num_experts, self.top_k = num_experts, top_k
        self.tokens_per_sample = tokens_per_sample
        self.capacity_factor = capacity_factor
        self.ends_dtype = ends_dtype
        self.weight_names = weight_names  # FQNs of the expert weights, in argument order
        # Under ZeRO-2/3 the module holds the weights itself (attribute names, in
        # argument order) and is called without them: an FSDP unit of its own.
        self.owned: tuple[str, ...] = ()
        self.group: dist.ProcessGroup | None = None
        self.ep, self.ep_rank = 1, 0
        self.tp_group: dist.ProcessGroup | None = None
        self.tp, self.tp_rank = 1, 0
        # All-to-alls of tokens this rank has posted (dispatch and combine, forward and
        # backward: what the plan's ExpertLayer.all_to_alls counts), and the exchanges of
        # counts before each dispatch.
        self.messages = 0
        self.count_exchanges = 0
        self.dropped = 0   # slots this rank's tokens lost to the capacity

    def bind(self, group: dist.ProcessGroup | None, ep: int, ep_rank: int,
             tp_group: dist.ProcessGroup | None = None, tp: int = 1, tp_rank: int = 0
             ) -> None:
        self.group, self.ep, self.ep_rank = group, ep, ep_rank
        self.tp_group, self.tp, self.tp_rank = tp_group, tp, tp_rank

    def forward(self, tokens: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                *expert_weights: torch.Tensor) -> torch.Tensor:
        if self.owned:
            expert_weights = tuple(getattr(self, name) for name in self.owned)
        if self.tp == 1:
            return self._route(tokens, indices, weights, expert_weights)
        # Under tensor parallelism the tokens are the same on every tp rank: each sends
        # its share of them (every rank a contiguous part), and the outputs are gathered.
        part = _share(tokens.shape[0], self.tp, self.tp_rank)
        rows = _Replicated.apply(tokens, self.tp_group)[part]
        mine = _Replicated.apply(weights, self.tp_group)[part]
        keep = self._kept_slots(indices.reshape(-1)).view(indices.shape)[part]
        out = self._route(rows, indices[part], mine, expert_weights, keep)
        return _Gathered.apply(out, self.tp_group, self.tp, self.tp_rank)

    def _route(self, tokens: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
               expert_weights: tuple[torch.Tensor, ...],
               keep: torch.Tensor | None = None) -> torch.Tensor:
        top_k, width = self.top_k, tokens.shape[-1]
        flat = indices.reshape(-1)
        if keep is None:
            keep = self._kept_slots(flat)
        slots = keep.reshape(-1).nonzero().squeeze(1)
        self.dropped += flat.numel() - slots.numel()
        order = slots[flat[slots].argsort(stable=True)]          # kept slots by expert
        counts = torch.bincount(flat[order], minlength=self.num_experts)
        routed = tokens[order // top_k]
        if self.ep == 1:
            out = self._run(routed, counts, expert_weights)
        else:
            out = self._exchange(routed, counts, expert_weights)
        # In the experts' output dtype (the compute dtype under mixed precision).
        values = out.new_zeros(flat.numel(), width).index_copy(0, order, out)
        return (values.view(-1, top_k, width) * weights.unsqueeze(-1)).sum(1)

    def _run(self, routed: torch.Tensor, counts: torch.Tensor,
             expert_weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
        ends = counts.cumsum(0).to(self.ends_dtype)
        return self.body(routed, ends, *expert_weights)

    def _exchange(self, routed: torch.Tensor, counts: torch.Tensor,
                  expert_weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
        ep, local = self.ep, self.num_experts // self.ep
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)  # (source, local expert)
        self.count_exchanges += 1
        send = counts.view(ep, local).sum(1).tolist()
        recv_counts = received.view(ep, local)
        recv = recv_counts.sum(1).tolist()
        arrived = self._all_to_all(routed, recv, send)
        # Rows arrive by source rank, then expert: sort them by expert for the body.
        expert_of_row = torch.arange(local, device=counts.device).repeat(ep).repeat_interleave(
            recv_counts.reshape(-1))
        by_expert = expert_of_row.argsort(stable=True)
        out = self._run(arrived[by_expert], recv_counts.sum(0), expert_weights)
        back = torch.empty_like(out).index_copy(0, by_expert, out)
        return self._all_to_all(back, send, recv)

    def _all_to_all(self, rows: torch.Tensor, recv: list[int], send: list[int]
                    ) -> torch.Tensor:
        self.messages += 1
        out = _AllToAll.apply(rows.contiguous(), recv, send, self.group)
        if out.requires_grad:
            # Its reverse is posted when backward reaches it: never for a forward that
            # a recompute replays, whose backward runs through the first forward's graph.
            out.register_hook(self._count_reverse)
        return out

    def _count_reverse(self, grad: torch.Tensor) -> None:
        self.messages += 1

    def _kept_slots(self, flat: torch.Tensor) -> torch.Tensor:
        """Which slots (token, choice) reach their expert: a bool per slot."""
        if self.capacity_factor is None:
            return torch.ones_like(flat, dtype=torch.bool)
        per_sample = self.tokens_per_sample * self.top_k
        capacity = math.ceil(self.capacity_factor * per_sample / self.num_experts)
        chosen = nn.functional.one_hot(flat, self.num_experts).view(-1, per_sample,
                                                                   self.num_experts)
        rank = ((chosen.cumsum(1) - 1) * chosen).sum(-1).reshape(-1)  # within sample, expert
        return rank < capacity


def _share(rows: int, parts: int, index: int) -> slice:
    """Rank ``index``'s contiguous share of ``rows`` split over ``parts`` (the first
    ``rows % parts`` ranks one more)."""
    base, extra = divmod(rows, parts)
    start = index * base + min(index, extra)
    return slice(start, start + base + (index < extra))


class _Replicated(torch.autograd.Function):
    """A tensor every tp rank holds alike, of which each uses a part: its gradient is
    the sum of the ranks' (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Gathered(torch.autograd.Function):
    """Each tp rank's rows, concatenated on every rank; backward keeps this rank's rows
    of the (identical) gradient."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, group: dist.ProcessGroup, tp: int,
                tp_rank: int) -> torch.Tensor:
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(tp)]
        dist.all_gather(sizes, torch.tensor([rows.shape[0]]), group=group)
        parts = [rows.new_empty(int(n), *rows.shape[1:]) for n in sizes]
        dist.all_gather(parts, rows.contiguous(), group=group)
        ctx.part = _share(sum(int(n) for n in sizes), tp, tp_rank)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.part], None, None, None


def expert_modules(module: nn.Module) -> list[ExpertParallel]:
    return [m for m in module.modules() if isinstance(m, ExpertParallel)]


def expert_weights(module: nn.Module) -> list[nn.Parameter]:
    """The routed expert weights of ``module``'s :class:`ExpertParallel` layers, as the
    module holds them now (FSDP replaces parameters by DTensor ones)."""
    return [module.get_parameter(name) for experts in expert_modules(module)
            for name in experts.weight_names]


def shard_experts(module: nn.Module, group: dist.ProcessGroup | None, ep: int,
                  ep_rank: int, tp_group: dist.ProcessGroup | None = None, tp: int = 1,
                  tp_rank: int = 0) -> list[nn.Parameter]:
    """Bind every :class:`ExpertParallel` of ``module`` to its group and keep this rank's
    experts ``[ep_rank * E/ep, (ep_rank+1) * E/ep)`` of each routed expert weight (its
    copy of the whole weight is dropped). Returns the expert parameters, whose gradients
    are reduced (and under ZeRO sharded) over the expert-data-parallel group."""
    owned: list[nn.Parameter] = []
    for experts in expert_modules(module):
        experts.bind(group, ep, ep_rank, tp_group, tp, tp_rank)
        for name in experts.weight_names:
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            whole = owner._parameters[attr]
            rows = whole.shape[0] // ep
            local = nn.Parameter(whole.detach()[ep_rank * rows:(ep_rank + 1) * rows].clone(),
                                 whole.requires_grad)
            owner._parameters[attr] = local
            owned.append(local)
    return owned
