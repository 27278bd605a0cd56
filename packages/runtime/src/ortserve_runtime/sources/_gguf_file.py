"""A GGUF file's header read and checked, its tensors mapped, nothing loaded.

gguf-py's ``GGUFReader`` builds an object per array element: on SmolLM2's 49,152 tokens
and 48,900 merges that took 6-14 s of a conversion (measured), against 0.6 s here, where
arrays of numbers are one ``frombuffer`` and strings one decode each. Every size and
offset is checked against the file before a view is made, so a truncated or lying file is
a :class:`GgufError` naming what is wrong, never a crash or a huge allocation.
Quantization layouts and the writer the tests use stay gguf-py's.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ._names import GgufError

__all__ = ["GgufError", "GgufFile", "GgufTensor"]


@dataclass(frozen=True, slots=True)
class GgufTensor:
    """One tensor: ``shape`` in ggml's order (fastest-varying dimension first, as the
    file and llama.cpp name it), ``data`` its bytes as a read-only view of the file."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    data: np.ndarray

    @property
    def n_bytes(self) -> int:
        return int(self.data.nbytes)


_MAGIC = 0x46554747  # "GGUF", little-endian
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4
_MAX_COUNT = 1 << 31
"""More array elements or tensors than any model has: a lying header."""


class GgufFile:
    """The metadata (``fields``: plain Python values by key) and tensors of one GGUF file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._data = np.memmap(path, mode="r", dtype=np.uint8)
        except (OSError, ValueError) as exc:
            raise GgufError(f"{path.name} cannot be read: {exc}") from exc
        self._buffer = memoryview(self._data)  # type: ignore[arg-type]
        self._offset = 0
        try:
            magic, version = self._unpack("<II")
            if magic != _MAGIC:
                raise GgufError(f"{path.name} is not a GGUF file (no GGUF magic)")
            if version not in (2, 3):
                raise GgufError(f"{path.name} is GGUF version {version}; versions 2 and 3 are read")
            tensor_count, field_count = self._unpack("<QQ")
            if tensor_count > _MAX_COUNT or field_count > _MAX_COUNT:
                raise GgufError(f"{path.name} claims {tensor_count} tensors and {field_count} keys")
            self.fields: dict[str, Any] = {}
            for _ in range(field_count):
                key = self._string()
                (kind,) = self._unpack("<I")
                self.fields[key] = self._value(kind)
            infos = [self._tensor_info() for _ in range(tensor_count)]
        except (struct.error, UnicodeDecodeError) as exc:
            raise GgufError(f"{path.name} is truncated or corrupt in its header ({exc})") from exc
        alignment = self.fields.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GgufError(f"{path.name} has an invalid general.alignment ({alignment!r})")
        start = -(-self._offset // alignment) * alignment
        self.tensors: list[GgufTensor] = []
        for name, shape, tensor_type, offset in infos:
            block, block_bytes = GGML_QUANT_SIZES[tensor_type]
            elements = math.prod(shape)
            if shape and shape[0] % block:
                raise GgufError(f"tensor {name}: a row of {shape[0]} is not whole {tensor_type.name} blocks")
            size = elements // block * block_bytes
            begin = start + offset
            if begin + size > len(self._data):
                raise GgufError(
                    f"tensor {name} ({tensor_type.name}, shape {list(shape)}) reaches past the end of {path.name} "
                    f"({begin + size} > {len(self._data)} bytes): a truncated or lying file"
                )
            self.tensors.append(GgufTensor(name, shape, tensor_type, self._data[begin : begin + size]))

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._buffer, self._offset)
        self._offset += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        end = self._offset + length
        if end > len(self._buffer):
            raise struct.error(f"a string of {length} bytes at {self._offset} reaches past the end")
        text = bytes(self._buffer[self._offset : end]).decode("utf-8", errors="replace")
        self._offset = end
        return text

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._unpack("<IQ")
            if count > _MAX_COUNT:
                raise GgufError(f"{self.path.name} has an array of {count} elements")
            if item == _STRING:
                return [self._string() for _ in range(count)]
            if item not in _SCALARS:
                return [self._value(item) for _ in range(count)]  # arrays of arrays: rare, small
            dtype = np.dtype(_SCALARS[item])
            end = self._offset + count * dtype.itemsize
            if end > len(self._buffer):
                raise struct.error(f"an array of {count} elements at {self._offset} reaches past the end")
            values = np.frombuffer(self._buffer, dtype=dtype, count=count, offset=self._offset).tolist()
            self._offset = end
            return values
        if kind not in _SCALARS:
            raise GgufError(f"{self.path.name} has a key of unknown type {kind}")
        (value,) = self._unpack(_SCALARS[kind])
        return value

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        (dims,) = self._unpack("<I")
        if dims > _MAX_DIMS:
            raise GgufError(f"tensor {name} has {dims} dimensions")
        shape = tuple(int(d) for d in self._unpack(f"<{dims}Q")) if dims else ()
        if any(d <= 0 or d > _MAX_COUNT for d in shape):
            raise GgufError(f"tensor {name} has absurd dimensions {list(shape)}")
        raw_type, offset = self._unpack("<IQ")
        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GgufError(f"tensor {name} has unknown type {raw_type}") from None
        if tensor_type not in GGML_QUANT_SIZES:
            raise GgufError(f"tensor {name} has type {tensor_type.name}, which has no known layout")
        return name, shape, tensor_type, int(offset)
