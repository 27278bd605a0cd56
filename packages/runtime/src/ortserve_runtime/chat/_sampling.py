"""Per-request generation options and the host-side sampler.

Sampling runs in NumPy on the logits the model returns, one row per request, so every
request in a batch keeps its own temperature, top-k/top-p, penalty and seed. Order of the
logit processors follows transformers: repetition penalty, EOS suppression for
``min_tokens``, temperature, top-k, top-p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from .._errors import InvalidRequestError
from ._constraints import Grammar

__all__ = ["GenerationOptions", "Sampler"]

MAX_STOP_STRINGS = 16


@dataclass(frozen=True, slots=True)
class GenerationOptions:
    """What a caller may ask of one generation. ``None`` means the model's default."""

    max_tokens: int | None = None
    """Upper bound on generated tokens; by default whatever still fits the context."""
    temperature: float = 1.0
    """0 means greedy decoding."""
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    """End-of-sequence tokens are suppressed until this many tokens exist."""
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    """Text that ends generation; neither it nor anything after it is ever emitted."""
    grammar: Grammar | None = None
    """Constrain the output to a JSON schema, regular expression or Lark grammar."""

    def validate(self) -> None:
        """Raise :class:`InvalidRequestError` naming the first option out of range."""
        checks: list[tuple[bool, str, str]] = [
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 2.0, "temperature", "must be in [0, 2]"),
            (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be 0 (disabled) or positive"),
            (
                math.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
                "repetition_penalty",
                "must be in (0, 10]",
            ),
            (self.min_tokens >= 0, "min_tokens", "must not be negative"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens",
                "must not exceed max_tokens",
            ),
            (self.seed is None or 0 <= self.seed < 2**63, "seed", "must be a non-negative 63-bit integer"),
            (len(self.stop) <= MAX_STOP_STRINGS, "stop", f"allows at most {MAX_STOP_STRINGS} strings"),
            (all(self.stop), "stop", "must not contain empty strings"),
        ]
        for ok, param, problem in checks:
            if not ok:
                raise InvalidRequestError(f"{param} {problem}", param=param)

    @property
    def greedy(self) -> bool:
        """Whether this request picks the most likely token at every step."""
        return self.temperature == 0.0 or self.top_k == 1


class Sampler:
    """Chooses the next token for one request from its logits row."""

    def __init__(self, options: GenerationOptions, eos_token_ids: frozenset[int]) -> None:
        self.options = options
        self._eos = np.fromiter(eos_token_ids, dtype=np.int64)
        self._rng = np.random.default_rng(options.seed)
        self._plain_greedy = options.greedy and options.repetition_penalty == 1.0 and options.min_tokens == 0

    def choose(self, logits: npt.NDArray[np.float32], previous: list[int], generated: int) -> int:
        """Pick the next token. ``previous`` is the prompt plus generated ids (for the penalty)."""
        if self._plain_greedy:
            return int(np.argmax(logits))
        options = self.options
        scores = logits.astype(np.float64, copy=True)
        if options.repetition_penalty != 1.0 and previous:
            seen = np.unique(np.asarray(previous, dtype=np.int64))
            values = scores[seen]
            with np.errstate(over="ignore"):  # a tiny penalty overflows to +inf: see below
                scores[seen] = np.where(
                    values > 0, values / options.repetition_penalty, values * options.repetition_penalty
                )
        if generated < options.min_tokens and self._eos.size:
            kept = scores[self._eos].copy()
            scores[self._eos] = -np.inf
            if not np.isfinite(scores).any():  # a grammar allows only the end: let it end
                scores[self._eos] = kept
        if options.greedy:
            return int(np.argmax(scores))
        with np.errstate(over="ignore"):
            scores /= options.temperature
        if 0 < options.top_k < scores.size:
            kth = np.partition(scores, -options.top_k)[-options.top_k]
            scores[scores < kth] = -np.inf
        top = scores.max()
        # A temperature or penalty near zero (valid, e.g. 1e-308) scales logits past the float
        # range, and inf - inf would be NaN; softmax's limit: the largest ones share evenly.
        probs = (scores == top).astype(np.float64) if np.isposinf(top) else np.exp(scores - top)
        probs /= probs.sum()
        if options.top_p < 1.0:
            order = np.argsort(-probs)
            cumulative = np.cumsum(probs[order])
            # Keep the smallest set whose mass reaches top_p (always at least one token).
            cutoff = int(np.searchsorted(cumulative, options.top_p)) + 1
            keep = order[:cutoff]
            kept = probs[keep] / probs[keep].sum()
            return int(keep[self._rng.choice(keep.size, p=kept)])
        return int(self._rng.choice(probs.size, p=probs))
