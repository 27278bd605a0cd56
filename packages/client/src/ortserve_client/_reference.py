"""``hf:OWNER/REPO[/PATH]`` model references: what to download and what to serve.

Kept apart from :mod:`._download` (and without its imports, httpx among them) so that
``ortserve serve`` can tell a reference from a local path without paying for them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HubReference"]

_PREFIX = "hf:"

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
"""The parts of a split GGUF file, ``NAME-00001-of-00003.gguf``: the names the runtime
looks for beside the first part (``ortserve_runtime.sources._names.split_parts``)."""


@dataclass(frozen=True, slots=True)
class HubReference:
    """A model on the Hugging Face Hub, as ``hf:OWNER/REPO[/PATH]`` names it.

    ``PATH`` is a folder of the repo (``subfolder``; without one, the whole repo), or, when
    its last part ends in ``.gguf``, one GGUF file (``filename``, inside ``subfolder``):
    then only that file is downloaded, or every part of a split file
    (``NAME-00001-of-00003.gguf`` names parts 1 to 3). ``ortserve serve --model`` and
    :class:`LocalServer` resolve references this way::

        reference = HubReference.parse("hf:acme/tiny-GGUF/tiny-Q4_0.gguf")
        folder = pull(reference.repo_id, subfolder=reference.subfolder, allow_patterns=reference.allow_patterns)
        path = reference.local_path(folder)  # the .gguf file in the snapshot: what to serve
    """

    repo_id: str
    """``OWNER/REPO``."""
    subfolder: str | None = None
    """The folder of the repo to download (or that holds ``filename``); ``None``: the repo's root."""
    filename: str | None = None
    """The GGUF file's name in ``subfolder`` (as given: any part of a split file); ``None`` for a folder."""

    @classmethod
    def parse(cls, source: str | os.PathLike[str]) -> HubReference | None:
        """The reference ``source`` holds, or ``None`` when it is not an ``hf:`` reference
        (a local path, to be served as it is). A malformed reference (no ``OWNER/REPO``, a
        ``..`` part, a split file numbered outside its count) is a ``ValueError``."""
        text = os.fspath(source)
        if not text.startswith(_PREFIX):
            return None
        # A Path made of the text joins parts with "\" on Windows; empty and "." parts go,
        # as a Path would drop them.
        parts = [p for p in text[len(_PREFIX) :].replace("\\", "/").split("/") if p not in ("", ".")]
        if len(parts) < 2 or ".." in parts:
            raise ValueError(f"expected hf:OWNER/REPO[/SUBFOLDER] or hf:OWNER/REPO[/SUBFOLDER]/FILE.gguf, got {text!r}")
        repo_id, rest = "/".join(parts[:2]), parts[2:]
        if not rest or not rest[-1].lower().endswith(".gguf"):
            return cls(repo_id, "/".join(rest) or None)
        filename = rest[-1]
        split = _SPLIT.match(filename)
        if split is not None and not 1 <= int(split["index"]) <= int(split["count"]):
            raise ValueError(f"{text!r}: a split GGUF file's part number must be from 1 to its count")
        return cls(repo_id, "/".join(rest[:-1]) or None, filename)

    @property
    def files(self) -> tuple[str, ...]:
        """The GGUF files to download, relative to ``subfolder``: ``filename``, or every
        part of a split file, the first part first; none for a folder (all of it)."""
        if self.filename is None:
            return ()
        split = _SPLIT.match(self.filename)
        if split is None:
            return (self.filename,)
        count = int(split["count"])
        return tuple(f"{split['stem']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1))

    @property
    def allow_patterns(self) -> list[str] | None:
        """``allow_patterns`` for :func:`pull`: the files (matched literally), or ``None``
        for a folder, which is downloaded whole."""
        return [literal_pattern(name) for name in self.files] or None

    def local_path(self, folder: str | os.PathLike[str]) -> Path:
        """What to serve, given the folder :func:`pull` returned for this reference: that
        folder, or the GGUF file inside it (a split file's first part, the others beside
        it). A file that is not there (a cached snapshot without it, a missing part) is
        a :class:`DownloadError` naming it."""
        folder = Path(folder)
        if self.filename is None:
            return folder
        for name in self.files:
            if not (folder / name).is_file():
                from ._errors import DownloadError

                inside = f"{self.subfolder}/{name}" if self.subfolder else name
                raise DownloadError(
                    f"file {inside!r} of repo {self.repo_id!r} was not downloaded: the repo (or its cached copy) lacks it",
                    repo_id=self.repo_id,
                    filename=inside,
                )
        return folder / self.files[0]

    def __str__(self) -> str:
        return _PREFIX + "/".join(p for p in (self.repo_id, self.subfolder, self.filename) if p)


def literal_pattern(name: str) -> str:
    """``name`` as an fnmatch pattern that matches only itself."""
    return re.sub(r"([*?[])", r"[\1]", name)
