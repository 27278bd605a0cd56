"""Greedy output of ortserve equals transformers' greedy `generate` on the same checkpoint.

Needs torch and transformers (the `fixtures` dependency group), so it is skipped in CI.
Run it with the fixtures environment, for example:

    PYTHONPATH=packages/runtime/src:tests /tmp/fx/bin/python -m pytest tests/runtime/test_transformers_parity.py
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ortserve_runtime import GenerationOptions, ModelRegistry

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PROMPTS = ["The quick brown fox jumps", "Return a new list containing all items", "hello", "x = [1, 2, 3]"]
NEW_TOKENS = 30


def transformers_greedy() -> list[list[int]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(FIXTURES / "tiny-qwen2-hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(FIXTURES / "tiny-qwen2-hf", dtype=torch.float32)
    results = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        results.append(out[0, ids.shape[1] :].tolist())
    return results


async def ortserve_greedy() -> list[list[int]]:
    registry = ModelRegistry()
    registry.add("tiny", FIXTURES / "tiny-qwen2")
    model = await registry.get("tiny")
    # eos tokens stay ordinary tokens here, as in the transformers call above
    model.eos_token_ids = frozenset()
    results = []
    for prompt in PROMPTS:
        _, tokens, _, _ = await model.generate(
            prompt, options=GenerationOptions(max_tokens=NEW_TOKENS, temperature=0)
        ).collect()
        results.append(tokens)
    await registry.close()
    return results


def test_greedy_matches_transformers_token_for_token() -> None:
    assert asyncio.run(ortserve_greedy()) == transformers_greedy()
