"""Token files: a flat binary of token ids, as nanoGPT's prepare scripts write them
(``np.array(ids, dtype=np.uint16).tofile("train.bin")``), read memory-mapped.

A ``.bin`` file holds ids and nothing else: no header, little-endian, one dtype for the
whole file, uint16 (ids below 65,536: GPT-2's 50,257, Llama-2's 32,000) or uint32 (Llama-3's
128,256). The file does not say which, so the reader is told (``--data-dtype``, uint16 by
default as in nanoGPT); a file whose size is not a whole number of ids is refused. A
``.npy`` file (``numpy.save``) says its own dtype and is read memory-mapped too.
Memory-mapping reads only the pages a batch touches: a file far larger than memory
trains as fast as a small one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from partc.cli.choices import TOKEN_DTYPES
from partc.errors import DataError

# Each dtype's name to its numpy dtype, little-endian whatever the machine.
_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
assert tuple(_DTYPES) == TOKEN_DTYPES


def read_token_file(path: str | Path, dtype: str = "uint16") -> np.ndarray:
    """The ids of a ``.bin`` token file (``dtype`` one of :data:`TOKEN_DTYPES`) or of a
    ``.npy`` file (1-D, an integer dtype; ``dtype`` unused), memory-mapped read-only.
    Raises :class:`DataError` naming the file for a missing, empty or damaged one."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"token file {path} does not exist (or is not a file)", path=str(path))
    if path.suffix == ".npy":
        return _read_npy(path)
    if dtype not in _DTYPES:
        raise DataError(f"token file {path}: dtype must be one of {', '.join(_DTYPES)}, got "
                        f"{dtype!r}", path=str(path))
    size, itemsize = path.stat().st_size, _DTYPES[dtype].itemsize
    if size == 0:
        raise DataError(f"token file {path} is empty", path=str(path))
    if size % itemsize:
        raise DataError(f"token file {path} has {size} bytes, not a whole number of "
                        f"{dtype} ids ({itemsize} bytes each): is it a token file, and of "
                        f"this dtype (--data-dtype)?", path=str(path))
    return np.memmap(path, dtype=_DTYPES[dtype], mode="r")


def _read_npy(path: Path) -> np.ndarray:
    try:
        ids = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as error:
        raise DataError(f"token file {path} is not a readable .npy array: {error}",
                        path=str(path)) from None
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.size == 0:
        raise DataError(f"token file {path} holds a {ids.dtype} array of shape {ids.shape}; "
                        "expected a non-empty 1-D array of integer token ids", path=str(path))
    if ids.dtype.kind == "i" and int(ids.min()) < 0:
        raise DataError(f"token file {path} holds negative ids", path=str(path))
    return ids


def smallest_dtype(vocab_size: int) -> str:
    """The narrowest token-file dtype that holds ids below ``vocab_size``."""
    for name, dtype in _DTYPES.items():
        if vocab_size <= np.iinfo(dtype).max + 1:
            return name
    raise DataError(f"a vocabulary of {vocab_size} ids does not fit a uint32 token file")


def write_token_file(ids: np.ndarray | list[int], path: str | Path,
                     dtype: str | None = None) -> Path:
    """Write ``ids`` as a ``.bin`` token file (``dtype``: the narrowest that holds the
    largest id when not given); returns the path. Tokenize once, train many times."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
        raise DataError(f"token ids must be a non-empty 1-D integer array, got {ids.dtype} "
                        f"of shape {ids.shape}", path=str(path))
    if int(ids.min()) < 0:
        raise DataError("token ids must not be negative", path=str(path))
    dtype = dtype or smallest_dtype(int(ids.max()) + 1)
    if dtype not in _DTYPES:
        raise DataError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}",
                        path=str(path))
    if int(ids.max()) > np.iinfo(_DTYPES[dtype]).max:
        raise DataError(f"id {int(ids.max())} does not fit {dtype}: use uint32",
                        path=str(path))
    path = Path(path)
    ids.astype(_DTYPES[dtype]).tofile(path)
    return path
