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

What moves is storages: the saved tensors that view one storage share one copy of it,
as the estimate counts a layer's saved bytes (by storage, parameters left out); the
module's own tensors (parameters, buffers, passed in by position: ``held``) and every
view of them stay.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

OFFLOADED_MODE = "offload"


@dataclass
class OffloadCounters:
    """What a stage's offloaded layers moved and held, in bytes, since the counters were
    last reset: ``to_host`` / ``to_device`` moved each way, ``resident`` on the host now,
    ``peak_resident`` the most held at once, ``storages`` copied out."""

    to_host: int = 0
    to_device: int = 0
    resident: int = 0
    peak_resident: int = 0
    storages: int = 0

    def reset(self) -> None:
        """Start a new count (what is on the host now stays counted as resident)."""
        self.to_host = self.to_device = self.storages = 0
        self.peak_resident = self.resident


class _Saved:
    """One storage that saved tensors view, on the host: its copy, and on the way back
    its device copy."""

    __slots__ = ("host", "device", "nbytes", "origin")

    def __init__(self, host: torch.Tensor, nbytes: int, origin: torch.device) -> None:
        self.host: torch.Tensor | None = host
        self.device: torch.Tensor | None = None
        self.nbytes, self.origin = nbytes, origin

    def view(self, dtype: torch.dtype, offset: int, shape: tuple, stride: tuple) -> torch.Tensor:
        """A saved tensor again: its view of the copy nearest the compute."""
        copy = self.device if self.device is not None else self.host
        return torch.empty(0, dtype=dtype, device=copy.device).set_(
            copy.untyped_storage(), offset, shape, stride)


class _Group:
    """The saved tensors of one call of an offloaded layer (one microbatch), the
    events of their copies, and the group made just before it in the same forward."""

    def __init__(self, owner: "ActivationOffload", name: str, previous: "_Group | None",
                 held: set[int]) -> None:
        self.owner, self.name = owner, name
        # Weakly: a group whose graph autograd dropped (a forward without backward) goes.
        self._previous = weakref.ref(previous) if previous is not None else None
        self.held = held                  # the storages of the module's own tensors
        self.saved: list[_Saved] = []
        # Per storage (held weakly: no other storage takes its place while the group
        # lives, so views of one storage share one copy), its copy.
        self._copies: dict[StorageWeakRef, _Saved] = {}
        # What autograd never unpacked leaves the host's count when the group goes.
        weakref.finalize(self, owner.forget, self.saved)
        self.copied_out: Any = None      # CUDA event: the copies to host are done
        self.fetched = False
        self.fetched_event: Any = None   # CUDA event: the copies back are done
        self.left = 0                    # saved tensors not yet unpacked

    def pack(self, tensor: torch.Tensor) -> Any:
        if not offloadable(tensor, self.held):
            return tensor
        key = StorageWeakRef(tensor.untyped_storage())
        entry = self._copies.get(key)
        if entry is None:
            entry = self._copies[key] = self.owner.copy_out(tensor)
            self.saved.append(entry)
        self.left += 1
        return (entry, tensor.dtype, tensor.storage_offset(), tuple(tensor.shape),
                tuple(tensor.stride()))

    def unpack(self, packed: Any) -> torch.Tensor:
        if not (isinstance(packed, tuple) and packed and isinstance(packed[0], _Saved)):
            return packed
        if not self.fetched:
            self.owner.fetch(self)
        self.owner.wait_fetched(self)
        previous = self._previous() if self._previous is not None else None
        if previous is not None and not previous.fetched:
            self.owner.fetch(previous)               # the next backward's, beside this one
        tensor = packed[0].view(*packed[1:])
        self.left -= 1
        if self.left == 0:
            self.owner.release(self)
        return tensor


def offloadable(tensor: torch.Tensor, held: set[int]) -> bool:
    """A plain tensor with storage, not a parameter nor a view of one, nor sharing the
    storage of the module's own tensors ``held`` (its parameters and buffers)."""
    if type(tensor) is not torch.Tensor or tensor.device.type == "meta":
        return False         # parameters, DTensor and other subclasses stay
    base = tensor._base if tensor._base is not None else tensor
    if isinstance(base, nn.Parameter):
        return False
    return tensor.untyped_storage().data_ptr() not in held


class ActivationOffload(nn.Module):
    """A stage's ledger of offloaded activations (no parameters, no buffers): the
    counters, the side stream on a GPU, and the groups of the forward in progress."""

    def __init__(self) -> None:
        super().__init__()
        self.counters = OffloadCounters()
        self._stream: Any = None
        # This forward's groups so far, in order (weakly: autograd's graph holds them).
        self._chain: list[weakref.ref] = []

    # -------------------------------------------------------------- the forward side

    def open(self, name: str, held: set[int]) -> _Group:
        """A new group for one call of layer ``name``; a layer already in the chain
        starts a new forward (the next microbatch)."""
        chain = [group for group in (ref() for ref in self._chain) if group is not None]
        if any(group.name == name for group in chain):
            chain = []
        if len(chain) >= 2 and chain[-2].copied_out is not None:
            # The window: at most the last layer's copies in flight beside this one.
            torch.cuda.current_stream().wait_event(chain[-2].copied_out)
        group = _Group(self, name, chain[-1] if chain else None, held)
        self._chain = [weakref.ref(g) for g in (*chain, group)]
        return group

    def close(self, group: _Group) -> None:
        """The layer's forward is done: mark where its copies out end."""
        if self._stream is not None and group.saved:
            group.copied_out = torch.cuda.Event()
            group.copied_out.record(self._stream)

    def copy_out(self, tensor: torch.Tensor) -> _Saved:
        """A copy of ``tensor``'s whole storage on the host."""
        storage = tensor.untyped_storage()
        whole = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        nbytes = storage.nbytes()
        if tensor.device.type == "cuda":
            stream = self._side_stream(tensor.device)
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(stream):
                host.copy_(whole, non_blocking=True)
            whole.record_stream(stream)   # its memory is reused only after the copy
        else:
            host = whole.clone()           # the host is the device: a copy apart
        counters = self.counters
        counters.to_host += nbytes
        counters.storages += 1
        counters.resident += nbytes
        counters.peak_resident = max(counters.peak_resident, counters.resident)
        return _Saved(host, nbytes, tensor.device)

    # ------------------------------------------------------------- the backward side

    def fetch(self, group: _Group) -> None:
        """Start bringing ``group``'s storages back (on the side stream on a GPU)."""
        group.fetched = True
        on_gpu = [entry for entry in group.saved if entry.origin.type == "cuda"]
        for entry in group.saved:
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
        """The compute stream waits for ``group``'s copies back (once)."""
        if group.fetched_event is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(group.fetched_event)
            for entry in group.saved:
                if entry.device is not None:
                    entry.device.record_stream(stream)
            group.fetched_event = None

    def release(self, group: _Group) -> None:
        """Every saved tensor of ``group`` is in autograd's hands: the host copies go."""
        for entry in group.saved:
            if entry.host is not None:
                self.counters.resident -= entry.nbytes
            entry.host = entry.device = None
        group.saved.clear()

    def forget(self, saved: list[_Saved]) -> None:
        """A group went without its backward (autograd dropped its graph): what it
        left on the host goes with it."""
        for entry in saved:
            if entry.host is not None:
                self.counters.resident -= entry.nbytes

    def _side_stream(self, device: torch.device) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream


def offload_layer(ledger: ActivationOffload, layer: Callable[..., Any], *args: Any,
                  held: tuple[int, ...] = ()) -> Any:
    """Run ``layer(*args)`` (one layer's nodes, as the recompute pass wraps them) with
    what it saves for backward kept on the host (see the module docstring). ``held``:
    the positions of ``args`` that are the module's own tensors (parameters, buffers),
    which stay where they are with every tensor sharing their storage."""
    own = {args[i].untyped_storage().data_ptr() for i in held
           if isinstance(args[i], torch.Tensor) and type(args[i]) in (torch.Tensor, nn.Parameter)}
    group = ledger.open(type(layer).__name__, own)
    with torch.autograd.graph.saved_tensors_hooks(group.pack, group.unpack):
        result = layer(*args)
    ledger.close(group)
    return result


def ledgers(module: nn.Module) -> list[ActivationOffload]:
    """The :class:`ActivationOffload` modules inside ``module`` (a rank's stages)."""
    return [m for m in module.modules() if isinstance(m, ActivationOffload)]
