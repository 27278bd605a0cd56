"""Host memory for key/value caches: zeros that cost nothing until written, and pages given
back when rows are freed (the C heap's trim: ``_memory.release_freed_memory``)."""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["PAGE", "give_back", "unhuged_zeros"]

PAGE = mmap.PAGESIZE


def unhuged_zeros(shape: tuple[int, ...], dtype: Any) -> npt.NDArray[Any]:
    """Zeros in an anonymous memory map, taken from the system a page at a time as written.

    numpy asks for transparent huge pages on large arrays, so the first token written to a
    cache row made 2 MB of it resident per layer (measured: a burst of 16 short requests
    held 1.6 GB); and a map's pages can be given back (:func:`give_back`).
    """
    count = int(np.prod(shape))
    buffer = mmap.mmap(-1, max(count * np.dtype(dtype).itemsize, 1))
    return np.frombuffer(buffer, dtype, count).reshape(shape)


def give_back(array: npt.NDArray[Any], start: int, end: int) -> None:
    """Drop the whole pages of bytes ``start`` to ``end`` of an :func:`unhuged_zeros`
    array: they read as zeros again and cost no memory until written."""
    first, last = -(-start // PAGE) * PAGE, end // PAGE * PAGE
    buffer: Any = array
    while isinstance(buffer, np.ndarray):
        buffer = buffer.base
    buffer = buffer.obj if isinstance(buffer, memoryview) else buffer
    if last > first and isinstance(buffer, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        buffer.madvise(mmap.MADV_DONTNEED, first, last - first)
