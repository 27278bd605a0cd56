"""Reasoning models: the think-block splitter on token streams, and grammars that leave
the reasoning free (checked with the real llguidance matcher)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ortserve_runtime import ChatTemplate, Grammar, InvalidRequestError, ReasoningMarkers, ReasoningParser
from ortserve_runtime.chat._constraints import GrammarCompiler
from ortserve_runtime.chat._reasoning import detect_reasoning, reasoning_start

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-qwen3-think"
MARKERS = ReasoningMarkers()


def split(pieces: list[str], start: str) -> tuple[str, str]:
    parser = ReasoningParser(MARKERS, start)  # type: ignore[arg-type]
    thought, answer = "", ""
    for piece in pieces:
        t, a = parser.feed(piece)
        thought, answer = thought + t, answer + a
    t, a = parser.finish()
    return thought + t, answer + a


def every_split(text: str) -> list[list[str]]:
    """``text`` whole, in single characters, and cut once at every position."""
    return [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]


@pytest.mark.parametrize(
    ("text", "start", "expected"),
    [
        ("<think>\nLet me see.\n</think>\n\nThe answer.", "opens", ("Let me see.", "The answer.")),
        ("Let me see.\n</think>\n\nThe answer.", "open", ("Let me see.", "The answer.")),
        ("The answer, no thinking.", "opens", ("", "The answer, no thinking.")),
        ("  <think>x</think>y <think>z</think>", "opens", ("x", "y <think>z</think>")),
        ("<think>\ncut short by max_", "opens", ("cut short by max_", "")),
        ("a < b and </thin", "open", ("a < b and </thin", "")),
        ("<thi", "opens", ("", "<thi")),
        ("\n\n</think>\n\n", "open", ("", "")),
    ],
)
def test_splitter_on_every_token_boundary(text: str, start: str, expected: tuple[str, str]) -> None:
    for pieces in every_split(text):
        assert split(pieces, start) == expected, pieces


def test_splitter_holds_back_only_what_may_be_a_marker() -> None:
    parser = ReasoningParser(MARKERS, "open")
    assert parser.feed("step one </") == ("step one", "")  # "</" may open "</think>"
    assert parser.feed("b> two") == (" </b> two", "")
    assert parser.feed("</think>") == ("", "")
    assert parser.reasoning_done
    assert parser.feed("\n\nDone") == ("", "Done")


def test_template_detection_and_where_the_output_starts() -> None:
    template = ChatTemplate.from_folder(FIXTURE)
    assert template is not None
    markers = detect_reasoning(template.source)
    assert markers == MARKERS
    messages = [{"role": "user", "content": "hi"}]
    assert reasoning_start(markers, template.render(messages)) == "open"
    off = template.render(messages, extra={"enable_thinking": False})
    assert off.endswith("<think>\n\n</think>\n\n")
    assert reasoning_start(markers, off) is None
    assert reasoning_start(markers, "<|im_start|>assistant\n") == "opens"
    assert detect_reasoning("{{ messages }}") is None


def test_extra_template_variables_never_replace_the_messages() -> None:
    """Nor are they dropped without a word (sixteenth probe): a 400 naming the variable."""
    template = ChatTemplate.from_folder(FIXTURE)
    assert template is not None
    for name, value in (("messages", []), ("add_generation_prompt", False), ("tools", "x")):
        with pytest.raises(InvalidRequestError, match=f"may not set {name!r}") as refused:
            template.render([{"role": "user", "content": "hi"}], extra={name: value})
        assert refused.value.param == "chat_template_kwargs"
    text = template.render([{"role": "user", "content": "hi"}], extra={"enable_thinking": True})
    assert "hi" in text and text.endswith("<think>\n")


def test_earlier_reasoning_is_rendered_as_qwen3_does() -> None:
    template = ChatTemplate.from_folder(FIXTURE)
    assert template is not None
    turn = {"role": "assistant", "content": "yes", "reasoning_content": "thought about it"}
    last = template.render([{"role": "user", "content": "q"}, turn], add_generation_prompt=False)
    assert "<think>\nthought about it\n</think>\n\nyes" in last
    earlier = template.render([{"role": "user", "content": "q"}, turn, {"role": "user", "content": "and?"}])
    assert "thought about it" not in earlier  # dropped before the last user turn, as Qwen3 does


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(FIXTURE / "tokenizer.json", 1024, frozenset({1021}))


def accepts(compiler: GrammarCompiler, grammar: Grammar, text: str) -> bool:
    from tokenizers import Tokenizer

    constraint = compiler.constraint(grammar)
    tokenizer = Tokenizer.from_file(str(FIXTURE / "tokenizer.json"))
    for token in tokenizer.encode(text, add_special_tokens=False).ids:
        constraint.advance(token)
    matcher = constraint._matcher
    return bool(matcher.is_accepting() and not matcher.is_error())


@pytest.mark.parametrize(
    ("grammar", "answer"),
    [
        (Grammar("regex", "[0-9]+"), "42"),
        (
            Grammar("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}}),
            '{"a":1}',
        ),  # compact: JSON whitespace is strict here
        (Grammar("lark", 'start: "yes" | "no"'), "no"),
    ],
)
def test_grammar_constrains_only_the_answer(compiler: GrammarCompiler, grammar: Grammar, answer: str) -> None:
    opens = Grammar(grammar.kind, grammar.source, after_reasoning=(MARKERS, "opens"))
    is_open = Grammar(grammar.kind, grammar.source, after_reasoning=(MARKERS, "open"))
    thought = "free text: { not json } 7 < 8, </thin"
    assert accepts(compiler, opens, f"<think>\n{thought}\n</think>\n\n{answer}")
    assert accepts(compiler, is_open, f"{thought}</think>{answer}")
    assert accepts(compiler, grammar, answer)
    assert not accepts(compiler, opens, answer)  # the think block comes first
    assert not accepts(compiler, is_open, f"{thought}</think>\n\n{answer}!")  # the answer still obeys


def test_a_grammar_asked_for_again_is_copied_in_its_first_state() -> None:
    """A model keeps its last compiled grammars (an agent sends the same tools every turn;
    building a lexer took 0.5 s for 40 tools with large enums): the next request asking for
    one gets a copy, in its first state whatever the earlier copies consumed, with the same
    masks as a grammar compiled afresh."""
    import numpy as np

    compiler = GrammarCompiler(FIXTURE / "tokenizer.json", 1024, frozenset({1021}))
    schema = Grammar("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    first = compiler.constraint(schema)
    assert compiler.reused == 0
    forced = first._matcher.compute_ff_tokens()  # '{"a":', which the grammar forces
    assert forced
    for token in forced:
        first.advance(token)
    second = compiler.constraint(schema)
    assert compiler.reused == 1
    fresh = GrammarCompiler(FIXTURE / "tokenizer.json", 1024, frozenset({1021})).constraint(schema)
    logits = np.zeros((1, 1024), dtype=np.float32)
    assert np.array_equal(second.mask(logits), fresh.mask(logits))
    assert accepts(compiler, schema, '{"a":7}') and compiler.reused == 2
    assert not accepts(compiler, schema, "7")
    assert compiler.reused == 3
    compiler.constraint(Grammar("regex", "[0-9]+"))  # another grammar: compiled, not copied
    assert compiler.reused == 3


def test_a_tokenizer_llguidance_refuses_is_tried_once_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose ONNX vocabulary is smaller than its tokenizer's cannot take grammars:
    its requests with one are refused naming the grammar's field (a 400, not a 500), and the
    refused build (0.3 s of the GIL for 49K tokens) is not tried again at each request
    (eighteenth probe of the hardening issue, F4)."""
    import llguidance

    builds = []
    real = llguidance.LLTokenizer

    def counted(*args: Any, **kwargs: Any) -> llguidance.LLTokenizer:
        builds.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLTokenizer", counted)
    compiler = GrammarCompiler(FIXTURE / "tokenizer.json", 10, frozenset({1}))
    for _ in range(3):
        with pytest.raises(InvalidRequestError, match=r"cannot take grammars.*vocab size too small") as refused:
            compiler.constraint(Grammar("regex", "[0-9]+"))
        assert refused.value.param == "grammar"
    assert len(builds) == 1
