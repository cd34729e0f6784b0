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
tensors (cast to their dtype), pipelined in chunks (:class:`HostOptimizer`).

What overlaps on a GPU: every copy runs on the tier's copy stream from or into pinned
memory, behind the compute stream's work so far (:meth:`HostTier.stream_out`,
``copy_out``, ``copy_in``); the host buckets' gradients go out as backward makes them
and are added into the buckets as they land, beside the rest of backward; the step's
chunks overlap each other's copies and host work; the compute stream waits for the
copies back before the next forward (:meth:`HostTier.join`). The host's step itself
waits for the whole backward (clipping needs the global norm, and a non-finite step is
skipped whole). On a CPU the same calls copy at once, in the same order, and the
counters (``streamed``, ``overlapped``) say what a GPU would overlap.

torch's Adam and AdamW run in their fused CPU form (one
vectorised kernel over each tensor; ``benchmarks/host_adam.py`` measured it several
times faster than the foreach form) unless the user chose a form. Its ``param_groups``
are the device tensors' (learning-rate schedulers act on them as on any optimizer);
their hyperparameters reach the host optimizer at every step, and its ``state`` is the
host optimizer's state of each master under the device tensor's key, so that
checkpoints (``partc/runtime/checkpoint_chunks.py``) save and load the host's moments as
any optimizer's, cut as the device tensor is.

Checkpoints hold the weights at their full precision: where the device keeps a
parameter in the compute dtype and the host its fp32 master (the gradient buckets on
the host, mixed precision), the master is the weight a checkpoint saves and loads
(:attr:`HostTier.weights`); elsewhere the device tensor is an exact copy of its master
after every step, and is saved. After a load, :meth:`HostTier.after_load` brings the two
together again (the master to the device where it was loaded, else the device's tensor
to the master).
"""

from __future__ import annotations

import weakref
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

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
    # Of ``to_host``: the gradients streamed out during backward (the host buckets').
    # Of ``to_device``: the weights copied back while the host still had chunks to step
    # (the pipelined step's overlap: only the last chunk's copy follows the whole step).
    streamed: int = 0
    overlapped: int = 0

    def reset(self) -> None:
        self.to_host = self.to_device = self.steps = self.streamed = self.overlapped = 0


@dataclass
class HostTier:
    """The host beside a rank's device: where offloaded tensors are made, and the copies
    into and out of it, counted (the module's doc)."""

    device_type: str
    counters: TierCounters = field(default_factory=TierCounters)
    # id of a device parameter kept in the compute dtype -> its fp32 host master, the
    # weight checkpoints and state dicts read and write (the module's doc).
    weights: dict[int, torch.Tensor] = field(default_factory=dict)
    # The host optimizers stepping this rank's tensors (held weakly).
    optimizers: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    # The copy stream on a GPU (made at the first copy); None on a CPU.
    _copies: Any = None

    def after_load(self) -> None:
        """After the rank's tensors were loaded (a checkpoint, a state dict): each host
        optimizer's masters and the device tensors agree again (the module's doc)."""
        for optimizer in list(self.optimizers):
            optimizer.masters_from_device(skip=self.weights)

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

    # -- copies: on a GPU asynchronous, on the tier's copy stream; on a CPU made here --

    def _stream(self) -> Any:
        """The copy stream (made at the first copy), behind the work the compute stream
        has queued so far: what it copies is final, and what it overwrites read."""
        if self._copies is None:
            self._copies = torch.cuda.Stream()
        self._copies.wait_stream(torch.cuda.current_stream())
        return self._copies

    def stream_out(self, source: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """``source`` (on the device) into a host tensor of its own, counted: on a GPU
        into pinned memory on the copy stream, with the event that marks it done (wait
        with :meth:`wait`); on a CPU copied here (no event)."""
        self.counters.to_host += source.numel() * source.element_size()
        if not self.pinned:
            return source.detach().to(self.device, copy=True), None
        staging = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
        return staging, self._async(staging, source)

    def copy_out(self, into: torch.Tensor, source: torch.Tensor) -> Any:
        """``source`` (the device's) into the host tensor ``into``, counted; on a GPU
        asynchronously (the event to :meth:`wait` for), on a CPU here (None)."""
        self.counters.to_host += source.numel() * source.element_size()
        if not self.pinned:
            into.copy_(source.detach())
            return None
        return self._async(into, source)

    def copy_in(self, into: torch.Tensor, source: torch.Tensor, *,
                overlapped: bool = False) -> None:
        """The host tensor ``source`` into ``into`` (the device's, in its dtype),
        counted in the device's bytes (and as ``overlapped`` where host work follows
        it); on a GPU asynchronously on the copy stream (:meth:`join` orders the
        compute stream after it)."""
        nbytes = into.numel() * into.element_size()
        self.counters.to_device += nbytes
        self.counters.overlapped += nbytes if overlapped else 0
        if not self.pinned:
            into.copy_(source)
            return
        self._async(into, source)

    def _async(self, into: torch.Tensor, source: torch.Tensor) -> Any:
        stream = self._stream()
        with torch.cuda.stream(stream):
            into.copy_(source.detach(), non_blocking=True)
            for tensor in (into, source):
                if tensor.is_cuda:   # not reused by the allocator before the copy ran
                    tensor.record_stream(stream)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    @staticmethod
    def wait(event: Any) -> None:
        """The host waits for a copy's ``event`` (None: made already)."""
        if event is not None:
            event.synchronize()

    def join(self) -> None:
        """The compute stream waits for every copy issued (the weights back before the
        next forward reads them); nothing on a CPU."""
        if self._copies is not None:
            torch.cuda.current_stream().wait_stream(self._copies)

    def fence(self) -> None:
        """The host waits for every copy issued (before it changes what they read)."""
        if self._copies is not None:
            self._copies.synchronize()

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
    else :meth:`zero_grad` clears (the host buckets).

    The step is pipelined over chunks of about ``chunk_elements`` elements (the plan's
    bucket size; all at once without it): every chunk's gradients are copied out first
    (on a GPU, all issued at once on the copy stream), then each chunk is stepped on the
    host as soon as its gradients are there and its updated weights copied back at once,
    so that on a GPU the copies of one chunk run while the host steps the next. Stepping
    a chunk at a time is the same arithmetic as one step (torch's per-parameter
    optimizers update each tensor on its own, and count a step per tensor stepped)."""

    def __init__(self, params: Iterable[torch.Tensor], optimizer_class: type[torch.optim.Optimizer],
                 tier: HostTier, *, grad_of: Callable[[torch.Tensor], torch.Tensor | None]
                 | None = None, grads_on_host: bool = False,
                 on_zero_grad: Callable[[], None] | None = None,
                 chunk_elements: int | None = None, **defaults: Any) -> None:
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
        self._device = {id(p): p for group in self.param_groups for p in group["params"]}
        self.chunks = _chunks(list(self._device.values()), chunk_elements)
        self.state = HostState(self)   # type: ignore[assignment]
        tier.optimizers.add(self)

    @torch.no_grad()
    def masters_from_device(self, skip: dict[int, torch.Tensor]) -> None:
        """Each master from its device tensor (after a load into the device's), or for a
        parameter in ``skip`` (whose master was loaded) the device tensor from it."""
        self.tier.fence()
        for key, param in self._device.items():
            master = self._master[key]
            if key in skip:
                local_tensor(param).copy_(master)
            else:
                master.copy_(local_tensor(param).reshape(master.shape))

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 host master of ``param``."""
        return self._master[id(param)]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        tier = self.tier
        tier.fence()   # the last step's weights are back before the masters change
        for outer, inner in zip(self.param_groups, self.host.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        out = [self._grads_out(chunk) for chunk in self.chunks]   # all issued at once
        before = tier.count_state(self.host)
        for index, (grads, copied) in enumerate(out):
            tier.wait(copied)
            for master, grad in grads:
                master.grad = grad
            self.host.step()
            follows = index < len(out) - 1   # host work after this chunk's copy back
            for param in self.chunks[index]:
                master = self._master[id(param)]
                if master.grad is not None:
                    tier.copy_in(local_tensor(param), master, overlapped=follows)
                master.grad = None
        tier.counters.host_resident += tier.count_state(self.host) - before
        tier.join()
        tier.counters.steps += 1
        return loss

    def _grads_out(self, chunk: list[torch.Tensor]) -> tuple[list, Any]:
        """A chunk's (master, host gradient) pairs, its gradients' copies out issued,
        and the event of the last (None where none is in flight)."""
        pairs, copied = [], None
        for param in chunk:
            master, grad = self._master[id(param)], self._grad_of(param)
            if grad is None:
                continue
            if self.grads_on_host:
                pairs.append((master, grad.view(master.shape)))   # the host buckets'
                continue
            held = self._grad.get(id(param))
            if held is None:
                held = self._grad[id(param)] = self.tier.new(master)
            copied = self.tier.copy_out(held, grad.reshape(master.shape)) or copied
            pairs.append((master, held))
        return pairs, copied

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


def _chunks(params: list[torch.Tensor], elements: int | None) -> list[list[torch.Tensor]]:
    """``params`` in runs of at least ``elements`` elements (the last may hold fewer);
    one run without a size."""
    if elements is None:
        return [params] if params else []
    chunks: list[list[torch.Tensor]] = [[]]
    held = 0
    for param in params:
        if held >= elements:
            chunks.append([])
            held = 0
        chunks[-1].append(param)
        held += local_tensor(param).numel()
    return chunks if params else []


class HostState(MutableMapping):
    """A :class:`HostOptimizer`'s ``state``: the host optimizer's state of each master,
    keyed by the device tensor it stands for (what checkpoints read as any optimizer's
    ``state``)."""

    def __init__(self, optimizer: HostOptimizer) -> None:
        self._optimizer = optimizer

    def _master(self, param: torch.Tensor) -> torch.Tensor:
        try:
            return self._optimizer._master[id(param)]
        except KeyError:
            raise KeyError(param) from None

    def __getitem__(self, param: torch.Tensor) -> dict[str, Any]:
        master = self._master(param)
        if master not in self._optimizer.host.state:
            raise KeyError(param)
        return self._optimizer.host.state[master]

    def __setitem__(self, param: torch.Tensor, value: dict[str, Any]) -> None:
        self._optimizer.host.state[self._master(param)] = value

    def __delitem__(self, param: torch.Tensor) -> None:
        del self._optimizer.host.state[self._master(param)]

    def __iter__(self) -> Iterator[torch.Tensor]:
        held = self._optimizer.host.state
        return iter([p for key, p in self._optimizer._device.items()
                     if self._optimizer._master[key] in held])

    def __len__(self) -> int:
        return sum(1 for _ in self)
