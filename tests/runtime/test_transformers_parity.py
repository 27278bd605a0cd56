"""Greedy output of ortserve equals transformers' greedy `generate` on the same checkpoint.

Needs torch and transformers (the `fixtures` dependency group, not in the uv environment),
so it is skipped in CI. Run it by hand with an environment that has them plus pytest,
pytest-timeout, jinja2 and llguidance, for example:

    PYTHONPATH=packages/runtime/src /opt/fixvenv/bin/python -m pytest \
        tests/runtime/test_transformers_parity.py -q -p no:cacheprovider
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ortserve_runtime import GenerationOptions, ModelRegistry

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PROMPTS = ["The quick brown fox jumps", "Return a new list containing all items", "hello", "the the world"]
"""The last one reaches EOS after 10 greedy tokens."""
NEW_TOKENS = 30


def transformers_greedy(*, with_eos: bool) -> list[list[int]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(FIXTURES / "tiny-qwen2-hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(FIXTURES / "tiny-qwen2-hf", dtype=torch.float32)
    model.eval()
    results = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        extra = {} if with_eos else {"eos_token_id": None}
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, **extra)
        results.append(out[0, ids.shape[1] :].tolist())
    return results


async def ortserve_greedy(*, with_eos: bool) -> tuple[list[list[int]], frozenset[int]]:
    """Greedy tokens per prompt, and the model's EOS ids."""
    registry = ModelRegistry()
    registry.add("tiny", FIXTURES / "tiny-qwen2")
    model = await registry.get("tiny")
    eos = model.eos_token_ids
    if not with_eos:
        model.eos_token_ids = frozenset()  # EOS ids stay ordinary tokens, as in transformers
    results = []
    for prompt in PROMPTS:
        _, tokens, reason, usage = await model.generate(
            prompt, options=GenerationOptions(max_tokens=NEW_TOKENS, temperature=0)
        ).collect()
        if reason == "stop":  # ended by EOS: counted in usage, never streamed
            assert usage.completion_tokens == len(tokens) + 1
        results.append(tokens)
    await registry.close()
    return results, eos


def test_greedy_matches_transformers_token_for_token() -> None:
    ours, _ = asyncio.run(ortserve_greedy(with_eos=False))
    theirs = transformers_greedy(with_eos=False)
    assert [len(t) for t in ours] == [NEW_TOKENS] * len(PROMPTS)
    assert ours == theirs


def test_greedy_up_to_eos_matches_transformers() -> None:
    ours, eos = asyncio.run(ortserve_greedy(with_eos=True))
    theirs = transformers_greedy(with_eos=True)
    # transformers ends a sequence with the EOS id it generated; ortserve does not stream it.
    assert theirs[-1][-1] in eos and len(theirs[-1]) == 11  # "the the world" really ended at EOS
    assert ours == [t[:-1] if t[-1] in eos else t for t in theirs]
