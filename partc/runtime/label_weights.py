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
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from partc.errors import PartcError


def label_counts(labels: torch.Tensor, counted: str) -> torch.Tensor:
    """Per sample, the labels the loss averages over (float64; "samples": 1 each)."""
    if counted == "shifted":
        return (labels[:, 1:] != -100).reshape(len(labels), -1).sum(1).double()
    if counted == "tokens":   # also one label per sample: (batch,)
        return (labels != -100).reshape(len(labels), -1).sum(1).double()
    return torch.ones(labels.shape[0], dtype=torch.float64)


def sample_weights(counts: torch.Tensor, *, microbatches: int, dp: int, replicas: int,
                   device: torch.device | str = "cpu",
                   dp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Each sample's weight (float32) for ``counts``: the global batch's when it holds
    ``replicas`` (= dp) replicas' rows, else this replica's (then the batch's total is
    all-reduced over ``dp_group``, on ``device``: collective). Raises on every rank alike when some
    microbatch counts no label."""
    per_microbatch = counts.reshape(replicas * microbatches, -1).sum(1)
    numbers = torch.stack([counts.sum(), (per_microbatch == 0).sum().double()])
    if replicas < dp:
        numbers = numbers.to(device)
        dist.all_reduce(numbers, group=dp_group)
    total, empty = float(numbers[0]), int(numbers[1])
    if empty:
        raise PartcError(
            f"{empty} of the step's {microbatches * dp} microbatches count no label (every "
            "one -100): the model's own loss, a mean over the counted labels, is NaN there "
            "and so are its gradients. Shuffle padded samples among the batch, or drop "
            "those without a label")
    return (counts * (microbatches * dp / total)).float()
