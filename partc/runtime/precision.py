"""Mixed precision under ZeRO 0/1: the stage computes with bf16 copies of its parameters,
made once per step. (Under ZeRO-1, once ``module.optimizer`` has made the distributed
optimizer, the parameters themselves are bf16 and the fp32 masters are each rank's dp
shards, ``partc/runtime/optimizer.py``: there is nothing left to copy.)

The module's parameters stay fp32: they are the master weights, what the optimizer
steps, checkpoints save and ``state_dict`` returns. For the schedule's step (every
microbatch's forward and backward) :meth:`ComputeCopies.step` puts a compute-dtype copy
of each parameter in its place, cast once, and puts the fp32 parameter back after the
last backward. Gradients are produced in the compute dtype on the copies and, microbatch
by microbatch, added into the fp32 buckets of :class:`partc.runtime.optimizer.GradBuckets`
(as on the fp32 parameter: the buckets own them), reduced there in fp32 and handed to the
fp32 parameters as their ``.grad``. (Megatron and torchtitan compute with bf16 parameters
the same way; ZeRO-2/3 get the same scheme from FSDP2's ``MixedPrecisionPolicy``.)

The stage still runs under autocast: with compute-dtype parameters it casts no weight,
and it keeps the ops that must stay fp32 (softmax, the norms, the loss) in fp32 as
torch's autocast does on a GPU (on CPU ranks, stand-ins for GPUs, under CUDA's policy:
``partc.autocast_policy.cuda_policy``; CPU autocast would run a norm with an
fp32 input and bf16 weights, which CPU kernels refuse). Installing that policy
registers some 200 kernels, milliseconds of a step: it is installed at the first step
and kept, so CPU autocast in this process follows CUDA's rules from then on, until
:meth:`ComputeCopies.close` (``DistributedModule.close``) or the module is freed.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator, Sequence

import torch
from torch import nn

from partc.autocast_policy import cuda_policy
from partc.errors import PartcError
from partc.plan import Plan
from partc.runtime.optimizer import GradBuckets


def compute_dtype(plan: Plan) -> torch.dtype:
    """The dtype the stages compute in: the plan's training dtype (float32 runs without
    mixed precision)."""
    dtype = plan.train.dtype
    if dtype == torch.float16:
        raise PartcError("training in float16 needs loss scaling, which partc's runtime "
                         "does not do: train in bfloat16 (plans for float16 are fine)")
    return dtype


class ComputeCopies:
    """The module's parameters as compute-dtype copies for one step (see the module).
    Without ``buckets`` (ZeRO-2/3, where FSDP makes the copies) only the autocast rules
    of CPU ranks are set for the step."""

    def __init__(self, modules: Sequence[nn.Module], dtype: torch.dtype,
                 buckets: GradBuckets | None) -> None:
        """``modules``: the rank's stages (one, or its virtual stages)."""
        self.dtype, self.buckets = dtype, buckets
        self.device = next((p.device for m in modules for p in m.parameters()),
                           torch.device("cpu"))
        self.last_bytes = 0  # of the copies the last step made (telemetry, benchmarks)
        self._policy: contextlib.ExitStack | None = None  # CUDA's autocast rules, kept
        # Every (owner, attribute) naming each parameter: a tied one (within a stage or
        # across the rank's stages) is swapped once.
        self._places: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str]]]] = {}
        for module in modules:
            for name, param in module.named_parameters(remove_duplicate=False):
                owner_name, _, attr = name.rpartition(".")
                entry = self._places.setdefault(id(param), (param, []))
                entry[1].append((module.get_submodule(owner_name), attr))

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        copies = []
        with torch.no_grad():
            for master, places in self._places.values() if self.buckets is not None else ():
                if not master.is_floating_point() or master.dtype == self.dtype:
                    continue
                copy = nn.Parameter(master.detach().to(self.dtype), master.requires_grad)
                if master.requires_grad:
                    self.buckets.stand_in(copy, master)
                copies.append(copy)
                for owner, attr in places:
                    owner._parameters[attr] = copy
        self.last_bytes = sum(c.numel() * c.element_size() for c in copies)
        # On CPU ranks (stand-ins for GPUs) autocast follows CUDA's rules, which keep
        # the norms in fp32 whatever dtype their weights have, as a GPU would run them.
        if self.device.type == "cpu" and self._policy is None:
            self._policy = contextlib.ExitStack()
            self._policy.enter_context(cuda_policy(self.dtype))
            weakref.finalize(self, self._policy.close)
        try:
            yield
        finally:
            if copies:
                for master, places in self._places.values():
                    for owner, attr in places:
                        owner._parameters[attr] = master
            for copy in copies:
                self.buckets.drop_stand_in(copy)

    def close(self) -> None:
        """CPU autocast's own rules in force again (see the module)."""
        if self._policy is not None:
            self._policy.close()
            self._policy = None
