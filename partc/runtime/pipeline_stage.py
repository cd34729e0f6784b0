"""What partc changes in torch's pipeline stage, and the gradient sync it arms.

:class:`CountingStage` is ``torch.distributed.pipelining``'s ``PipelineStage`` with
partc's additions: it counts the point-to-point messages it posts (the plan's figures are
checked against them), tells the watchdog of each microbatch, runs pipelining's
first-step shape inference on zeros and without touching written buffers, holds each
receive buffer only while its microbatch needs it (:class:`_ReceiveBuffers`), and under
ZeRO-2/3 reduce-scatters gradients after every microbatch, or, for a ZeRO-2 plan that
reduces once per step, after the stage's last one (see :mod:`.rank_build`).
:class:`partc.runtime.optimizer.GradBuckets` (ZeRO 0/1's bucketed gradient reduction,
overlapping the last backward) is armed here; :func:`contiguous_transfers` makes what
crosses a stage boundary contiguous.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward
from torch.distributed.tensor import DTensor

from partc.errors import PartcError
from partc.runtime import split_backward, value_checks
from partc.runtime.optimizer import GradBuckets
from partc.runtime.watchdog import Watchdog

try:  # private to torch: without it the stage keeps torch's buffers (see _ReceiveBuffers)
    from torch.distributed.pipelining.stage import _RecvInfo
except ImportError:  # pragma: no cover - a torch that moved it
    _RecvInfo = None

log = logging.getLogger(__name__)


class CountingStage(PipelineStage):
    """A pipeline stage that counts the point-to-point messages it posts, and under
    ZeRO-2/3 reduce-scatters gradients after every microbatch, or with ``reduce_once``
    (ZeRO-2) accumulates them whole until the stage's last backward of the step (see
    the module's doc)."""

    def __init__(self, *args: Any, zero_stage: int = 0, reduce_once: bool = False,
                 grad_sync: Any = None, compute_copies: Any = None,
                 watchdog: Watchdog | None = None,
                 scaled_elsewhere: frozenset[int] = frozenset(),
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.messages: Counter[str] = Counter()
        self.zero_stage = zero_stage
        self.reduce_once = reduce_once
        # ZeRO 0/1 with dp > 1 or mixed precision: GradBuckets (any object with its
        # begin/end/finish calls: benchmarks/optimizer.py measures another against it)
        self.grad_sync = grad_sync
        self.compute_copies = compute_copies  # mixed precision under ZeRO 0/1 (precision.py)
        self.watchdog = watchdog  # told of each microbatch's start
        # Parameters (ids) another stage of this rank holds too and scales: a tied
        # weight is one parameter of both, divided by the microbatches once.
        self.scaled_elsewhere = scaled_elsewhere
        # The receive buffers' shapes, per microbatch (see _ReceiveBuffers)
        self.activation_buffers = _ReceiveBuffers("activation")
        self.gradient_buffers = _ReceiveBuffers("gradient")

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if self.watchdog is not None:
            self.watchdog.mark(f"schedule: forward, microbatch {fwd_chunk_id}")
        output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if not self.has_backward:
            # Forward only: the outputs are still to be sent, but nothing reads the
            # microbatch's inputs again.
            outputs, _inputs = self.fwd_cache[fwd_chunk_id]
            self.fwd_cache[fwd_chunk_id] = (outputs, [])
            self.activation_buffers.release(self.args_recv_info, fwd_chunk_id)
        return output

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if self.watchdog is not None:
            self.watchdog.mark(f"schedule: backward, microbatch {bwd_chunk_id}")
        result = super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        if self.has_backward:
            # Autograd (and a split backward's saved state) keeps what it needs itself.
            self.activation_buffers.release(self.args_recv_info, bwd_chunk_id)
            self.gradient_buffers.release(self.grad_recv_info, bwd_chunk_id)
            loss = kwargs.get("loss", args[0] if args else None)
            if self.is_last and isinstance(loss, torch.Tensor) and not loss._is_view() \
                    and kwargs.get("full_backward", True):
                # The schedule keeps each microbatch's loss to the end of the step, and
                # through its graph the stage's input (autograd's leaf): the value is
                # all it needs of it.
                loss.detach_()
        return result

    def _prepare_backward_infra(self, *args: Any, **kwargs: Any) -> Any:
        with value_checks.skipped():   # made-up values: the model's checks would fail
            result = super()._prepare_backward_infra(*args, **kwargs)
        if not self.is_last:
            self.gradient_buffers.adopt(self.grad_recv_info)
        return result

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
        # On its first step pipelining learns shapes by running the stage on made-up
        # inputs: a forward that writes buffers (BatchNorm's running statistics) must
        # see only the real microbatches, as on one device. The written buffers are
        # replaced, not copied back into: the backward that pipelining then infers
        # still needs them as they were saved.
        before: dict[int, torch.Tensor] = {}  # one copy of a buffer two modules share
        saved = [(owner, name, before.setdefault(id(buffer), buffer.detach().clone()))
                 for owner in self.submod.modules()
                 for name, buffer in owner._buffers.items() if buffer is not None]
        try:
            with value_checks.skipped():   # the model's checks would fail on made-up values
                result = super()._prepare_forward_infra(*args, **kwargs)
        except RuntimeError as error:
            if "floating point dtype can require gradients" not in str(error):
                raise
            kinds = sorted({str(t.dtype).removeprefix("torch.")
                            for t in pytree.tree_leaves(getattr(self, "inputs_meta", ()))
                            if isinstance(t, torch.Tensor) and not t.is_floating_point()})
            raise PartcError(
                f"stage {self.stage_index} receives a {'/'.join(kinds) or 'non-floating'} "
                f"tensor from the stage before it, and torch {torch.__version__}'s pipeline "
                "stage asks a gradient of every tensor it receives, which such a tensor "
                "cannot have: run this plan on torch 2.13 or later, whose stage asks none "
                "of it, or pin stages (Constraints.stages) whose boundaries only floating "
                "tensors cross") from error
        finally:
            for owner, name, value in saved:
                if not torch.equal(owner._buffers[name], value):
                    owner._buffers[name] = value
        if not self.is_first:
            self.activation_buffers.adopt(self.args_recv_info)
        return result

    def _to_tensor(self, arg: Any) -> torch.Tensor:
        # Pipelining's first-step shape inference runs a later stage on tensors made
        # from the received metadata, uninitialised: an integer tensor sent on (token
        # ids, positions) would index an embedding or a buffer with whatever the memory
        # held. Zeros are in range for every index and leave shapes as they are.
        tensor = super()._to_tensor(arg)
        if not isinstance(arg, torch.Tensor) and not isinstance(tensor, DTensor):
            with torch.no_grad():
                tensor.zero_()
        return tensor

    # Forward only (``DistributedModule.evaluate``), torch's multi-stage schedules still
    # hand input gradients between two adjacent stages of one rank ("v" placement), and
    # the stage refuses: there are none to hand over.
    def get_local_bwd_output(self, mb_index: int) -> Any:
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
        if self.has_backward:
            # Torch zeroes the buffer of a gradient the next stage did not make.
            self.gradient_buffers.allocate(self.grad_recv_info, mb_index)
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def scale_grads(self, grad_scale_factor: int) -> None:
        if grad_scale_factor != 1:
            for param in self.submod.parameters():
                if param.grad is not None and id(param) not in self.scaled_elsewhere:
                    param.grad.div_(grad_scale_factor)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        if isinstance(self.grad_sync, GradBuckets):
            # The rank's buckets (over all its virtual stages) are reduced and scaled
            # once, after the schedule (ScheduleRun.train).
            grad_scale_factor = 1
        elif self.grad_sync is not None:
            self.grad_sync.finish(grad_scale_factor)
        super().perform_reduce_grad(grad_scale_factor)

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict,
                                   last_backward: bool = False) -> tuple:
        if self.grad_sync is not None:
            self.grad_sync.begin(last=last_backward)
            try:
                return self._backward(backward_type, bwd_kwargs, last_backward)
            finally:
                self.grad_sync.end()
        if self.zero_stage < 2 or not isinstance(self.submod, FSDPModule):
            return self._backward(backward_type, bwd_kwargs, last_backward)
        if backward_type != "full":
            raise PartcError(f"ZeRO-{self.zero_stage} supports full backward only, "
                             f"not {backward_type!r}")
        # FSDP's no-sync accumulates the unsharded gradient (fp32: its reduce dtype) in
        # every unit; the backward that syncs reduce-scatters what accumulated.
        sync = last_backward or not self.reduce_once
        self.submod.set_requires_gradient_sync(sync)
        self.submod.set_reshard_after_backward(self.zero_stage >= 3)
        self.submod.set_is_last_backward(sync)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                               bwd_kwargs["input_values"])
        return grads, None

    def _backward(self, backward_type: str, bwd_kwargs: dict, last_backward: bool) -> tuple:
        """A zero-bubble schedule's split backward by :mod:`.split_backward` (torch's
        loses or double-counts gradients on some graphs); a full one by torch."""
        if backward_type == "input":
            return split_backward.input_grads(
                bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                bwd_kwargs["input_values"], self.submod.parameters())
        if backward_type == "weight":
            given = split_backward.weight_grads(bwd_kwargs["param_groups"])
            if isinstance(self.grad_sync, GradBuckets):
                self.grad_sync.take(given)
            return (), None
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def _count(self, kind: str, ops: list) -> list:
        self.messages[kind] += len(ops)
        return ops

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list:
        if not self.is_first:
            self.activation_buffers.allocate(self.args_recv_info, fwd_chunk_id)
        return self._count("recvs", super().get_fwd_recv_ops(fwd_chunk_id))

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
        if self.has_backward and not self.is_last:
            self.gradient_buffers.allocate(self.grad_recv_info, bwd_chunk_id)
        return self._count("recvs", super().get_bwd_recv_ops(bwd_chunk_id))

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
        return self._count("sends", super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list:
        return self._count("sends", super().get_bwd_send_ops(bwd_chunk_id))


@dataclass(frozen=True)
class _BufferSpec:
    """One receive buffer as torch allocated it at setup, to make again."""

    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    def allocate(self) -> torch.Tensor:
        buffer = torch.empty_strided(self.shape, self.stride, dtype=self.dtype,
                                     device=self.device)
        return buffer.requires_grad_(self.requires_grad)

    def placeholder(self) -> torch.Tensor:
        # Not None: torch posts no receive for a None buffer only where it has no
        # metadata either, and asserts so.
        return torch.empty(0, dtype=self.dtype, device=self.device)


class _ReceiveBuffers:
    """One direction of a stage's receive buffers (activations coming in, or gradients
    coming back), held only while a microbatch needs them, as Megatron holds them.

    Torch's stage allocates one buffer per microbatch for each tensor it receives at
    its first step and keeps them all: a later stage would hold ``m`` microbatches'
    activations at its cut where only those in flight are needed. :meth:`adopt`
    records the buffers torch made (shape, strides, dtype) and puts 0-element
    placeholders in their place; :meth:`allocate` makes a microbatch's buffers when
    its receive is posted (or before a gradient is handed over on the rank, which
    torch zeroes where none came); :meth:`release` lets them go after the
    microbatch's backward, or its forward when there is none. A stage input is the
    buffer itself, so what autograd saved of it stays alive through autograd alone.
    A buffer handed over on the rank (V-schedule) replaces the placeholder and is let
    go the same way. DTensor buffers (and a torch without ``_RecvInfo``) keep torch's
    behaviour.
    """

    def __init__(self, direction: str) -> None:
        self.direction = direction
        self.specs: dict[int, tuple[_BufferSpec | None, ...]] = {}

    def adopt(self, infos: dict[int, tuple]) -> None:
        """Record the buffers torch just allocated in ``infos`` and release them."""
        if _RecvInfo is None:
            log.info("pipeline stage: torch has no _RecvInfo; %s receive buffers are "
                     "kept for every microbatch, as torch keeps them", self.direction)
            return
        self.specs = {chunk: tuple(_spec(info) for info in chunk_infos)
                      for chunk, chunk_infos in infos.items()}
        for chunk in self.specs:
            self.release(infos, chunk)

    def allocate(self, infos: dict[int, tuple], chunk: int) -> None:
        for info, spec in zip(infos[chunk], self.specs.get(chunk, ())):
            if spec is not None:
                info.buffer = spec.allocate()

    def release(self, infos: dict[int, tuple], chunk: int) -> None:
        for info, spec in zip(infos.get(chunk, ()), self.specs.get(chunk, ())):
            if spec is not None:
                info.buffer = spec.placeholder()

    @staticmethod
    def held(infos: dict[int, tuple]) -> list[torch.Tensor]:
        """The buffers ``infos`` hold now, placeholders left out."""
        return [info.buffer for chunk_infos in infos.values() for info in chunk_infos
                if isinstance(getattr(info, "buffer", None), torch.Tensor)
                and info.buffer.numel() > 0]


def _spec(info: Any) -> _BufferSpec | None:
    """The buffer of ``info`` to hold lazily, or None: a model input (first stage), a
    gradient that never comes (no buffer), a DTensor's local shard."""
    if not isinstance(info, _RecvInfo) or getattr(info, "is_root_arg", False):
        return None
    buffer = info.buffer
    if not isinstance(buffer, torch.Tensor) or isinstance(buffer, DTensor) \
            or hasattr(getattr(info, "tensor_meta", None), "placements"):
        return None
    return _BufferSpec(shape=buffer.shape, stride=buffer.stride(), dtype=buffer.dtype,
                       device=buffer.device, requires_grad=buffer.requires_grad)


def contiguous_transfers(module: nn.Module, *, first: bool, last: bool) -> None:
    """Make every tensor that crosses a stage boundary contiguous, both ways, and no
    output a view.

    Pipelining sends a stage's outputs and its inputs' gradients as they are, and makes
    the receiving buffers with the strides it saw on the first step; point-to-point
    sends need contiguous tensors, but a stage may end on a view (a transpose, an
    ``expand``ed mask) and a gradient may come back strided the same way. Outputs are
    made contiguous after the stage's forward (not the last stage's: they go to the
    loss), and those that are still views of another tensor (a reshape, or a stage
    input passed on to a later stage: a skip across blocks) become :func:`not_a_view`:
    a zero-bubble schedule's split backward detaches each output in place, which
    autograd refuses for a view. Inputs pass through :class:`_ContiguousGrad`, whose
    backward makes their gradients contiguous before they are sent back."""
    if not last:
        module.register_forward_hook(lambda _module, _args, output: pytree.tree_map_only(
            torch.Tensor, lambda t: not_a_view(t.contiguous()), output))
    if not first:
        module.register_forward_pre_hook(lambda _module, args: tuple(
            _ContiguousGrad.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad
            else a for a in args))


def not_a_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or where it is a view the same values under a tensor of its
    own: the same storage, no copy, its gradient passed straight through
    (:class:`_Alias`). Torch's split backward (``stage_backward_input``) ends with
    ``detach_()`` on every stage output and on the loss, and autograd cannot detach a
    view in place."""
    if not tensor._is_view():
        return tensor
    return _Alias.apply(tensor) if tensor.requires_grad else tensor.detach()


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward makes the gradient contiguous."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class _Alias(torch.autograd.Function):
    """The identity, whose output is no view: ``detach`` shares the storage (and the
    version counter, so autograd still sees an in-place write to either) without the
    view's link to its base."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad
