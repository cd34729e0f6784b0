"""Activation recompute at run time: what the recompute pass's calls do.

``checkpoint_layer(region, mode, *inputs)`` runs ``region`` keeping only its inputs for
backward, and reruns it there. The recompute pass makes the regions: for ``"full"`` a
whole layer; for ``"selective"`` each attention core of a layer (the product of queries
and keys, scale, mask, softmax, dropout and the product with the values: Megatron's
selective recompute, Korthikanti et al. section 4.2), the rest of the layer keeping what
it saves as without recompute. Both are non-reentrant ``torch.utils.checkpoint`` with the
RNG state preserved, so dropout masks in the rerun equal the forward's, and without early
stop: the rerun replays the whole region, so a tensor-parallel layer's forward
collectives run again, all of them, as the cost model charges (with early stop, which
trailing ones replay depends on what backward needs).
"""

from __future__ import annotations

from typing import Any, Callable

from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

RECOMPUTED_MODES = ("selective", "full")


def checkpoint_layer(layer: Callable[..., Any], mode: str, *args: Any,
                     written: tuple[int, ...] = ()) -> Any:
    """Run ``layer(*args)`` (a whole layer for ``mode="full"``, an attention core of one
    for ``"selective"``), keeping only ``args`` for backward, and return its result.

    ``written``: the positions of the arguments the layer updates in place, buffers such
    as BatchNorm's running statistics. The forward updates them, once per microbatch as
    in eager PyTorch; the rerun in backward updates copies of what they held before the
    forward, so it computes what the forward did and the buffers are not updated twice.
    (Passed to ``checkpoint`` they would also fail its check that saved inputs are
    unchanged.)
    """
    if mode not in RECOMPUTED_MODES:
        raise ValueError(f"recompute mode must be one of {RECOMPUTED_MODES}, got {mode!r}")
    if written:
        layer, args = _writing_once(layer, args, written)
    with set_checkpoint_early_stop(False):
        return checkpoint(layer, *args, use_reentrant=False, preserve_rng_state=True)


def _writing_once(layer: Callable[..., Any], args: tuple, written: tuple[int, ...]
                  ) -> tuple[Callable[..., Any], tuple]:
    """``layer`` taking the arguments at ``written`` from a closure (the live tensors on
    its first call, copies of their values before it on later ones), and the other
    arguments. The copies are made here, before the forward writes the live ones."""
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
