"""Smaller key/value storage for the ort-cpu engine (``ModelConfig.kv_cache_dtype``).

onnxruntime's GroupQueryAttention types its cache (``T_CACHE``) apart from its
activations (``T``): an fp32 graph can keep fp16 or int8 keys and values, rounding each
one as it is written into the cache and widening it as attention reads it. The graph's
cache inputs and outputs change type; nothing else in it does, and the engine's rows are
still written in place. Measured on SmolLM2-135M (docs/performance.md): fp16 halves the
cache and int8 quarters it, and both move logprobs a little.

int8 needs a scale per layer, key/value and channel (``PER_CHANNEL``: one per kv head and
head dimension), fixed for the session. They are measured once per model by running
:data:`CALIBRATION_TEXT` through the unchanged graph and reading the keys and values it
wrote: the largest magnitude of each channel, with headroom, is mapped to 127. Keys are
stored after rotary embedding, which turns each pair of channels together, so a pair
shares its larger scale. The scales are kept under ``$ORTSERVE_CACHE/kv-scales``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
import onnx.helper
import onnx.numpy_helper

from ._int8_prefill import model_cache_key, ortserve_cache

__all__ = ["CALIBRATION_TEXT", "KvScales", "load_or_measure_scales", "scales_from_cache", "store_kv_as"]

logger = logging.getLogger(__name__)

KvScales = list[tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]]
"""Per layer, the (key, value) int8 scales, each shaped ``(1, kv heads, 1, head size)``."""

HEADROOM = 1.25
"""Largest calibrated magnitude x this = 127: text the calibration did not cover may run
larger (values past it saturate at +-127)."""

FORMAT = 1
"""Bumped when the measurement changes, so that older scales are measured again."""

CALIBRATION_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a screw press. Within fifty years presses ran in "
    "more than two hundred European cities, and the price of books fell sharply.\n\n"
    "User: Can you write a Python function that returns the n-th Fibonacci number?\n"
    "Assistant: Sure! Here is an iterative version:\n\n"
    "```python\ndef fibonacci(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n"
    "        a, b = b, a + b\n    return a\n```\n\n"
    "It runs in O(n) time and O(1) memory. For n = 10 it returns 55.\n\n"
    'Q: {"city": "Lyon", "population": 522250, "area_km2": 47.87, "rivers": ["Rhone", "Saone"]}\n'
    "A: Lyon is France's third-largest city; 522,250 people live on 47.87 km2 where the Rhone "
    "meets the Saone.\n\n"
    "Les marchés de Lyon ouvrent tôt. Der Zug fährt um 7:45 Uhr ab. 東京は日本の首都です。\n"
    "1. Preheat the oven to 180 °C.\n2. Mix 250 g flour, 2 eggs and 100 ml milk.\n3. Bake for 25 minutes.\n"
    "| item | qty | price |\n|---|---:|---:|\n| apples | 3 | 1.20 |\n| bread | 1 | 2.50 |\n\n"
    "Thank you! That was very helpful. Could you also explain why the recursive version is slow?\n"
    "Assistant: The recursive version recomputes the same values many times: fib(n) calls fib(n-1) "
    "and fib(n-2), and each of those calls its own pair, so the work doubles with every step.\n"
)
"""English prose, a chat exchange, code, JSON, numbers, other scripts and markdown: the
kinds of text a server sees, so each channel shows its usual range."""


def store_kv_as(
    graph_model: onnx.ModelProto,
    cache_names: Sequence[tuple[str, str, str, str]],
    elem_type: int,
    scales: KvScales | None = None,
) -> None:
    """Edit ``graph_model`` in place so that its key/value cache inputs and outputs
    (``cache_names``: per layer past key, present key, past value, present value) are of
    ``elem_type``; for int8, its GroupQueryAttention nodes also take ``scales``."""
    graph = graph_model.graph
    names = {name for layer in cache_names for name in layer}
    for value in [*graph.input, *graph.output]:
        if value.name in names:
            value.type.tensor_type.elem_type = elem_type
    if scales is None:
        if elem_type == onnx.TensorProto.FLOAT16:
            _attend_in_half(graph)
        return
    layer_of = {past_key: layer for layer, (past_key, _, _, _) in enumerate(cache_names)}
    for node in graph.node:
        if node.op_type != "GroupQueryAttention" or node.input[3] not in layer_of:
            continue
        layer = layer_of[node.input[3]]
        key_scale, value_scale = (f"ortserve/kv_scale.{layer}.{part}" for part in ("key", "value"))
        graph.initializer.extend(
            [
                onnx.numpy_helper.from_array(scales[layer][0], key_scale),
                onnx.numpy_helper.from_array(scales[layer][1], value_scale),
            ]
        )
        while len(node.input) < 14:
            node.input.append("")
        node.input[12], node.input[13] = key_scale, value_scale
        node.attribute.extend(
            [
                onnx.helper.make_attribute("k_quant_type", "PER_CHANNEL"),
                onnx.helper.make_attribute("v_quant_type", "PER_CHANNEL"),
                onnx.helper.make_attribute("kv_cache_bit_width", 8),
            ]
        )


def load_or_measure_scales(model_path: Path, graph_model: onnx.ModelProto, measure: Callable[[], KvScales]) -> KvScales:
    """The int8 scales of the model at ``model_path`` (graph ``graph_model``) kept by an
    earlier load, else ``measure()``'s, kept for the next (a read-only cache: measured
    again at each load, with a warning)."""
    derivation = f"kv-scales {FORMAT} {HEADROOM} {CALIBRATION_TEXT}"
    path = ortserve_cache("kv-scales") / f"{model_cache_key(model_path, graph_model, derivation)}.npz"
    try:
        with np.load(path) as kept:
            layers = len(kept.files) // 2
            return [(kept[f"k{layer}"], kept[f"v{layer}"]) for layer in range(layers)]
    except (OSError, KeyError, ValueError):
        pass
    scales = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.npz")
        arrays = {f"{part}{layer}": pair[i] for layer, pair in enumerate(scales) for i, part in enumerate("kv")}
        np.savez(partial, **arrays)  # type: ignore[arg-type]  # numpy's stub wants positional arrays
        partial.replace(path)
    except OSError as exc:
        logger.warning("int8 key/value scales not kept at %s (%s): they are measured at every load", path, exc)
    return scales


def scales_from_cache(
    keys: npt.NDArray[np.float32], values: npt.NDArray[np.float32], *, interleaved: bool
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """A layer's (key, value) scales from the keys and values a calibration run wrote,
    ``(1, kv heads, tokens, head size)`` each. Rotary embedding turns key channels in
    pairs (``i`` and ``i + head size / 2``, or ``2i`` and ``2i + 1`` when ``interleaved``),
    so a pair shares the larger of its two peaks: a later position may turn either's
    magnitude into the other."""
    key_peak = np.abs(keys).max(axis=2, keepdims=True)
    if interleaved:
        pair = np.maximum(key_peak[..., 0::2], key_peak[..., 1::2])
        key_peak = np.repeat(pair, 2, axis=-1)
    else:
        half = key_peak.shape[-1] // 2
        pair = np.maximum(key_peak[..., :half], key_peak[..., half:])
        key_peak = np.concatenate([pair, pair], axis=-1)
    value_peak = np.abs(values).max(axis=2, keepdims=True)
    # A channel that stayed at 0 still gets a usable scale (its values round to 0 or 1 step).
    floor = np.float32(1e-6)
    return (
        (np.maximum(key_peak, floor) * HEADROOM / 127).astype(np.float32),
        (np.maximum(value_peak, floor) * HEADROOM / 127).astype(np.float32),
    )


_HALF_INPUTS = (0, 1, 2, 7, 8, 10, 11)
"""GroupQueryAttention's inputs of type ``T``: query, key, value, the rotary cos and sin
caches, attention bias, head sink."""


def _attend_in_half(graph: onnx.GraphProto) -> None:
    """Run every GroupQueryAttention of ``graph`` in fp16: its ``T`` inputs cast to fp16
    and its output back to the graph's type.

    Why not an fp16 cache beside fp32 attention (``T_CACHE`` fp16, ``T`` fp32, which the
    operator also takes): attention then reads the keys and values of the call's own tokens
    as computed and earlier ones as stored, so a row's values depend on where the prefill
    calls split the prompt, and a prefix-cache hit changes logprobs (measured on SmolLM2:
    up to 1.2). In fp16 throughout, a call's own keys are the stored ones.
    """
    nodes: list[onnx.NodeProto] = []
    casts: dict[str, str] = {}
    for node in graph.node:
        if node.op_type == "GroupQueryAttention":
            for index in _HALF_INPUTS:
                if index < len(node.input) and node.input[index]:
                    name = node.input[index]
                    if name not in casts:
                        casts[name] = f"ortserve/fp16/{name}"
                        nodes.append(onnx.helper.make_node("Cast", [name], [casts[name]], to=onnx.TensorProto.FLOAT16))
                    node.input[index] = casts[name]
            output = node.output[0]
            node.output[0] = f"ortserve/fp16/{output}"
            nodes.append(node)
            nodes.append(onnx.helper.make_node("Cast", [node.output[0]], [output], to=onnx.TensorProto.FLOAT))
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
