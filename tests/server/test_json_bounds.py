"""The count of a JSON body's keys, containers and separators (``_json_bounds``) against
the decoded body: exact whatever the strings hold (quotes, escapes, brackets, colons,
commas) and wherever the numpy passes cut the text."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from ortserve_server import _json_bounds


def _counts(value: Any) -> tuple[int, int, int, int]:
    """Keys, containers, separators and nesting depth of a decoded value."""
    if isinstance(value, dict):
        inner = [_counts(item) for item in value.values()]
        return (
            len(value) + sum(c[0] for c in inner),
            1 + sum(c[1] for c in inner),
            max(len(value) - 1, 0) + sum(c[2] for c in inner),
            1 + max((c[3] for c in inner), default=0),
        )
    if isinstance(value, list):
        inner = [_counts(item) for item in value]
        return (
            sum(c[0] for c in inner),
            1 + sum(c[1] for c in inner),
            max(len(value) - 1, 0) + sum(c[2] for c in inner),
            1 + max((c[3] for c in inner), default=0),
        )
    return 0, 0, 0, 0


_TRICKY = ["a", ":", ",", "{", "[", "]", "}", "\\", '"', "é", " ", '\\"', "\\\\"]


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(_TRICKY) for _ in range(rng.randint(0, 10)))


def _value(rng: random.Random, depth: int = 0) -> Any:
    pick = rng.random()
    if depth > 5 or pick < 0.3:
        return rng.choice([1, -2.5, True, None, _text(rng)])
    if pick < 0.65:
        return {_text(rng): _value(rng, depth + 1) for _ in range(rng.randint(0, 5))}
    return [_value(rng, depth + 1) for _ in range(rng.randint(0, 5))]


@pytest.mark.parametrize(("chunk", "bodies"), [(4, 40), (64, 150), (256 * 1024, 300)])  # few where passes are many
def test_counts_match_the_decoded_body(chunk: int, bodies: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_json_bounds, "_CHUNK", chunk)
    rng = random.Random(chunk)
    for _ in range(bodies):
        body = {_text(rng): _value(rng) for _ in range(rng.randint(1, 6))}
        ascii_only = rng.random() < 0.5
        text = json.dumps(body, ensure_ascii=ascii_only).encode()
        shape = _json_bounds._shape(text)
        keys, containers, separators, depth = _counts(body)
        assert (shape.keys, shape.containers, shape.separators) == (keys, containers, separators), text
        assert shape.depth == depth == _json_bounds._nesting(text), text  # the depth alone, counted apart
        # Fields as the text spells them (the 400 quotes the name as sent), their weights and depths.
        fields = {json.dumps(name, ensure_ascii=ascii_only)[1:-1]: _counts(value) for name, value in body.items()}
        weights = {name: sum(c[:3]) for name, c in fields.items()}
        depths = {name: c[3] for name, c in fields.items()}
        if max(weights.values()):
            assert weights[str(shape.heaviest)] == max(weights.values()), text  # of equals, either is right
        else:
            assert shape.heaviest is None, text
        if max(depths.values()):
            assert depths[str(shape.deepest)] == max(depths.values()), text
        else:
            assert shape.deepest is None, text


def test_a_field_name_with_escaped_quotes_is_read_whole() -> None:
    # Longer than a numpy pass: its quotes are carried from one to the next.
    name = 'say \\"hi\\" \\\\' + '\\"' * 200_000
    text = ('{"model": "m", "' + name + '": [' + ",".join(["1"] * 600_000) + "]}").encode()
    assert _json_bounds._past_bounds(text, 50_000, 500_000) == ("about 600000 array items (at most 500000)", name)


def test_one_item_past_the_bound_is_past_it() -> None:
    """The items a body holds are counted from its commas: N items have N - 1 between them,
    so 1,001 items passed a bound of 1,000 (fourteenth probe, issue 45)."""
    for items, past in ((1_000, False), (1_001, True)):
        for text in (
            '{"model": "m", "x": [' + ",".join(["1"] * items) + "]}",
            "[" + ",".join(["1"] * items) + "]",
        ):
            assert (_json_bounds._past_bounds(text.encode(), 50_000, 1_000) is not None) == past, (items, text[:30])
