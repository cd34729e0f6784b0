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

import functools
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


_selective_context = functools.partial(create_selective_checkpoint_contexts, _keep_expensive)


def checkpoint_layer(layer: Callable[..., Any], mode: str, *args: Any) -> Any:
    """Run ``layer(*args)``, keeping for backward what ``mode`` says, and return its result."""
    if mode == "full":
        with set_checkpoint_early_stop(False):
            return checkpoint(layer, *args, use_reentrant=False, preserve_rng_state=True)
    if mode == "selective":
        with set_checkpoint_early_stop(False):
            return checkpoint(layer, *args, use_reentrant=False, preserve_rng_state=True,
                              context_fn=_selective_context)
    raise ValueError(f"recompute mode must be one of {RECOMPUTED_MODES}, got {mode!r}")
