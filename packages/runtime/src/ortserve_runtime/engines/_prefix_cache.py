"""Prefix cache of the ``ort-cpu`` engine: key/value rows of earlier prompts, kept so that a
prompt sharing their beginning prefills only the rest.

A chat resends its whole history every turn and an agent loop its whole context every
step; requests often share one system prompt. When a prompt has gone into the cache (at
the end of its prefill), a copy of its key/value row is kept here with its token ids. A
new request takes the entry with the longest common token prefix, copies that much into
its own row and prefills only the rest; a full hit still recomputes the last prompt token
(its logits are needed), and with ``even_calls`` the last two (a reproducible engine never
prefills a single row).

By default a finished reply's rows are kept as decode steps wrote them, so that a chat's
next turn finds its whole history here. With ``reproducible`` on, only prompt rows are
kept, never a reply's: a reply's key/values were written by decode steps, which
onnxruntime computes with other kernels than a prefill (one query row), so they differ in
the last bits from what a cold prefill of the same tokens gives; the engine prefills the
reply again while idle and keeps that. Copied rows are then bit for bit what a prefill of
the same tokens computes, and a request's tokens and logprobs do not depend on what the
cache holds (see ``_ort_cpu``).

Entries are separate arrays sized to their tokens, so the budget (tokens held) is exactly
the memory held and an evicted entry frees it at once; the least recently used go first.
An entry that is a prefix of a newer one is dropped (the newer covers it). Where key/values
also depend on how the call was made (LongRoPE: short or long rotary factors by the call's
width), entries carry a group and are reused only within it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

__all__ = ["CacheEntry", "PrefixCache"]

Rows = list[tuple[npt.NDArray[np.generic], npt.NDArray[np.generic]]]
"""Per layer, keys and values of one sequence: ``(kv_heads, tokens, head_size)`` each."""

_clock = itertools.count()


@dataclass(eq=False)
class CacheEntry:
    tokens: npt.NDArray[np.int64]
    rows: Rows
    group: str = ""
    used: int = field(default_factory=lambda: next(_clock))


class PrefixCache:
    """Entries up to ``budget_tokens`` tokens in all; hits of at least ``min_tokens``."""

    def __init__(self, budget_tokens: int, min_tokens: int, bytes_per_token: int, *, even_calls: bool) -> None:
        self.budget_tokens = budget_tokens
        self.even_calls = even_calls
        """Leave an even number of tokens to prefill, two at least (see :meth:`lookup`)."""
        self.min_tokens = max(1, min_tokens)
        self.bytes_per_token = bytes_per_token
        self._entries: list[CacheEntry] = []
        self.hits = 0
        self.hit_tokens = 0
        self.misses = 0
        self.evictions = 0

    @property
    def held_tokens(self) -> int:
        return sum(len(e.tokens) for e in self._entries)

    @property
    def held_bytes(self) -> int:
        return self.held_tokens * self.bytes_per_token

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: Sequence[int], group: str = "", *, count: bool = True) -> tuple[CacheEntry | None, int]:
        """The entry of ``group`` sharing the longest prefix with ``prompt`` and how many of
        its tokens to reuse; ``(None, 0)`` below ``min_tokens``. One token at least is left
        to prefill (its logits are needed); with ``even_calls`` an even number, two at least:
        the reproducible engine prefills in calls of an even number of rows (see
        ``_ort_cpu._even_call``), and a reused token is not computed again only to make a
        call even."""
        if not self._entries or len(prompt) <= self.min_tokens:
            self.misses += count and self.budget_tokens > 0
            return None, 0
        ids = np.asarray(prompt, dtype=np.int64)
        best, best_length = None, 0
        for entry in self._entries:
            if entry.group != group:
                continue
            length = _common_prefix(entry.tokens, ids)
            if length > best_length:
                best, best_length = entry, length
        if self.even_calls:
            usable = min(best_length, len(prompt) - 2)
            usable -= (len(prompt) - usable) % 2
        else:
            usable = min(best_length, len(prompt) - 1)
        if best is None or usable < self.min_tokens:
            self.misses += count
            return None, 0
        best.used = next(_clock)
        self.hits += count
        self.hit_tokens += usable * count
        return best, usable

    def store(self, tokens: Sequence[int], copy_rows: Callable[[int], Rows], group: str = "") -> CacheEntry | None:
        """Keep the first ``len(tokens)`` positions of a row, in ``group``; ``copy_rows(n)``
        copies them. Returns the entry whose first ``len(tokens)`` positions hold them: the
        new one, or one that held them already as part of a longer entry (nothing copied);
        ``None`` when they are too short or too long to keep."""
        count = len(tokens)
        if count < self.min_tokens or count > self.budget_tokens:
            return None
        ids = np.asarray(tokens, dtype=np.int64)
        for entry in self._entries:
            if entry.group == group and len(entry.tokens) >= count and _common_prefix(entry.tokens, ids) == count:
                entry.used = next(_clock)  # already held, as part of a longer entry
                return entry
        self._entries = [e for e in self._entries if e.group != group or _common_prefix(e.tokens, ids) < len(e.tokens)]
        while self._entries and self.held_tokens + count > self.budget_tokens:
            self._entries.remove(min(self._entries, key=lambda e: e.used))
            self.evictions += 1
        entry = CacheEntry(ids, copy_rows(count), group)
        self._entries.append(entry)
        return entry

    def clear(self) -> None:
        self._entries.clear()


def _common_prefix(a: npt.NDArray[np.int64], b: npt.NDArray[np.int64]) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
