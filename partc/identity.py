"""A model's identity without its values: the hash ranks and plans compare, and the
fully qualified names under which each parameter and buffer is known (ties have several)."""

from __future__ import annotations

import hashlib

from torch import nn


def model_hash(model: nn.Module) -> str:
    """A stable hash of the module tree and parameter shapes/dtypes (never values)."""
    digest = hashlib.sha256()
    for fqn, module in model.named_modules(remove_duplicate=False):
        digest.update(f"m {fqn} {type(module).__module__}.{type(module).__qualname__}\n".encode())
    for fqn, tensor in model.named_parameters(remove_duplicate=False):
        digest.update(f"p {fqn} {tuple(tensor.shape)} {tensor.dtype}\n".encode())
    for fqn, tensor in model.named_buffers(remove_duplicate=False):
        digest.update(f"b {fqn} {tuple(tensor.shape)} {tensor.dtype}\n".encode())
    return digest.hexdigest()[:16]


def param_fqns(model: nn.Module) -> dict[int, tuple[str, ...]]:
    """Every FQN of every parameter and buffer, grouped by tensor identity (ties)."""
    groups: dict[int, list[str]] = {}
    named = list(model.named_parameters(remove_duplicate=False))
    named += list(model.named_buffers(remove_duplicate=False))
    for fqn, tensor in named:
        groups.setdefault(id(tensor), []).append(fqn)
    return {key: tuple(fqns) for key, fqns in groups.items()}
