"""The model's own loss over microbatches and replicas: one weight per sample.

A Hugging Face model given ``labels`` returns its loss as a mean over the labels it
counts: those not -100, a causal LM's shifted by one (``labels[:, 1:]``, each position
predicting the next token). Cut into M microbatches on each of dp replicas, microbatch
``m`` returns ``S_m / n_m`` (its summed loss over its ``n_m`` counted labels). The
runtime averages the microbatch losses over M and dp (torch's schedule scales the
gradients by 1/M, the replicas' all-reduce by 1/dp), so a mean of microbatch means would
weigh the few tokens of a padded microbatch as much as a full one's, and differ from one
device's ``model(**batch).loss``, the mean over the whole batch's ``N`` counted labels.

Weighing microbatch ``m``'s loss by ``w_m = n_m * M * dp / N`` makes the average
``sum_m S_m / N``: the whole batch's mean, and its gradients, on every plan. The loss
layer (``partc.passes.trace.weighted_own_loss``) multiplies the loss by the sum of its
microbatch's sample weights, each sample's its count times ``M * dp / N``; the weights
travel as the loss's target, cut into microbatches and replicas with the batch. For a
loss the runtime cannot count ("samples": a mean over the batch's samples) every sample
counts 1, and each microbatch's weight is 1.

A microbatch without a counted label would return 0/0 (NaN, and NaN gradients, which no
weight can undo): it is refused on every rank before anything runs.

A causal LM's own loss shifts its labels inside the model, which a sequence split over
context-parallel ranks cannot do: the token after a rank's last one is another rank's.
Where the model's loss takes them already shifted (transformers' ``shift_labels``),
partc gives it them, made on the host from the labels of the whole sequence
(:func:`next_labels`), and the loss counts them as they are ("tokens"). Then each of the
``cp`` ranks of a microbatch returns the mean over the labels of its own tokens,
``S_mr / n_mr``; weighing it by ``n_mr * M * dp * cp / N`` keeps the average over
microbatches, replicas and ranks at the whole batch's mean.

A user's ``loss_fn`` that returns such a mean over its target's entries not -100
(cross-entropy's default; ``ModelInfo.counted_target``, asked of it when compiled) is
weighed the same way, by the count of its target's part over the batch's: each
microbatch's loss times ``n_m`` (counted where the loss runs) times
``M * dp * cp / N`` (:func:`count_scale`, once per step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from partc.errors import PartcError
from partc.runtime import cp_layout

#: The input a causal LM's loss reads its targets from, already shifted (transformers'
#: ``ForCausalLMLoss``): made by the runtime from ``labels`` where partc added it.
SHIFT_LABELS = "shift_labels"
#: The label (class index) a loss does not count: cross-entropy's default ignore_index.
IGNORED = -100


def next_labels(labels: torch.Tensor) -> torch.Tensor:
    """Each row's labels one position on, -100 at the last (what position ``t``
    predicts: ``labels[t + 1]``), as a causal LM's own loss shifts them."""
    shifted = torch.full(labels.shape, IGNORED, dtype=labels.dtype, device=labels.device)
    shifted[..., :-1] = labels[..., 1:]
    return shifted


def splits_over_sequence(own_loss: str | None, input_names: Sequence[str]) -> bool:
    """Whether the loss may be taken over a sequence split over context-parallel ranks:
    the user's loss_fn (None), or the model's own over labels it reads as given, each
    position's its own (``shift_labels``: "tokens")."""
    return not own_loss or (own_loss == "tokens" and SHIFT_LABELS in input_names)


def own_loss_refusal(own_loss: str | None) -> str:
    """Why the model's own loss (``own_loss``, which labels it counts) keeps its
    sequence whole: :func:`splits_over_sequence` is False."""
    if own_loss == "samples":
        return ("the model computes its own loss as a mean over samples, from the whole "
                "of each sequence: give partc.compile a loss_fn whose mean is over tokens "
                "to split the sequence")
    if own_loss == "tokens":   # read as given, but not known to be read position by position
        return ("the model computes its own loss from labels it reads inside itself (an "
                "encoder-decoder shifts them into its decoder's inputs): give "
                "partc.compile a loss_fn on the logits and targets (and no labels input) "
                "to split the sequence")
    return (f"the model computes its own loss ({own_loss}) from labels, shifting them by "
            f"one position along the whole sequence, which a shard does not hold, and "
            f"its loss function takes no shift_labels (the labels already shifted, which "
            f"partc gives a causal LM's): give partc.compile a loss_fn on the logits and "
            f"next-token targets (and no labels input) to split the sequence")


def uneven_ignored(target: Any, *, microbatches: int, replicas: int,
                   cp: int = 1) -> str | None:
    """For the target of a ``loss_fn`` that could not be asked what it averages over
    (``ModelInfo.counted_target`` None): where it holds class indices with -100s
    (ignored by cross-entropy by default) in different numbers per microbatch, or per
    context-parallel rank's tokens of one, what that may do to the step's loss (the mean
    of the parts' losses, unweighed); else None. ``target`` holds ``replicas``
    replicas' rows, dim 1 the sequence."""
    if not isinstance(target, torch.Tensor) or target.dim() == 0 \
            or target.is_floating_point() or target.dtype == torch.bool:
        return None
    shards = [label_counts(cp_layout.shard(target, 1, cp, rank), "tokens")
              for rank in range(cp)] if cp > 1 and target.dim() >= 2 else []
    per_part = _per_part(label_counts(target, "tokens"), shards, microbatches,
                         replicas).flatten()
    if bool((per_part == per_part[0]).all()):
        return None
    parts = "microbatch" + (" and context-parallel rank" if shards else "")
    return (f"loss_fn's target holds -100s in different numbers per {parts} (counting "
            f"{int(per_part.min())} to {int(per_part.max())} of the others): the step's "
            "loss and gradients are the mean of loss_fn over the parts, so where loss_fn "
            "averages over the targets it counts (cross-entropy's default), the few "
            "counted targets of a part weigh as much as a full part's, and the loss is not "
            "one device's over the whole batch. partc could not ask loss_fn what it "
            "averages over on small inputs of its shapes (one that does not fix them is "
            "asked, and a mean over its counted targets weighed)")


def _per_part(counts: torch.Tensor, shards: Sequence[torch.Tensor], microbatches: int,
              replicas: int) -> torch.Tensor:
    """Per cp rank (one without ``shards``), per microbatch of each replica: the count."""
    return torch.stack([part.reshape(replicas * microbatches, -1).sum(1)
                        for part in (list(shards) or [counts])])


def label_counts(labels: torch.Tensor, counted: str) -> torch.Tensor:
    """Per sample, the labels the loss averages over (float64; "samples": 1 each)."""
    if counted == "shifted":
        return (labels[:, 1:] != IGNORED).reshape(len(labels), -1).sum(1).double()
    if counted == "tokens":   # also one label per sample: (batch,)
        return (labels != IGNORED).reshape(len(labels), -1).sum(1).double()
    return torch.ones(labels.shape[0], dtype=torch.float64)


def sample_weights(counts: torch.Tensor, *, microbatches: int, dp: int, replicas: int,
                   device: torch.device | str = "cpu",
                   dp_group: dist.ProcessGroup | None = None,
                   shards: Sequence[torch.Tensor] = (), cp_rank: int = 0) -> torch.Tensor:
    """Each sample's weight (float32) for ``counts``: its count (``shards``: under
    context parallelism, per cp rank the counts of its tokens of each sample; rank
    ``cp_rank``'s) times :func:`count_scale`."""
    scale = count_scale(counts, microbatches=microbatches, dp=dp, replicas=replicas,
                        device=device, dp_group=dp_group, shards=shards)
    return ((shards[cp_rank] if shards else counts) * scale).float()


def count_scale(counts: torch.Tensor, *, microbatches: int, dp: int, replicas: int,
                device: torch.device | str = "cpu",
                dp_group: dist.ProcessGroup | None = None,
                shards: Sequence[torch.Tensor] = ()) -> float:
    """``M * dp * cp / N``: what a part's count is multiplied by to weigh its mean, for
    per-sample ``counts`` of the global batch when they hold ``replicas`` (= dp)
    replicas' rows, else of this replica's (then the batch's total ``N`` is all-reduced
    over ``dp_group``, on ``device``: collective); ``shards`` per cp rank. Raises on
    every rank alike when some microbatch (or a cp rank's tokens of it) counts none."""
    cp = max(len(shards), 1)
    per_microbatch = _per_part(counts, shards, microbatches, replicas)
    numbers = torch.stack([counts.sum(), (per_microbatch == 0).any(0).sum().double()])
    if replicas < dp:
        numbers = numbers.to(device)
        dist.all_reduce(numbers, group=dp_group)
    total, empty = float(numbers[0]), int(numbers[1])
    if empty:
        where = " (on one context-parallel rank's tokens)" if cp > 1 else ""
        raise PartcError(
            f"{empty} of the step's {microbatches * dp} microbatches count no label{where} "
            "(every one -100): the loss, a mean over the counted labels, is NaN there and "
            "so are its gradients. Shuffle padded samples among the batch, or drop those "
            "without a label")
    return microbatches * dp * cp / total


@dataclass(frozen=True)
class CountWeights:
    """One step's weights of a loss_fn's counted target, for this rank: per microbatch,
    by the storage offset of its chunk of the target (the schedule's chunks are views of
    one tensor), its count of entries not -100 times ``scale`` (:func:`count_scale`),
    counted on the host: a number, so that weighing adds neither a sync nor a saved
    tensor."""

    scale: float
    by_offset: Mapping[int, float]

    def of(self, target: torch.Tensor) -> float | torch.Tensor:
        """The weight of the microbatch whose target is ``target``; one the schedule
        copied is counted where it is."""
        weight = self.by_offset.get(target.storage_offset())
        return weight if weight is not None else (target != IGNORED).sum() * self.scale
