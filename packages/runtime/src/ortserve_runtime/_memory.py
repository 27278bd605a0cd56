"""This process's resident memory, for what a load or a grammar build costs, and the C
heap's free memory handed back."""

from __future__ import annotations

import contextlib
import ctypes
import os

__all__ = ["release_freed_memory", "resident_memory"]


def release_freed_memory() -> None:
    """Hand memory the C allocator holds free back to the system (glibc's ``malloc_trim``;
    elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def resident_memory() -> int:
    """This process's resident set size in bytes (Linux ``/proc/self/statm``; 0 where
    there is none, and then resident sizes read 0)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return 0


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
