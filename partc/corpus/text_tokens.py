"""Text to token ids: the built-in byte-level tokenizer, a Hugging Face tokenizer from a
local directory, and the readers of a text file and of a ``datasets`` data set.

A tokenizer here is anything with ``vocab_size`` (ids are below it), ``eos_token_id``
(an int, or None) and ``encode(text) -> list[int]`` without special tokens. A text file
is one document: its ids, in order. A data set is many: each row's ``text`` encoded and
followed by the tokenizer's end-of-sequence id (when it has one), so that packed
sequences see where one document ends and the next begins, as GPT-2 and Llama were
trained. No special token is added otherwise (no BOS per chunk: packing cuts the stream
wherever a sequence ends).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Iterable, Protocol

import numpy as np

from partc.corpus.token_files import smallest_dtype
from partc.errors import DataError


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as ids: 256 of them, no end-of-sequence id, nothing to download. What a
    character-level model such as ``samples/gpt.py``'s reads."""

    vocab_size = 256
    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class _HuggingFaceTokenizer:
    """A transformers tokenizer as a :class:`Tokenizer`: its full vocabulary (added tokens
    too), ids without special tokens, and no warning that a whole text is longer than
    the model's context (packing cuts it)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._tokenizer.model_max_length = 1 << 62
        self.vocab_size = len(tokenizer)
        self.eos_token_id = tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


def load_tokenizer(directory: str | Path | None) -> Tokenizer:
    """The Hugging Face tokenizer saved in ``directory`` (``save_pretrained``'s files:
    tokenizer.json, tokenizer_config.json, ...), read from disk only; the byte-level
    tokenizer when ``directory`` is None. Raises :class:`DataError` naming the directory
    when it is not there, transformers is not installed, or it holds no tokenizer."""
    if directory is None:
        return ByteTokenizer()
    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"tokenizer directory {directory} does not exist: give a directory "
                        "that a Hugging Face tokenizer was saved to (save_pretrained), or "
                        "leave --tokenizer out for the byte-level tokenizer",
                        path=str(directory))
    try:
        transformers = importlib.import_module("transformers")
    except ImportError:
        raise DataError(f"--tokenizer {directory} needs the transformers package: pip "
                        "install transformers", path=str(directory)) from None
    try:
        made = transformers.AutoTokenizer.from_pretrained(str(directory),
                                                          local_files_only=True)
    except (OSError, ValueError) as error:
        raise DataError(f"no Hugging Face tokenizer could be read from {directory}: "
                        f"{error}", path=str(directory)) from None
    return _HuggingFaceTokenizer(made)


def _as_array(ids: list[int], tokenizer: Tokenizer) -> np.ndarray:
    """Ids in the narrowest dtype a token file of this vocabulary would use."""
    return np.asarray(ids, dtype=smallest_dtype(tokenizer.vocab_size))


def encode_text_file(path: str | Path, tokenizer: Tokenizer) -> np.ndarray:
    """The ids of a UTF-8 text file: one document."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"data file {path} does not exist", path=str(path)) from None
    except UnicodeDecodeError as error:
        raise DataError(f"data file {path} is not UTF-8 text ({error.reason} at byte "
                        f"{error.start}); a token file must end in .bin or .npy",
                        path=str(path)) from None
    return _as_array(tokenizer.encode(text), tokenizer)


def encode_dataset(directory: str | Path, tokenizer: Tokenizer, *,
                   column: str = "text") -> np.ndarray:
    """The ids of a ``datasets`` data set saved with ``save_to_disk`` (its ``train``
    split when it is a DatasetDict): each row's ``column`` encoded, followed by the
    end-of-sequence id when the tokenizer has one."""
    directory = Path(directory)
    try:
        datasets = importlib.import_module("datasets")
    except ImportError:
        raise DataError(f"--data {directory} is a directory, read as a data set saved by "
                        "the datasets library, which is not installed: pip install "
                        "datasets (or give a text file or a token file)",
                        path=str(directory)) from None
    try:
        loaded = datasets.load_from_disk(str(directory))
    except (FileNotFoundError, ValueError) as error:
        raise DataError(f"{directory} is not a data set saved with save_to_disk: {error}",
                        path=str(directory)) from None
    if isinstance(loaded, dict):   # a DatasetDict: splits by name
        if "train" not in loaded:
            raise DataError(f"data set {directory} has splits {', '.join(loaded)} and no "
                            "'train'", path=str(directory))
        loaded = loaded["train"]
    if column not in loaded.column_names:
        raise DataError(f"data set {directory} has no {column!r} column (it has "
                        f"{', '.join(loaded.column_names)})", path=str(directory))
    ids: list[int] = []
    end = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    for row in loaded[column]:
        ids += tokenizer.encode(row) + end
    if not ids:
        raise DataError(f"data set {directory} holds no text", path=str(directory))
    return _as_array(ids, tokenizer)
