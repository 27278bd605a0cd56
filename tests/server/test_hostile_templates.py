"""Chat templates (an operator's file, or a GGUF file's) that loop for ever, call themselves
or ask for a range past the sandbox's bound: each request is a 400 that says so, at once,
and the server serves the next one (issue 45)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from ortserve_runtime import ChatTemplate, InvalidRequestError, ModelLoadError
from serving import TINY_MODEL, serving_templates

TEMPLATES = {
    # 10^10 steps, each within the sandbox's 100,000 a range: rendered for ever before.
    "nested-ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
    # RecursionError, then a bare 500 "internal server error".
    "recursive-macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    # The sandbox's OverflowError, a bare 500 too.
    "range-past-the-sandbox": "{% for i in range(1000000) %}{% endfor %}x",
    # The eighth probe: a 2 GB string made and dropped per request (1.4 s), and loops over
    # the messages inside loops over the messages (a body of 100,000 messages: 10^15 steps).
    "center": "{{ messages[0].content|center(2000000000) }}",
    "repeat": "{{ 'x' * 2000000000 }}",
    "format-width": "{{ '{:>2000000000}'.format(messages[0].content) }}",
    "messages-in-messages": (
        "{% for a in messages %}{% for b in messages[1:] %}{% for c in messages %}{% endfor %}{% endfor %}{% endfor %}x"
    ),
    # Tenth session: loops over a copy of the messages went uncounted; '*' widths, '~', '+'
    # and join made values past the bound; a loop writing a bounded value a million times.
    "messages-copied": (
        "{% set ms = messages|list %}{% for a in ms %}{% for b in ms %}{% for c in ms %}{% endfor %}{% endfor %}{% endfor %}"
    ),
    "star-width": "{{ '%*d' % (2000000000, 1) }}",
    "doubling": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "join": "{{ (['x' * 1000000] * 1000)|join }}",
    "writes": "{% for i in range(100000) %}{{ 'x' * 1000000 }}{% endfor %}",
}
SAID = {
    "nested-ranges": "make more than 1000000 steps",
    "recursive-macro": "recursion",
    "range-past-the-sandbox": "Range too big",
    "center": "its center makes a value of 2,000,000,000 items",
    "repeat": "its '*' makes a value of 2,000,000,000 items",
    "format-width": "its str.format makes a value of 2,000,000,000 items",
    "messages-in-messages": "make more than 1000000 steps",
    "messages-copied": "make more than 1000000 steps",
    "star-width": "its '%' makes a value of 2,000,000,000 items",
    "doubling": "its '~' makes a value of 1,048,576 items",
    "join": "its join makes a value of 1,000,000,000 items",
    "writes": "it writes more than 67,108,864 characters",
}
MESSAGES = {name: [{"role": "user", "content": "hi"}] * 200 for name in ("messages-in-messages", "messages-copied")}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serving_templates(tmp_path_factory.mktemp("templates"), TEMPLATES, plain=TINY_MODEL) as base:
        yield base


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_a_template_that_cannot_render_is_a_400_at_once(url: str, name: str) -> None:
    messages = MESSAGES.get(name, [{"role": "user", "content": "hi"}])
    response = httpx.post(
        f"{url}/v1/chat/completions", json={"model": name, "messages": messages, "max_tokens": 2}, timeout=30
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "the chat template could not render" in error["message"], error
    assert SAID[name] in error["message"], error
    plain = httpx.post(f"{url}/v1/chat/completions", json={"model": "plain", "messages": messages[:1], "max_tokens": 2})
    assert plain.status_code == 200


def test_a_template_past_a_megabyte_fails_its_load_naming_the_size(tmp_path: Path) -> None:
    """Eighth probe: a 22 MB template (a GGUF file may carry any) compiled for 128 s at load."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 'x' }}" * 120_000}))
    started = time.perf_counter()
    with pytest.raises(ModelLoadError, match=r"is 1,080,000 characters; a template may have at most 1,048,576"):
        ChatTemplate.from_folder(tmp_path)
    assert time.perf_counter() - started < 1  # refused before compiling


def test_a_template_that_renders_past_its_time_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step bounded is not enough: a million steps of a slow one (``in`` between two
    long strings) take minutes, so a rendering also has a deadline (10 s; 0.3 s here)."""
    monkeypatch.setattr("ortserve_runtime.chat._template._RENDER_SECONDS", 0.3)
    template = ChatTemplate(
        "{% set a = 'a' * 999999 %}{% set b = 'a' * 5000 ~ 'b' %}"
        "{% for i in range(100000) %}{% if b in a %}{% endif %}{% endfor %}",
        special_tokens={},
    )
    started = time.perf_counter()
    with pytest.raises(InvalidRequestError, match=r"it renders for more than 0.3 s"):
        template.render([{"role": "user", "content": "hi"}])
    assert time.perf_counter() - started < 2


def test_real_templates_loop_and_recurse_as_before() -> None:
    """The counting wraps every loop and call: what templates do with them still works."""
    template = ChatTemplate(
        "{% macro show(m) %}<|{{ m.role }}|>{{ m.content }}{% endmacro %}"
        "{% for m in messages %}{{ show(m) }}{% if loop.last %}[{{ loop.length }}]{% endif %}{% endfor %}"
        "{% for x in [[1, [2]], 3] recursive %}{% if x is iterable %}({{ loop(x) }}){% else %}{{ x }}{% endif %}{% endfor %}"
        "{{ '%-3s|%*d' % ('a', 3, 7) }}{{ messages|map(attribute='role')|join(',') }}",
        special_tokens={},
    )
    text = template.render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert text == "<|system|>s<|user|>u[2](1(2))3a  |  7system,user"
