"""A batch against the plan, on every rank, before any message is sent.

``forward_backward`` and ``evaluate`` take the global batch (dim 0 the global batch
size, every rank passing the same) or only this data-parallel replica's rows (dim 0 the
global batch over dp); every other dimension and every dtype are the plan's
(``plan.model.inputs``). A batch that differs raises :class:`partc.PlanMismatchError`
naming each difference: pipelining fixes shapes at the first step, and a different
shape later would fail on one rank with a dropped connection on the others.

Inputs come as the model was traced: by position, by keyword (``forward_backward(**batch)``),
or as one mapping (``forward_backward(batch)``); :meth:`BatchCheck.ordered` puts them in
the plan's order (a positional input may also be given by its name). A plan on the
model's own loss (``plan.model.own_loss``) takes no target: its labels are an input. Where
partc gives that loss its labels already shifted (``shift_labels``, a causal LM's), they
are made here from the labels given (:func:`~partc.runtime.label_weights.next_labels`).
A padding mask the model was traced without (``plan.model.left_out``) is taken, checked
(no padding, or rows padded at their end whose pads count no label) and left out, and so
are position ids of 0..S-1 (:mod:`partc.runtime.padding`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch
import torch.utils._pytree as pytree

from partc.errors import PlanMismatchError
from partc.plan import InputSpec, Plan
from partc.runtime.label_weights import SHIFT_LABELS, next_labels
from partc.runtime.padding import refusal


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchCheck:
    """The plan's inputs and target, and how the global batch splits over dp."""

    inputs: tuple[InputSpec, ...]
    target: InputSpec | None
    global_batch_size: int
    dp: int
    dp_rank: int
    own_loss: str | None = None   # ``plan.model.own_loss``: the target is made, not given
    # ``plan.model.shift_labels``: the shift_labels input is made from labels, not given
    shift_labels: bool = False
    # ``plan.model.left_out``: inputs taken, checked and left out (a padding mask, plain
    # position ids);
    # ``pads_at_end``: rows padded at their end whose pads count no label pass the check
    left_out: tuple[str, ...] = ()
    pads_at_end: bool = False

    @classmethod
    def of(cls, plan: Plan, dp_rank: int) -> "BatchCheck":
        specs = plan.model.inputs
        own_loss = plan.model.own_loss
        return cls(inputs=tuple(s for s in specs if s.name != "target"),
                   target=None if own_loss else next(
                       (s for s in specs if s.name == "target"), None),
                   global_batch_size=plan.global_batch_size,
                   dp=plan.dp, dp_rank=dp_rank, own_loss=own_loss,
                   shift_labels=plan.model.shift_labels,
                   left_out=plan.model.left_out, pads_at_end=plan.model.pads_at_end)

    def ordered(self, inputs: tuple, named: Mapping[str, Any], target: Any) -> tuple:
        """The model's inputs in the plan's order, from those given by position and by
        name (one mapping given alone counts as by name); PlanMismatchError naming what
        is missing, unknown or not a tensor."""
        if len(inputs) == 1 and isinstance(inputs[0], Mapping) and not named:
            inputs, named = (), inputs[0]
        named = {key: value for key, value in named.items() if value is not None}
        counted = named.get("labels") if self.own_loss else target
        # (Without the labels the pads are judged by, the batch is refused below for that.)
        padded = [why for name in self.left_out if name in named
                  and (counted is not None or not self.pads_at_end)
                  if (why := refusal(name, named[name], counted, self.pads_at_end))
                  is not None]
        if padded:
            raise PlanMismatchError("this batch does not match the plan: " + "; ".join(padded))
        named = {key: value for key, value in named.items() if key not in self.left_out}
        positional = [s for s in self.inputs if not s.keyword]
        problems = []
        if len(inputs) > len(positional):
            problems.append(f"{len(inputs)} inputs given by position, the plan takes "
                            f"{len(positional)} ({_names(positional) or 'none'}) "
                            f"and {_names(self.inputs, keyword=True)} by name")
        by_position = dict(zip((s.name for s in positional), inputs))
        twice = sorted(set(by_position) & set(named))
        if twice:
            problems.append(f"{', '.join(twice)} given both by position and by name")
        given = {**named, **by_position}
        if self.shift_labels and SHIFT_LABELS not in given and "labels" in given:
            given[SHIFT_LABELS] = next_labels(given["labels"])
        missing = [s.name for s in self.inputs if s.name not in given]
        unknown = sorted(set(given) - {s.name for s in self.inputs})
        if missing:
            problems.append(f"missing {', '.join(missing)}")
        if unknown:
            problems.append(f"{', '.join(unknown)} not among the model's inputs as traced "
                            f"({_names(self.inputs)})")
        if self.own_loss and target is not None:
            problems.append("a target given, but the plan trains on the model's own loss: "
                            "give its labels among the inputs")
        if problems:
            raise PlanMismatchError("this batch does not match the plan: " +
                                    "; ".join(problems) + ". Pass the inputs the model was "
                                    "compiled with, or compile again")
        return tuple(given[s.name] for s in self.inputs)

    def labels(self, inputs: tuple) -> torch.Tensor:
        """The labels the model's own loss counts (``shift_labels`` where it reads them
        as given, else ``labels``; for a mean over samples, the first input, whose rows
        are the samples)."""
        names = [s.name for s in self.inputs]
        if self.own_loss == "tokens" and SHIFT_LABELS in names:
            return inputs[names.index(SHIFT_LABELS)]
        return inputs[names.index("labels")] if "labels" in names else inputs[0]

    @property
    def share(self) -> int:
        """One data-parallel replica's rows of the global batch."""
        return self.global_batch_size // self.dp

    def rows(self, inputs: tuple, target: Any) -> slice:
        """This replica's rows of the batch given, after checking it."""
        given = self.size(inputs, target)  # the global batch, or this replica's rows
        self.check(inputs, target, given)
        if given == self.share:
            return slice(None)
        return slice(self.dp_rank * self.share, (self.dp_rank + 1) * self.share)

    def size(self, inputs: tuple, target: Any) -> int:
        """The batch given: the global batch or this replica's slice of it (its dp
        share), read from the first tensor's dim 0; for any other size the global batch,
        which :meth:`check` then reports the shapes against."""
        first = next((t for t in (*inputs, *pytree.tree_leaves(target))
                      if isinstance(t, torch.Tensor) and t.dim() > 0), None)
        if first is not None and first.shape[0] == self.share:
            return self.share
        return self.global_batch_size

    def check(self, inputs: tuple, target: Any, batch: int | None = None) -> None:
        """Shapes and dtypes against the plan for a batch of ``batch`` rows (the global
        batch by default)."""
        batch = self.global_batch_size if batch is None else batch
        problems = []
        if len(inputs) != len(self.inputs):
            problems.append(f"{len(inputs)} inputs given, the plan has {len(self.inputs)} "
                            f"({', '.join(s.name for s in self.inputs)})")
        for given, spec in zip(inputs, self.inputs):
            problems += _mismatch(spec, given, batch)
        if self.target is not None:
            if target is None:
                problems.append("no target given; the plan's loss needs one")
            else:
                problems += _mismatch(self.target, target, batch)
        if problems:
            if self.dp > 1:
                problems.append(self._other_size(batch))
            raise PlanMismatchError(
                "this batch does not match the plan: " + "; ".join(problems) +
                ". The plan fixes the global batch, micro-batch size and every other "
                "dimension; compile again for new shapes")

    def _other_size(self, batch: int) -> str:
        """The other batch size ``forward_backward`` takes, than the ``batch`` checked."""
        if batch != self.global_batch_size:
            other, size = "global batch", self.global_batch_size
        else:
            other, size = "data-parallel slice", self.share
        return (f"(or give this rank's {other}: dim 0 of {size}, "
                f"global batch {self.global_batch_size} over dp {self.dp})")


def _names(specs: Any, keyword: bool | None = None) -> str:
    return ", ".join(s.name for s in specs if keyword is None or s.keyword == keyword)


def _mismatch(spec: InputSpec, given: Any, batch: int) -> list[str]:
    expected = (batch, *spec.shape)
    if not isinstance(given, torch.Tensor):
        return [f"{spec.name} is a {type(given).__name__}, not a tensor"]
    problems = []
    if tuple(given.shape) != expected:
        problems.append(f"{spec.name} has shape {tuple(given.shape)}, "
                        f"the plan's is {expected}")
    if given.dtype != spec.dtype:
        problems.append(f"{spec.name} is {given.dtype}, the plan's is {spec.dtype}")
    return problems
