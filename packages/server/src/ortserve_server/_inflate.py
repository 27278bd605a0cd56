"""An HTTP answer's content coding undone a bounded piece at a time, for the readers that
count what they take from hosts they do not control (MCP over HTTP, remote images).

httpx decodes a ``Content-Encoding`` a whole network chunk at a time, before its reader can
count anything: a 32 KB zstd answer became 1 GiB in one step (the event loop held 2.5 s,
+2 GiB). So these readers ask for :data:`ACCEPT_ENCODING` only, read the raw bytes and
inflate them here with zlib's ``max_length``: a bomb grows by :data:`PIECE` bytes at a time
and its reader refuses it at its own bound.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

__all__ = ["ACCEPT_ENCODING", "PIECE", "CodingError", "Inflater"]

ACCEPT_ENCODING = "gzip, deflate"
"""The content codings to ask for: those :class:`Inflater` undoes."""
_ENCODINGS = ("gzip", "x-gzip", "deflate")
PIECE = 64 * 1024
"""The most that one step of inflating makes."""


class CodingError(ValueError):
    """An answer in a content coding not asked for, or not the coding it says."""


class Inflater:
    """One answer's bytes, decoded from its ``Content-Encoding`` (``identity``: as they are)."""

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding.strip().lower() or "identity"
        if self.encoding != "identity" and self.encoding not in _ENCODINGS:
            raise CodingError(f"an answer in the content coding {self.encoding!r} (asked for {ACCEPT_ENCODING})")
        # zlib reads both gzip and deflate, and tells them apart by their header; "deflate"
        # without zlib's header (raw, as many servers send it) is told by its first bytes.
        self._inflater = None if self.encoding == "identity" else zlib.decompressobj(32 + zlib.MAX_WBITS)
        self._head = b"" if self.encoding == "deflate" else None

    def pieces(self, chunk: bytes) -> Iterator[bytes]:
        """``chunk`` decoded, in pieces of at most :data:`PIECE` bytes, each made only when
        the one before was taken (a gzip member's end ends the answer)."""
        if self._inflater is None:
            yield chunk
            return
        if self._head is not None:  # deflate's first two bytes: a zlib header, or raw deflate
            chunk, self._head = self._head + chunk, None
            if len(chunk) < 2:
                self._head = chunk
                return
            method, flags = chunk[0], chunk[1]
            if method & 0x0F != zlib.DEFLATED or (method * 256 + flags) % 31:
                self._inflater = zlib.decompressobj(-zlib.MAX_WBITS)
        try:
            while chunk and not self._inflater.eof:
                piece = self._inflater.decompress(chunk, PIECE)
                chunk = self._inflater.unconsumed_tail
                yield piece
                while len(piece) == PIECE and not chunk:  # all read; more output may wait inside
                    piece = self._inflater.decompress(b"", PIECE)
                    yield piece
        except zlib.error as exc:
            raise CodingError(f"an answer that is not the {self.encoding} it says ({exc})") from None
