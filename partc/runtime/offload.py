"""Optimizer offload (ZeRO-Offload): the fp32 masters, the optimizer's state and its step
on the host; the device keeps the weights it computes with.

:class:`HostTier` is the host as the runtime sees it: where offloaded tensors live (the
CPU; pinned memory when the device is a GPU, so that copies run asynchronously), and
counters of what crosses the link each way and of what it holds. On a CPU "device" the
host is the same memory, but the offloaded tensors are still tensors of their own, made
and counted here, so that a test can hold the counters to the plan
(``partc.cost.host_offload`` prices the same bytes).

:class:`HostOptimizer` steps device tensors (a rank's parameters, FSDP's local shards,
or ZeRO-1's dp shards) with the user's optimizer class over fp32 host masters of them:
each step copies the gradients out (unless they are on the host already: the gradient
buckets of a rank with one replica live there, ``GradBuckets(host=...)``), steps the
masters on the host's cores, and copies the updated weights back into the device
tensors (cast to their dtype). torch's Adam and AdamW run in their fused CPU form (one
vectorised kernel over each tensor; ``benchmarks/host_adam.py`` measured it several
times faster than the foreach form) unless the user chose a form. Its ``param_groups``
are the device tensors' (learning-rate schedulers act on them as on any optimizer);
their hyperparameters reach the host optimizer at every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn


@dataclass
class TierCounters:
    """What one rank's offload moved and holds, in bytes: ``to_host`` and ``to_device``
    since the counters were made (or :meth:`reset`), and ``host_resident``, the bytes of
    the host tensors it keeps (masters, gradients, the optimizer's state)."""

    to_host: int = 0
    to_device: int = 0
    host_resident: int = 0
    steps: int = 0

    def reset(self) -> None:
        self.to_host = self.to_device = self.steps = 0


@dataclass
class HostTier:
    """The host beside a rank's device: where offloaded tensors are made, and the copies
    into and out of it, counted (the module's doc)."""

    device_type: str
    counters: TierCounters = field(default_factory=TierCounters)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def pinned(self) -> bool:
        return self.device_type == "cuda"

    def new(self, like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zeroed host tensor shaped as ``like``, counted as held."""
        tensor = torch.zeros(like.shape, dtype=dtype, device=self.device,
                             pin_memory=self.pinned)
        self.counters.host_resident += tensor.numel() * tensor.element_size()
        return tensor

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (on the device) as a host tensor of its own, the bytes counted."""
        self.counters.to_host += tensor.numel() * tensor.element_size()
        return tensor.detach().to(self.device, copy=True)

    def copy_out(self, into: torch.Tensor, source: torch.Tensor) -> None:
        """``source`` (the device's) into the host tensor ``into``, counted."""
        self.counters.to_host += source.numel() * source.element_size()
        into.copy_(source.detach())

    def copy_in(self, into: torch.Tensor, source: torch.Tensor) -> None:
        """The host tensor ``source`` into ``into`` (the device's, in its dtype),
        counted in the device's bytes."""
        self.counters.to_device += into.numel() * into.element_size()
        into.copy_(source, non_blocking=self.pinned)

    def count_state(self, optimizer: torch.optim.Optimizer) -> int:
        """Bytes of ``optimizer``'s state tensors (its host state; a step count is no
        tensor of the parameter's shape, and not counted)."""
        return sum(t.numel() * t.element_size() for state in optimizer.state.values()
                   for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``param``: a DTensor's local shard, else the tensor."""
    local = getattr(param, "_local_tensor", None)
    return (local if local is not None else param).detach()


def host_kernel(optimizer_class: type[torch.optim.Optimizer],
                defaults: dict[str, Any]) -> dict[str, Any]:
    """``defaults`` with torch's fused CPU kernel chosen for Adam and AdamW where the
    user chose no form (the module's doc)."""
    fused_classes = (torch.optim.Adam, torch.optim.AdamW)
    if issubclass(optimizer_class, fused_classes) \
            and defaults.get("fused") is None and defaults.get("foreach") is None:
        return dict(defaults, fused=True)
    return dict(defaults)


class HostOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` over fp32 host masters of ``params`` (device tensors), as the
    module's doc says. ``grad_of(param)``: the gradient to step ``param`` with (on the
    device, or with ``grads_on_host`` fp32 host tensors already: the host buckets'),
    None to skip it; by default the local part of its ``.grad``. ``on_zero_grad``: what
    else :meth:`zero_grad` clears (the host buckets)."""

    def __init__(self, params: Iterable[torch.Tensor], optimizer_class: type[torch.optim.Optimizer],
                 tier: HostTier, *, grad_of: Callable[[torch.Tensor], torch.Tensor | None]
                 | None = None, grads_on_host: bool = False,
                 on_zero_grad: Callable[[], None] | None = None, **defaults: Any) -> None:
        super().__init__(list(params), defaults)
        self.tier, self.grads_on_host, self._on_zero_grad = tier, grads_on_host, on_zero_grad
        self._grad_of = grad_of or (lambda p: None if p.grad is None else local_tensor(p.grad))
        self._master: dict[int, nn.Parameter] = {}
        self._grad: dict[int, torch.Tensor] = {}
        groups = []
        for group in self.param_groups:
            masters = []
            for param in group["params"]:
                local = local_tensor(param)
                master = tier.new(local)
                master.copy_(local)
                self._master[id(param)] = nn.Parameter(master)
                masters.append(self._master[id(param)])
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": masters})
        self.host = optimizer_class(groups, **host_kernel(optimizer_class, defaults))

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 host master of ``param``."""
        return self._master[id(param)]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        tier = self.tier
        for outer, inner in zip(self.param_groups, self.host.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})
            for param in outer["params"]:
                master, grad = self._master[id(param)], self._grad_of(param)
                if grad is None:
                    master.grad = None
                elif self.grads_on_host:
                    master.grad = grad.view(master.shape)   # the host buckets' slots
                else:
                    held = self._grad.get(id(param))
                    if held is None:
                        held = self._grad[id(param)] = tier.new(master)
                    tier.copy_out(held, grad.reshape(master.shape))
                    master.grad = held
        before = tier.count_state(self.host)
        self.host.step()
        tier.counters.host_resident += tier.count_state(self.host) - before
        for group in self.param_groups:
            for param in group["params"]:
                master = self._master[id(param)]
                if master.grad is not None:
                    tier.copy_in(local_tensor(param), master)
                master.grad = None
        tier.counters.steps += 1
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._on_zero_grad is not None:
            self._on_zero_grad()
        for group in self.param_groups:
            for param in group["params"]:
                param.grad = None

    def state_dict(self) -> dict[str, Any]:
        return self.host.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.host.load_state_dict(state_dict)
