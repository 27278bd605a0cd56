"""A genai model folder read once: its ``genai_config.json`` and how onnxruntime-genai
loads it on the configured execution provider."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._config import ModelConfig
from ._errors import ModelLoadError
from ._model_files import MAX_GRAPH_BYTES, MAX_TOKENIZER_BYTES, checked_file, read_json_file
from ._providers import apply_og_provider, og_load_error

__all__ = ["GenaiFolder", "load_og_model", "read_json"]

log = logging.getLogger("ortserve.runtime")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``, or :class:`ModelLoadError` naming the file."""
    data = read_json_file(path)
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object", path=path)
    return data


@dataclass(frozen=True, slots=True)
class GenaiFolder:
    """What every generative and speech model reads from its folder, once."""

    path: Path
    genai: dict[str, Any]

    @classmethod
    def read(cls, path: Path) -> GenaiFolder:
        return cls(path, read_json(path / "genai_config.json"))

    @property
    def model(self) -> dict[str, Any]:
        model = self.genai.get("model")
        return model if isinstance(model, dict) else {}

    @property
    def model_type(self) -> str:
        return str(self.model.get("type", ""))

    @property
    def decoder(self) -> dict[str, Any]:
        decoder = self.model.get("decoder")
        return decoder if isinstance(decoder, dict) else {}

    @property
    def is_multimodal(self) -> bool:
        return any(section in self.model for section in ("vision", "speech", "embedding"))

    @property
    def is_encoder_decoder(self) -> bool:
        return "encoder" in self.model

    @property
    def context_length(self) -> int:
        try:
            length = int(self.model["context_length"])
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ModelLoadError(
                f"{self.path / 'genai_config.json'} lacks a required field: {exc}", path=self.path
            ) from exc
        if length < 1:
            raise ModelLoadError(
                f"{self.path / 'genai_config.json'}: model.context_length must be positive, not {length}",
                path=self.path,
            )
        return length

    def check_graph_files(self) -> None:
        """Each ONNX graph the config names (decoder, vision, speech, embedding, encoder) is
        a regular file onnx and og can read whole: one linked to ``/dev/zero`` grew the
        server past 3 GB in seconds (fourteenth probe of the hardening issue)."""
        for section in self.model.values():
            filename = section.get("filename") if isinstance(section, dict) else None
            if isinstance(filename, str):
                checked_file(self.path / filename, MAX_GRAPH_BYTES)

    @property
    def shortest_sequence(self) -> int:
        """The least ``max_length`` og accepts for a request: a sliding-window layer's cache
        (Gemma 2's local layers) is sized by it and must hold the whole window."""
        sliding = self.decoder.get("sliding_window")
        window = int(sliding.get("window_size") or 0) if isinstance(sliding, dict) else 0
        return min(window, self.context_length)

    @property
    def tokenizer_path(self) -> Path:
        """``tokenizer.json``, which the front reads (checked before any engine loads)."""
        return checked_file(self.path / "tokenizer.json", MAX_TOKENIZER_BYTES)

    def max_sequence_length(self, config: ModelConfig) -> int:
        """Prompt plus completion tokens per request: the context, capped by the config."""
        return min(self.context_length, config.max_sequence_length or self.context_length)

    @property
    def paged_attention(self) -> bool:
        """Built for ``og.Engine``'s dynamic batching: the builder's ``use_paged_attention``
        writes ``engine.dynamic_batching`` into genai_config.json (og 0.18 schedules by it)
        and a decoder that takes a ``block_table``."""
        engine = self.genai.get("engine")
        inputs = self.decoder.get("inputs")
        return (isinstance(engine, dict) and isinstance(engine.get("dynamic_batching"), dict)) or (
            isinstance(inputs, dict) and "block_table" in inputs
        )


def check_og_runs(og_model: Any, folder: GenaiFolder, provider: str, *, speculative: bool = False) -> None:
    """Run a text decoder through a 3-token prompt and 2 decode steps on ``og_model``, or
    raise :class:`ModelLoadError` with og's error: a folder og loads but cannot run (the
    builder's fp16 CPU graphs fail their first decode step in onnxruntime 1.31, measured)
    is then that model's load error, not a 500 on every request. ``speculative``: then
    also through og's n-gram speculation, on a prompt whose end it finds earlier (og
    refuses models that are not plain decoders only when it first drafts)."""
    import onnxruntime_genai as og

    probes = [([0, 1, 2], False), ([0, 1, 2, 3, 0, 1, 2], True)] if speculative else [([0, 1, 2], False)]
    for prompt, drafted in probes:
        try:
            params = og.GeneratorParams(og_model)
            params.set_search_options(max_length=max(len(prompt) + 6, folder.shortest_sequence), do_sample=False)
            if drafted:
                params.set_speculative_options(ngram_size=3, max_draft_tokens=4)
            generator = og.Generator(og_model, params)
            generator.append_tokens(prompt)
            for _ in range(2):
                generator.generate_next_token()
        except Exception as exc:  # og raises plain RuntimeError for every run failure
            what = "its n-gram speculation (speculative: ngram)" if drafted else "it"
            raise ModelLoadError(
                f"{folder.path}: onnxruntime-genai loads it but cannot run {what} on {provider}: {exc}",
                path=folder.path,
            ) from exc


def load_og_model(folder: Path, config: ModelConfig, *, every_core: bool = True) -> Any:
    """``og.Model`` for ``folder`` on ``config.provider``, with ``intra_op_threads`` and
    ``session_options`` (onnxruntime session config entries, which og passes on from a
    section's session_options) applied to the decoder and, where there is one, the encoder;
    ``every_core``: on the CPU without ``intra_op_threads``, use every core (og's default is
    about one); a load failure is a :class:`ModelLoadError` naming provider and fix."""
    import onnxruntime_genai as og

    started = time.perf_counter()
    try:
        og_config = og.Config(str(folder))
        apply_og_provider(og_config, config.provider, config.provider_options)
        threads = config.intra_op_threads
        if threads is None and every_core and config.provider == "cpu":
            # og's own default keeps to about one core; onnxruntime's (the ort-cpu engine's)
            # takes every core, so the og engines get the same.
            threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        session: dict[str, Any] = dict(config.session_options)
        if threads is not None:
            session["intra_op_num_threads"] = threads
        if session:
            sections = ["decoder"] + (["encoder"] if "encoder" in GenaiFolder.read(folder).model else [])
            og_config.overlay(json.dumps({"model": {s: {"session_options": session} for s in sections}}))
        model = og.Model(og_config)
    except ValueError:
        raise
    except Exception as exc:  # onnxruntime-genai raises plain RuntimeError for every load failure
        raise og_load_error(folder, config.provider, exc) from exc
    log.info("loaded %s on %s in %.1f s", folder, config.provider, time.perf_counter() - started)
    return model
