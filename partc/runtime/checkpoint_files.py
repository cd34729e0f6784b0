"""A checkpoint's files as data: their digests, checked before anything reads them, and
DCP's ``.metadata`` read without running code.

Digests: the manifest (version 2) records every file of a checkpoint step with its size
and its SHA-256 (``files: {name: {"bytes": n, "sha256": hex}}``). SHA-256 rather than
BLAKE2b: Python's ``hashlib`` takes it from OpenSSL, which uses the CPU's SHA
instructions (268 MiB/s against BLAKE2b's 93 MiB/s on the machines here), and
``sha256sum`` checks a file by hand. A version-1 manifest (sizes only) still loads,
with a warning that its files cannot be verified.

``.metadata``: torch's ``FileSystemReader.read_metadata`` reads it with ``pickle.load``,
so a planted file runs code on every rank that loads it. :class:`SafeReader` is a
``FileSystemReader`` whose ``read_metadata`` unpickles with :class:`MetadataUnpickler`,
which builds only the classes DCP's metadata is made of (listed in ``_ADMITTED``: seen
in real ``.metadata`` files with ``pickletools``) and refuses any other global before it
is looked up, so nothing the file names is ever called. Every ``.metadata`` partc reads
goes through it: a checkpoint's load, ``partc checkpoint verify`` and
``build(state_dict=<a DCP directory>)`` (partc/weights.py).
"""

from __future__ import annotations

import hashlib
import io
import pickle
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from partc.errors import CheckpointError

METADATA = ".metadata"
DIGEST = "sha256"
_BLOCK = 8 << 20

# module -> the names a DCP ``.metadata`` pickle may reference there (torch 2.6 - 2.13).
_ADMITTED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata",
        "TensorProperties", "TensorStorageMetadata", "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.distributed.checkpoint._extension": frozenset({"ExtensionRegistry"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePosixPath",
                          "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata and nothing else: a global outside ``_ADMITTED`` (or a
    ``torch.<dtype>``) raises before it is imported or called."""

    def __init__(self, file: io.BufferedIOBase, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _ADMITTED.get(module, ()):
            return super().find_class(module, name)
        raise CheckpointError(
            f"{self.source} references {module}.{name}, which DCP's metadata never holds: "
            "the file was planted or damaged and was not loaded (no code in it ran); "
            "restore the checkpoint from a copy you trust", path=self.source)

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.source} holds a persistent reference, which DCP's "
                              "metadata never does: it was not loaded", path=self.source)


def read_metadata(file: Path) -> Metadata:
    """DCP's ``Metadata`` from a ``.metadata`` file, through :class:`MetadataUnpickler`."""
    try:
        with open(file, "rb") as handle:
            metadata = MetadataUnpickler(handle, str(file)).load()
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(f"{file} does not read as DCP's metadata: "
                              f"{type(error).__name__}: {error}", path=str(file)) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file} holds a {type(metadata).__name__}, not DCP's "
                              "Metadata", path=str(file))
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file-system reader with ``.metadata`` read by :func:`read_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(str(self.path)) / METADATA)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


# -- digests ---------------------------------------------------------------------------------


def file_digest(path: Path) -> str:
    digest = hashlib.new(DIGEST)
    with open(path, "rb") as handle:
        while block := handle.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def describe(directory: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes": size, "sha256": hex}}`` of files in ``directory``, hashed in
    parallel threads (hashlib releases the GIL)."""
    names = sorted(names)
    with ThreadPoolExecutor(max_workers=4) as pool:
        digests = list(pool.map(lambda name: file_digest(directory / name), names))
    return {name: {"bytes": (directory / name).stat().st_size, DIGEST: digest}
            for name, digest in zip(names, digests)}


def file_problem(directory: Path, name: str, recorded: Any) -> str | None:
    """What is wrong with one file against the manifest's record (``{"bytes", "sha256"}``,
    or a version-1 size alone), or None."""
    file = directory / name
    if not file.is_file():
        return f"{file} is missing: {directory} is a partial checkpoint"
    size = recorded if isinstance(recorded, int) else recorded.get("bytes")
    if file.stat().st_size != size:
        return (f"{file} has {file.stat().st_size} bytes, the manifest says {size}: the "
                "file is truncated or was changed; restore it from a copy or load an "
                "earlier step")
    if isinstance(recorded, dict) and file_digest(file) != recorded.get(DIGEST):
        return (f"{file} does not match its {DIGEST} in the manifest: its bytes changed "
                "after the save (a damaged disk or copy, or an edit); restore it from a "
                "copy or load an earlier step")
    return None


def check_files(directory: Path, files: dict[str, Any], share: tuple[int, int] = (0, 1)
                ) -> None:
    """Raise CheckpointError naming the first bad file among this process's ``share``
    (its index and the number of sharers: files ``i`` with ``i % count == index``), the
    ``.metadata`` always first and by every sharer (it is read next)."""
    index, count = share
    names = sorted(files)
    mine = [n for i, n in enumerate(names) if i % count == index and n != METADATA]
    if METADATA in files:
        mine.insert(0, METADATA)
    with ThreadPoolExecutor(max_workers=4) as pool:
        problems = list(pool.map(lambda name: file_problem(directory, name, files[name]),
                                 mine))
    for name, problem in zip(mine, problems):
        if problem is not None:
            raise CheckpointError(problem, path=str(directory / name))


def verify(directory: Path, manifest: dict[str, Any]) -> list[str]:
    """Every problem of one checkpoint step against its manifest, one line each:
    missing, truncated or changed files, then a ``.metadata`` that does not read as
    DCP's metadata (read safely, after its digest is checked)."""
    files = manifest["files"]
    checked = {name: file_problem(directory, name, files[name]) for name in sorted(files)}
    problems = [p for p in checked.values() if p is not None]
    if METADATA in checked and checked[METADATA] is None:
        try:
            read_metadata(directory / METADATA)
        except CheckpointError as error:
            problems.append(str(error))
    if files and not all(isinstance(v, dict) for v in files.values()):
        problems.append(f"{directory / 'manifest.json'} records sizes only (a version-1 "
                        "checkpoint): the files' bytes cannot be verified")
    return problems


__all__ = ["MetadataUnpickler", "SafeReader", "read_metadata", "describe", "check_files",
           "verify", "file_digest", "METADATA", "DIGEST"]
