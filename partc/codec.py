"""Frozen dataclasses of plain values as JSON data, and back, typed by their annotations.

Files are data, never code: what partc reads from disk is JSON, decoded field by field
against the annotations of a closed set of dataclasses (the caller names the type to
read; nothing in the file names one). A field of the wrong type, a missing or unknown key
is a :class:`CodecError` naming the field, e.g. ``layers[3].saved_bytes.full``.

Numbers keep their JSON type (``0`` stays an int, ``0.0`` a float, bools are not
numbers), so that data read back is equal to, and has the same ``repr`` as, what was
written: the plan cache keys plans on ``repr(problem)``.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Mapping

import torch


class CodecError(ValueError):
    """Data that is not a value of the type asked for; ``field`` says where."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field or 'top level'}: {message}")
        self.field = field


def to_data(value: Any) -> Any:
    """``value`` (dataclasses, tuples, dicts with str keys, scalars) as JSON data."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_data(getattr(value, f.name)) for f in dataclasses.fields(value)
                if f.init}
    if isinstance(value, (tuple, list)):
        return [to_data(item) for item in value]
    if isinstance(value, dict):
        return {str(key): to_data(item) for key, item in value.items()}
    return value


def from_data(cls: type, data: Any, field: str = "") -> Any:
    """A ``cls`` (a dataclass) from :func:`to_data`'s data; raises CodecError."""
    return _decode(cls, data, field)


def check(value: Any, annotation: Any, field: str = "") -> None:
    """Raise CodecError unless ``value`` (already built) has the annotated type, all the
    way down its dataclass fields."""
    _check(annotation, value, field)


def _check(annotation: Any, value: Any, field: str) -> None:
    if _is_dataclass_type(annotation):
        if not isinstance(value, annotation):
            raise CodecError(field, f"expected {annotation.__name__}, got {_kind(value)}")
        hints = _hints(annotation)
        for f in dataclasses.fields(annotation):
            if f.init:
                _check(hints[f.name], getattr(value, f.name), _join(field, f.name))
        return
    _each(annotation, value, field, _check, built=True)


def _decode(annotation: Any, data: Any, field: str) -> Any:
    if _is_dataclass_type(annotation):
        if not isinstance(data, Mapping):
            raise CodecError(field, f"expected a mapping, got {_kind(data)}")
        hints = _hints(annotation)
        known = {f.name: f for f in dataclasses.fields(annotation) if f.init}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise CodecError(_join(field, unknown[0]), "unknown key")
        for name, f in known.items():
            if name not in data and f.default is dataclasses.MISSING \
                    and f.default_factory is dataclasses.MISSING:
                raise CodecError(_join(field, name), "missing")
        values = {name: _decode(hints[name], item, _join(field, name))
                  for name, item in data.items()}
        try:
            return annotation(**values)
        except (TypeError, ValueError) as error:   # the class's own validation
            raise CodecError(field, str(error)) from None
    return _each(annotation, data, field, _decode, built=False)


def _each(annotation: Any, value: Any, field: str, recurse: Any, *, built: bool) -> Any:
    """The non-dataclass annotations: scalars, unions, tuples, dicts, torch.dtype."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        present = [option for option in args if option is not type(None)]
        if value is not None and len(present) == 1:   # say what is wrong inside it
            return recurse(present[0], value, field)
        for option in args:
            try:
                return recurse(option, value, field)
            except CodecError:
                pass
        raise CodecError(field, f"expected {_name(annotation)}, got {_kind(value)}")
    if origin is tuple:
        if not isinstance(value, tuple if built else (list, tuple)):
            raise CodecError(field, f"expected a list, got {_kind(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            items = [recurse(args[0], item, f"{field}[{i}]") for i, item in enumerate(value)]
        elif len(args) == len(value):
            items = [recurse(a, item, f"{field}[{i}]")
                     for i, (a, item) in enumerate(zip(args, value))]
        else:
            raise CodecError(field, f"expected {len(args)} items, got {len(value)}")
        return None if built else tuple(items)
    if origin is dict:
        if not isinstance(value, dict if built else Mapping):
            raise CodecError(field, f"expected a mapping, got {_kind(value)}")
        if any(not isinstance(key, str) for key in value):
            raise CodecError(field, "keys must be strings")
        items = {key: recurse(args[1], item, _join(field, key)) for key, item in value.items()}
        return None if built else items
    if annotation is type(None):
        if value is not None:
            raise CodecError(field, f"expected null, got {_kind(value)}")
        return None
    if annotation is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif annotation is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif annotation in (str, bool) or annotation is torch.dtype:
        ok = isinstance(value, annotation)
    else:
        raise CodecError(field, f"cannot read a {_name(annotation)} from a file")
    if not ok:
        raise CodecError(field, f"expected {_name(annotation)}, got {_kind(value)}")
    return value


def _is_dataclass_type(annotation: Any) -> bool:
    # Not tuple[SomeDataclass, ...]: a generic alias passes for its argument's class.
    return typing.get_origin(annotation) is None and isinstance(annotation, type) \
        and dataclasses.is_dataclass(annotation)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _join(field: str, name: str) -> str:
    return f"{field}.{name}" if field else name


def _name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation)


def _kind(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r:.40}"
