"""The declared wire format of the step types: typed dataclasses <-> JSON values.

Everything that crosses a process or host boundary in the pipeline runtime
(``StepInput``, ``StepOutput``, timeline intervals, the pipeline spec) is a
dataclass of plain fields. On the wire a dataclass is the JSON array of its
fields in declaration order (tuples are arrays, ``Path`` a string, ``bytes``
base64 text): compact,
and both ends run the same declarations (the handshake's magic names the
protocol version). ``dumps`` writes JSON; ``from_wire`` rebuilds a value from
the *declared* field types and refuses anything else: a wrong field count, a
wrong type, a too deep or too long value. Nothing is looked up by a name that
came from the wire, so decoding runs no code but the dataclasses' own
constructors (``__post_init__`` validates configs).

Decoders are built once per type (closures), so a step of 16 sequences
decodes in tens of microseconds, not a generic walk over type hints.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import json
import operator
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_DEPTH = 12
MAX_ITEMS = 1 << 22            # elements of one list (block tables, token ids)

Decoder = Callable[[Any], Any]


class WireError(ValueError):
    """A message does not match its declared format."""


def dumps(value: Any) -> str:
    """JSON text of ``value`` (dataclasses as arrays of their fields)."""
    return _ENCODER.encode(value)


def to_wire(value: Any) -> Any:
    """``value`` as plain JSON values (what ``dumps`` writes, parsed back)."""
    return json.loads(dumps(value))


def from_wire(tp: Any, data: Any, where: str = "message") -> Any:
    """``data`` (parsed JSON) as a value of type ``tp``; raises ``WireError`` naming where."""
    try:
        return _decoder(tp)(data)
    except WireError as exc:
        raise WireError(f"{where}: {exc}") from None
    except RecursionError:
        raise WireError(f"{where}: nested too deep") from None


_GETTERS: dict[type, Callable[[Any], Any]] = {}


def _default(value: Any) -> Any:
    getter = _GETTERS.get(type(value))
    if getter is None:
        getter = _GETTERS[type(value)] = _getter(type(value))
    return getter(value)


# One encoder for every call: ``json.dumps`` with options builds one per call, which a
# stage pays on every hop of every token (~10 us, several times that with cold caches).
_ENCODER = json.JSONEncoder(default=_default, separators=(",", ":"))


def _getter(cls: type) -> Callable[[Any], Any]:
    if issubclass(cls, Path):
        return str
    if issubclass(cls, bytes):
        return lambda value: base64.b64encode(value).decode("ascii")
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} has no wire format (only dataclasses of plain fields travel)")
    names = _field_names(cls)
    if len(names) == 1:
        return lambda value: [getattr(value, names[0])]
    return operator.attrgetter(*names)       # a tuple: a JSON array


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.init)


@functools.cache
def _decoder(tp: Any) -> Decoder:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _union_decoder(args)
    if dataclasses.is_dataclass(tp):
        return _dataclass_decoder(tp)
    if origin is list or tp is list:
        return _list_decoder(_decoder(args[0]) if args else _json_value)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            items = _list_decoder(_decoder(args[0]))
            return lambda data: tuple(items(data))
        return _tuple_decoder(tuple(_decoder(a) for a in args))
    if origin is dict or tp is dict:
        return _dict_decoder
    return _scalar_decoder(tp)


def _dataclass_decoder(cls: type) -> Decoder:
    """An array of ``cls``'s fields -> ``cls``. The body is generated once per class, on first
    use (dataclasses may refer to each other), as ``dataclasses`` writes ``__init__``: one
    unpacking and one line per field, a field of plain types (int, str, bool) checked inline;
    a walk over the fields took about twice as long on a step of 128 sequences. Only the
    declared names and decoders go into it; nothing from the wire does."""
    names = _field_names(cls)
    built: list[Decoder] = []

    def decode(data: Any) -> Any:
        if not built:
            built.append(_generate_dataclass_decoder(cls, names))
        return built[0](data)

    return decode


def _generate_dataclass_decoder(cls: type, names: tuple[str, ...]) -> Decoder:
    hints = typing.get_type_hints(cls)
    env: dict[str, Any] = {"cls": cls, "WireError": WireError, "field": _decode_field, "describe": _describe}
    values = [f"v{i}" for i in range(len(names))]
    lines = ["def decode(data):",
             f"    if type(data) is not list or len(data) != {len(names)}:",
             f"        raise WireError('expected {cls.__name__} as an array of {len(names)} fields, got '"
             f" + describe(data))",
             f"    {', '.join(values)}, = data" if names else "    pass"]
    for i, name in enumerate(names):
        dec = env[f"d{i}"] = _decoder(hints[name])
        env[f"w{i}"] = f"{cls.__name__}.{name}"
        plain = getattr(dec, "plain_types", None)
        if plain is not None:
            env[f"p{i}"] = plain
            lines.append(f"    if type(v{i}) not in p{i}:")
            lines.append(f"        v{i} = field(d{i}, v{i}, w{i})")
        elif getattr(dec, "nullable", False):   # X | None: a null is the union decoder's None
            lines.append(f"    if v{i} is not None:")
            lines.append(f"        v{i} = field(d{i}, v{i}, w{i})")
        else:
            lines.append(f"    v{i} = field(d{i}, v{i}, w{i})")
    lines += ["    try:",
              f"        return cls({', '.join(values)})",
              "    except (TypeError, ValueError) as exc:    # the class's own validation",
              f"        raise WireError(f'invalid {cls.__name__}: {{exc}}') from None"]
    exec("\n".join(lines), env)   # noqa: S102 - source built from the declarations above only
    return env["decode"]


def _decode_field(dec: Decoder, value: Any, where: str) -> Any:
    try:
        return dec(value)
    except WireError as exc:
        raise WireError(f"{where}: {exc}") from None


def _union_decoder(args: tuple) -> Decoder:
    nullable = type(None) in args
    options = [_decoder(a) for a in args if a is not type(None)]
    plain = [getattr(d, "plain_types", None) for d in options]

    def decode(data: Any) -> Any:
        if data is None:
            if nullable:
                return None
            raise WireError("must not be null")
        errors = []
        for dec in options:
            try:
                return dec(data)
            except WireError as exc:
                errors.append(str(exc))
        raise WireError(" / ".join(errors))

    if nullable and all(p is not None for p in plain):   # e.g. int | None
        decode.plain_types = tuple(t for p in plain for t in p) + (type(None),)  # type: ignore[attr-defined]
    decode.nullable = nullable  # type: ignore[attr-defined]
    return decode


_SCALARS = {bool: (bool,), int: (int,), float: (float, int), str: (str,), Path: (str,), bytes: (str,),
            type(None): (type(None),)}


def _from_base64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WireError(f"expected base64 bytes: {exc}") from None


def _list_decoder(item: Decoder) -> Decoder:
    fast = getattr(item, "scalar_types", None)
    fast_set = frozenset(fast) if fast is not None else None

    def decode(data: Any) -> list:
        if type(data) is not list:
            raise WireError(f"expected an array, got {_describe(data)}")
        if len(data) > MAX_ITEMS:
            raise WireError(f"{len(data)} items is more than {MAX_ITEMS}")
        # The items' types in one C-level pass (a block table, token ids): a generator over
        # them took ~2.5 us for 30 ints, ~0.15 ms a step of 128 sequences.
        if fast_set is not None and fast_set.issuperset(map(type, data)):
            return data if float not in fast else [float(v) for v in data]
        return [item(v) for v in data]

    return decode


def _tuple_decoder(items: tuple[Decoder, ...]) -> Decoder:
    def decode(data: Any) -> tuple:
        if type(data) is not list or len(data) != len(items):
            raise WireError(f"expected an array of {len(items)} items, got {_describe(data)}")
        return tuple(dec(v) for dec, v in zip(items, data))

    return decode


def _scalar_decoder(tp: Any) -> Decoder:
    if tp not in _SCALARS:
        raise WireError(f"type {tp!r} has no wire format")
    allowed = _SCALARS[tp]
    convert = {float: float, Path: Path, bytes: _from_base64}.get(tp)

    def decode(data: Any) -> Any:
        if type(data) not in allowed:
            raise WireError(f"expected {getattr(tp, '__name__', tp)}, got {_describe(data)}")
        return convert(data) if convert is not None else data

    decode.scalar_types = allowed  # type: ignore[attr-defined]
    if convert is None:
        decode.plain_types = allowed  # type: ignore[attr-defined]
    elif tp is float:   # a JSON float is the value as it is; only an int goes through float()
        decode.plain_types = (float,)  # type: ignore[attr-defined]
    return decode


def _dict_decoder(data: Any) -> dict:
    if type(data) is not dict:
        raise WireError(f"expected an object, got {_describe(data)}")
    return _json_value(data)


def _json_value(value: Any, depth: int = 0) -> Any:
    """An untyped container's content: plain JSON values only, bounded depth."""
    if depth > MAX_DEPTH:
        raise WireError(f"nested deeper than {MAX_DEPTH}")
    if type(value) is dict:
        return {k: _json_value(v, depth + 1) for k, v in value.items()}
    if type(value) is list:
        if len(value) > MAX_ITEMS:
            raise WireError(f"{len(value)} items is more than {MAX_ITEMS}")
        return [_json_value(v, depth + 1) for v in value]
    if value is None or type(value) in (bool, int, float, str):
        return value
    raise WireError(f"{type(value).__name__} is not a JSON value")


def _describe(data: Any) -> str:
    if type(data) is list:
        return f"an array of {len(data)}"
    return type(data).__name__
