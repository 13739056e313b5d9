"""The declared wire format of the step types: typed dataclasses <-> JSON values.

Everything that crosses a process or host boundary in the pipeline runtime
(``StepInput``, ``StepOutput``, timeline intervals, the pipeline spec) is a
dataclass of plain fields. ``to_wire`` turns one into JSON-able values
(dataclass -> dict of its fields, tuple -> list, Path -> str); ``from_wire``
rebuilds it from the *declared* field types and refuses anything else: a
missing or unknown field, a wrong type, a too deep or too long value. Nothing
is looked up by a name that came from the wire, so decoding runs no code but
the dataclasses' own constructors (``__post_init__`` validates configs).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from pathlib import Path
from typing import Any

MAX_DEPTH = 12
MAX_ITEMS = 1 << 22            # elements of one list (block tables, token ids)


class WireError(ValueError):
    """A message does not match its declared format."""


def to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_wire(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_wire(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{type(value).__name__} has no wire format (only dataclasses of plain fields travel)")


def from_wire(tp: Any, data: Any, where: str = "message") -> Any:
    """``data`` (parsed JSON) as a value of type ``tp``; raises ``WireError`` naming the bad field."""
    return _decode(tp, data, where, 0)


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _decode(tp: Any, data: Any, where: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise WireError(f"{where}: nested deeper than {MAX_DEPTH}")
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        raise WireError(f"{where}: untyped fields do not travel")
    if origin in (typing.Union, types.UnionType):
        return _decode_union(args, data, where, depth)
    if dataclasses.is_dataclass(tp):
        return _decode_dataclass(tp, data, where, depth)
    if origin is list or tp is list:
        items = _as_list(data, where)
        return [_decode(args[0], v, f"{where}[{i}]", depth + 1) for i, v in enumerate(items)] if args else \
            [_json_value(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(items)]
    if origin is tuple:
        return _decode_tuple(args, data, where, depth)
    if origin is dict or tp is dict:
        if not isinstance(data, dict):
            raise WireError(f"{where}: expected an object, got {type(data).__name__}")
        return {str(k): _json_value(v, f"{where}.{k}", depth + 1) for k, v in data.items()}
    return _decode_scalar(tp, data, where)


def _decode_union(args: tuple, data: Any, where: str, depth: int) -> Any:
    if data is None:
        if type(None) in args:
            return None
        raise WireError(f"{where}: must not be null")
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _decode(arg, data, where, depth)
        except WireError as exc:
            errors.append(str(exc))
    raise WireError("; ".join(errors))


def _decode_dataclass(cls: type, data: Any, where: str, depth: int) -> Any:
    if not isinstance(data, dict):
        raise WireError(f"{where}: expected an object for {cls.__name__}, got {type(data).__name__}")
    fields = _field_types(cls)
    unknown = set(data) - set(fields)
    if unknown:
        raise WireError(f"{where}: unknown field(s) {sorted(unknown)} for {cls.__name__}")
    kwargs = {name: _decode(tp, data[name], f"{where}.{name}", depth + 1)
              for name, tp in fields.items() if name in data}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:   # a missing field, or the class's own validation
        raise WireError(f"{where}: invalid {cls.__name__}: {exc}") from None


def _decode_tuple(args: tuple, data: Any, where: str, depth: int) -> tuple:
    items = _as_list(data, where)
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_decode(args[0], v, f"{where}[{i}]", depth + 1) for i, v in enumerate(items))
    if len(items) != len(args):
        raise WireError(f"{where}: expected {len(args)} items, got {len(items)}")
    return tuple(_decode(t, v, f"{where}[{i}]", depth + 1) for i, (t, v) in enumerate(zip(args, items)))


def _as_list(data: Any, where: str) -> list:
    if not isinstance(data, list):
        raise WireError(f"{where}: expected a list, got {type(data).__name__}")
    if len(data) > MAX_ITEMS:
        raise WireError(f"{where}: {len(data)} items is more than {MAX_ITEMS}")
    return data


def _decode_scalar(tp: Any, data: Any, where: str) -> Any:
    if tp is bool:
        ok = isinstance(data, bool)
    elif tp is int:
        ok = isinstance(data, int) and not isinstance(data, bool)
    elif tp is float:
        ok = isinstance(data, (int, float)) and not isinstance(data, bool)
        data = float(data) if ok else data
    elif tp is str:
        ok = isinstance(data, str)
    elif tp is Path:
        ok = isinstance(data, str)
        data = Path(data) if ok else data
    elif tp is type(None):
        ok = data is None
    else:
        raise WireError(f"{where}: type {tp!r} has no wire format")
    if not ok:
        raise WireError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {type(data).__name__}")
    return data


def _json_value(value: Any, where: str, depth: int) -> Any:
    """An untyped container's content: plain JSON values only, bounded depth."""
    if depth > MAX_DEPTH:
        raise WireError(f"{where}: nested deeper than {MAX_DEPTH}")
    if isinstance(value, dict):
        return {str(k): _json_value(v, f"{where}.{k}", depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_value(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(_as_list(value, where))]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise WireError(f"{where}: {type(value).__name__} is not a JSON value")
