"""Every rank trains on the same batch: a digest of each step's batch, compared over the
ranks that must agree, inside the step's one all-reduce (:mod:`.nonfinite`).

Which ranks must agree. ``forward_backward`` takes the global batch (every rank the
same; each data-parallel replica trains on its own rows of it) or only this replica's
rows (:mod:`.batch_check`). Either way every rank of one data-parallel replica trains
on that replica's rows: its pipeline stages (stage 0 reads the inputs, the last stage
the target: rows that differ pair one batch's inputs with another batch's targets), its
tensor-parallel ranks (each computes a shard of the same activations) and so the
expert-parallel ranks inside it. Hence:

1. **within each replica**, every rank's rows agree (its pipeline stages, tensor-parallel
   and expert-parallel ranks);
2. **over the world**, every rank given the *global* batch was given the same one (the
   contract of ``partc train``'s ``data(step)`` and of ``data_sampler``: replicas given
   different global batches read rows of different draws, samples repeated or lost
   between replicas, and a resume on another dp degree reads other ones).

Ranks of different replicas given their own rows legitimately see different data (a
loader that shards samples over replicas, ``data_sampler().indices(step)``): nothing
compares them. The expert-parallel all-to-all crosses replicas by design. partc has no
context parallelism. ``evaluate``'s batch is not checked: it changes no parameter.

The digests. Each is BLAKE2b (``hashlib``, 48 bits) over tensors' dtypes, shapes and
bytes: the inputs, then the target's tensors.

- **rows**: this rank's replica's rows of every tensor (all of them when the rank is
  given its rows; its block of dim 0 when given the global batch), compared by rule 1;
- **global sample** (given the global batch with dp > 1): the first row of every
  replica's block, compared by rule 2. A loader seeded by the rank, or replicas' blocks
  in another order, differ there; a difference in other rows of another replica's
  block is not seen here, and that replica's own ranks still agree on what they train.
  With dp = 1 the rows are the global batch, and rule 1 is rule 2.

A changed byte, rows swapped or another dtype change a digest but for a chance of
2**-48. A batch on the CPU (what ``partc train`` and ``data_sampler`` give; partc moves
the rows to the device itself) is hashed where it lies, without a copy; a batch given
on the device is copied to the host first (this rank's rows, dp rows more), which waits
for the device once per checked step.

What it costs, on a checked step: hashing this replica's rows of the batch (BLAKE2b,
about 1 ns per byte on an idle core, 10 on a busy 2-core machine; once per step, not per
microbatch: under dp each rank hashes its share, not the global batch), and four floats
per rank in the step's all-reduce (no collective more); reading the verdict is a loop
over the ranks on the host copy the loss's read already makes.
``TrainSpec.batch_check_every`` = N checks steps 1, 1 + N, 1 + 2N, ... (``module.step``);
0 turns it off. ``benchmarks/nonfinite_check.py`` measures it. Under torch's fake process
group, which moves no data, the check is off.

Each rank writes its digests into four slots of its own in the step's vector, the
others' slots zero, so the all-reduce's sum hands every rank every rank's digests
exactly (48 bits as two float32 integers below 2**24; -1 for no global sample): every
rank reads the same verdict and raises alike, naming two ranks that disagree.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree

from partc.errors import BatchMismatchError
from partc.runtime.batch_check import BatchCheck
from partc.runtime.topology import Topology

SLOTS_PER_RANK = 4        # rows digest (high, low 24 bits), global sample (high, low)
DIGEST_BYTES = 6          # 48 bits: two float32 integers below 2**24
_M24 = (1 << 24) - 1
_NONE = -1.0              # the global-sample slots of a rank without one
ROWS, GLOBAL = "rows", "global batch"   # what two ranks disagree on


def digest(tensors: Sequence[torch.Tensor]) -> int:
    """BLAKE2b (48 bits) of ``tensors``' dtypes, shapes and bytes, in order."""
    hasher = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for tensor in tensors:
        tensor = tensor.detach()
        hasher.update(f"{tensor.dtype}{tuple(tensor.shape)};".encode())
        flat = tensor.reshape(-1)
        if flat.device.type != "cpu":
            flat = flat.cpu()
        hasher.update(flat.contiguous().view(torch.uint8).numpy())
    return int.from_bytes(hasher.digest(), "big")


def _split(value: int) -> list[float]:
    return [float(value >> 24), float(value & _M24)]


def _joined(high: float, low: float) -> int | None:
    return None if high < 0 else (round(high) << 24) | round(low)


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """Two ranks that must agree on the batch and do not, at ``step``."""

    step: int
    ranks: tuple[int, int]
    digests: tuple[int, int]
    what: str        # ROWS or GLOBAL
    differing: int   # ranks whose digest differs from the first rank's
    compared: int    # ranks compared
    replica: int | None = None


class BatchDigests:
    """This rank's digest of each checked step's batch, and the verdict on all ranks'."""

    def __init__(self, topology: Topology, batches: BatchCheck, every: int,
                 enabled: bool = True) -> None:
        self._topology = topology
        self._batches = batches
        self.every = every if enabled else 0

    @property
    def slots(self) -> int:
        """The floats this check adds to the step's all-reduce on a checked step."""
        return SLOTS_PER_RANK * self._topology.world_size

    def checks(self, step: int) -> bool:
        """Whether step ``step`` (``module.step``, from 1) is checked: the same on every
        rank."""
        return self.every > 0 and (step - 1) % self.every == 0

    def measure(self, step: int, inputs: tuple, target: Any) -> torch.Tensor | None:
        """This step's slots of the all-reduce's vector on this rank (its digests in its
        own four, zeros elsewhere), on the rank's device; None when the step is not
        checked. Call after :meth:`BatchCheck.rows` accepted the batch."""
        if not self.checks(step):
            return None
        topo, batches = self._topology, self._batches
        tensors = [t for t in (*inputs, *pytree.tree_leaves(target))
                   if isinstance(t, torch.Tensor) and t.dim() > 0]
        slots = [_NONE, _NONE]
        if batches.size(inputs, target) == batches.global_batch_size and batches.dp > 1:
            share = batches.share
            slots = _split(digest([t[::share] for t in tensors]))  # each block's first row
            rows = slice(topo.dp_rank * share, (topo.dp_rank + 1) * share)
            tensors = [t[rows] for t in tensors]
        vector = torch.zeros(self.slots)
        start = SLOTS_PER_RANK * topo.rank
        vector[start:start + SLOTS_PER_RANK] = torch.tensor(_split(digest(tensors)) + slots)
        return vector.to(topo.device)

    def verdict(self, step: int, values: Sequence[float]) -> Mismatch | None:
        """Two ranks that disagree, from the reduced slots ``values`` (every rank's
        digests): each replica's rows (rule 1), then the global sample (rule 2)."""
        topo = self._topology
        rows = [_joined(*values[SLOTS_PER_RANK * r:SLOTS_PER_RANK * r + 2])
                for r in range(topo.world_size)]
        sample = [_joined(*values[SLOTS_PER_RANK * r + 2:SLOTS_PER_RANK * (r + 1)])
                  for r in range(topo.world_size)]
        for replica in range(topo.dp):
            members = [r for r in range(topo.world_size)
                       if (r // (topo.tp * topo.cp)) % topo.dp == replica]
            found = _first_difference(step, members, rows, ROWS, replica)
            if found is not None:
                return found
        given = [r for r in range(topo.world_size) if sample[r] is not None]
        return _first_difference(step, given, sample, GLOBAL)

    def judge(self, step: int, values: Sequence[float]) -> None:
        """Raise :class:`partc.BatchMismatchError` (on every rank alike) when two ranks
        that must agree were given different batches at ``step``."""
        found = self.verdict(step, values)
        if found is not None:
            raise BatchMismatchError(describe(found, self._topology), step=step,
                                     ranks=found.ranks)


def _first_difference(step: int, ranks: list[int], digests: list[int | None], what: str,
                      replica: int | None = None) -> Mismatch | None:
    if len(ranks) < 2:
        return None
    first = ranks[0]
    differing = [rank for rank in ranks[1:] if digests[rank] != digests[first]]
    if not differing:
        return None
    other = differing[0]
    return Mismatch(step=step, ranks=(first, other), digests=(digests[first], digests[other]),
                    what=what, differing=len(differing), compared=len(ranks),
                    replica=replica)


def _place(rank: int, topo: Topology) -> str:
    """``rank 3 (stage 1, replica 0, tp rank 1)``."""
    tp_rank, rest = rank % topo.tp, rank // (topo.tp * topo.cp)
    dp_rank, pp_rank = rest % topo.dp, rest // topo.dp
    where = [f"stage {pp_rank}"]
    if topo.dp > 1:
        where.append(f"replica {dp_rank}")
    if topo.tp > 1:
        where.append(f"tp rank {tp_rank}")
    return f"rank {rank} ({', '.join(where)})"


def describe(found: Mismatch, topo: Topology) -> str:
    """The message of a batch that differs between ranks, as every rank tells it."""
    first, other = found.ranks
    pair = f"step {found.step}: {_place(first, topo)} and {_place(other, topo)} were given"
    if found.what == GLOBAL:
        head = f"{pair} different global batches"
        rule = ("every rank given the global batch must be given the same one (each "
                "replica trains on its own rows of it)")
    else:
        head = (f"{pair} different batches" if topo.dp == 1 else
                f"{pair} different rows of data-parallel replica {found.replica}")
        rule = ("every rank of a replica (its pipeline stages, its tensor-parallel ranks) "
                "trains on the same rows: stage 0 reads the inputs and the last stage the "
                "target")
    more = (f"; {found.differing} of the {found.compared} ranks compared differ from rank "
            f"{first}" if found.differing > 1 else "")
    return (f"{head} (digests {found.digests[0]:012x} and {found.digests[1]:012x}{more}): "
            f"{rule}. Found before the optimizer stepped: no parameter has changed. Seed "
            f"the data by the step, not the rank (partc train's data({found.step - 1}) "
            "returns the global batch of that step on every rank), or give each replica "
            "its own rows on all of its ranks (module.data_sampler(n).indices(step)). "
            "TrainSpec(batch_check_every=0) (--batch-check-every 0) turns this check off")
