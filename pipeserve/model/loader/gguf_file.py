"""A GGUF file's metadata and tensor table, parsed in milliseconds.

The ``gguf`` package's reader builds a numpy view for every part of every metadata value
(three per string), so the driver spent about 4.5 s opening SmolLM2's 49k-token vocabulary
(a Llama 3 vocabulary, 128k tokens and as many merges, several times that) before the
engine could start. Loading a model needs a few dozen scalars and the tensor table, so this
reader walks the header with ``struct``, keeps each value's offset, and decodes a value
only when it is asked for (an array of strings, when its ``contents()`` are). Tensor data stays memory-mapped: ``data`` is a read-only view of the file, shaped
as ``gguf.GGUFReader`` shapes it (element arrays for float/integer types, the raw bytes
of each row for quantized ones), so the rest of the loader reads it unchanged.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (versions 2 and 3,
little-endian; a byte-swapped file is refused with a clear error). Models split into several
files by llama.cpp's gguf-split open from their first part.
"""

from __future__ import annotations

import os
import re
import struct
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = 0x46554747                     # b"GGUF" read as a little-endian uint32
SPLIT_NO, SPLIT_COUNT = "split.no", "split.count"          # gguf-split's keys (0-based part number)
_SPLIT_NAME = re.compile(r"(.*)-(\d{5})-of-(\d{5})\.gguf", re.IGNORECASE)
DEFAULT_ALIGNMENT = 32
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_SCALARS = {                           # value type -> (struct format, numpy dtype)
    GGUFValueType.UINT8: ("<B", np.uint8), GGUFValueType.INT8: ("<b", np.int8),
    GGUFValueType.UINT16: ("<H", np.uint16), GGUFValueType.INT16: ("<h", np.int16),
    GGUFValueType.UINT32: ("<I", np.uint32), GGUFValueType.INT32: ("<i", np.int32),
    GGUFValueType.FLOAT32: ("<f", np.float32), GGUFValueType.BOOL: ("<?", np.bool_),
    GGUFValueType.UINT64: ("<Q", np.uint64), GGUFValueType.INT64: ("<q", np.int64),
    GGUFValueType.FLOAT64: ("<d", np.float64),
}
_ELEMENT_DTYPES = {                    # unquantized tensor types: their element arrays
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class Field:
    """One metadata value, decoded on ``contents()``."""

    __slots__ = ("_file", "name", "type", "_offset", "_element", "_count")

    def __init__(self, file: "GGUFFile", name: str, type_: GGUFValueType, offset: int,
                 element: GGUFValueType | None = None, count: int = 0) -> None:
        self._file, self.name, self.type, self._offset = file, name, type_, offset
        self._element, self._count = element, count      # arrays: element type, length

    def contents(self) -> Any:
        """The value: a Python scalar, a str, or a list of either."""
        buf = self._file.buffer
        if self.type == GGUFValueType.STRING:
            return _string(buf, self._offset)[0]
        if self.type != GGUFValueType.ARRAY:
            return struct.unpack_from(_SCALARS[self.type][0], buf, self._offset)[0]
        if self._element == GGUFValueType.STRING:
            out, offset = [], self._offset
            for _ in range(self._count):
                text, offset = _string(buf, offset)
                out.append(text)
            return out
        dtype = np.dtype(_SCALARS[self._element][1]).newbyteorder("<")
        return np.frombuffer(buf, dtype, self._count, self._offset).tolist()


class Tensor(NamedTuple):
    """A tensor's entry, as ``gguf.ReaderTensor`` has it (``shape``: fastest dimension first)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """The parsed header of ``path``: ``get_field(key)`` and ``tensors``; ValueError when the
    file is not a GGUF this reader understands.

    A model split by llama.cpp's gguf-split (``NAME-00001-of-00003.gguf``: the metadata in
    the first part, each part its own tensor table and data) opens from its first part:
    ``tensors`` are then every part's, each viewing its own file."""

    def __init__(self, path: str, part_of_split: bool = False) -> None:
        self.path = path
        try:
            self._map = np.memmap(path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read {path} as a GGUF file: {exc}") from exc
        self.buffer = memoryview(self._map)
        try:
            self.fields, self.tensors = self._parse()
        except (struct.error, IndexError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is truncated or not a GGUF file ({exc})") from None
        count = self.fields.get(SPLIT_COUNT)
        if count is not None and count.contents() > 1 and not part_of_split:
            # each part's tensors view that part's mapping, which they keep open
            self.tensors += [t for part in self._open_parts(int(count.contents())) for t in part.tensors]
        names = set()
        for tensor in self.tensors:
            if tensor.name in names:
                raise ValueError(f"{path}: tensor {tensor.name!r} appears twice")
            names.add(tensor.name)

    def _open_parts(self, count: int) -> list["GGUFFile"]:
        """The other parts of a split model, by gguf-split's naming, checked against their metadata."""
        match = _SPLIT_NAME.fullmatch(os.path.basename(self.path))
        number = self.fields.get(SPLIT_NO)
        if match is None or int(match.group(3)) != count or (number is not None and number.contents() != 0):
            raise ValueError(f"{self.path} is part of a model split in {count} files (gguf-split); pass its first "
                             f"part, named like NAME-00001-of-{count:05d}.gguf")
        parts = []
        for i in range(2, count + 1):
            name = os.path.join(os.path.dirname(self.path), f"{match.group(1)}-{i:05d}-of-{count:05d}.gguf")
            if not os.path.exists(name):
                raise ValueError(f"{self.path} is part 1 of {count} of a split model, but part {i} ({name}) is "
                                 "missing: every part must sit beside the first")
            part = GGUFFile(name, part_of_split=True)
            got = part.get_field(SPLIT_NO)
            if got is None or got.contents() != i - 1:
                raise ValueError(f"{name} is not part {i} of {count} of {self.path}'s model (split.no "
                                 f"{None if got is None else got.contents()})")
            parts.append(part)
        return parts

    def get_field(self, key: str) -> Field | None:
        return self.fields.get(key)

    def _parse(self) -> tuple[dict[str, Field], list[Tensor]]:
        buf = self.buffer
        if len(buf) < 24 or _U32.unpack_from(buf, 0)[0] != MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic at its start)")
        version = _U32.unpack_from(buf, 4)[0]
        if version not in (2, 3):
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big") in (2, 3)
            raise ValueError(f"{self.path}: GGUF version {version} " + (
                "is a big-endian file, which pipeserve does not read" if swapped else
                "is not supported (versions 2 and 3 are)"))
        n_tensors, n_kv = _U64.unpack_from(buf, 8)[0], _U64.unpack_from(buf, 16)[0]
        offset, fields = 24, {}
        for _ in range(n_kv):
            key, offset = _string(buf, offset)
            type_ = _value_type(_U32.unpack_from(buf, offset)[0], key)
            fields[key], offset = self._field(key, type_, offset + 4)
        infos = []
        for _ in range(n_tensors):
            name, offset = _string(buf, offset)
            n_dims = _U32.unpack_from(buf, offset)[0]
            dims = np.frombuffer(buf, np.dtype("<u8"), n_dims, offset + 4).copy()
            offset += 4 + 8 * n_dims
            raw_type, rel = _U32.unpack_from(buf, offset)[0], _U64.unpack_from(buf, offset + 4)[0]
            offset += 12
            try:
                tensor_type = GGMLQuantizationType(raw_type)
            except ValueError:
                raise ValueError(f"{self.path}: tensor {name!r} has an unknown GGML type {raw_type}") from None
            infos.append((name, tensor_type, dims, rel))
        alignment = fields["general.alignment"].contents() if "general.alignment" in fields else DEFAULT_ALIGNMENT
        start = -(-offset // alignment) * alignment
        return fields, [self._tensor(name, tensor_type, dims, start + rel) for name, tensor_type, dims, rel in infos]

    def _field(self, key: str, type_: GGUFValueType, offset: int) -> tuple[Field, int]:
        """The field whose value starts at ``offset``, and the offset after it."""
        buf = self.buffer
        if type_ == GGUFValueType.STRING:
            return Field(self, key, type_, offset), offset + 8 + _U64.unpack_from(buf, offset)[0]
        if type_ != GGUFValueType.ARRAY:
            return Field(self, key, type_, offset), offset + struct.calcsize(_SCALARS[type_][0])
        element = _value_type(_U32.unpack_from(buf, offset)[0], key)
        count = _U64.unpack_from(buf, offset + 4)[0]
        start = offset + 12
        if element == GGUFValueType.STRING:
            end = start
            for _ in range(count):
                end += 8 + _U64.unpack_from(buf, end)[0]
        elif element == GGUFValueType.ARRAY:
            raise ValueError(f"{self.path}: metadata {key!r} is an array of arrays, which pipeserve does not read")
        else:
            end = start + count * struct.calcsize(_SCALARS[element][0])
        return Field(self, key, type_, start, element, count), end

    def _tensor(self, name: str, tensor_type: GGMLQuantizationType, dims: np.ndarray, offset: int) -> Tensor:
        n_elements = int(np.prod(dims)) if len(dims) else 1
        block, type_size = GGML_QUANT_SIZES[tensor_type]
        n_bytes = n_elements * type_size // block
        if offset + n_bytes > len(self._map):
            raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)")
        np_dims = tuple(int(d) for d in reversed(dims.tolist()))
        raw = self._map[offset:offset + n_bytes]
        if tensor_type in _ELEMENT_DTYPES:
            data = raw.view(np.dtype(_ELEMENT_DTYPES[tensor_type]).newbyteorder("<")).reshape(np_dims)
        else:   # quantized: each row's blocks as raw bytes
            data = raw.reshape(quant_shape_to_byte_shape(np_dims, tensor_type))
        return Tensor(name, tensor_type, dims, n_elements, n_bytes, offset, data)


def _string(buf: memoryview, offset: int) -> tuple[str, int]:
    length = _U64.unpack_from(buf, offset)[0]
    end = offset + 8 + length
    return bytes(buf[offset + 8:end]).decode("utf-8"), end


def _value_type(raw: int, key: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise ValueError(f"GGUF metadata {key!r} has an unknown value type {raw}") from None
