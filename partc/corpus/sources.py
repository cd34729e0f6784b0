"""What ``--data PATH`` names, opened as a :class:`TokenCorpus`.

By its form: a ``.bin`` file is a token file (flat ids, ``--data-dtype``); a ``.npy``
file a numpy array of ids; a directory a ``datasets`` data set saved with
``save_to_disk`` (its ``text`` column); any other file UTF-8 text. Text and data sets are
tokenized by ``--tokenizer DIR`` (a Hugging Face tokenizer saved there) or, without it, by
the byte-level tokenizer. A token file is already tokenized: ``--tokenizer`` with one is
refused, as is ``--data-dtype`` with text (the two would say nothing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from partc.corpus.packing import TokenCorpus
from partc.corpus.text_tokens import encode_dataset, encode_text_file, load_tokenizer
from partc.corpus.token_files import read_token_file
from partc.errors import DataError

TOKEN_FILE_SUFFIXES = (".bin", ".npy")


def is_token_file(path: str | Path) -> bool:
    return Path(path).suffix in TOKEN_FILE_SUFFIXES


def open_corpus(path: str | Path, *, seq_len: int, tokenizer: str | Path | None = None,
                dtype: str | None = None, vocab_size: int | None = None) -> TokenCorpus:
    """``path``'s ids packed into samples of ``seq_len``. With ``vocab_size`` (the
    model's), a tokenizer with more ids than the model embeds is refused here, before
    any step; a token file's ids are checked batch by batch as they are read."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"--data {path} does not exist", path=str(path))
    if is_token_file(path):
        if tokenizer is not None:
            raise DataError(f"--data {path} is a token file (already tokenized): "
                            "--tokenizer is for text", path=str(path))
        ids = read_token_file(path, dtype or "uint16")
    else:
        if dtype is not None:
            raise DataError(f"--data-dtype is for token files (.bin); {path} is read as "
                            f"{'a data set' if path.is_dir() else 'text'}", path=str(path))
        reader = load_tokenizer(tokenizer)
        if vocab_size is not None and reader.vocab_size > vocab_size:
            raise DataError(f"the tokenizer ({tokenizer or 'byte-level'}) has "
                            f"{reader.vocab_size} ids, the model embeds {vocab_size}: give "
                            "the model's own tokenizer (--tokenizer DIR) or a model with a "
                            "larger vocabulary", path=str(path))
        ids = encode_dataset(path, reader) if path.is_dir() else encode_text_file(path,
                                                                                 reader)
    return TokenCorpus(ids=ids, seq_len=seq_len, source=str(path))


def sequence_length(example_inputs: Any, where: str) -> int:
    """The model's sequence length: the second dimension of its token ids in
    ``example_inputs`` (a tensor, a tuple whose first item is one, or a dict with
    ``input_ids``). Raises :class:`DataError` when they are not (batch, seq) integer ids."""
    ids = example_inputs
    if isinstance(ids, dict):
        ids = ids.get("input_ids")
    elif isinstance(ids, (tuple, list)) and ids:
        ids = ids[0]
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 2
            and not ids.dtype.is_floating_point and not ids.dtype.is_complex):
        raise DataError(f"--data feeds token ids, but {where}'s example inputs do not start "
                        "with (batch, seq) integer ids (a tensor, a tuple whose first item "
                        "is one, or a dict with 'input_ids')")
    return int(ids.shape[1])


# What a tokenizer's batch holds that packed token rows can fill (:func:`token_batch`).
FILLED_KEYS = ("input_ids", "attention_mask", "labels")


def token_batch(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """A tokenizer's batch of unpadded token rows for a model that computes its own
    loss: the ids, a mask of ones (no padding) and the labels, the ids themselves (a
    Hugging Face causal LM shifts them)."""
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def model_batch(example_inputs: Any, where: str, *,
                loss_fn: bool) -> Callable[[torch.Tensor, torch.Tensor], tuple[Any, Any]]:
    """How a packed batch's ``(inputs, next-token targets)`` reach the model in the form
    of its ``example_inputs``: by position (a tensor, or a tuple of one), the ids and the
    targets; as a mapping (a tokenizer's batch, ``model(**batch)``), the same keys
    (:data:`FILLED_KEYS`), and the targets only where a ``loss_fn`` reads them: with
    ``labels`` and no ``loss_fn`` the model's own loss is the loss. Raises
    :class:`DataError` for inputs that token rows cannot fill."""
    if isinstance(example_inputs, dict):
        other = sorted(set(example_inputs) - set(FILLED_KEYS))
        if other:
            raise DataError(f"--data fills {', '.join(FILLED_KEYS)} from token rows, but "
                            f"{where}'s example inputs also take {', '.join(other)}: give "
                            "the factory a data(step) that makes them")
        keys = [key for key in FILLED_KEYS if key in example_inputs]
        own_loss = "labels" in keys and not loss_fn

        def mapping(ids: torch.Tensor, targets: torch.Tensor) -> tuple[Any, Any]:
            made = token_batch(ids)
            return {key: made[key] for key in keys}, None if own_loss else targets
        return mapping
    if isinstance(example_inputs, (tuple, list)) and len(example_inputs) > 1:
        raise DataError(f"--data feeds one input, the token ids, but {where}'s example "
                        f"inputs are {len(example_inputs)} by position: give the factory a "
                        "data(step) that makes them")
    return lambda ids, targets: (ids, targets)
