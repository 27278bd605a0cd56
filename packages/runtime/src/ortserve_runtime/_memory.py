"""This process's resident memory, for what a load or a grammar build costs."""

from __future__ import annotations

import os

__all__ = ["resident_memory"]


def resident_memory() -> int:
    """This process's resident set size in bytes (Linux ``/proc/self/statm``; 0 where
    there is none, and then resident sizes read 0)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return 0


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
