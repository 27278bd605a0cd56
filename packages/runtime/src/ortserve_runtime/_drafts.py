"""Draft tokens for speculative decoding: guesses at a request's next tokens that an engine
checks in one model call instead of one call per token.

Two proposers, both reading text the request already has, so a draft costs no model call:

* **prompt lookup** (``--speculative ngram``, as vLLM's ``ngram`` and llama.cpp's
  ``ngram``): the last few tokens of the sequence are looked up in the prompt and the output
  so far; what followed their latest earlier occurrence is the draft. Work grounded in its
  input (quoting, summarising, editing, RAG answers, JSON repeating the prompt's keys)
  repeats long runs of it.
* **the request's prediction** (OpenAI's Predicted Outputs, ``prediction`` on chat and
  completions): text the caller expects the output to be close to, such as the file being
  edited. A cursor follows the output through the prediction; where the output departs
  from it (the edit), the cursor finds its place again by the output's last tokens.

The engine checks a draft by running the request's last token and the draft in one call
and sampling each position in turn from its logits, as without speculation; the draft is
accepted up to the first position whose sampled token differs, and that token is kept in
its place. For a sampled request this is rejection sampling for a proposer that puts all
its probability on its one guess: every token is drawn from the model's own distribution,
with the same random draws in the same order, so the output's distribution (and a seeded
output) is the one without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Drafter", "PromptLookup"]

MAX_DRAFT_TOKENS = 8
"""The most tokens a draft holds: a call of 9 positions costs 2.2x a one-token step on
SmolLM2-135M int4 and 2.6x on the 0.5B-shaped model (measured, see docs/performance.md), so longer
drafts only pay when nearly all of them are accepted."""


class PromptLookup:
    """The continuation of the latest earlier occurrence of a sequence's last ``n`` tokens
    (``n`` from the largest of ``sizes`` down), kept as an index of every n-gram's last end
    position that grows with the sequence (no rescans)."""

    def __init__(self, sizes: Sequence[int] = (4, 3, 2)) -> None:
        self._sizes = tuple(sorted(sizes, reverse=True))
        self._ends: dict[tuple[int, ...], int] = {}
        self._indexed = 0
        """Positions whose n-grams ending there are in the index."""

    def propose(self, sequence: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the latest earlier occurrence of the end of
        ``sequence`` (which only grows between calls)."""
        length = len(sequence)
        # Index n-grams ending before the last position: the suffix must not find itself.
        for end in range(max(self._indexed, 1), length):
            for n in self._sizes:
                if end >= n:
                    self._ends[tuple(sequence[end - n : end])] = end
        self._indexed = max(self._indexed, length)
        for n in self._sizes:
            if length < n:
                continue
            found = self._ends.get(tuple(sequence[length - n :]))
            if found is not None:
                return list(sequence[found : min(found + limit, length)])
        return []


_NEARBY = 16
"""Prediction tokens after the last known place searched for the output's last token alone."""


class _PredictionCursor:
    """Where the output stands in a predicted text (see the module docstring)."""

    def __init__(self, prediction: Sequence[int]) -> None:
        self.prediction = list(prediction)
        self._position = 0
        """The prediction's token expected next; -1 while the output is off it."""
        self._followed = 0
        """Output tokens accounted for in ``_position``."""
        self._ends: dict[tuple[int, ...], list[int]] = {}
        """Every 2-, 3- and 4-gram of the prediction -> the positions just after it, in order."""
        for n in (4, 3, 2):
            for end in range(n, len(self.prediction) + 1):
                self._ends.setdefault(tuple(self.prediction[end - n : end]), []).append(end)

    def propose(self, output: Sequence[int], limit: int) -> list[int]:
        prediction = self.prediction
        position = self._position
        for token in output[self._followed :]:
            if 0 <= position < len(prediction) and prediction[position] == token:
                position += 1
            else:
                position = -1
        self._followed = len(output)
        if position < 0:
            position = self._find(output)
        self._position = position
        return prediction[position : position + limit] if position >= 0 else []

    def _find(self, output: Sequence[int]) -> int:
        """Where the output's last tokens (4, 3, then 2 of them) stand in the prediction:
        the first occurrence after the last known place, else the first anywhere; else its
        last token a little after the last known place (the same text tokenized another
        way: a prediction starting with a partial character, or mid-word); -1 if nowhere
        (the output is in its own text, the edit)."""
        known = max(self._position, 0)
        for n in (4, 3, 2):
            ends = self._ends.get(tuple(output[-n:])) if len(output) >= n else None
            if ends:
                after = [end for end in ends if end > known]
                return (after or ends)[0]
        if output:
            nearby = self.prediction[known : known + _NEARBY]
            if output[-1] in nearby:
                return known + nearby.index(output[-1]) + 1
        return -1


@dataclass
class Drafter:
    """One request's proposers and its record of accepted drafts."""

    prompt: Sequence[int]
    prediction: Sequence[int] | None = None
    """Token ids of the request's predicted output, if it has one."""
    lookup: bool = False
    """Whether the prompt and output are searched too (``--speculative ngram``)."""
    proposed: int = 0
    """Draft tokens checked so far."""
    accepted: int = 0
    """Draft tokens that became output tokens."""
    acceptance: float = field(init=False)
    """The estimated chance that the next draft token is accepted: the engine sizes drafts
    by it (0: never worth a call; see :meth:`record`)."""
    _cursor: _PredictionCursor | None = field(init=False, default=None)
    _lookup: PromptLookup | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.prediction:
            self._cursor = _PredictionCursor(self.prediction)
        if self.lookup:
            self._lookup = PromptLookup()
        self.acceptance = self.prior

    @property
    def prior(self) -> float:
        """The acceptance assumed before any draft was checked, and drifted back to while
        none is (a prediction is usually close to the output; a lookup is a guess)."""
        return 0.8 if self._cursor is not None else 0.6

    def propose(self, output: Sequence[int], limit: int = MAX_DRAFT_TOKENS) -> list[int]:
        """A draft of up to ``limit`` tokens to follow ``output`` (the tokens generated so
        far): the prediction's, else the prompt lookup's; ``[]`` when neither has one."""
        if limit < 1:
            return []
        if self._cursor is not None:
            draft = self._cursor.propose(output, limit)
            if draft:
                return draft
        if self._lookup is not None:
            return self._lookup.propose([*self.prompt, *output], limit)
        return []

    def record(self, proposed: int, accepted: int) -> None:
        """Account a checked draft: ``proposed`` tokens, the first ``accepted`` of them taken.

        Each token checked up to the first rejection is one trial of the acceptance, moved
        towards it by a tenth (recent drafts count most: a quoted passage ends, code resumes).
        """
        self.proposed += proposed
        self.accepted += accepted
        for taken in [True] * accepted + ([False] if accepted < proposed else []):
            self.acceptance += 0.1 * (float(taken) - self.acceptance)

    def skipped(self) -> None:
        """A draft was available but not worth its call: drift back towards :attr:`prior`, so
        that a request whose early drafts failed tries again later (a quote may follow)."""
        self.acceptance += 0.03 * (self.prior - self.acceptance)
