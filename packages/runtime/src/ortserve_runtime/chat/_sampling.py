"""Per-request generation options and the host-side sampler.

Sampling runs in NumPy on the logits the model returns, one row per request, so every
request in a batch keeps its own temperature, top-k/top-p, penalties and seed. The order:

1. the grammar mask (applied by the request before the sampler sees the row);
2. ``logit_bias`` (OpenAI: added to the logit, before anything else of the sampler's);
3. ``repetition_penalty`` (transformers/CTRL: over prompt and output);
4. ``presence_penalty`` / ``frequency_penalty`` (OpenAI: over the output only, as vLLM);
5. EOS suppression while fewer than ``min_tokens`` exist;
6. -- log-probabilities are taken here: what the model would pick among the tokens the
   request allows, so greedy decoding picks the token of highest logprob --
7. temperature, then top-k, top-p and min-p truncate what is sampled from.

Log-probabilities are reported before temperature and truncation, as the model's
distribution over what the request allows; vLLM reports the raw model's by default, but
a caller who biased or constrained a token expects its logprob to say so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from .._errors import InvalidRequestError
from ._constraints import Grammar

__all__ = ["MAX_TOP_LOGPROBS", "GenerationOptions", "Sampler", "Scored", "score"]

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
"""OpenAI's limit on ``top_logprobs``."""


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
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    """Token id -> bias in [-100, 100] added to its logit (-100 bans, +100 all but forces)."""
    min_p: float = 0.0
    """Drop tokens less likely than ``min_p`` times the most likely one (0 disables)."""
    presence_penalty: float = 0.0
    """OpenAI's: subtracted once from the logit of every token the output already has."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted from a token's logit once per time the output has it."""
    logprobs: int | None = None
    """Report each token's log-probability and this many most likely alternatives
    (0: the token's own only); ``None``: none, and no work spent on them."""
    prompt_logprobs: int | None = None
    """Report the log-probability of each prompt token given the tokens before it, with
    this many most likely alternatives (OpenAI's legacy ``echo`` with ``logprobs``, vLLM's
    ``prompt_logprobs``): the model's own distribution (no bias, penalty or grammar applies
    to a prompt). Engines that compute every prompt position's logits only (ort-cpu);
    ``None``: none. With it, ``max_tokens`` may be 0: the prompt is scored, nothing generated."""
    prediction: str | None = None
    """Text the output is expected to be close to (OpenAI's Predicted Outputs): its tokens
    are drafts for speculative decoding, which change how fast the output comes, never what
    it is (greedy output, and sampled output's distribution; see _drafts)."""
    cache_salt: str | None = None
    """The prefix-cache scope (vLLM's ``cache_salt``): key/value rows computed for a
    request with one salt serve only requests with the same salt, so that users given
    different salts cannot learn from ``cached_tokens`` or timing what the other sent."""
    reasoning_budget: int | None = None
    """A reasoning model's thinking, at most this many tokens: then its think block is
    closed (its end marker forced) and the answer follows (Anthropic's
    ``thinking.budget_tokens``). ``None``: as long as the model thinks."""
    background: bool = False
    """Run behind interactive requests (a batch's lines): queued after them, and, on an
    engine whose rows are all taken when an interactive request waits, its row given up
    (it ends with :class:`~ortserve_runtime.PreemptedError`, to be run again)."""

    def validate(self) -> None:
        """Raise :class:`InvalidRequestError` naming the first option out of range."""
        checks: list[tuple[bool, str, str]] = [
            (
                self.max_tokens is None
                or self.max_tokens >= 1
                or (self.max_tokens == 0 and self.prompt_logprobs is not None),
                "max_tokens",
                "must be at least 1 (0 only when the prompt's logprobs are asked for)",
            ),
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
            (
                all(math.isfinite(b) and -100.0 <= b <= 100.0 for b in self.logit_bias.values()),
                "logit_bias",
                "values must be in [-100, 100]",
            ),
            (all(t >= 0 for t in self.logit_bias), "logit_bias", "keys must be non-negative token ids"),
            (math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (
                math.isfinite(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
                "presence_penalty",
                "must be in [-2, 2]",
            ),
            (
                math.isfinite(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
                "frequency_penalty",
                "must be in [-2, 2]",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
                "logprobs",
                f"must be in [0, {MAX_TOP_LOGPROBS}]",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
                "prompt_logprobs",
                f"must be in [0, {MAX_TOP_LOGPROBS}]",
            ),
            (self.reasoning_budget is None or self.reasoning_budget >= 0, "reasoning_budget", "must not be negative"),
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


@dataclass(frozen=True, slots=True)
class Scored:
    """The log-probability of the chosen token and of the most likely ones (best first),
    from the scores the sampler chose among (see the module's order)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


# OpenAI reports an impossible token (a grammar or ``min_tokens`` banned it) as -9999.0;
# JSON has no -Infinity.
_FLOOR = -9999.0


class Sampler:
    """Chooses the next token for one request from its logits row."""

    def __init__(self, options: GenerationOptions, eos_token_ids: frozenset[int]) -> None:
        self.options = options
        self._eos = np.fromiter(eos_token_ids, dtype=np.int64)
        self._rng = np.random.default_rng(options.seed)
        self._bias_ids = np.fromiter(options.logit_bias.keys(), dtype=np.int64)
        self._bias = np.fromiter(options.logit_bias.values(), dtype=np.float64)
        self._penalised = options.presence_penalty != 0.0 or options.frequency_penalty != 0.0
        self._plain = (
            options.repetition_penalty == 1.0
            and options.min_tokens == 0
            and not options.logit_bias
            and not self._penalised
        )
        self._plain_greedy = options.greedy and self._plain and options.logprobs is None
        self.argmax_unless_eos = (
            options.greedy
            and options.repetition_penalty == 1.0
            and not options.logit_bias
            and not self._penalised
            and options.logprobs is None
        )
        """The pick is the row's argmax unless that is an EOS ``min_tokens`` still forbids (a
        fast path for the caller: no copy of the row, no processing)."""
        self._scores: npt.NDArray[np.float64] | npt.NDArray[np.float32] | None = None

    def choose(
        self, logits: npt.NDArray[np.float32], previous: list[int], generated: int, output: Sequence[int] = ()
    ) -> int:
        """Pick the next token. ``previous`` is the prompt plus generated ids (for the
        repetition penalty), ``output`` the generated ids (presence/frequency penalties)."""
        if self._plain_greedy:
            return int(np.argmax(logits))
        options = self.options
        scores = logits if self._plain and options.greedy else self._process(logits, previous, generated, output)
        if options.logprobs is not None:
            self._scores = scores  # kept for scored(): log-probabilities before temperature
        if options.greedy:
            return int(np.argmax(scores))
        peak = scores.max()
        with np.errstate(over="ignore"):
            tempered_peak = peak / options.temperature
        if np.isfinite(peak) and not np.isfinite(tempered_peak):
            # A temperature near zero (valid, e.g. 5e-324) scales the best score past the float
            # range: every positive score would tie at +inf, every negative one at -inf (and
            # -inf - -inf is NaN). Softmax's limit as the temperature goes to 0: the best share.
            probs = (scores == peak).astype(np.float64)
        else:
            with np.errstate(over="ignore"):  # a tiny temperature overflows lesser scores to -inf
                if options.logprobs is None:
                    scores /= options.temperature  # a copy already (_process): no second row to allocate
                else:
                    scores = scores / options.temperature  # the kept row stays untempered
            if 0 < options.top_k < scores.size:
                kth = np.partition(scores, -options.top_k)[-options.top_k]
                scores[scores < kth] = -np.inf
            top = scores.max()
            # A penalty near zero (valid, e.g. 1e-308) scales logits past the float range, and
            # inf - inf would be NaN; softmax's limit: the largest ones share evenly.
            probs = (scores == top).astype(np.float64) if np.isposinf(top) else np.exp(scores - top)
        probs /= probs.sum()
        if options.min_p > 0.0:
            # Relative to the most likely token after temperature, as vLLM and transformers.
            probs[probs < options.min_p * probs.max()] = 0.0
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

    def _process(
        self, logits: npt.NDArray[np.float32], previous: list[int], generated: int, output: Sequence[int]
    ) -> npt.NDArray[np.float64]:
        """The logits after bias, penalties and ``min_tokens``, as a new float64 row."""
        options = self.options
        scores = logits.astype(np.float64, copy=True)
        if self._bias_ids.size:
            scores[self._bias_ids] += self._bias
        if options.repetition_penalty != 1.0 and previous:
            seen = np.unique(np.asarray(previous, dtype=np.int64))
            values = scores[seen]
            with np.errstate(over="ignore"):  # a tiny penalty overflows to +inf: see choose()
                scores[seen] = np.where(
                    values > 0, values / options.repetition_penalty, values * options.repetition_penalty
                )
        if self._penalised and output:
            ids, counts = np.unique(np.asarray(output, dtype=np.int64), return_counts=True)
            scores[ids] -= counts * options.frequency_penalty + options.presence_penalty
        if generated < options.min_tokens and self._eos.size:
            kept = scores[self._eos].copy()
            scores[self._eos] = -np.inf
            if not np.isfinite(scores).any():  # a grammar allows only the end: let it end
                scores[self._eos] = kept
        return scores

    def prompt_scored(self, logits: npt.NDArray[np.float32], token: int) -> Scored:
        """A prompt token's log-probabilities (``options.prompt_logprobs`` alternatives) from
        the logits of the position before it: the model's own, as nothing of the options
        applies to a prompt."""
        return score(logits, token, self.options.prompt_logprobs or 0)

    def scored(self, token: int) -> Scored:
        """Log-probabilities of the last :meth:`choose` (``options.logprobs`` must be set)."""
        scores = self._scores
        assert scores is not None, "scored() needs options.logprobs and a choose() first"
        self._scores = None
        return score(scores, token, self.options.logprobs or 0)


def score(scores: npt.NDArray[np.floating], token: int, top: int) -> Scored:
    """The log-probability of ``token`` and of the ``top`` most likely tokens (best first)
    under the log-softmax of ``scores`` (a row of logits, -inf where a token is not
    allowed), summed in float64: a sampled token's (:meth:`Sampler.scored`) and a prompt
    token's (:meth:`~ortserve_runtime._contract.Request.score_prompt`) alike."""
    finite = scores[np.isfinite(scores)].astype(np.float64)
    peak = float(finite.max()) if finite.size else 0.0
    log_total = peak + math.log(float(np.exp(finite - peak).sum())) if finite.size else 0.0

    def logprob(index: int) -> float:
        value = float(scores[index]) - log_total
        return value if math.isfinite(value) and value > _FLOOR else _FLOOR

    best: list[tuple[int, float]] = []
    if top:
        candidates = np.argpartition(-scores, top - 1)[:top] if top < scores.size else np.arange(scores.size)
        ordered = sorted(candidates.tolist(), key=lambda i: (-float(scores[i]), i))
        best = [(int(i), logprob(int(i))) for i in ordered]
    return Scored(token, logprob(token), tuple(best))
