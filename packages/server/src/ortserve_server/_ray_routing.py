"""What the Ray Serve ingress reads of a request to pick a replica, and how it merges
the replicas' metrics: plain functions, without Ray, so they are tested without it
(:mod:`ortserve_server.ray` uses them)."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

__all__ = ["affinity_key", "merge_metrics", "response_owner"]


def affinity_key(path: str, body: bytes, prefix_chars: int) -> str | None:
    """The key that keeps a conversation on one replica, or ``None`` (no preference).

    It is the model name and the conversation's opening, rendered as text: the system
    prompt (or instructions) and messages up to and including the first user message, at
    most ``prefix_chars`` characters. Every later turn of a chat repeats that opening, so
    all its turns land where its prefix is cached; two chats that share only a long
    system prompt also share a key once it fills ``prefix_chars``.
    """
    endpoint = path.rstrip("/").rsplit("/", 2)
    if len(endpoint) < 2 or not body:
        return None
    name = "/".join(endpoint[-2:]) if endpoint[-2] == "chat" else endpoint[-1]
    if name not in ("chat/completions", "completions", "responses", "messages"):
        return None
    try:
        request = json.loads(body)
        return _affinity(name, request, prefix_chars) if isinstance(request, dict) else None
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None  # the replica answers the error (a body nested too deeply, too)


def _affinity(name: str, request: dict[str, Any], prefix_chars: int) -> str | None:
    parts: list[str] = []
    if name == "completions":
        prompt = request.get("prompt")
        parts.append(_text(prompt[0] if isinstance(prompt, list) and prompt else prompt))
    else:
        parts.append(_text(request.get("system")) + _text(request.get("instructions")))
        turns = request.get("messages") if name != "responses" else request.get("input")
        for turn in turns if isinstance(turns, list) else [turns]:
            role = turn.get("role", "") if isinstance(turn, dict) else "user"
            parts.append(f"{role}:{_text(turn)}")
            if role == "user" or sum(map(len, parts)) >= prefix_chars:
                break
    opening = "\n".join(parts)[:prefix_chars]
    if not opening.strip():
        return None
    return hashlib.blake2b(f"{request.get('model')}\0{opening}".encode(), digest_size=16).hexdigest()


_RESPONSE_ID = re.compile(r"resp_([a-z0-9]+)-[0-9a-f]{32}")


def response_owner(method: str, path: str, body: bytes) -> str | None:
    """The replica that made the stored response a request names, from the id's tag
    (each replica tags its ids with its own id: ``resp_<replica>-<hex>``), or ``None``.

    Stored responses live in the replica that made them, so a follow-up turn
    (``POST /responses`` with ``previous_response_id``) and ``GET``/``DELETE
    /responses/{id}`` must reach that replica; elsewhere they would be a 404.
    """
    segments = path.rstrip("/").split("/")
    if "responses" not in segments:
        return None
    after = segments[segments.index("responses") + 1 :]
    if method == "POST" and not after:
        try:
            request = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return None
        named = request.get("previous_response_id") if isinstance(request, dict) else None
    else:
        named = after[0] if after else None
    match = _RESPONSE_ID.fullmatch(named) if isinstance(named, str) else None
    return match.group(1) if match else None


def _text(value: Any) -> str:
    """The text of a message, its content, or a content part list (images and audio
    count for nothing: the prefix they share is the text around them)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(_text(item) for item in value)
    if isinstance(value, dict):
        if isinstance(value.get("text"), str):
            return str(value["text"])
        return _text(value.get("content"))
    return ""


def merge_metrics(texts: dict[str, str]) -> bytes:
    """One exposition from several, every sample labelled with the replica it came from."""
    from prometheus_client.exposition import generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.samples import Sample

    families: dict[str, Metric] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            merged.samples += [
                Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
                for s in family.samples
            ]

    class _Merged:
        def collect(self) -> list[Metric]:
            return list(families.values())

    return generate_latest(_Merged())  # type: ignore[arg-type,unused-ignore]  # a duck-typed collector
