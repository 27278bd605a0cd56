"""Exact stop strings on the host side.

Text that might be the start of a stop string is held back until the next token decides,
so a stop string that spans tokens is found too, and neither it nor anything after it is
ever emitted.
"""

from __future__ import annotations

__all__ = ["StopMatcher"]


class StopMatcher:
    """Feeds decoded text in; gets back the part that is safe to emit."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._pending = ""
        self.matched: str | None = None
        """The stop string that was found (the earliest in the text), once one was."""

    def feed(self, text: str) -> tuple[str, bool]:
        """Return ``(safe_text, stopped)``; once stopped, the caller must not feed more."""
        if not self._stops:
            return text, False
        pending = self._pending + text
        hits = [i for i in (pending.find(stop) for stop in self._stops) if i >= 0]
        if hits:
            self._pending = ""
            at = min(hits)
            self.matched = next(stop for stop in self._stops if pending.find(stop) == at)
            return pending[:at], True
        hold = self._held_suffix(pending)
        self._pending = pending[len(pending) - hold :] if hold else ""
        return pending[: len(pending) - hold], False

    def flush(self) -> str:
        """Text still held back when generation ends for another reason."""
        pending, self._pending = self._pending, ""
        return pending

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
