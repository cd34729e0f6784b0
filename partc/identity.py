"""A model's identity without its values: the hash ranks and plans compare, the digest of
its behaviour the analysis cache keys on besides, and the fully qualified names under
which each parameter and buffer is known (ties have several)."""

from __future__ import annotations

import hashlib
import types
from typing import Any

import torch
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


def behaviour_digest(model: nn.Module) -> str:
    """A stable digest of what ``model_hash`` leaves out and the traced graph depends on:
    the code of every module class (its methods), every module's plain attributes
    (an activation's name, ``inplace``, ``eps``, the training flag, a config), and
    which parameters and buffers are one tensor (ties). Two models with one hash but
    other forwards (``relu`` where the other has ``silu``, a weight tied or not) differ
    here, so a measured model is never reused for the other. Values of tensors are left
    out; code outside the module classes (a function their forward calls) is not seen."""
    digest = hashlib.sha256()
    classes: dict[type, str] = {}
    # One object held by many modules (a Hugging Face config, whose repr is its JSON) is
    # described once: every value here is alive, so its id names it.
    described: dict[int, str] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        kind = type(module)
        if kind not in classes:
            classes[kind] = _class_digest(kind)
        digest.update(f"m {fqn} {classes[kind]}\n".encode())
        for name, value in sorted(vars(module).items()):
            if not name.startswith("_"):
                text = described.get(id(value))
                if text is None:
                    text = described[id(value)] = _stable_repr(value)
                digest.update(f"a {fqn}.{name} {text}\n".encode())
    for fqns in sorted(param_fqns(model).values()):
        digest.update(f"t {' '.join(fqns)}\n".encode())
    return digest.hexdigest()[:16]


def _class_digest(kind: type) -> str:
    digest = hashlib.sha256()
    for cls in kind.__mro__:
        if cls is nn.Module or cls is object:
            break
        for name, value in sorted(vars(cls).items()):
            function = getattr(value, "__func__", value)  # staticmethod, classmethod
            if isinstance(getattr(function, "__code__", None), types.CodeType):
                digest.update(f"{cls.__qualname__}.{name} {_code_repr(function.__code__)}\n"
                              .encode())
    return digest.hexdigest()[:16]


def _code_repr(code: types.CodeType) -> str:
    consts = [_code_repr(c) if isinstance(c, types.CodeType) else _stable_repr(c)
              for c in code.co_consts]
    return repr((code.co_code.hex(), code.co_names, consts))


def _stable_repr(value: Any) -> str:
    """``repr`` without what changes between processes: object addresses, set order."""
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({', '.join(_stable_repr(v) for v in value)})"
    if isinstance(value, (set, frozenset)):
        return f"set({', '.join(sorted(_stable_repr(v) for v in value))})"
    if isinstance(value, dict):
        return "{" + ", ".join(sorted(f"{_stable_repr(k)}: {_stable_repr(v)}"
                                      for k, v in value.items())) + "}"
    if isinstance(value, torch.Tensor):
        return f"tensor({tuple(value.shape)}, {value.dtype})"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    text = repr(value)
    return type(value).__qualname__ if " at 0x" in text else text
