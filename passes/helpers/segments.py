"""What a forward runs around each repeated block, recorded without tracing.

:mod:`partc.passes.helpers.dedupe` traces a model that holds a few representatives of each
repeated container and copies their layers to the blocks they stand for. That is right
only if the whole model runs, around every block it does not trace, exactly what it runs
around the block standing for it. A block's class and parameters do not show that: the
model's own forward may treat blocks apart (``if i == 4: x = x + skip``), and a block may
read state that is the same object in every block (``config.layer_types[self.layer_idx]``).

So the forward is run once, eagerly, on fake tensors (no real compute, no state written:
parameters and buffers are fakes passed through ``torch.func.functional_call``), under a
``TorchFunctionMode`` that records every torch call the model's Python makes (``linear``,
``Tensor.add``, ``Tensor.view`` …; calls made inside another recorded call are not
seen). A hook on each block starts a new *segment* when the block is entered, so a
block's segment holds its own ops and all the model's code after it up to the next
block: everything the ``layers`` pass can put in the block's layer, and more.

Each recorded call is described by its function, its plain arguments (numbers, shapes,
dtypes, slices) by value, its tensor arguments by where they come from, and the shapes,
dtypes and gradient flags of what it returns. A tensor comes from a model input, from a
parameter or buffer (named relative to its block), or from an earlier call, named by the
segment that made it and the call's position there. Segments are named as the block that
opens them, relative to the block that reads them within one container (``-1``: the
previous block, whatever its index) and through a caller-given mapping otherwise (dedupe
maps each block to the representative that stands for it): equal descriptions mean that
the layer graphs, the code between blocks included, are the same up to block indices.

What it costs, and why it is not cheaper: the recording is one forward of the whole model
(no backward), and nearly all of its time is the dispatch of each op (for Llama-3-70B,
about 24,000 dispatches for 80 blocks: on fake tensors half of the trace phase of a cold
plan, 1.4 CPU-s; on meta tensors 0.5). It runs on fake tensors with autograd on because
that is what ``torch.export`` runs on the representatives, and the recording must see
what export would; a model all on the meta device runs on meta tensors, which fakes of
it would wrap, under export's flags (so Hugging Face's ``is_tracing`` holds there too,
and its masks call no ``.item()``); without autograd, code that asks
``torch.is_grad_enabled()`` or a tensor's
``requires_grad`` takes another branch, the same for every block (a loop that detaches
one block's output when gradients are on would record it like the others), and the
gradient flags that tell blocks after a detach from those before would all be off.
Each call is described as it is recorded, so describing a segment afterwards costs
nothing but the blocks of another container it names.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode

from partc.passes.trace import without_kv_cache

log = logging.getLogger("partc")

PREFIX = None  # the segment before the first block of any container

Segment = tuple[int, int] | None  # (container number, block position) or PREFIX


@dataclass
class Recording:
    """One forward's calls, per segment, with the order in which blocks were entered.

    Each call is described as it is recorded, its references to other segments already
    made relative or ``"prefix"``; a reference to a block of another container is left
    as a :class:`_Block` for :meth:`describe` to map, and ``across`` names the segments
    that hold one (only those depend on the mapping)."""

    containers: tuple[str, ...]
    entered: list[tuple[int, int]] = field(default_factory=list)
    calls: dict[Segment, list[tuple]] = field(default_factory=dict)
    params: dict[str, tuple[Segment, str]] = field(default_factory=dict)  # fqn → owner
    across: set[Segment] = field(default_factory=set)

    @property
    def recorded(self) -> int:
        """The calls recorded so far, every segment's."""
        return sum(len(calls) for calls in self.calls.values())

    def describe(self, segment: Segment, rep: Callable[[int, int], Hashable]) -> tuple:
        """The calls of ``segment``, every reference to another segment made relative
        (same container) or mapped by ``rep(container, position)`` (any other)."""
        calls = self.calls.get(segment, [])
        if segment not in self.across:
            return tuple(calls)

        def resolve(value: Any) -> Any:
            if isinstance(value, _Block):
                return ("block", value.container, rep(value.container, value.position))
            if isinstance(value, tuple):
                return tuple(resolve(v) for v in value)
            return value

        return tuple(resolve(call) for call in calls)


@dataclass(frozen=True)
class _Block:
    """A block of another container than the segment's, named by its own position."""

    container: int
    position: int


# Values described by type and repr, checked by exact type first (the common case).
_SCALARS = frozenset({int, float, bool, str, type(None)})


class _Recorder(TorchFunctionMode):
    def __init__(self, recording: Recording, fqns: dict[int, str], inputs: dict[int, int]):
        super().__init__()
        self.recording, self.fqns, self.inputs = recording, fqns, inputs
        self.segment: Segment = PREFIX
        self.calls = recording.calls.setdefault(PREFIX, [])
        # id → (segment, call, leaf, kind) of each tensor a recorded call returned
        self.made: dict[int, tuple[Segment, int, int, tuple]] = {}
        self.names: dict[Any, str] = {}
        self.alive: list[Any] = []  # keeps ids unique while recording

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if isinstance(out, torch.device):
            # A tensor's ``.device``: fake tensors answer it in Python, unseen here, and
            # the recording never describes the device.
            return out
        calls = self.calls
        calls.append((self._name(func), self._arg(args), self._arg(kwargs), _kind(out)))
        if isinstance(out, torch.Tensor):
            leaves: Any = (out,)
        elif type(out) in (tuple, list) and all(isinstance(v, torch.Tensor) for v in out):
            leaves = out
        else:
            leaves = [v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)]
        call = len(calls) - 1
        for leaf, tensor in enumerate(leaves):
            self.made[id(tensor)] = (self.segment, call, leaf, _kind(tensor))
        self.alive.append(out)
        return out

    def _name(self, func: Any) -> str:
        try:
            return self.names[func]
        except KeyError:
            name = self.names[func] = _name(func)
            return name
        except TypeError:  # a callable that cannot be a key
            return _name(func)

    def _arg(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value)
        if type(value) in _SCALARS:
            return (type(value).__name__, repr(value))
        if isinstance(value, (tuple, list)):
            return (type(value).__name__,) + tuple(self._arg(v) for v in value)
        if isinstance(value, dict):
            return ("dict",) + tuple((k, self._arg(v)) for k, v in value.items())
        if isinstance(value, slice):
            return ("slice", self._arg(value.start), self._arg(value.stop),
                    self._arg(value.step))
        return _plain(value)

    def _tensor(self, value: torch.Tensor) -> tuple:
        key = id(value)
        if key in self.fqns:
            fqn = self.fqns[key]
            owner, name = self.recording.params[fqn]
            where = fqn if owner is PREFIX else self._place(owner)
            return ("param", where, name, _kind(value))
        made = self.made.get(key)
        if made is not None:
            segment, call, leaf, kind = made
            return ("value", self._place(segment), call, leaf, kind)
        if key in self.inputs:
            return ("input", self.inputs[key], _kind(value))
        return ("tensor", _kind(value))  # made outside any torch call seen here

    def _place(self, other: Segment) -> Hashable:
        """Where ``other`` lies, seen from the segment being recorded."""
        if other is PREFIX:
            return "prefix"
        segment = self.segment
        if segment is not PREFIX and other[0] == segment[0]:
            return ("relative", other[1] - segment[1])
        self.recording.across.add(segment)
        return _Block(*other)

    def enter(self, container: int, position: int) -> None:
        self.segment = (container, position)
        self.calls = self.recording.calls.setdefault(self.segment, [])
        self.recording.entered.append(self.segment)


def _name(func: Any) -> str:
    return f"{getattr(func, '__module__', None)}.{getattr(func, '__qualname__', repr(func))}"


def _kind(value: Any) -> tuple:
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), str(value.dtype), value.requires_grad)
    if isinstance(value, (tuple, list)):
        return tuple(_kind(v) for v in value)
    return _plain(value)


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes,
                                           torch.dtype, torch.device, torch.Size,
                                           torch.memory_format, torch.layout, enum.Enum)):
        return (type(value).__name__, repr(value))
    return ("object", type(value).__qualname__)  # by type: its content is not compared


def record(model: nn.Module, containers: tuple[str, ...], args: tuple, kwargs: dict,
           on_block: Callable[[str, int, int, int], None] | None = None) -> Recording:
    """Run ``model`` on fakes of ``args``/``kwargs``, its parameters and buffers fakes
    too, recording each segment of the blocks of ``containers`` (as they hold now).
    ``on_block(container, position, size, calls)`` is told as each block is entered, with
    the calls recorded so far (a model whose blocks loop in Python runs for minutes).

    A model whose tensors and inputs are all on the meta device already is run on meta
    tensors instead (:func:`_on_meta`), where that runs: the same calls, a third of the
    time; anything it cannot run there is run on fakes."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    if _on_meta(named.values(), (args, kwargs)):
        try:
            return _record(model, containers, args, kwargs, named, contextlib.nullcontext(),
                           on_block)
        except Exception as error:  # noqa: BLE001 - an op meta tensors cannot run: on fakes
            log.debug("recording on fake tensors (on meta ones: %s: %s)",
                      type(error).__name__, error)
    return _record(model, containers, args, kwargs, named,
                   FakeTensorMode(allow_non_fake_inputs=True), on_block)


def _on_meta(tensors: Any, inputs: Any) -> bool:
    """Whether every tensor of ``tensors`` and ``inputs`` is on the meta device: fakes of
    them would be too, and run the meta kernels, behind the fake tensors' dispatch.
    Under export's flags (:func:`_as_export_runs`) the model takes the branches it takes
    on fakes (Hugging Face's ``is_tracing`` holds for both); the recording describes
    shapes, dtypes and gradient flags, never the device."""
    leaves = [*tensors, *(t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor))]
    return bool(leaves) and all(t.device.type == "meta" and not isinstance(t, FakeTensor)
                                for t in leaves)


def _record(model: nn.Module, containers: tuple[str, ...], args: tuple, kwargs: dict,
            named: dict[str, torch.Tensor], mode: Any,
            on_block: Callable[[str, int, int, int], None] | None) -> Recording:
    recording = Recording(containers=containers)
    device = next(iter(named.values())).device if named else torch.device("cpu")
    with mode:
        fakes_by_id: dict[int, torch.Tensor] = {}
        for tensor in named.values():
            if id(tensor) not in fakes_by_id:
                fake = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()),
                                           dtype=tensor.dtype, device=tensor.device)
                fakes_by_id[id(tensor)] = fake.requires_grad_(tensor.requires_grad)
        fake_args, fake_kwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: torch.empty_strided(
                tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device),
            (args, kwargs))
    fakes = {fqn: fakes_by_id[id(t)] for fqn, t in named.items()}
    fqns = {id(fake): fqn for fqn, fake in reversed(list(fakes.items()))}
    _owners(model, containers, recording, named)
    inputs = {id(t): i for i, t in enumerate(pytree.tree_leaves((fake_args, fake_kwargs)))
              if isinstance(t, torch.Tensor)}
    recorder = _Recorder(recording, fqns, inputs)
    with _entry_hooks(model, containers, recorder, on_block), _as_export_runs(), mode, \
            recorder, without_kv_cache(model):   # as the model is traced
        torch.func.functional_call(model, fakes, fake_args, fake_kwargs, tie_weights=False)
    return recording


def _as_export_runs() -> contextlib.AbstractContextManager:
    """What ``torch.export(strict=False)`` runs the forward under: ``torch.compiler.
    is_compiling()`` and ``is_exporting()`` True. Models branch on them (Hugging Face's
    mixture-of-experts layers call ``torch._grouped_mm`` eagerly, which refuses float32
    on the meta device, and a custom op of their own under export), so the recording
    must take the branches the trace takes. torch keeps no public switch for it: its
    export's own context, where this torch has one."""
    try:
        from torch._export.utils import _compiling_state_context
    except ImportError:
        return contextlib.nullcontext()
    return _compiling_state_context()


def _owners(model: nn.Module, containers: tuple[str, ...], recording: Recording,
            named: dict[str, torch.Tensor]) -> None:
    """Each parameter's block (or PREFIX: outside every block) and name within it."""
    for fqn in named:
        recording.params[fqn] = (PREFIX, fqn)
        for number, container in enumerate(containers):
            prefix = f"{container}." if container else ""
            rest = fqn[len(prefix):] if fqn.startswith(prefix) else None
            position, _, name = (rest or "").partition(".")
            if rest and position.isdigit() and \
                    int(position) < len(model.get_submodule(container)._modules):
                recording.params[fqn] = ((number, int(position)), name)


@contextlib.contextmanager
def _entry_hooks(model: nn.Module, containers: tuple[str, ...], recorder: _Recorder,
                 on_block: Callable[[str, int, int, int], None] | None) -> Iterator[None]:
    handles = []
    try:
        for number, container in enumerate(containers):
            blocks = model.get_submodule(container)._modules.values()
            for position, block in enumerate(blocks):
                def hook(module, inputs, number=number, position=position,
                         container=container, size=len(blocks)):
                    recorder.enter(number, position)
                    if on_block is not None:
                        on_block(container, position, size,
                                 recorder.recording.recorded)
                handles.append(block.register_forward_pre_hook(hook))
        yield
    finally:
        for handle in handles:
            handle.remove()
