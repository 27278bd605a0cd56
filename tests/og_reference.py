"""onnxruntime-genai's own greedy search on a folder: the reference every engine must match."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import onnxruntime_genai as og
from serving import TINY_MODEL


def og_greedy(
    prompt_ids: list[int],
    n: int,
    folder: Path = TINY_MODEL,
    provider: str | None = None,
    adapter: Path | None = None,
) -> list[int]:
    """Up to ``n`` tokens of raw ``og.Generator`` greedy decoding (EOS included when reached),
    on ``provider`` (an ``og.Config.append_provider`` name) or the folder's own choice,
    through the LoRA ``adapter`` file when given (``og.Adapters``)."""
    config = og.Config(str(folder))
    if provider is not None:
        config.clear_providers()
        config.append_provider(provider)
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt_ids) + n, do_sample=False)
    generator = og.Generator(model, params)
    if adapter is not None:
        adapters = og.Adapters(model)
        adapters.load(str(adapter), "reference")
        generator.set_active_adapter(adapters, "reference")
    generator.append_tokens(np.array(prompt_ids, dtype=np.int32))
    out: list[int] = []
    while not generator.is_done() and len(out) < n:
        generator.generate_next_token()
        out.append(int(generator.get_next_tokens()[0]))
    return out


def ordinary_ids(count: int, seed: int = 0) -> list[int]:
    """``count`` ordinary token ids of the tiny ChatML vocabulary (its specials sit at 1019
    and up), for prompts of an exact length."""
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(count)]
