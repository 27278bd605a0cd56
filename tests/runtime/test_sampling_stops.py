"""The host-side sampler and the stop-string matcher, on crafted inputs."""

from __future__ import annotations

import numpy as np
from ortserve_runtime._sampling import GenerationOptions, Sampler
from ortserve_runtime._stops import StopMatcher

EOS = frozenset({3})


def logits(best: int, size: int = 8) -> np.ndarray:
    row = np.zeros(size, dtype=np.float32)
    row[best] = 10.0
    return row


def test_greedy_takes_the_argmax() -> None:
    assert Sampler(GenerationOptions(temperature=0), EOS).choose(logits(5), [], 0) == 5


def test_min_tokens_suppresses_eos() -> None:
    sampler = Sampler(GenerationOptions(temperature=0, min_tokens=2), EOS)
    row = logits(3)
    row[6] = 5.0
    assert sampler.choose(row, [], 0) == 6
    assert sampler.choose(row, [], 1) == 6
    assert sampler.choose(row, [], 2) == 3


def test_repetition_penalty_follows_the_definition() -> None:
    row = np.array([0.0, 4.0, 3.5, 0.0, -1.0], dtype=np.float32)
    sampler = Sampler(GenerationOptions(temperature=0, repetition_penalty=2.0), EOS)
    # token 1 was seen: its positive logit is divided (4 -> 2) so token 2 now wins.
    assert sampler.choose(row, [1], 0) == 2
    assert Sampler(GenerationOptions(temperature=0), EOS).choose(row, [1], 0) == 1


def test_top_p_and_top_k_restrict_the_choice() -> None:
    row = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    narrow = Sampler(GenerationOptions(temperature=1.0, top_p=0.4, seed=0), frozenset())
    assert {narrow.choose(row, [], 0) for _ in range(50)} == {0}
    two = Sampler(GenerationOptions(temperature=1.0, top_k=2, seed=0), frozenset())
    assert {two.choose(row, [], 0) for _ in range(200)} == {0, 1}
    wide = Sampler(GenerationOptions(temperature=1.0, seed=0), frozenset())
    assert {wide.choose(row, [], 0) for _ in range(400)} == {0, 1, 2, 3}


def test_seed_makes_sampling_reproducible() -> None:
    row = np.zeros(100, dtype=np.float32)
    a = Sampler(GenerationOptions(seed=1), EOS)
    b = Sampler(GenerationOptions(seed=1), EOS)
    assert [a.choose(row, [], i) for i in range(20)] == [b.choose(row, [], i) for i in range(20)]
    c = Sampler(GenerationOptions(seed=2), EOS)
    assert [c.choose(row, [], i) for i in range(20)] != [a.choose(row, [], i) for i in range(20)]


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


def test_stop_spanning_pieces_is_held_back_then_cut() -> None:
    matcher = StopMatcher(("STOP",))
    assert matcher.feed("abcST") == ("abc", False)
    assert matcher.feed("O") == ("", False)
    assert matcher.feed("Pxyz") == ("", True)


def test_held_back_text_is_released_when_it_is_not_a_stop() -> None:
    matcher = StopMatcher(("STOP",))
    assert matcher.feed("abST") == ("ab", False)
    assert matcher.feed("Ax") == ("STAx", False)
    assert feed_all(StopMatcher(("STOP",)), ["a", "ST"]) == ("aST", False)


def test_earliest_of_several_stops_wins() -> None:
    assert feed_all(StopMatcher(("world", "lo")), ["hello world"]) == ("hel", True)


def test_no_stops_passes_everything() -> None:
    assert StopMatcher(()).feed("anything") == ("anything", False)
