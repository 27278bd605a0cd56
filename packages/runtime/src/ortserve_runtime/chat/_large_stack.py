"""Calls into llguidance's compiler, on a thread with a stack large enough for it.

llguidance compiles a grammar by recursion along its ``$ref`` chains and rule references
(a ``_grammar_depth`` check bounds them first); a stack overflow there kills the process,
whatever the request. So every compiling call runs on a thread of its own whose stack
takes the largest grammar within the size bound (``max_grammar_bytes``, 128 KiB), should
the check miss a shape (as it did three times).

Measured (llguidance 1.9.1, the least stack that compiled the longest chain of each shape
within 128 KiB): ``$ref`` hops through an ``anyOf`` 18 MiB (5,506 hops), through
``items`` 31 MiB, ``additionalProperties`` 22 MiB; Lark rules ``a:b`` 51 MiB (16,557
rules), rules of 24 nested parentheses each (the deepest llguidance takes) 107 MiB (2,365
rules): the deepest. 256 MiB leaves more than twice that. The stack is reserved, not
committed: only what a compile touches is resident, and it is returned when the thread
ends (glibc keeps at most 40 MiB of ended threads' stacks; this one is unmapped), so a
compile that goes 107 MiB deep grows the process by that only while it runs. llguidance
releases the GIL while it compiles, so the caller's wait holds no other thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["COMPILER_STACK", "on_large_stack"]

T = TypeVar("T")

COMPILER_STACK = 256 * 2**20
"""The stack of the thread each compile runs on (bytes)."""

_starting = threading.Lock()
"""``threading.stack_size`` is the process's: set, start, restore, one thread at a time."""


def on_large_stack(call: Callable[[], T]) -> T:
    """``call()`` on a new thread with a :data:`COMPILER_STACK` stack: its result, or its
    exception raised here."""
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # noqa: BLE001  # the caller's to handle
            failure.append(exc)

    with _starting:
        previous = threading.stack_size(COMPILER_STACK)
        try:
            thread = threading.Thread(target=run, name="grammar_compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]
