"""Reasoning models through the openai SDK on a real server: thinking as
``reasoning_content``/``reasoning`` (whole and streamed), ``chat_template_kwargs`` and
grammars that hold for the answer only. The fixture's template opens ``<think>`` in the
generation prompt, so the random model's output is reasoning until it closes the block
(it never does by itself): thinking off is how a test gets an answer."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import anthropic
import httpx
import openai
import pytest
from ortserve_runtime import ModelConfig
from ortserve_server import ServerConfig, create_app
from serving import TINY_MODEL, running

THINK_MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-qwen3-think"
PROMPT = "Tell me about the iterable in sorted order"
HELLO = [{"role": "user", "content": PROMPT}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    config = ServerConfig(
        models={"think": THINK_MODEL, "tiny": TINY_MODEL},
        model_config=ModelConfig(max_batch_size=4, max_sequence_length=512),
    )
    with running(create_app(config)) as url, openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as c:
        yield c


def test_thinking_is_reasoning_not_content(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="think", messages=HELLO, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    message = reply.choices[0].message
    extra = message.model_extra or {}
    assert extra["reasoning_content"] and extra["reasoning"] == extra["reasoning_content"]
    assert message.content == ""
    assert reply.choices[0].finish_reason == "length"
    # The random model never closes its think block: every token is reasoning.
    assert reply.usage is not None and reply.usage.completion_tokens_details is not None
    assert reply.usage.completion_tokens_details.reasoning_tokens == reply.usage.completion_tokens == 12


def test_streamed_reasoning_equals_whole(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="think", messages=HELLO, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    thought, content, both = "", "", True
    for chunk in client.chat.completions.create(
        model="think",
        messages=HELLO,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
        stream=True,
    ):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            if "reasoning_content" in extra:
                thought += extra["reasoning_content"]
                both = both and extra.get("reasoning") == extra["reasoning_content"]
            content += choice.delta.content or ""
    assert both and thought == (whole.choices[0].message.model_extra or {})["reasoning_content"]
    assert content == ""


def test_thinking_off_through_chat_template_kwargs(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="think",
        messages=HELLO,  # type: ignore[arg-type]
        max_tokens=6,
        temperature=0,
        extra_body=OFF,
    )
    message = reply.choices[0].message
    assert message.content and "reasoning_content" not in (message.model_extra or {})
    usage_on = client.chat.completions.create(model="think", messages=HELLO, max_tokens=1).usage  # type: ignore[arg-type]
    assert reply.usage is not None and usage_on is not None
    # The template rendered the empty "<think>\n\n</think>\n\n" block instead of "<think>\n".
    assert reply.usage.prompt_tokens > usage_on.prompt_tokens


def test_tokenize_takes_chat_template_kwargs(client: openai.OpenAI) -> None:
    """/v1/tokenize makes the prompt a chat with the same ``chat_template_kwargs`` makes;
    with a prompt instead of messages they are a 400 naming them, not ignored."""
    url = str(client.base_url).removesuffix("/v1/")
    chat = client.chat.completions.create(model="think", messages=HELLO, max_tokens=1, extra_body=OFF)  # type: ignore[arg-type]
    body: dict[str, Any] = {"model": "think", "messages": HELLO}
    off = httpx.post(f"{url}/v1/tokenize", json={**body, **OFF}, timeout=30).json()
    on = httpx.post(f"{url}/v1/tokenize", json=body, timeout=30).json()
    assert chat.usage is not None and off["count"] == chat.usage.prompt_tokens > on["count"]
    for extra, param in ((OFF, "chat_template_kwargs"), ({"add_generation_prompt": False}, "add_generation_prompt")):
        refused = httpx.post(f"{url}/v1/tokenize", json={"model": "think", "prompt": "hi", **extra}, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param


def test_regex_holds_for_the_answer_when_thinking_is_off(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="think",
        messages=HELLO,  # type: ignore[arg-type]
        max_tokens=20,
        extra_body={**OFF, "guided_regex": "[0-9]{3}"},
    )
    assert re.fullmatch("[0-9]{3}", reply.choices[0].message.content or "")


def test_regex_leaves_the_reasoning_free(client: openai.OpenAI) -> None:
    # Thinking on: the block is open, so the constraint waits for "</think>"; the random
    # model never writes it, so its (unconstrained) text stays reasoning to max_tokens.
    reply = client.chat.completions.create(
        model="think",
        messages=HELLO,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
        extra_body={"guided_regex": "[0-9]{3}"},
    )
    free = client.chat.completions.create(model="think", messages=HELLO, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    thought = (reply.choices[0].message.model_extra or {})["reasoning_content"]
    assert thought == (free.choices[0].message.model_extra or {})["reasoning_content"]
    assert not re.fullmatch("[0-9]*", thought)


def test_reasoning_effort_and_earlier_reasoning_are_accepted(client: openai.OpenAI) -> None:
    history = [
        *HELLO,
        {"role": "assistant", "content": "yes", "reasoning_content": "thought"},
        {"role": "user", "content": "more"},
    ]
    reply = client.chat.completions.create(
        model="think",
        messages=history,  # type: ignore[arg-type]
        max_tokens=3,
        reasoning_effort="low",
    )
    assert reply.choices[0].finish_reason == "length"


def test_a_reasoning_budget_closes_the_think_block(client: openai.OpenAI) -> None:
    """``reasoning_budget`` (and ``reasoning_effort`` for a template that does not read it)
    bound the thinking: after that many tokens the think block's end is forced and the
    answer follows. The random model never closes it itself: before, the effort was taken
    and ignored (fourteenth probe, issue 45)."""

    def chat(**extra: Any) -> Any:
        return client.chat.completions.create(
            model="think",
            messages=HELLO,  # type: ignore[arg-type]
            max_tokens=16,
            temperature=0,
            **extra,
        )

    free = chat()
    free_thought = (free.choices[0].message.model_extra or {})["reasoning_content"]
    assert free.choices[0].message.content in (None, "") and free.usage is not None
    bounded = chat(extra_body={"reasoning_budget": 4})
    thought = (bounded.choices[0].message.model_extra or {})["reasoning_content"]
    assert thought and free_thought.startswith(thought) and len(thought) < len(free_thought)
    assert bounded.choices[0].message.content  # the answer after the forced end
    # "none" is the template's own switch where it has one (Qwen3's enable_thinking).
    none = chat(reasoning_effort="none")
    off = chat(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert none.choices[0].message.content == off.choices[0].message.content
    assert none.usage is not None and off.usage is not None and none.usage.prompt_tokens == off.usage.prompt_tokens
    zero = chat(extra_body={"reasoning_budget": 0})  # the block closed at once instead
    assert (zero.choices[0].message.model_extra or {}).get("reasoning_content") in (None, "")
    assert zero.choices[0].message.content
    low = chat(reasoning_effort="low")  # 1,024 tokens: not reached in 16
    assert (low.choices[0].message.model_extra or {})["reasoning_content"] == free_thought
    for extra, param in (
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"extra_body": {"reasoning_budget": -1}}, "reasoning_budget"),
        # Checked beside a budget too (sixteenth probe: "bogus" went to the template).
        ({"reasoning_effort": "bogus", "extra_body": {"reasoning_budget": 5}}, "reasoning_effort"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            chat(**extra)
        assert refused.value.body["param"] == param  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as other:
        client.chat.completions.create(
            model="tiny",
            messages=HELLO,
            max_tokens=2,
            extra_body={"reasoning_budget": 4},  # type: ignore[arg-type]
        )
    assert other.value.body["param"] == "reasoning_budget"  # type: ignore[index]


def test_reasoning_settings_that_disagree_or_do_nothing_are_a_400(client: openai.OpenAI) -> None:
    """Seventeenth probe, issue 45: ``reasoning_effort`` lost without a word to
    ``chat_template_kwargs`` (its value went in only where the kwargs had none), and a
    ``reasoning_budget`` with thinking turned off was taken and ignored. Each is a 400
    naming the field; settings that agree are taken."""
    for extra, param in (
        ({"reasoning_effort": "high", **OFF}, "reasoning_effort"),
        ({"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "none"}}, "reasoning_effort"),
        ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}, "reasoning_effort"),
        ({"reasoning_effort": "none", "reasoning_budget": 50}, "reasoning_budget"),
        ({"reasoning_budget": 50, **OFF}, "reasoning_budget"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="think", messages=HELLO, max_tokens=2, extra_body=extra)  # type: ignore[arg-type]
        assert refused.value.body["param"] == param, extra  # type: ignore[index]
    for extra in (
        {"reasoning_effort": "none", **OFF},
        {"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": True, "reasoning_effort": "low"}},
        {"reasoning_effort": "none", "reasoning_budget": 0},  # a budget of none agrees (nineteenth probe)
        {"reasoning_budget": 0, **OFF},
    ):
        reply = client.chat.completions.create(model="think", messages=HELLO, max_tokens=2, extra_body=extra)  # type: ignore[arg-type]
        assert reply.choices[0].finish_reason == "length"


def test_reasoning_effort_for_a_model_that_does_not_reason_is_a_400(client: openai.OpenAI) -> None:
    """Seventh probe of issue 45: chat took ``reasoning_effort`` for a model without thinking
    markup (whose template does not read it) and ignored it; the Responses API refused the
    same ``reasoning.effort``. Both refuse it now, naming it."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2, reasoning_effort="high")  # type: ignore[arg-type]
    assert refused.value.status_code == 400
    body = cast("dict[str, Any]", refused.value.body)
    assert body["param"] == "reasoning_effort" and "not a reasoning model" in body["message"]


def test_a_model_without_thinking_markup_has_no_reasoning_fields(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4)  # type: ignore[arg-type]
    assert "reasoning_content" not in (reply.choices[0].message.model_extra or {})
    assert reply.usage is not None and reply.usage.completion_tokens_details is None


# -- the Responses API ----------------------------------------------------------------------


def _reasoning(response: Any) -> Any:
    first = response.output[0]
    assert first.type == "reasoning" and first.id.startswith("rs_")
    return first


def test_responses_thinking_is_a_reasoning_item(client: openai.OpenAI) -> None:
    response = client.responses.create(model="think", input=PROMPT, max_output_tokens=12, temperature=0)
    item = _reasoning(response)
    [part] = item.content or []
    assert part.type == "reasoning_text" and part.text and item.summary == []
    # The block never closes: the answer is one empty message, both cut short.
    assert item.status == "incomplete" and response.status == "incomplete"
    [message] = response.output[1:]
    assert message.type == "message" and response.output_text == ""
    usage = response.usage
    assert usage is not None and usage.output_tokens == 12
    assert usage.output_tokens_details.reasoning_tokens == 12  # every token was in the block
    chat = client.chat.completions.create(model="think", messages=HELLO, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    assert part.text == (chat.choices[0].message.model_extra or {})["reasoning_content"]


def test_responses_streamed_reasoning_equals_whole(client: openai.OpenAI) -> None:
    whole = client.responses.create(model="think", input=PROMPT, max_output_tokens=12, temperature=0)
    with client.responses.stream(model="think", input=PROMPT, max_output_tokens=12, temperature=0) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"  # cut by max_output_tokens (not "completed")
    final = events[-1].response
    kinds = [event.type for event in events]
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert deltas == done.text == _reasoning(whole).content[0].text == _reasoning(final).content[0].text
    # The reasoning item opens first and closes before the message opens.
    assert kinds.index("response.output_item.added") < kinds.index("response.reasoning_text.delta")
    opened = [i for i, kind in enumerate(kinds) if kind == "response.output_item.added"]
    assert kinds.index("response.output_item.done") < opened[1]
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["reasoning", "message"] and [e.output_index for e in added] == [0, 1]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.usage is not None and final.usage.output_tokens_details.reasoning_tokens == 12


def test_responses_summary_and_effort(client: openai.OpenAI) -> None:
    asked = {"effort": "low", "summary": "auto"}
    response = client.responses.create(
        model="think",
        input=PROMPT,
        max_output_tokens=6,
        temperature=0,
        reasoning=asked,  # type: ignore[arg-type]
    )
    item = _reasoning(response)
    assert [s.text for s in item.summary] == [item.content[0].text]
    assert response.reasoning is not None and response.reasoning.effort == "low"
    with client.responses.stream(
        model="think",
        input=PROMPT,
        max_output_tokens=6,
        temperature=0,
        reasoning=asked,  # type: ignore[arg-type]
    ) as stream:
        events = list(stream)
    summary = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
    assert summary == item.summary[0].text
    kinds = {event.type for event in events}
    assert {"response.reasoning_summary_part.added", "response.reasoning_summary_part.done"} <= kinds
    with pytest.raises(openai.BadRequestError) as refused:  # a model that does not reason
        client.responses.create(model="tiny", input=PROMPT, max_output_tokens=2, reasoning={"effort": "low"})
    assert refused.value.body["param"] == "reasoning.effort"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bogus:  # named as this API's field (sixteenth probe)
        client.responses.create(
            model="think",
            input=PROMPT,
            max_output_tokens=2,
            reasoning={"effort": "bogus"},  # type: ignore[typeddict-item]
        )
    assert bogus.value.body["param"] == "reasoning.effort"  # type: ignore[index]


def test_responses_reasoning_items_go_back_as_input(client: openai.OpenAI) -> None:
    first = client.responses.create(model="think", input=PROMPT, max_output_tokens=4, temperature=0, store=True)
    follow = client.responses.create(
        model="think", input="more", previous_response_id=first.id, max_output_tokens=2, temperature=0
    )
    assert follow.status == "incomplete"
    # Handed back by the client, as a stateless agent does: the item is accepted as input.
    items: list[Any] = [
        {"role": "user", "content": PROMPT},
        _reasoning(first).model_dump(exclude_none=True),
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1, "b": 2}'},
        {"type": "function_call_output", "call_id": "c1", "output": "3"},
    ]
    again = client.responses.create(model="think", input=items, max_output_tokens=2, temperature=0)
    assert again.status == "incomplete"
    # The template keeps the thinking of the turn in progress: the prompt is longer with it.
    without = client.responses.create(model="think", input=items[:1] + items[2:], max_output_tokens=1)
    assert again.usage is not None and without.usage is not None
    assert again.usage.input_tokens > without.usage.input_tokens


def test_responses_without_reasoning_have_no_reasoning_item(client: openai.OpenAI) -> None:
    response = client.responses.create(model="tiny", input=PROMPT, max_output_tokens=3)
    assert [item.type for item in response.output] == ["message"]
    assert response.usage is not None and response.usage.output_tokens_details.reasoning_tokens == 0


# -- the Anthropic Messages API -------------------------------------------------------------

THINK: Any = {"type": "enabled", "budget_tokens": 1024}
GREEDY = {"temperature": 0}  # the SDK's methods no longer take it (newer Claude models refuse it)
ASK: Any = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def claude(client: openai.OpenAI) -> Iterator[anthropic.Anthropic]:
    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    with anthropic.Anthropic(base_url=base, api_key="x", max_retries=0) as c:
        yield c


def test_anthropic_thinking_is_a_thinking_block(claude: anthropic.Anthropic, client: openai.OpenAI) -> None:
    message = claude.messages.create(model="think", messages=ASK, max_tokens=12, extra_body=GREEDY, thinking=THINK)
    [block] = message.content  # the block never closes: no text block after it
    assert block.type == "thinking" and block.thinking and block.signature == ""
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 12
    chat = client.chat.completions.create(model="think", messages=HELLO, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    assert block.thinking == (chat.choices[0].message.model_extra or {})["reasoning_content"]


def test_anthropic_streamed_thinking_equals_whole(claude: anthropic.Anthropic) -> None:
    whole = claude.messages.create(model="think", messages=ASK, max_tokens=12, extra_body=GREEDY, thinking=THINK)
    with claude.messages.stream(
        model="think", messages=ASK, max_tokens=12, extra_body=GREEDY, thinking=THINK
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = "".join(
        e.delta.thinking for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
    )
    starts = [e for e in events if e.type == "content_block_start"]
    assert [e.content_block.type for e in starts] == ["thinking"] and starts[0].index == 0
    assert [e.index for e in events if e.type == "content_block_stop"] == [0]
    assert deltas == whole.content[0].thinking == final.content[0].thinking  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens"


def test_anthropic_budget_tokens_bound_the_thinking(claude: anthropic.Anthropic) -> None:
    """``thinking.budget_tokens``: a thinking block of at most that many tokens, then the
    text block (the random model never ends its thinking itself)."""
    message = claude.messages.create(
        model="think",
        messages=ASK,
        max_tokens=16,
        extra_body=GREEDY,
        thinking={"type": "enabled", "budget_tokens": 4},
    )
    assert [block.type for block in message.content] == ["thinking", "text"]
    free = claude.messages.create(model="think", messages=ASK, max_tokens=16, extra_body=GREEDY, thinking=THINK)
    assert free.content[0].thinking.startswith(message.content[0].thinking)  # type: ignore[union-attr]


def test_anthropic_thinking_off_unless_asked(claude: anthropic.Anthropic) -> None:
    # Anthropic's default: no thinking. The template closes the block, so all is answer.
    for thinking in (anthropic.NOT_GIVEN, {"type": "disabled"}):
        message = claude.messages.create(
            model="think", messages=ASK, max_tokens=4, extra_body=GREEDY, thinking=thinking
        )  # type: ignore[arg-type]
        assert [block.type for block in message.content] == ["text"]
    on = claude.messages.count_tokens(model="think", messages=ASK, thinking=THINK).input_tokens
    off = claude.messages.count_tokens(model="think", messages=ASK).input_tokens
    assert off > on  # "<think>\n\n</think>\n\n" rendered instead of "<think>\n"


def test_anthropic_thinking_refused_for_other_models_and_checked(claude: anthropic.Anthropic) -> None:
    for model, thinking, param in (
        ("tiny", THINK, "thinking"),
        ("think", {"type": "enabled"}, "thinking.budget_tokens"),
        ("think", {"type": "sometimes"}, "thinking.type"),
        # A budget that would do nothing (sixteenth probe: taken and ignored).
        ("think", {"type": "adaptive", "budget_tokens": 2}, "thinking.budget_tokens"),
        ("think", {"type": "disabled", "budget_tokens": 5}, "thinking.budget_tokens"),
    ):
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude.messages.create(model=model, messages=ASK, max_tokens=2, thinking=thinking)
        assert refused.value.body["error"]["message"].startswith(param)  # type: ignore[index]


def test_anthropic_earlier_thinking_reaches_the_template(claude: anthropic.Anthropic) -> None:
    call: Any = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1, "b": 2}}
    result: Any = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "3"}
    thought: Any = {"type": "thinking", "thinking": "I should add them.", "signature": ""}

    def count(blocks: list[Any]) -> int:
        history = [*ASK, {"role": "assistant", "content": blocks}, {"role": "user", "content": [result]}]
        return claude.messages.count_tokens(model="think", messages=history, thinking=THINK).input_tokens

    # Qwen3's template keeps the thinking of the turn in progress (a tool loop).
    assert count([thought, call]) > count([call])


def test_the_model_list_says_which_models_reason(client: openai.OpenAI) -> None:
    models = {m.id: (m.model_extra or {}) for m in client.models.list()}
    assert models["think"]["reasoning"] is True
    assert models["tiny"]["reasoning"] is False
