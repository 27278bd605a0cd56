"""References every engine must match: onnxruntime-genai's own greedy search on a folder,
and a prompt's log-probabilities from the folder's graph run whole by onnxruntime."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import onnxruntime as ort
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


def prompt_logprobs(prompt_ids: list[int], folder: Path = TINY_MODEL) -> list[float]:
    """The log-probability of each prompt token after the first given those before it:
    the folder's decoder graph run once over the whole prompt by onnxruntime (no past
    key/values, every position's logits), log-softmax in float64."""
    head_size = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]["head_size"]
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    feeds = {
        "input_ids": np.asarray([prompt_ids], dtype=np.int64),
        "attention_mask": np.ones((1, len(prompt_ids)), dtype=np.int64),
    }
    for item in session.get_inputs():
        if item.name.startswith("past_key_values."):
            feeds[item.name] = np.zeros((1, item.shape[1], 0, head_size), dtype=np.float32)
    logits = session.run(["logits"], feeds)[0][0].astype(np.float64)
    peak = logits.max(axis=-1, keepdims=True)
    logprobs = logits - peak - np.log(np.exp(logits - peak).sum(axis=-1, keepdims=True))
    return [float(logprobs[i - 1, token]) for i, token in enumerate(prompt_ids) if i > 0]
