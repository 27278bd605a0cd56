"""A GGUF file (or the parts of a split one) turned into a genai model folder.

The folder holds what every engine reads: ``model.onnx`` (+ ``model.onnx.data``, see
:mod:`._gguf_graph`), ``genai_config.json``, ``tokenizer.json`` and
``tokenizer_config.json`` (from the file's ``tokenizer.ggml.*`` keys and chat template,
see :mod:`._gguf_tokenizer`), and ``ortserve_source.json`` saying where it came from.
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._gguf_arch import ARCHITECTURES, Hyperparameters
from ._gguf_file import GgufFile
from ._gguf_graph import write_graph
from ._gguf_tokenizer import eog_token_ids, tokenizer_files
from ._names import CONVERTER_VERSION, GgufError, split_parts

__all__ = ["CONVERTER_VERSION", "GgufError", "convert_gguf", "split_parts"]

logger = logging.getLogger(__name__)


def convert_gguf(source: Path, folder: Path, progress: Callable[[float], None] = lambda fraction: None) -> None:
    """Write the genai folder of the GGUF file ``source`` into ``folder`` (which exists)."""
    files = [GgufFile(part) for part in split_parts(source)]
    fields = files[0].fields
    tensors = [tensor for file in files for tensor in file.tensors]
    names = collections.Counter(tensor.name for tensor in tensors)
    repeated = sorted(name for name, count in names.items() if count > 1)
    if repeated:  # as llama.cpp's loader refuses it; one of them was taken silently before
        more = f" (and {len(repeated) - 3} more)" if len(repeated) > 3 else ""
        raise GgufError(f"{source.name} has tensors more than once: {', '.join(repeated[:3])}{more}")
    _check_vocabulary(fields, tensors)
    try:
        params, summary = write_graph(tensors, fields, folder, progress)
    except GgufError:
        raise
    except Exception as exc:  # a tensor whose bytes do not match its header, and the like
        raise GgufError(f"{source.name} could not be converted: {exc}") from exc
    for name, content in tokenizer_files(fields).items():
        (folder / name).write_text(json.dumps(content, ensure_ascii=False), encoding="utf-8")
    genai = _genai_config(params, fields)
    (folder / "genai_config.json").write_text(json.dumps(genai, indent=2), encoding="utf-8")
    (folder / "ortserve_source.json").write_text(
        json.dumps(
            {
                "source": str(source),
                "converter_version": CONVERTER_VERSION,
                "architecture": params.architecture,
                "name": fields.get("general.name"),
                **summary,
                # What each file weighs, checked before the folder is used again (a cut one
                # failed every load for good; sixteenth probe).
                "sizes": {path.name: path.stat().st_size for path in sorted(folder.iterdir())},
            },
            indent=2,
        ),
        encoding="utf-8",
    )


_MAX_TOKENS = 1 << 20
"""Tokens a vocabulary may have: four times the largest published (Gemma 3's 262,144)."""
_MAX_TOKEN_CHARS = 4096
"""Characters one token's text may have; published vocabularies' longest are some hundred."""


def _check_vocabulary(fields: dict[str, Any], tensors: list[Any]) -> None:
    """Refuse a vocabulary that is not one row a token of the embedding (llama.cpp refuses
    that shape too), or so large, or with a token so long, that tokenizing with it would
    cost the server gigabytes or minutes: 10 million tokens beside a 267-row embedding
    loaded as "ready" (+2.5 GiB); one 10 MB special token held the load for good (the
    fifteenth probe of issue 45)."""
    tokens = fields.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        return  # tokenizer_files says what is missing
    if len(tokens) > _MAX_TOKENS:
        raise GgufError(f"the vocabulary has {len(tokens):,} tokens; at most {_MAX_TOKENS:,} are served")
    longest = max(range(len(tokens)), key=lambda i: len(tokens[i]) if isinstance(tokens[i], str) else 0, default=None)
    if longest is not None and isinstance(tokens[longest], str) and len(tokens[longest]) > _MAX_TOKEN_CHARS:
        raise GgufError(
            f"token {longest} of the vocabulary is {len(tokens[longest]):,} characters long; "
            f"at most {_MAX_TOKEN_CHARS:,} are served"
        )
    embedding = next((tensor for tensor in tensors if tensor.name == "token_embd.weight"), None)
    if embedding is not None and len(embedding.shape) == 2 and int(embedding.shape[1]) != len(tokens):
        raise GgufError(
            f"the vocabulary has {len(tokens):,} tokens but token_embd.weight has {int(embedding.shape[1]):,} rows "
            "(one a token)"
        )


def _genai_config(params: Hyperparameters, fields: dict[str, Any]) -> dict[str, Any]:
    """genai_config.json as og's builder writes it for this decoder."""

    def token_id(key: str) -> int | None:
        value = fields.get(f"tokenizer.ggml.{key}")
        return int(value) if isinstance(value, int) and 0 <= value < params.vocab_size else None

    eos = [i for i in eog_token_ids(fields) if 0 <= i < params.vocab_size]
    bos = token_id("bos_token_id")
    pad = token_id("padding_token_id")
    if not eos:
        raise GgufError("the file names no end-of-sequence token (tokenizer.ggml.eos_token_id)")
    return {
        "model": {
            "bos_token_id": bos if bos is not None else eos[0],
            "context_length": params.context_length,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": "model.onnx",
                "head_size": params.head_size,
                "hidden_size": params.hidden,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": params.heads,
                "num_hidden_layers": params.layers,
                "num_key_value_heads": params.kv_heads,
            },
            "eos_token_id": eos if len(eos) > 1 else eos[0],
            "pad_token_id": pad if pad is not None else eos[0],
            "type": ARCHITECTURES[params.architecture].og_type,
            "vocab_size": params.vocab_size,
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": False,
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": params.context_length,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": True,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 50,
            "top_p": 1.0,
        },
    }
