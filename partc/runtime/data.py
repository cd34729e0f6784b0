"""The samples each rank reads: a global order that depends on the step only.

The global order is an endless stream of epochs over ``num_samples`` samples, each
epoch a permutation drawn from ``seed + epoch`` (``torch.randperm`` on a CPU
generator). Step ``s`` (0-based: the optimizer steps done before it) reads stream
positions ``s * B`` to ``(s + 1) * B - 1``, ``B`` the plan's global batch; data-parallel
replica ``r`` of ``dp`` takes rows ``r * B/dp`` to ``(r + 1) * B/dp - 1`` of it, the rows
``forward_backward`` gives that replica when handed the global batch (its
microbatches are consecutive runs of those rows). So the step a checkpoint records is
the data position: a run resumed at step ``s`` on any dp degree reads exactly the samples
an uninterrupted run would have read, and every rank of a replica (its pipeline stages,
its tensor-parallel ranks) the same ones. A sampler holds at most two epochs'
permutations (8 bytes per sample each).
"""

from __future__ import annotations

import torch


class DataSampler:
    """Sample indices per step, for one data-parallel replica (``dp_rank`` of ``dp``)."""

    def __init__(self, num_samples: int, *, global_batch_size: int, dp: int = 1,
                 dp_rank: int = 0, seed: int = 0) -> None:
        for name, value in (("num_samples", num_samples),
                            ("global_batch_size", global_batch_size), ("dp", dp)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"data_sampler: {name} must be a positive int, got {value!r}")
        if global_batch_size % dp:
            raise ValueError(f"data_sampler: a global batch of {global_batch_size} does not "
                             f"split over {dp} data-parallel replicas")
        if not 0 <= dp_rank < dp:
            raise ValueError(f"data_sampler: dp_rank {dp_rank} is not in 0..{dp - 1}")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.dp, self.dp_rank, self.seed = dp, dp_rank, seed
        self._epochs: dict[int, torch.Tensor] = {}  # the last two permutations drawn

    @property
    def local_batch_size(self) -> int:
        """Samples this replica reads per step."""
        return self.global_batch_size // self.dp

    def epoch_of(self, step: int) -> int:
        """The epoch step ``step``'s first sample belongs to."""
        return step * self.global_batch_size // self.num_samples

    def global_indices(self, step: int) -> torch.Tensor:
        """Every sample step ``step`` reads, in the global batch's row order."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"data_sampler: step must be an int >= 0, got {step!r}")
        start = step * self.global_batch_size
        return self._positions(start, start + self.global_batch_size)

    def indices(self, step: int) -> torch.Tensor:
        """The samples this replica reads at step ``step`` (a LongTensor of
        ``global_batch_size // dp``): its contiguous slice of :meth:`global_indices`."""
        share = self.local_batch_size
        return self.global_indices(step)[self.dp_rank * share:(self.dp_rank + 1) * share]

    def _positions(self, start: int, stop: int) -> torch.Tensor:
        parts = []
        while start < stop:
            epoch, offset = divmod(start, self.num_samples)
            take = min(stop - start, self.num_samples - offset)
            parts.append(self._permutation(epoch)[offset:offset + take])
            start += take
        return torch.cat(parts)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._epochs:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            if len(self._epochs) >= 2:
                self._epochs.pop(min(self._epochs))
            self._epochs[epoch] = torch.randperm(self.num_samples, generator=generator)
        return self._epochs[epoch]

    def state_dict(self) -> dict[str, int]:
        """What fixes the order (the position is the step): for a checkpoint's extra."""
        return {"num_samples": self.num_samples, "global_batch_size": self.global_batch_size,
                "seed": self.seed}
