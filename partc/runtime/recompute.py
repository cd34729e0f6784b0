"""Activation recompute at run time: what the recompute pass's calls do.

``"full"`` keeps only a layer's inputs and reruns the whole layer in backward.
``"selective"`` keeps the outputs of the expensive ops (matrix products, convolutions,
attention kernels: the ops FlopCounterMode counts, as the cost model does) and reruns
the cheap ones between them — softmax, dropout, norms, activations — whose outputs are
the large part of a transformer's activations. Both are non-reentrant
``torch.utils.checkpoint`` with the RNG state preserved, so dropout masks in the rerun
equal the forward's, and without early stop: the rerun replays the whole layer, so a
tensor-parallel layer's forward collectives run again, all of them, as the cost model
charges (with early stop, which trailing ones replay depends on what backward needs).
"""

from __future__ import annotations

import collections
from typing import Any, Callable

from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts,
                                    set_checkpoint_early_stop)
from torch.utils.flop_counter import flop_registry

RECOMPUTED_MODES = ("selective", "full")


def _is_expensive(op: Any) -> bool:
    packet = getattr(op, "overloadpacket", op)
    return packet in flop_registry or "scaled_dot_product" in str(packet)


def _keep_expensive(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if _is_expensive(op):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class _KeptEntries(dict):
    """One op's saved outputs in a selective checkpoint's storage, kept for every
    backward pass through the region: the first write (the forward's) stays. torch marks
    an entry consumed once read, which a split backward (input gradients, then weight
    gradients: torch's zero-bubble schedules) would then find gone on its second pass.
    The storage is freed with the region's autograd graph, as saved tensors are."""

    def __setitem__(self, index: Any, value: Any) -> None:
        if index not in self:
            super().__setitem__(index, value)


def _selective_context() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_keep_expensive)


def _selective_context_twice() -> tuple[Any, Any]:
    caching, cached = create_selective_checkpoint_contexts(_keep_expensive)
    # Both modes share one storage: the forward writes it, each backward pass reads it.
    caching.storage = cached.storage = collections.defaultdict(_KeptEntries)
    return caching, cached


def checkpoint_layer(layer: Callable[..., Any], mode: str, *args: Any,
                     written: tuple[int, ...] = (), twice: bool = False) -> Any:
    """Run ``layer(*args)``, keeping for backward what ``mode`` says, and return its result.

    ``written``: the positions of the arguments the layer updates in place, buffers such
    as BatchNorm's running statistics. The forward updates them, once per microbatch as
    in eager PyTorch; the rerun in backward updates copies of what they held before the
    forward, so it computes what the forward did and the buffers are not updated twice.
    (Passed to ``checkpoint`` they would also fail its check that saved inputs are
    unchanged.)

    ``twice``: backward passes through the layer twice (a split backward: input, then
    weight gradients), so selective recompute keeps the outputs it saved until the
    layer's graph is freed; otherwise each is freed as backward reads it.
    """
    if mode not in RECOMPUTED_MODES:
        raise ValueError(f"recompute mode must be one of {RECOMPUTED_MODES}, got {mode!r}")
    if written:
        layer, args = _writing_once(layer, args, written)
    context = ({"context_fn": _selective_context_twice if twice else _selective_context}
               if mode == "selective" else {})
    with set_checkpoint_early_stop(False):
        return checkpoint(layer, *args, use_reentrant=False, preserve_rng_state=True,
                          **context)


def _writing_once(layer: Callable[..., Any], args: tuple, written: tuple[int, ...]
                  ) -> tuple[Callable[..., Any], tuple]:
    """``layer`` taking the arguments at ``written`` from a closure (the live tensors on
    its first call, copies of their values before it on later ones), and the other
    arguments. The copies are made here, not in the rerun: selective recompute replays
    only the ops the forward ran."""
    live = {i: args[i] for i in written}
    before = {i: tensor.detach().clone() for i, tensor in live.items()}
    calls = 0

    def run(*rest: Any) -> Any:
        nonlocal calls
        own = live if calls == 0 else before
        calls += 1
        merged = list(rest)
        for i in sorted(own):
            merged.insert(i, own[i])
        return layer(*merged)

    return run, tuple(arg for i, arg in enumerate(args) if i not in live)
