"""Frozen dataclasses of plain values as JSON data, and back, typed by their annotations.

The one serializer of the plan (plan.json, the plan cache) and of the cache's measured
models. Files are data, never code: what partc reads from disk is JSON, decoded field by
field against the annotations of a closed set of dataclasses (the caller names the type
to read; nothing in the file names one). A field of the wrong type, a missing or unknown
key is a :class:`CodecError` naming the field, e.g. ``layers[3].saved_bytes.full``.

What each annotation is written as:

- a dataclass: a mapping of its fields in order; one marked :func:`as_list` (a small
  record such as a collective), the list of its fields' values (its last
  :data:`UNLESS_DEFAULT` fields left off while at their defaults); one marked
  :func:`own_form` (the plan's budget section), what its ``to_dict`` writes;
- tuples: lists; ``dict[str, X]``: mappings; ``X | None``: X or null;
- a string enum (:mod:`partc.names`): its value; ``torch.dtype``: its name
  (``"bfloat16"``, :func:`dtype_name`); a :class:`~partc.placement.Placement`: DTensor's
  spelling (``"Shard(0)"``).

A field's metadata can change how it is written, so that files keep the form they had:
:data:`UNLESS_DEFAULT` writes it only when it is not its default (files written before
the field existed read as they did), :data:`NONE_AS_EMPTY` writes ``None`` as ``{}``.

Numbers keep their JSON type (``0`` stays an int, ``0.0`` a float, bools are not
numbers), so that data read back is equal to, and has the same ``repr`` as, what was
written: the plan cache keys plans on ``repr(problem)``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from typing import Any, Callable, Mapping, NamedTuple

import torch

from partc.placement import Placement

# Field metadata (``field(default=..., metadata=UNLESS_DEFAULT)``).
UNLESS_DEFAULT = {"partc.codec": "unless default"}
NONE_AS_EMPTY = {"partc.codec": "none as {}"}


class CodecError(ValueError):
    """Data that is not a value of the type asked for; ``field`` says where."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field or 'top level'}: {message}")
        self.field = field


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how plans write a dtype."""
    return str(dtype).removeprefix("torch.")


def dtype_named(name: str) -> torch.dtype:
    """The inverse of :func:`dtype_name`."""
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


class _Hook(NamedTuple):
    """A type written as a string: ``write`` makes it, ``read`` parses it (ValueError)."""

    write: Callable[[Any], str]
    read: Callable[[str], Any]


_HOOKS: dict[type, _Hook] = {
    torch.dtype: _Hook(dtype_name, dtype_named),
    Placement: _Hook(str, Placement.parse),
}


def as_list(cls: type) -> type:
    """Class decorator: write the dataclass ``cls`` as the list of its fields' values
    (a record small and numerous enough that keys would be most of the file)."""
    cls.__codec_as_list__ = True
    return cls


def own_form(cls: type) -> type:
    """Class decorator: write the dataclass ``cls`` by its own ``to_dict`` and read it by
    its classmethod ``from_dict`` (a section whose file form is not its fields')."""
    cls.__codec_own_form__ = True
    return cls


def to_data(value: Any) -> Any:
    """``value`` (dataclasses, tuples, dicts with str keys, scalars, enums, dtypes,
    placements) as JSON data."""
    hook = _HOOKS.get(type(value))
    if hook is not None:
        return hook.write(value)
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _dataclass_data(value)
    if isinstance(value, (tuple, list)):
        return [to_data(item) for item in value]
    if isinstance(value, dict):
        return {str(key): to_data(item) for key, item in value.items()}
    return value


def _dataclass_data(value: Any) -> Any:
    cls = type(value)
    if _writes_itself(cls):
        return value.to_dict()
    if _is_list_record(cls):
        fields = _init_fields(cls)
        # Trailing UNLESS_DEFAULT fields at their defaults are left off (files written
        # before they existed read as they did).
        while fields and _policy(fields[-1]) == UNLESS_DEFAULT \
                and getattr(value, fields[-1].name) == _default(fields[-1]):
            fields.pop()
        return [to_data(getattr(value, f.name)) for f in fields]
    data = {}
    for f in _init_fields(cls):
        item = getattr(value, f.name)
        if _policy(f) == UNLESS_DEFAULT and item == _default(f):
            continue
        data[f.name] = {} if item is None and _policy(f) == NONE_AS_EMPTY else to_data(item)
    return data


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
        for f in _init_fields(annotation):
            _check(hints[f.name], getattr(value, f.name), _join(field, f.name))
        return
    _each(annotation, value, field, _check, built=True)


def _decode(annotation: Any, data: Any, field: str) -> Any:
    if not _is_dataclass_type(annotation):
        return _each(annotation, data, field, _decode, built=False)
    if _writes_itself(annotation):
        return _build(annotation.from_dict, data, field)
    known = {f.name: f for f in _init_fields(annotation)}
    if _is_list_record(annotation):
        fewest = len(known) - sum(1 for f in known.values() if _policy(f) == UNLESS_DEFAULT)
        if not isinstance(data, (list, tuple)) or not fewest <= len(data) <= len(known):
            raise CodecError(field, f"expected a list of {len(known)} items, got {_kind(data)}")
        data = dict(zip(known, data))
    if not isinstance(data, Mapping):
        raise CodecError(field, f"expected a mapping, got {_kind(data)}")
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise CodecError(_join(field, unknown[0]), "unknown key")
    for name, f in known.items():
        if name not in data and _default(f) is dataclasses.MISSING:
            raise CodecError(_join(field, name), "missing")
    hints = _hints(annotation)
    values = {name: None if item == {} and _policy(known[name]) == NONE_AS_EMPTY
              else _decode(hints[name], item, _join(field, name))
              for name, item in data.items()}
    return _build(annotation, values, field, keywords=True)


def _build(make: Callable, data: Any, field: str, *, keywords: bool = False) -> Any:
    """``make(**data)`` or ``make(data)``; the class's own validation as a CodecError."""
    try:
        return make(**data) if keywords else make(data)
    except (TypeError, ValueError) as error:
        raise CodecError(field, str(error)) from None


def _each(annotation: Any, value: Any, field: str, recurse: Any, *, built: bool) -> Any:
    """The non-dataclass annotations: unions, tuples, dicts, then the leaves."""
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
        keys = {key: _leaf(args[0], key, _join(field, key), built) for key in value}
        items = {keys[key]: recurse(args[1], item, _join(field, key))
                 for key, item in value.items()}
        return None if built else items
    return _leaf(annotation, value, field, built)


def _leaf(annotation: Any, value: Any, field: str, built: bool) -> Any:
    """A scalar, an enum or a hooked type: the value itself when ``built`` (checked),
    else read from its JSON form."""
    if annotation is type(None):
        if value is not None:
            raise CodecError(field, f"expected null, got {_kind(value)}")
        return None
    if isinstance(annotation, type) and (issubclass(annotation, enum.Enum)
                                         or annotation in _HOOKS):
        if isinstance(value, annotation):
            return value
        if built or not isinstance(value, str):
            raise CodecError(field, f"expected {_name(annotation)}, got {_kind(value)}")
        if annotation in _HOOKS:
            try:
                return _HOOKS[annotation].read(value)
            except ValueError as error:
                raise CodecError(field, str(error)) from None
        if value not in annotation._value2member_map_:
            raise CodecError(field, f"unknown {annotation.__name__.lower()} {value!r}; one "
                             f"of {', '.join(m.value for m in annotation)}")
        return annotation(value)
    if annotation is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif annotation is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif annotation in (str, bool):
        ok = isinstance(value, annotation)
    else:
        raise CodecError(field, f"cannot read a {_name(annotation)} from a file")
    if not ok:
        raise CodecError(field, f"expected {_name(annotation)}, got {_kind(value)}")
    return value


def _is_dataclass_type(annotation: Any) -> bool:
    """A dataclass written as its fields (not a hooked one such as Placement)."""
    # Not tuple[SomeDataclass, ...]: a generic alias passes for its argument's class.
    return typing.get_origin(annotation) is None and isinstance(annotation, type) \
        and dataclasses.is_dataclass(annotation) and annotation not in _HOOKS


def _writes_itself(cls: type) -> bool:
    return cls.__dict__.get("__codec_own_form__", False)


def _is_list_record(cls: type) -> bool:
    return cls.__dict__.get("__codec_as_list__", False)


def _init_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _policy(f: dataclasses.Field) -> dict[str, str] | None:
    """How the field is written: :data:`UNLESS_DEFAULT`, :data:`NONE_AS_EMPTY` or plainly."""
    key = "partc.codec"
    return {key: f.metadata[key]} if key in f.metadata else None


def _default(f: dataclasses.Field) -> Any:
    """The field's default (from its factory if it has one), or ``MISSING``."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _join(field: str, name: str) -> str:
    return f"{field}.{name}" if field else name


def _name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation)


def _kind(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r:.40}"
