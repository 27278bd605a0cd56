"""What a chat's reasoning settings mean: template variables (``chat_template_kwargs``,
``reasoning_effort``) and a budget of thinking tokens for the templates that read no
effort of their own (see docs/guides/reasoning.md)."""

from __future__ import annotations

from typing import Any

from ortserve_client import protocol as p
from ortserve_runtime import ChatModel

from ._errors import BadRequestError, UnsupportedParameterError

__all__ = ["EFFORT_BUDGETS", "reasoning_budget", "template_kwargs"]


EFFORT_BUDGETS: dict[str, int | None] = {
    "none": 0,
    "minimal": 256,
    "low": 1024,
    "medium": 4096,
    "high": None,
    "xhigh": None,
}
"""The thinking tokens each ``reasoning_effort`` allows a reasoning model whose template
does not read it (Qwen3's, DeepSeek-R1's: they think as long as they like, so the effort
would do nothing); ``None``: as long as the model thinks."""


def reasoning_budget(data: p.ChatCompletionRequest, model: ChatModel) -> int | None:
    """The thinking tokens a chat may spend (``reasoning_budget``, or what its
    ``reasoning_effort`` means); a 400 for a model that does not reason, as the Responses
    API's ``reasoning.effort`` is: taken and ignored, either would be a setting that does
    nothing. A template that reads ``reasoning_effort`` gets it and no budget."""
    effort = data.reasoning_effort if isinstance(data.reasoning_effort, str) else None
    budget = data.reasoning_budget if isinstance(data.reasoning_budget, int) else None
    reads_effort = _template_reads(model, "reasoning_effort")
    for name, value in (("reasoning_effort", effort), ("reasoning_budget", budget)):
        if value is not None and model.reasoning is None and not (name == "reasoning_effort" and reads_effort):
            raise UnsupportedParameterError(
                f"'{name}' is not supported with model {data.model!r}: it is not a reasoning model", param=name
            )
    _check_agreement(data, effort, budget)
    if effort is not None and not reads_effort and effort not in EFFORT_BUDGETS:
        # Checked with a budget too: "bogus" beside one went to the template (sixteenth probe).
        raise BadRequestError(
            f"the reasoning effort must be one of {', '.join(map(repr, EFFORT_BUDGETS))}, not {effort!r}",
            param="reasoning_effort",
        )
    if budget is not None or effort is None or reads_effort:
        return budget
    return EFFORT_BUDGETS[effort]


def _check_agreement(data: p.ChatCompletionRequest, effort: str | None, budget: int | None) -> None:
    """A 400 where ``reasoning_effort`` and ``chat_template_kwargs`` say different things
    (the kwargs won without a word), or a ``reasoning_budget`` comes with thinking turned
    off (it did nothing); seventeenth probe, issue 45. Agreement is fine."""
    kwargs = data.chat_template_kwargs if isinstance(data.chat_template_kwargs, dict) else {}
    switch = kwargs.get("enable_thinking")
    if effort is not None:
        given = kwargs.get("reasoning_effort", effort)
        if given != effort:
            raise BadRequestError(
                f"reasoning_effort {effort!r} disagrees with chat_template_kwargs.reasoning_effort {given!r}: "
                "give one of them",
                param="reasoning_effort",
            )
        if isinstance(switch, bool) and switch != (effort != "none"):
            raise BadRequestError(
                f"reasoning_effort {effort!r} disagrees with chat_template_kwargs.enable_thinking "
                f"{str(switch).lower()}: give one of them",
                param="reasoning_effort",
            )
    off = effort == "none" or switch is False or kwargs.get("reasoning_effort") == "none"
    if budget and off:  # 0 agrees with no thinking (nineteenth probe)
        raise BadRequestError(
            "reasoning_budget is for a chat that thinks, and this one's thinking is turned off "
            "(reasoning_effort 'none' or chat_template_kwargs.enable_thinking false): it would do nothing",
            param="reasoning_budget",
        )


def _template_reads(model: ChatModel, variable: str) -> bool:
    """Whether ``model``'s chat template names ``variable`` (and so may act on it)."""
    return model.chat_template is not None and variable in model.chat_template.source


def template_kwargs(data: p.ChatCompletionRequest, model: ChatModel) -> dict[str, Any]:
    """The chat template variables a request adds: ``chat_template_kwargs`` and
    ``reasoning_effort`` (the render never lets them replace the messages or tools);
    ``reasoning_effort: "none"`` turns thinking off where the template has a switch
    (Qwen3's ``enable_thinking``) and reads no effort of its own."""
    kwargs = dict(data.chat_template_kwargs) if isinstance(data.chat_template_kwargs, dict) else {}
    if isinstance(data.reasoning_effort, str):
        kwargs.setdefault("reasoning_effort", data.reasoning_effort)
        if (
            data.reasoning_effort == "none"
            and model.reasoning is not None
            and _template_reads(model, "enable_thinking")
            and not _template_reads(model, "reasoning_effort")
        ):
            kwargs.setdefault("enable_thinking", False)
    return kwargs
