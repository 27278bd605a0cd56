"""Ids of what the server makes (completions, responses, files, batches)."""

from __future__ import annotations

import uuid

__all__ = ["new_id"]


def new_id(prefix: str) -> str:
    """``prefix`` (with its separator, as OpenAI spells each kind: ``chatcmpl-``, ``resp_``,
    ``file-``) and 32 random hex digits."""
    return f"{prefix}{uuid.uuid4().hex}"
