"""Token ids packed into sequences, and the samples each step reads.

:class:`TokenCorpus` cuts a stream of ``N`` ids into ``(N - 1) // seq`` samples: sample
``i`` is ids ``i * seq`` to ``i * seq + seq`` (``seq + 1`` of them), its inputs the first
``seq`` and its targets the last ``seq`` — each input's next token. Consecutive samples
share one id (a sample's last target is the next one's first input), so every id but the
first is a target once per epoch, and the ``N - 1 - num_samples * seq`` ids at the end
(fewer than ``seq``) are never read.

:class:`StepBatches` reads the samples :class:`partc.runtime.data.DataSampler` gives a
step: the global batch (``batches(step)``, what ``partc train``'s ``data(step)`` returns
and what a resumed run's data check digests) and one data-parallel replica's rows of it
(``batches.for_replica(dp, dp_rank)``, what a rank trains on). A batch is a function of
``(seed, step)`` and the corpus alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

from partc.errors import DataError
from partc.runtime.data import DataSampler

Batch = tuple[torch.Tensor, torch.Tensor]   # (inputs, targets): (batch, seq) int64 each


@dataclass(frozen=True, eq=False)
class TokenCorpus:
    """``ids`` (a 1-D integer array, memory-mapped or not) packed into samples of
    ``seq_len``; ``source`` names where the ids came from (for errors)."""

    ids: np.ndarray
    seq_len: int
    source: str

    def __post_init__(self) -> None:
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) \
                or self.seq_len < 1:
            raise DataError(f"{self.source}: the sequence length must be a positive int, "
                            f"got {self.seq_len!r}", path=self.source)
        if len(self.ids) < self.seq_len + 1:
            raise DataError(f"{self.source} holds {len(self.ids)} tokens, fewer than one "
                            f"sample needs ({self.seq_len} inputs and the next token: "
                            f"{self.seq_len + 1}); give more data or a model with a shorter "
                            "sequence", path=self.source)

    @property
    def num_samples(self) -> int:
        return (len(self.ids) - 1) // self.seq_len

    def samples(self, indices: torch.Tensor, *, vocab_size: int | None = None,
                step: int | None = None) -> Batch:
        """The samples ``indices`` names, as (inputs, targets) of shape ``(len(indices),
        seq_len)``, int64. With ``vocab_size``, an id at or above it is a DataError
        naming the source and ``step`` (an embedding would fail on it far from here)."""
        starts = indices.numpy().astype(np.int64)[:, None] * self.seq_len
        windows = np.asarray(self.ids[starts + np.arange(self.seq_len + 1)], dtype=np.int64)
        if vocab_size is not None and windows.size and int(windows.max()) >= vocab_size:
            where = "" if step is None else f" at step {step}"
            raise DataError(f"{self.source}: token id {int(windows.max())}{where} is outside "
                            f"the model's vocabulary of {vocab_size} ids: tokenize with the "
                            "model's tokenizer (--tokenizer), or check --data-dtype",
                            path=self.source, step=step)
        rows = torch.from_numpy(windows)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class StepBatches:
    """The batches of each step over ``corpus``: the global batch of
    ``global_batch_size`` samples, in the order ``DataSampler(seed)`` gives."""

    def __init__(self, corpus: TokenCorpus, *, global_batch_size: int, seed: int = 0,
                 vocab_size: int | None = None) -> None:
        self.corpus, self.seed, self.vocab_size = corpus, seed, vocab_size
        self.global_batch_size = global_batch_size
        self._sampler = DataSampler(corpus.num_samples, global_batch_size=global_batch_size,
                                    seed=seed)

    def __call__(self, step: int) -> Batch:
        """The global batch of step ``step`` (0-based)."""
        if isinstance(step, int) and step < 0:
            raise DataError(f"{self.corpus.source}: step {step} asked of training data: a "
                            "file's data has no held-out batch of its own; give one with "
                            "--eval-data PATH", path=self.corpus.source, step=step)
        return self.corpus.samples(self._sampler.global_indices(step),
                                   vocab_size=self.vocab_size, step=step)

    def for_replica(self, dp: int, dp_rank: int) -> Callable[[int], Batch]:
        """``step -> `` replica ``dp_rank``'s rows of the global batch (of ``dp``
        replicas): what ``forward_backward`` takes from that replica's ranks."""
        sampler = DataSampler(self.corpus.num_samples,
                              global_batch_size=self.global_batch_size, dp=dp,
                              dp_rank=dp_rank, seed=self.seed)

        def rows(step: int) -> Batch:
            return self.corpus.samples(sampler.indices(step), vocab_size=self.vocab_size,
                                       step=step)
        return rows

    def state_dict(self) -> dict[str, int | str]:
        """What fixes the order and the samples (the position is the step)."""
        return {**self._sampler.state_dict(), "seq_len": self.corpus.seq_len,
                "tokens": len(self.corpus.ids), "source": self.corpus.source}


def model_vocab_size(model: nn.Module) -> int | None:
    """The number of token ids ``model`` embeds: its input embedding's rows (Hugging
    Face's ``get_input_embeddings()``, else its first ``nn.Embedding``); None without one."""
    embedding = None
    if callable(getattr(model, "get_input_embeddings", None)):
        try:
            embedding = model.get_input_embeddings()
        except NotImplementedError:   # a transformers model without the accessor
            embedding = None
    if not isinstance(embedding, nn.Embedding):
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return None if embedding is None else embedding.num_embeddings
