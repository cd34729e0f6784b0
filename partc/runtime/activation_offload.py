"""Activation offload at run time: what the recompute pass's ``offload_layer`` calls do.

A layer the plan offloads (recompute mode ``"offload"``) runs its forward under
``torch.autograd.graph.saved_tensors_hooks``: every tensor it saves for backward, but the
parameters and their views (they stay on the device anyway), is copied to host memory as
the forward goes, and brought back before the layer's backward needs it. The stage's
:class:`ActivationOffload` (one module per stage, ``self.activation_offload``) holds the
copies, in groups: one group per call of an offloaded layer (one layer, one microbatch).

On a GPU the copies run on a side stream of their own, into pinned host memory:

- forward: the side stream waits for the op that made a tensor, copies it out and
  records an event; the tensor's device memory is given back to the caching allocator as
  soon as the copy is done (``record_stream``). At most one earlier layer's copies are in
  flight beside the layer running: as a layer starts, the compute stream waits for the
  copies of the group two before it, so the device holds a bounded window of saved
  tensors (the cost model's transient: :mod:`partc.cost.offload_time`);
- backward: the first unpack of a group brings its tensors back (unless a prefetch
  already did) and starts bringing back the group before it in the same forward (the
  layer whose backward comes next), so the copy in overlaps this layer's backward.

On CPU the host is the device: a packed tensor is a separate copy (the original goes
as on a GPU), and the counters (:class:`OffloadCounters`) record the bytes moved each way
and held, so a test checks them against the plan (``StagePlan.host_bytes``).

Saved tensors are deduplicated per group by what they view (storage, offset, shape,
strides, dtype), as the estimate counts a layer's saved bytes (by storage, parameters
left out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

OFFLOADED_MODE = "offload"


@dataclass
class OffloadCounters:
    """What a stage's offloaded layers moved and held, in bytes, since the counters were
    last reset: ``to_host`` / ``to_device`` moved each way, ``resident`` on the host now,
    ``peak_resident`` the most held at once, ``tensors`` copied out."""

    to_host: int = 0
    to_device: int = 0
    resident: int = 0
    peak_resident: int = 0
    tensors: int = 0

    def reset(self) -> None:
        """Start a new count (what is on the host now stays counted as resident)."""
        self.to_host = self.to_device = self.tensors = 0
        self.peak_resident = self.resident


class _Saved:
    """One saved tensor on the host: its copy, and on the way back its device copy."""

    __slots__ = ("host", "device", "nbytes", "origin")

    def __init__(self, host: torch.Tensor, nbytes: int, origin: torch.device) -> None:
        self.host: torch.Tensor | None = host
        self.device: torch.Tensor | None = None
        self.nbytes, self.origin = nbytes, origin


class _Group:
    """The saved tensors of one call of an offloaded layer (one microbatch), the
    events of their copies, and the group made just before it in the same forward."""

    def __init__(self, owner: "ActivationOffload", name: str, previous: "_Group | None",
                 parameters: set[int]) -> None:
        self.owner, self.name, self.previous = owner, name, previous
        self.parameters = parameters
        self.saved: dict[tuple, _Saved] = {}
        self.copied_out: Any = None      # CUDA event: the copies to host are done
        self.fetched = False
        self.fetched_event: Any = None   # CUDA event: the copies back are done
        self.left = 0                    # saved tensors not yet unpacked

    def pack(self, tensor: torch.Tensor) -> Any:
        if not self.owner.offloadable(tensor, self.parameters):
            return tensor
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
               tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device)
        entry = self.saved.get(key)
        if entry is None:
            entry = self.saved[key] = self.owner.copy_out(tensor, self)
        self.left += 1
        return entry

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Saved):
            return packed
        if not self.fetched:
            self.owner.fetch(self)
        self.owner.wait_fetched(self)
        if self.previous is not None and not self.previous.fetched:
            self.owner.fetch(self.previous)          # the next backward's, beside this one
        tensor = packed.device if packed.device is not None else packed.host
        self.left -= 1
        if self.left == 0:
            self.owner.release(self)
        return tensor


class ActivationOffload(nn.Module):
    """A stage's ledger of offloaded activations (no parameters, no buffers): the
    counters, the side stream on a GPU, and the groups of the forward in progress."""

    def __init__(self) -> None:
        super().__init__()
        self.counters = OffloadCounters()
        self._stream: Any = None
        self._chain: list[_Group] = []   # this forward's groups so far, in order

    # -------------------------------------------------------------- the forward side

    def open(self, name: str, parameters: set[int]) -> _Group:
        """A new group for one call of layer ``name``; a layer already in the chain
        starts a new forward (the next microbatch)."""
        if any(group.name == name for group in self._chain):
            self._chain = []
        previous = self._chain[-1] if self._chain else None
        if len(self._chain) >= 2 and self._chain[-2].copied_out is not None:
            # The window: at most the last layer's copies in flight beside this one.
            torch.cuda.current_stream().wait_event(self._chain[-2].copied_out)
        group = _Group(self, name, previous, parameters)
        self._chain.append(group)
        return group

    def close(self, group: _Group) -> None:
        """The layer's forward is done: mark where its copies out end."""
        if self._stream is not None and group.saved:
            group.copied_out = torch.cuda.Event()
            group.copied_out.record(self._stream)

    @staticmethod
    def offloadable(tensor: torch.Tensor, parameters: set[int]) -> bool:
        """A plain tensor with storage that is not a parameter nor a view of one."""
        if type(tensor) is not torch.Tensor and not isinstance(tensor, nn.Parameter):
            return False         # DTensor and other subclasses: left where they are
        if isinstance(tensor, nn.Parameter) or tensor.device.type == "meta":
            return False
        base = tensor._base if tensor._base is not None else tensor
        if isinstance(base, nn.Parameter):
            return False
        return tensor.untyped_storage().data_ptr() not in parameters

    def copy_out(self, tensor: torch.Tensor, group: _Group) -> _Saved:
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device.type == "cuda":
            stream = self._side_stream(tensor.device)
            host = torch.empty_like(tensor, device="cpu", pin_memory=True)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(stream):
                host.copy_(tensor.detach(), non_blocking=True)
            tensor.record_stream(stream)   # its memory is reused only after the copy
        else:
            host = tensor.detach().clone()  # the host is the device: a copy apart
        counters = self.counters
        counters.to_host += nbytes
        counters.tensors += 1
        counters.resident += nbytes
        counters.peak_resident = max(counters.peak_resident, counters.resident)
        return _Saved(host, nbytes, tensor.device)

    # ------------------------------------------------------------- the backward side

    def fetch(self, group: _Group) -> None:
        """Start bringing ``group``'s tensors back (on the side stream on a GPU)."""
        group.fetched = True
        on_gpu = [s for s in group.saved.values() if s.origin.type == "cuda"]
        for entry in group.saved.values():
            self.counters.to_device += entry.nbytes
        if not on_gpu:
            return
        stream = self._side_stream(on_gpu[0].origin)
        stream.wait_stream(torch.cuda.current_stream(on_gpu[0].origin))
        with torch.cuda.stream(stream):
            for entry in on_gpu:
                entry.device = entry.host.to(entry.origin, non_blocking=True)
        group.fetched_event = torch.cuda.Event()
        group.fetched_event.record(stream)

    def wait_fetched(self, group: _Group) -> None:
        if group.fetched_event is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(group.fetched_event)
            for entry in group.saved.values():
                if entry.device is not None:
                    entry.device.record_stream(stream)
            group.fetched_event = None

    def release(self, group: _Group) -> None:
        """Every saved tensor of ``group`` is back in autograd's hands: its host copies go."""
        for entry in group.saved.values():
            if entry.host is not None:
                self.counters.resident -= entry.nbytes
            entry.host = entry.device = None
        group.saved.clear()

    def _side_stream(self, device: torch.device) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream


def offload_layer(ledger: ActivationOffload, layer: Callable[..., Any], *args: Any) -> Any:
    """Run ``layer(*args)`` (one layer's nodes, as the recompute pass wraps them) with
    what it saves for backward kept on the host (see the module docstring). Parameters
    among ``args`` (and tensors sharing their storage) stay where they are."""
    parameters = {arg.untyped_storage().data_ptr() for arg in args
                  if isinstance(arg, torch.Tensor) and type(arg) in (torch.Tensor, nn.Parameter)
                  and (isinstance(arg, nn.Parameter) or arg.is_leaf and arg.requires_grad)}
    group = ledger.open(type(layer).__name__, parameters)
    with torch.autograd.graph.saved_tensors_hooks(group.pack, group.unpack):
        result = layer(*args)
    ledger.close(group)
    return result


def ledgers(module: nn.Module) -> list[ActivationOffload]:
    """The :class:`ActivationOffload` modules inside ``module`` (a rank's stages)."""
    return [m for m in module.modules() if isinstance(m, ActivationOffload)]
