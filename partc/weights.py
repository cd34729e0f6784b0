"""Weights for a model planned on the meta device: making such a model, and reading a
rank's tensors from files.

A model planned on the meta device holds no values; ``Program.build(state_dict=...)``
gives each rank its own tensors from ``model.state_dict()`` of a real copy, a Hugging
Face checkpoint directory (``*.safetensors``, sharded with ``model.safetensors.
index.json`` or not) or a ``torch.distributed.checkpoint`` directory of tensors by FQN
(``module.save_checkpoint``'s included: any plan's shards read back whole).
The files are opened lazily: a rank reads the tensors its stage holds and no others.
A DCP directory's ``.metadata`` is unpickled admitting only DCP's metadata classes
(partc/runtime/checkpoint_files.py); in one ``module.save_checkpoint`` wrote, each file
is checked against the manifest's size and digest before the first read from it.

Non-persistent buffers (rotary frequencies, causal masks) are not in any state dict:
their values are what the model's constructor computed. A model built under
``torch.device("meta")`` computed them on the meta device, so they do not exist; one
built under :func:`on_meta` has its parameters on the meta device and every buffer
computed by its own code on the CPU, which ``build`` then uses. (Re-running one
module's constructor later is not possible in general: its arguments are gone.)
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from partc.errors import CheckpointError, PartcError
from partc.runtime.checkpoint_files import METADATA, SafeReader, check_files, read_metadata


# A tensor-parallel shard to read: (dim, chunks, tp_rank, tp), laid out as the runtime's
# ``tp.shard_of`` cuts it.
Cut = tuple[int, int, int, int]


def shard_ranges(size: int, chunks: int, rank: int, tp: int) -> list[tuple[int, int]]:
    """The [start, stop) ranges of a dim of ``size`` that rank ``rank`` of ``tp`` holds
    under ``Shard(dim, chunks)``: of each of ``chunks`` pieces (``torch.chunk``'s), its
    ``torch.chunk`` of ``tp``."""
    ranges = []
    piece = -(-size // chunks)
    for start in range(0, size, piece):
        length = min(piece, size - start)
        part = -(-length // tp)
        lo = min(rank * part, length)
        ranges.append((start + lo, start + min(lo + part, length)))
    return ranges


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Build a model with its parameters on the meta device and its buffers real:

        with partc.on_meta():
            model = LlamaForCausalLM(config)

    Every parameter a module registers moves to the meta device at once (its CPU
    storage is freed before the next is made, so the peak is one parameter's); buffers
    stay as the model's code computed them, so ``build(state_dict=...)`` needs the
    weights only. Not thread-safe: patches ``nn.Module.register_parameter`` while open.
    """
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = type(param)(param.detach().to("meta"),
                                                   requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def open_weights(path: str | os.PathLike) -> Mapping[str, torch.Tensor]:
    """The tensors in ``path`` by FQN, read when asked for: a directory (or file) of
    ``*.safetensors``, or a ``torch.distributed.checkpoint`` directory (``.metadata``);
    a checkpoint root with a ``latest`` pointer, as ``module.save_checkpoint`` writes
    it, reads the checkpoint it names."""
    path = Path(path)
    if not path.exists():
        raise PartcError(f"no weights at {path}")
    if (path / "latest").is_file():  # a checkpoint root: the checkpoint it points at
        path = path / (path / "latest").read_text().strip()
    if path.is_dir() and (path / ".metadata").exists():
        return DcpWeights(path)
    files = [path] if path.suffix == ".safetensors" else sorted(path.glob("*.safetensors"))
    if not files:
        raise PartcError(f"{path} holds no weights partc reads: a directory of *.safetensors "
                         "(a Hugging Face checkpoint) or of torch.distributed.checkpoint "
                         "files (.metadata)")
    return SafetensorsWeights(files, path / "model.safetensors.index.json"
                              if path.is_dir() else None)


class SafetensorsWeights(Mapping):
    """Tensors of safetensors files, each read from its file on first access."""

    def __init__(self, files: list[Path], index: Path | None = None) -> None:
        try:   # an optional dependency: only a model read from safetensors files needs it
            from safetensors import safe_open
        except ImportError:
            raise PartcError("reading *.safetensors needs the safetensors package "
                             "(pip install safetensors; transformers brings it)") from None
        self._open = safe_open
        self._handles: dict[Path, Any] = {}
        if index is not None and index.exists():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise PartcError(f"{index} has no weight_map")
            self._where = {name: index.parent / file for name, file in weight_map.items()}
        else:
            self._where = {name: file for file in files for name in self._handle(file).keys()}

    def _handle(self, file: Path) -> Any:
        if file not in self._handles:
            if not file.exists():
                raise PartcError(f"{file} (named in the checkpoint's index) does not exist")
            self._handles[file] = self._open(str(file), framework="pt", device="cpu")
        return self._handles[file]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(name)
        return self._handle(self._where[name]).get_tensor(name)

    def read_tensors(self, cuts: Mapping[str, Cut | None]) -> dict[str, torch.Tensor]:
        """The tensors ``cuts`` names, read from their files: whole, or where a cut is
        given only that shard's rows (``get_slice``: the rest is never read)."""
        values = {}
        for name, cut in cuts.items():
            if cut is None:
                values[name] = self[name]
                continue
            dim, chunks, rank, tp = cut
            part = self._handle(self._where[name]).get_slice(name)
            size = part.get_shape()[dim]
            values[name] = torch.cat([part[(slice(None),) * dim + (slice(start, stop),)]
                                      for start, stop in shard_ranges(size, chunks, rank, tp)],
                                     dim)
        return values

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


class DcpWeights(Mapping):
    """Tensors of a ``torch.distributed.checkpoint`` directory by FQN, each loaded by
    this process alone (no collective: ranks ask for different tensors)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._reader = SafeReader(str(directory))
        manifest = directory / "manifest.json"
        # partc's checkpoints record every file's digest: checked before it is read.
        self._files: dict[str, Any] = {}
        if manifest.is_file():
            try:
                self._files = json.loads(manifest.read_text())["files"]
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise PartcError(f"{manifest} does not read: {error}") from None
            check_files(directory, {METADATA: self._files[METADATA]}
                        if METADATA in self._files else {})
        self._metadata = read_metadata(directory / METADATA)
        self._checked: set[str] = set()
        self._tensors = {name: meta for name, meta
                         in self._metadata.state_dict_metadata.items()
                         if isinstance(meta, TensorStorageMetadata)}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._tensors:
            raise KeyError(name)
        return self.read_tensors({name: None})[name]

    def read_tensors(self, cuts: Mapping[str, Cut | None]) -> dict[str, torch.Tensor]:
        """The tensors ``cuts`` names in one load (DCP reads every saved chunk of them
        back, whichever plan wrote them), then cut where a cut is given."""
        values = {name: torch.empty(self._tensors[name].size,
                                    dtype=self._tensors[name].properties.dtype)
                  for name in cuts}
        if values:
            self._check_files_of(values)
            dcp.load(values, storage_reader=self._reader, no_dist=True)
        for name, cut in cuts.items():
            if cut is not None:
                dim, chunks, rank, tp = cut
                ranges = shard_ranges(values[name].shape[dim], chunks, rank, tp)
                values[name] = torch.cat([values[name].narrow(dim, start, stop - start)
                                          for start, stop in ranges], dim)
        return values

    def _check_files_of(self, names: Mapping[str, Any]) -> None:
        """The files holding ``names``' chunks, each checked against the manifest once."""
        files = {info.relative_path for index, info in self._metadata.storage_data.items()
                 if index.fqn in names} - self._checked
        if self._files:
            unlisted = sorted(files - set(self._files))
            if unlisted:
                raise CheckpointError(f"{self.directory / unlisted[0]} holds tensors but "
                                      f"is not in {self.directory / 'manifest.json'}: the "
                                      "checkpoint was changed after its save",
                                      path=str(self.directory / unlisted[0]))
            check_files(self.directory, {name: self._files[name] for name in files})
        self._checked |= files

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)
