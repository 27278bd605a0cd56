"""The host-side sampler and the stop-string matcher, on crafted inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
from ortserve_runtime import InvalidRequestError
from ortserve_runtime.chat._sampling import GenerationOptions, Sampler
from ortserve_runtime.chat._stops import StopMatcher

EOS = frozenset({3})


def logits(best: int, size: int = 8) -> np.ndarray:
    row = np.zeros(size, dtype=np.float32)
    row[best] = 10.0
    return row


# -- Sampler ---------------------------------------------------------------------------------


def test_greedy_takes_the_argmax() -> None:
    assert Sampler(GenerationOptions(temperature=0), EOS).choose(logits(5), [], 0) == 5
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(20, 50)).astype(np.float32)
    greedy = Sampler(GenerationOptions(temperature=0), EOS)
    assert [greedy.choose(r, [], 0) for r in rows] == [int(np.argmax(r)) for r in rows]


def test_min_tokens_suppresses_eos() -> None:
    sampler = Sampler(GenerationOptions(temperature=0, min_tokens=2), EOS)
    row = logits(3)  # EOS is the argmax
    row[6] = 5.0
    assert sampler.choose(row, [], 0) == 6
    assert sampler.choose(row, [], 1) == 6
    assert sampler.choose(row, [], 2) == 3  # min_tokens reached: EOS may win again


def test_min_tokens_suppresses_every_eos_id_when_sampling() -> None:
    eos = frozenset({2, 5})
    row = np.full(8, -2.0, dtype=np.float32)
    row[[2, 5]] = 20.0  # the two EOS ids hold practically all the probability mass
    sampler = Sampler(GenerationOptions(temperature=1.0, min_tokens=10, seed=0), eos)
    picks = {sampler.choose(row, [], i % 10) for i in range(300)}
    assert picks.isdisjoint(eos)
    assert len(picks) > 1  # still sampling among the rest
    after = Sampler(GenerationOptions(temperature=1.0, min_tokens=10, seed=0), eos)
    assert after.choose(row, [], 10) in eos


def test_min_tokens_lets_eos_through_when_it_is_the_only_choice() -> None:
    # A grammar that only allows the end masks everything else to -inf.
    row = np.full(8, -np.inf, dtype=np.float32)
    row[3] = 0.0
    assert Sampler(GenerationOptions(temperature=0, min_tokens=5), EOS).choose(row, [], 0) == 3


def test_repetition_penalty_follows_the_definition() -> None:
    row = np.array([0.0, 4.0, 3.5, 0.0, -1.0], dtype=np.float32)
    sampler = Sampler(GenerationOptions(temperature=0, repetition_penalty=2.0), EOS)
    # token 1 was seen: its positive logit is divided (4 -> 2) so token 2 now wins.
    assert sampler.choose(row, [1], 0) == 2
    assert Sampler(GenerationOptions(temperature=0), EOS).choose(row, [1], 0) == 1
    # Seen twice is penalised once (4 / 2 = 2 still beats 3.5 / 2 = 1.75, not 4 / 4 = 1).
    assert sampler.choose(row, [1, 1, 2], 0) == 1
    # Negative logits are multiplied: -1 * 2 = -2 loses to -1.5, which was not seen.
    negative = np.array([-1.0, -1.5, -3.0], dtype=np.float32)
    assert Sampler(GenerationOptions(temperature=0), EOS).choose(negative, [0], 0) == 0
    assert sampler.choose(negative, [0], 0) == 1
    # A penalty below 1 favours seen tokens: 3.5 / 0.5 = 7 beats 4.
    assert Sampler(GenerationOptions(temperature=0, repetition_penalty=0.5), EOS).choose(row, [2], 0) == 2


def test_repetition_penalty_applies_before_sampling() -> None:
    # Two equal tokens; a strong penalty on token 0 makes token 1 (nearly) certain.
    row = np.array([50.0, 50.0, -20.0, -20.0], dtype=np.float32)
    sampler = Sampler(GenerationOptions(temperature=1.0, repetition_penalty=10.0, seed=1), frozenset())
    assert {sampler.choose(row, [0], 0) for _ in range(100)} == {1}


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (GenerationOptions(temperature=1e-308, seed=0), {1, 2}),
        (GenerationOptions(temperature=5e-324, seed=0), {1, 2}),
        (GenerationOptions(temperature=1.0, repetition_penalty=1e-308, seed=0), {1, 2}),
        (GenerationOptions(temperature=0, repetition_penalty=5e-324), {1}),  # argmax: the first
    ],
    ids=["tiny temperature", "subnormal temperature", "tiny penalty", "tiny penalty greedy"],
)
def test_extreme_valid_options_pick_the_limit_not_nan(options: GenerationOptions, expected: set[int]) -> None:
    # Found by fuzzing (a 500 "Probabilities contain NaN"): a temperature or penalty this
    # small is in range but overflows the scaled logits to +inf, and inf - inf is NaN. The
    # limit of softmax is an even choice among the largest logits, and so it must sample.
    row = np.array([-1.0, 3.0, 3.0, -2.0, -0.5], dtype=np.float32)
    sampler = Sampler(options, frozenset())
    with np.errstate(all="raise"):  # no overflow warnings either: they become errors in tests
        picks = {sampler.choose(row, [1, 2], 0) for _ in range(100)}
    assert picks == expected


def test_top_p_and_top_k_restrict_the_choice() -> None:
    row = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    narrow = Sampler(GenerationOptions(temperature=1.0, top_p=0.4, seed=0), frozenset())
    assert {narrow.choose(row, [], 0) for _ in range(50)} == {0}
    two_by_p = Sampler(GenerationOptions(temperature=1.0, top_p=0.75, seed=0), frozenset())
    assert {two_by_p.choose(row, [], 0) for _ in range(200)} == {0, 1}
    three_by_p = Sampler(GenerationOptions(temperature=1.0, top_p=0.85, seed=0), frozenset())
    assert {three_by_p.choose(row, [], 0) for _ in range(400)} == {0, 1, 2}
    two = Sampler(GenerationOptions(temperature=1.0, top_k=2, seed=0), frozenset())
    assert {two.choose(row, [], 0) for _ in range(200)} == {0, 1}
    wide = Sampler(GenerationOptions(temperature=1.0, seed=0), frozenset())
    assert {wide.choose(row, [], 0) for _ in range(400)} == {0, 1, 2, 3}


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    rows = np.random.default_rng(1).normal(size=(30, 64)).astype(np.float32)
    top1 = Sampler(GenerationOptions(temperature=2.0, top_k=1, seed=3), EOS)
    tiny_p = Sampler(GenerationOptions(temperature=1.5, top_p=1e-6, seed=3), EOS)
    expected = [int(np.argmax(r)) for r in rows]
    assert [top1.choose(r, [], 5) for r in rows] == expected
    assert [tiny_p.choose(r, [], 5) for r in rows] == expected


def test_sampling_follows_the_distribution() -> None:
    probs = np.array([0.6, 0.3, 0.1])
    sampler = Sampler(GenerationOptions(temperature=1.0, seed=7), frozenset())
    draws = np.bincount([sampler.choose(np.log(probs), [], 0) for _ in range(3000)], minlength=3) / 3000
    assert np.allclose(draws, probs, atol=0.04)
    # Temperature 0.5 squares the odds: 0.6^2 : 0.3^2 : 0.1^2.
    cold = Sampler(GenerationOptions(temperature=0.5, seed=7), frozenset())
    draws = np.bincount([cold.choose(np.log(probs), [], 0) for _ in range(3000)], minlength=3) / 3000
    assert np.allclose(draws, probs**2 / (probs**2).sum(), atol=0.04)


def test_seed_makes_sampling_reproducible() -> None:
    row = np.zeros(100, dtype=np.float32)
    a = Sampler(GenerationOptions(seed=1), EOS)
    b = Sampler(GenerationOptions(seed=1), EOS)
    assert [a.choose(row, [], i) for i in range(20)] == [b.choose(row, [], i) for i in range(20)]
    c = Sampler(GenerationOptions(seed=2), EOS)
    assert [c.choose(row, [], i) for i in range(20)] != [a.choose(row, [], i) for i in range(20)]


@pytest.mark.parametrize(
    ("options", "param"),
    [
        (GenerationOptions(max_tokens=0), "max_tokens"),
        (GenerationOptions(temperature=-0.1), "temperature"),
        (GenerationOptions(temperature=2.5), "temperature"),
        (GenerationOptions(temperature=math.inf), "temperature"),
        (GenerationOptions(top_p=0.0), "top_p"),
        (GenerationOptions(top_p=1.5), "top_p"),
        (GenerationOptions(top_p=math.nan), "top_p"),
        (GenerationOptions(top_k=-1), "top_k"),
        (GenerationOptions(repetition_penalty=math.nan), "repetition_penalty"),
        (GenerationOptions(min_tokens=-1), "min_tokens"),
        (GenerationOptions(max_tokens=2, min_tokens=3), "min_tokens"),
        (GenerationOptions(seed=2**63), "seed"),
        (GenerationOptions(stop=tuple("abcdefghijklmnopq")), "stop"),
        (GenerationOptions(logit_bias={5: 100.5}), "logit_bias"),
        (GenerationOptions(logit_bias={5: math.nan}), "logit_bias"),
        (GenerationOptions(logit_bias={-1: 1.0}), "logit_bias"),
        (GenerationOptions(min_p=-0.1), "min_p"),
        (GenerationOptions(min_p=1.5), "min_p"),
        (GenerationOptions(presence_penalty=2.5), "presence_penalty"),
        (GenerationOptions(frequency_penalty=-2.5), "frequency_penalty"),
        (GenerationOptions(frequency_penalty=math.inf), "frequency_penalty"),
        (GenerationOptions(logprobs=21), "logprobs"),
        (GenerationOptions(logprobs=-1), "logprobs"),
    ],
)
def test_validate_names_the_param(options: GenerationOptions, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        options.validate()
    assert info.value.param == param
    assert param in str(info.value)


def test_sensible_options_validate() -> None:
    GenerationOptions().validate()
    GenerationOptions(max_tokens=1, min_tokens=1, temperature=2.0, top_p=1.0, top_k=1, seed=0, stop=("x",)).validate()


def test_logit_bias_bans_and_forces() -> None:
    row = logits(5)
    assert Sampler(GenerationOptions(temperature=0, logit_bias={5: -100}), EOS).choose(row, [], 0) != 5
    forced = Sampler(GenerationOptions(temperature=1.0, seed=0, logit_bias={2: 100}), EOS)
    assert {forced.choose(row, [], 0) for _ in range(50)} == {2}


def test_presence_and_frequency_penalties_follow_openai() -> None:
    """logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty, over
    the output only (the prompt is not penalised)."""
    row = np.array([0.0, 3.0, 2.5, 1.0], dtype=np.float32)
    options = GenerationOptions(temperature=0, presence_penalty=0.4, frequency_penalty=0.3, logprobs=3)
    sampler = Sampler(options, frozenset())
    assert sampler.choose(row, [1, 1, 1, 1], 2, [1, 1]) == 2  # 3.0 - 2 * 0.3 - 0.4 = 2.0 < 2.5
    scored = sampler.scored(2)
    expected = np.array([0.0, 2.0, 2.5, 1.0])
    log_total = math.log(np.exp(expected).sum())
    assert scored.top == tuple((i, pytest.approx(expected[i] - log_total)) for i in (2, 1, 3))
    # A negative penalty encourages repeats.
    assert Sampler(GenerationOptions(temperature=0, presence_penalty=-1.0), EOS).choose(row, [], 1, [2]) == 2


def test_min_p_drops_unlikely_tokens() -> None:
    row = np.array([5.0, 4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=np.float32)
    sampler = Sampler(GenerationOptions(temperature=1.0, seed=1, min_p=0.2), EOS)
    assert {sampler.choose(row, [], 0) for _ in range(300)} == {0, 1}  # exp(-1) > 0.2 > exp(-5)
    free = Sampler(GenerationOptions(temperature=1.0, seed=1), EOS)
    assert len({free.choose(row, [], 0) for _ in range(300)}) > 2


def test_logprobs_are_a_log_softmax_and_greedy_picks_the_best() -> None:
    rng = np.random.default_rng(3)
    for _ in range(10):
        row = rng.normal(size=50).astype(np.float32)
        sampler = Sampler(GenerationOptions(temperature=0, logprobs=5), EOS)
        token = sampler.choose(row, [], 0)
        scored = sampler.scored(token)
        reference = row.astype(np.float64) - math.log(np.exp(row.astype(np.float64)).sum())
        assert token == scored.top[0][0] == int(np.argmax(reference))
        assert scored.logprob == pytest.approx(reference[token])
        assert [t for t, _ in scored.top] == list(np.argsort(-reference)[:5])
        assert [lp for _, lp in scored.top] == pytest.approx(sorted(reference, reverse=True)[:5])


def test_logprobs_come_before_temperature_and_after_the_mask() -> None:
    row = np.array([2.0, 1.0, -np.inf, 0.0], dtype=np.float32)  # token 2 masked by a grammar
    sampler = Sampler(GenerationOptions(temperature=0.5, seed=0, logprobs=4), frozenset())
    token = sampler.choose(row, [], 0)
    scored = sampler.scored(token)
    finite = np.array([2.0, 1.0, 0.0])
    assert scored.top[0] == (0, pytest.approx(2.0 - math.log(np.exp(finite).sum())))
    assert scored.top[-1] == (2, -9999.0)  # impossible: OpenAI's floor, JSON has no -inf


# -- StopMatcher ------------------------------------------------------------------------------


def feed_all(matcher: StopMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def test_stop_inside_one_piece() -> None:
    assert feed_all(StopMatcher(("lo",)), ["hel", "lo world"]) == ("hel", True)
    assert feed_all(StopMatcher(("ll",)), ["he", "ello", "x"]) == ("hee", True)


def test_stop_spanning_pieces_is_held_back_then_cut() -> None:
    matcher = StopMatcher(("STOP",))
    assert matcher.feed("abcST") == ("abc", False)
    assert matcher.feed("O") == ("", False)
    assert matcher.feed("Pxyz") == ("", True)


def test_stop_spanning_many_pieces() -> None:
    matcher = StopMatcher(("<end>",))
    emitted = [matcher.feed(p) for p in ["ok<", "e", "n", "d", ">tail"]]
    assert emitted == [("ok", False), ("", False), ("", False), ("", False), ("", True)]


def test_the_matched_stop_is_the_earliest_in_the_text() -> None:
    """Anthropic's stop_sequence names the stop string that ended the text."""
    matcher = StopMatcher(("world", "lo"))
    assert matcher.matched is None
    assert matcher.feed("hello world") == ("hel", True)
    assert matcher.matched == "lo"
    unmatched = StopMatcher(("zz",))
    feed_all(unmatched, ["abc"])
    assert unmatched.matched is None


def test_held_back_text_is_released_when_it_is_not_a_stop() -> None:
    matcher = StopMatcher(("STOP",))
    assert matcher.feed("abST") == ("ab", False)
    assert matcher.feed("Ax") == ("STAx", False)
    assert feed_all(StopMatcher(("STOP",)), ["a", "ST"]) == ("aST", False)
    # Released at the end: the flush returns what was held back.
    end = StopMatcher(("STOP",))
    assert end.feed("abcSTO") == ("abc", False)
    assert end.flush() == "STO"
    assert end.flush() == ""


def test_overlapping_prefixes_keep_the_longest_candidate() -> None:
    matcher = StopMatcher(("aab",))
    assert [matcher.feed(c) for c in "aaa"] == [("", False), ("", False), ("a", False)]
    assert matcher.feed("b") == ("", True)
    # With several stops the longest held suffix of any of them is kept.
    matcher = StopMatcher(("xyz", "yz!"))
    assert matcher.feed("..xy") == ("..", False)
    assert matcher.feed("z") == ("", True)


def test_earliest_of_several_stops_wins() -> None:
    assert feed_all(StopMatcher(("world", "lo")), ["hello world"]) == ("hel", True)
    assert feed_all(StopMatcher(("lo", "world")), ["hello world"]) == ("hel", True)
    assert feed_all(StopMatcher(("d", "o w")), ["hell", "o wor", "ld"]) == ("hell", True)


def test_a_stop_that_never_occurs_changes_nothing() -> None:
    pieces = ["alpha ", "be", "ta", " gam", "ma"]
    assert feed_all(StopMatcher(("zeta", "bet!")), pieces) == ("alpha beta gamma", False)


def test_no_stops_passes_everything() -> None:
    matcher = StopMatcher(())
    assert matcher.feed("anything") == ("anything", False)
    assert matcher.flush() == ""
