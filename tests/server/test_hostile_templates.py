"""Chat templates (an operator's file, or a GGUF file's) that loop for ever, call themselves
or ask for a range past the sandbox's bound: each request is a 400 that says so, at once,
and the server serves the next one (issue 45)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from serving import TINY_MODEL, serving_templates

TEMPLATES = {
    # 10^10 steps, each within the sandbox's 100,000 a range: rendered for ever before.
    "nested-ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
    # RecursionError, then a bare 500 "internal server error".
    "recursive-macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    # The sandbox's OverflowError, a bare 500 too.
    "range-past-the-sandbox": "{% for i in range(1000000) %}{% endfor %}x",
}
SAID = {
    "nested-ranges": "ranges make more than 1000000 steps",
    "recursive-macro": "recursion",
    "range-past-the-sandbox": "Range too big",
}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serving_templates(tmp_path_factory.mktemp("templates"), TEMPLATES, plain=TINY_MODEL) as base:
        yield base


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_a_template_that_cannot_render_is_a_400_at_once(url: str, name: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    response = httpx.post(
        f"{url}/v1/chat/completions", json={"model": name, "messages": messages, "max_tokens": 2}, timeout=30
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "the chat template could not render" in error["message"], error
    assert SAID[name] in error["message"], error
    plain = httpx.post(f"{url}/v1/chat/completions", json={"model": "plain", "messages": messages, "max_tokens": 2})
    assert plain.status_code == 200
