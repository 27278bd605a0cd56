"""A GGUF file's tokenizer as the ``tokenizer.json`` + ``tokenizer_config.json`` pair of a
genai folder.

A GGUF holds no ``tokenizer.json``: llama.cpp rebuilds its tokenizer at load time from the
``tokenizer.ggml.*`` metadata (token list, types, BPE merges or SentencePiece scores) and
from the *name* of the pre-tokenizer (``tokenizer.ggml.pre``), whose regular expressions
live in llama.cpp's source (``src/llama-vocab.cpp``), not in the file. A converted model
must see the ids llama.cpp would give for the same text, so this module writes a
``tokenizers`` description (what ortserve tokenizes and decodes with, and what llguidance
reads for grammars) that reproduces llama.cpp's tokenizer:

* ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE): the token list and merges as a BPE
  model, the pre-tokenizer name mapped to llama.cpp's list of regular expressions, each
  applied in turn as a ``Split`` (llama.cpp keeps both the matches and the text between
  them, which is ``tokenizers``' "Isolated" behaviour), then the GPT-2 byte-to-unicode
  mapping (``ByteLevel`` without its own regex). An unknown pre-tokenizer name is an error
  (:class:`ValueError` naming it) rather than a silent fallback to GPT-2's regex: a wrong
  split gives ids the model was not trained on, which looks like a working model that
  answers badly.
* ``tokenizer.ggml.model == "llama"`` (SentencePiece vocabulary with scores): llama.cpp's
  SPM tokenizer merges, again and again, the adjacent pair whose concatenation is the
  vocabulary entry with the highest score, and falls back to ``<0xXX>`` byte tokens. That
  is a BPE with a merge for every split of an entry into two entries, ranked by the score
  of the entry, with ``byte_fallback`` and the "▁" normalizer; every piece of text between
  special tokens gets the space prefix, as in llama.cpp.

Tokens of type CONTROL (and the few texts llama.cpp itself promotes to control tokens,
such as ``<|im_end|>``) become special added tokens, USER_DEFINED ones non-special added
tokens: both are matched in the text before pre-tokenization, as llama.cpp does with
``parse_special`` (what llama-server does for chat prompts). BOS/EOS are added by the
post-processor when ``add_bos_token``/``add_eos_token`` say so (with llama.cpp's defaults
when the keys are missing).

Not reproduced: the other tokenizer models (``bert``, ``t5``, ``rwkv``, ...) and the
pre-tokenizers outside :data:`SUPPORTED_PRE_TOKENIZERS` (hand-written C++ splitters such as
Kimi-K2's, the SentencePiece-style BPEs of Gemma 4, embedding models'); llama.cpp's
per-model token attributes (lstrip/rstrip for Phi-3 and a few embedding models); special
tokens that overlap in a text (llama.cpp takes the longest first, ``tokenizers`` the
leftmost); ties between equal SentencePiece scores (llama.cpp merges the leftmost pair,
the BPE here the lower token id first).

Long on purpose: most of its lines are llama.cpp's table of pre-tokenizer regular
expressions, one entry per name, which reads best as one table.

onnxruntime-genai's own tokenizer (onnxruntime-extensions) reads these files too but runs
its own approximation of the regular expressions: it gives llama.cpp's ids for SmolLM2
(``smollm``) and ``gpt-2``, mostly for ``llama-bpe``/``qwen2`` (runs of spaces before a
newline differ), and fails to load several others; ortserve does not tokenize with it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["SUPPORTED_PRE_TOKENIZERS", "eog_token_ids", "tokenizer_files"]

log = logging.getLogger("ortserve.runtime")

# llama.cpp's token types (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 1, 2, 3, 4, 6


# --------------------------------------------------------------------------- pre-tokenizers

# The regular expressions of llama.cpp's llm_tokenizer_bpe (src/llama-vocab.cpp), applied
# in order. Where llama.cpp runs its hand-written equivalent of a regex (GPT-2, Llama 3,
# Qwen2), the regex itself is used here. Where it adapted a regex for std::regex (the
# case-insensitive group spelled out), the adapted one is kept: it is what llama.cpp runs.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
# GPT-2's regex as llama.cpp lists it ends at "\s+(?!\S)"; the "|\s+" that ends it here (as in
# GPT-2's own) changes no split, since what no alternative matches is a piece anyway and
# llama.cpp's hand-written GPT-2 splitter has that branch, but it is the spelling that
# onnxruntime-extensions recognizes: without it, onnxruntime-genai 0.18 splits " x" off in
# "\treturn x ** 2".
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Written as escapes: the characters themselves would not survive Unicode normalization
# by editors (U+1F7D GREEK SMALL LETTER OMEGA WITH OXIA becomes U+03CE, breaking a range).
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b"
    "\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b"
    "\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb"
    "\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
    "\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_HAN_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_PUNCT_WORDS = r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
_DEEPSEEK3 = _PUNCT_WORDS + r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_SPARK = _PUNCT_WORDS + r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+"
# llama.cpp's adaptation of the case-split regexes of Tekken and GPT-4o to std::regex:
# "not a-z" / "not A-Z" among letters, so that every non-ASCII letter counts as both.
_UPPER = r"((?=[\p{L}])([^a-z]))"
_LOWER = r"((?=[\p{L}])([^A-Z]))"
_NOT_WORD = r"[^\r\n\p{L}\p{N}]?"


def _cased(suffix: str) -> str:
    return f"{_NOT_WORD}{_UPPER}*{_LOWER}+{suffix}|{_NOT_WORD}{_UPPER}+{_LOWER}*{suffix}"


_TEKKEN = _cased("") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O = _cased(_CONTRACTIONS + "?") + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_JAIS2 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    + "|".join(rf"\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4))
    + r"|\s{1,2}(?!\S)|\s{1}"
)
_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"


@dataclass(frozen=True, slots=True)
class _Pre:
    regexes: tuple[str, ...]
    # llama.cpp's "ignore_merges": a pre-tokenized word that is itself a token is kept whole.
    ignore_merges: bool = False
    # llama.cpp's default for add_bos when the GGUF has no tokenizer.ggml.add_bos_token.
    add_bos: bool = False


_GPT2_PRE = _Pre((_GPT2,))
_LLAMA3_PRE = _Pre((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_PRE = _Pre((_QWEN2,))
_STARCODER_PRE = _Pre((r"\p{N}", _GPT2))

_PRE_TOKENIZERS: dict[str, _Pre] = {
    "default": _Pre((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"],
        _LLAMA3_PRE,
    ),
    **dict.fromkeys(["dbrx", "smaug-bpe"], _Pre((_LLAMA3,))),
    **dict.fromkeys(
        [
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
            "exaone4",
        ],
        _GPT2_PRE,
    ),
    **dict.fromkeys(
        ["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"],
        _STARCODER_PRE,
    ),
    **dict.fromkeys(
        ["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"], _QWEN2_PRE
    ),
    "qwen35": _Pre((_QWEN35,)),
    "falcon": _Pre((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
    "deepseek-llm": _Pre(
        (
            "[\r\n]",
            rf"\s?[{_DEEPSEEK_LETTERS}]+",
            "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
            r"\s+\z",  # llama.cpp's std::regex "\s+$": the end of the piece, not of a line
            _CJK_HANGUL,
            r"\p{N}+",
        )
    ),
    "deepseek-coder": _Pre(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")),
    **dict.fromkeys(
        ["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"], _Pre((r"\p{N}{1,3}", _HAN_KANA, _DEEPSEEK3))
    ),
    "spark2_5": _Pre((r"\p{N}{1,3}", _HAN_KANA, _SPARK, r"\p{N}")),
    "jais-2": _Pre((_JAIS2,)),
    "chatglm-bpe": _Pre((_LLAMA3,)),
    **dict.fromkeys(["glm4", "glm5"], _Pre((_LLAMA3,), ignore_merges=True)),
    "tekken": _Pre((_TEKKEN,), ignore_merges=True, add_bos=True),
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _Pre((_GPT4O,))),
    **dict.fromkeys(["poro-chat", "bloom", "gpt3-finnish"], _Pre((_BLOOM,))),
    "viking": _Pre((_BLOOM, r"\p{N}")),
    "chameleon": _Pre(
        (
            "<sentinel:[0-9]+>",
            "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
            "([\t\n]|    |  )",
            r"\p{N}",
            r"[\p{P}!-/:-@\[-`{-~]",
            _GPT2,
        ),
        add_bos=True,
    ),
    **dict.fromkeys(
        ["bailingmoe", "bailingmoe2", "llada-moe"],
        _Pre(
            (
                r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                + r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
            )
        ),
    ),
    "seed-coder": _Pre(
        (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",)
    ),
    "ufakzeka": _Pre((r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",)),
    "grok-2": _QWEN2_PRE,
    "laguna": _Pre(("[^\n]+|[\n]+", _QWEN2)),
    "exaone-moe": _Pre(
        (
            _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
        )
    ),
    "minicpm5": _Pre(
        (
            r"\p{N}{1,3}",
            _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        ignore_merges=True,
    ),
}

SUPPORTED_PRE_TOKENIZERS: frozenset[str] = frozenset(_PRE_TOKENIZERS)
"""The ``tokenizer.ggml.pre`` values of byte-level BPE vocabularies that convert."""

# Texts llama.cpp treats as control tokens whatever their stored type (it promotes them
# while looking for EOT/EOM/FIM tokens), and the end-of-generation ones among them.
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
    }
)
_CONTROL_TEXTS = _EOG_TEXTS | {
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|fim_pad|>",
    "<fim-pad>",
    "<fim_pad>",
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<|file_sep|>",
}
# gpt-oss: llama.cpp makes these user-defined (matched in text, but shown when decoded).
_USER_DEFINED_TEXTS = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})


# --------------------------------------------------------------------------- public API


def tokenizer_files(fields: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"tokenizer.json": ..., "tokenizer_config.json": ...}`` (JSON-ready objects) from a
    GGUF's ``tokenizer.*`` metadata, decoded as :func:`gguf_fields` does.

    Raises :class:`ValueError` for a vocabulary this module cannot reproduce (a tokenizer
    model other than ``gpt2``/``llama``, an unknown ``tokenizer.ggml.pre``).
    """
    model = fields.get("tokenizer.ggml.model")
    vocab = _Vocab.from_fields(fields)
    if model == "gpt2":
        pre_name = fields.get("tokenizer.ggml.pre") or ""
        if not pre_name:
            log.warning("GGUF has no tokenizer.ggml.pre: using llama.cpp's 'default' pre-tokenizer")
            pre_name = "default"
        pre = _PRE_TOKENIZERS.get(pre_name)
        if pre is None:
            raise ValueError(
                f"GGUF pre-tokenizer {pre_name!r} (tokenizer.ggml.pre) is not supported; "
                f"supported: {', '.join(sorted(_PRE_TOKENIZERS))}"
            )
        add_bos = _flag(fields, "tokenizer.ggml.add_bos_token", pre.add_bos)
        add_eos = _flag(fields, "tokenizer.ggml.add_eos_token", False)
        tokenizer = _bpe_json(vocab, list(fields.get("tokenizer.ggml.merges") or []), pre)
    elif model == "llama":
        add_bos = _flag(fields, "tokenizer.ggml.add_bos_token", True)
        add_eos = _flag(fields, "tokenizer.ggml.add_eos_token", False)
        add_space_prefix = _flag(fields, "tokenizer.ggml.add_space_prefix", True)
        tokenizer = _spm_json(vocab, add_space_prefix)
    else:
        raise ValueError(
            f"GGUF tokenizer model {model!r} (tokenizer.ggml.model) is not supported; supported: 'gpt2', 'llama'"
        )
    tokenizer["post_processor"] = _post_processor(vocab, add_bos, add_eos)
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": _tokenizer_config(fields, vocab, add_bos, add_eos)}


def eog_token_ids(fields: Mapping[str, Any]) -> list[int]:
    """The ids that end generation for llama.cpp: EOS, EOT, EOM and the tokens whose text
    marks an end of turn (``<|im_end|>``, ``<|eot_id|>``, ...), in id order."""
    tokens: Sequence[str] = fields.get("tokenizer.ggml.tokens") or []
    ids = {i for i, text in enumerate(tokens) if text in _EOG_TEXTS}
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = fields.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int) and 0 <= value < len(tokens):
            ids.add(value)
    return sorted(ids)


# --------------------------------------------------------------------------- vocabulary


@dataclass(frozen=True, slots=True)
class _Vocab:
    tokens: list[str]
    types: list[int]
    scores: list[float]
    bos: int | None
    eos: int | None
    unk: int | None
    pad: int | None

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> _Vocab:
        tokens = fields.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError("GGUF has no tokenizer.ggml.tokens: no vocabulary to convert")
        # llama.cpp renames empty tokens so that every id has a distinct text.
        tokens = [text or f"[EMPTY_{i}]" for i, text in enumerate(tokens)]
        types = list(fields.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
        if len(types) < len(tokens):
            raise ValueError(f"GGUF has {len(types)} token types for {len(tokens)} tokens")
        scores = [float(score) for score in fields.get("tokenizer.ggml.scores") or [0.0] * len(tokens)]
        if len(scores) < len(tokens):
            raise ValueError(f"GGUF has {len(scores)} token scores for {len(tokens)} tokens")
        model = str(fields.get("tokenizer.ggml.model"))
        # llama.cpp's defaults when the ids are not in the file.
        defaults: dict[str, int | None] = (
            {"bos": 1, "eos": 2, "unk": 0, "pad": None} if model == "llama" else {"bos": 11, "eos": 11, "unk": None}
        )

        def special(name: str, key: str) -> int | None:
            value = fields.get(f"tokenizer.ggml.{key}", defaults.get(name))
            if isinstance(value, int) and 0 <= value < len(tokens):
                return value
            return None

        return cls(
            tokens=tokens,
            types=types,
            scores=scores,
            bos=special("bos", "bos_token_id"),
            eos=special("eos", "eos_token_id"),
            unk=special("unk", "unknown_token_id"),
            pad=special("pad", "padding_token_id"),
        )

    def ids(self) -> dict[str, int]:
        """Text -> id; a repeated text maps to its last id, as in llama.cpp."""
        return {text: i for i, text in enumerate(self.tokens)}

    def added_tokens(self) -> list[dict[str, Any]]:
        """The tokens llama.cpp matches in the text before tokenizing it (parse_special)."""
        ids = self.ids()
        added = []
        for i, (text, kind) in enumerate(zip(self.tokens, self.types, strict=False)):
            if ids[text] != i:
                continue  # a repeated text: only its last id is reachable, as in llama.cpp
            if text in _USER_DEFINED_TEXTS:
                special = False
            elif kind in (_CONTROL, _UNKNOWN) or text in _CONTROL_TEXTS:
                special = True
            elif kind == _USER_DEFINED:
                special = False
            else:
                continue
            added.append(
                {
                    "id": i,
                    "content": text,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "special": special,
                }
            )
        return added

    def text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens[token_id]


def _flag(fields: Mapping[str, Any], key: str, default: bool) -> bool:
    value = fields.get(key)
    return default if value is None else bool(value)


# --------------------------------------------------------------------------- gpt2 (byte-level BPE)


def _bpe_json(vocab: _Vocab, merges: list[str], pre: _Pre) -> dict[str, Any]:
    ids = vocab.ids()
    pairs: list[list[str]] = []
    seen: set[tuple[str, str]] = set()
    dropped = 0
    for merge in merges:
        # llama.cpp splits at the first space after the first character.
        cut = merge.find(" ", 1)
        if cut < 0:
            dropped += 1
            continue
        left, right = merge[:cut], merge[cut + 1 :]
        if (left, right) in seen:
            continue  # llama.cpp keeps the first rank of a repeated merge
        if left not in ids or right not in ids or left + right not in ids:
            dropped += 1  # tokenizers refuses such merges; llama.cpp never produces them as tokens
            continue
        seen.add((left, right))
        pairs.append([left, right])
    if dropped:
        log.warning("GGUF tokenizer: %d BPE merges dropped (malformed or outside the vocabulary)", dropped)
    splits = [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False} for regex in pre.regexes
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": vocab.added_tokens(),
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                *splits,
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": pre.ignore_merges,
            "vocab": ids,
            "merges": pairs,
        },
    }


# --------------------------------------------------------------------------- llama (SentencePiece)


_MAX_SPM_MERGES_PER_TOKEN = 8
"""Merges (splits of an entry into two entries) per vocabulary entry at most: the
SentencePiece vocabularies of Llama 2, Phi-3 and Gemma 3 (262,144 entries) make 1.9-2.0.
A vocabulary of nested entries ('a', 'aa', 'aaa', ...) makes one per character of each: a
2 MB file of 2,000 such entries made a million merges, a 663 MB ``tokenizer.json`` and 3.4 GiB
in the converter, and the server stalled 5.5 s loading it."""
_MAX_SPM_SPLIT_CHARACTERS = 64 << 20
"""Characters the splits may copy and look up at most (each candidate split of an entry
copies the entry once): Gemma 3's vocabulary needs under 11 million; one entry of 300,000
characters took 33 s of the converter without this bound."""


def _spm_merges(tokens: Sequence[str], scores: Sequence[float], ids: Mapping[str, int]) -> list[list[str]]:
    """Every split of a vocabulary entry into two entries, the entries with the highest
    score first: the BPE that reproduces llama.cpp's score-driven merging. A vocabulary
    that makes far more of them than a SentencePiece vocabulary does (see
    :data:`_MAX_SPM_MERGES_PER_TOKEN`) is a :class:`ValueError`, found before the merges or
    the work grow past their bounds."""
    lengths = {len(text) for text in ids}  # a split's halves are entries: only these lengths can be
    most_merges = _MAX_SPM_MERGES_PER_TOKEN * len(tokens)
    ranked: list[tuple[float, int, int, str, str]] = []
    copied = 0
    for token_id, text in enumerate(tokens):
        if ids.get(text) != token_id or len(text) < 2:
            continue
        for cut in range(1, len(text)):
            if cut not in lengths or len(text) - cut not in lengths:
                continue
            copied += len(text)
            if copied > _MAX_SPM_SPLIT_CHARACTERS:
                raise ValueError(
                    f"GGUF SentencePiece vocabulary of {len(tokens)} tokens has entries too long to split into "
                    f"merges (more than {_MAX_SPM_SPLIT_CHARACTERS} characters to look up; the longest entry "
                    f"has {max(lengths)}): not a vocabulary SentencePiece makes"
                )
            left, right = text[:cut], text[cut:]
            left_id, right_id = ids.get(left), ids.get(right)
            if left_id is not None and right_id is not None:
                ranked.append((-scores[token_id], token_id, left_id, left, right))
                if len(ranked) > most_merges:
                    raise ValueError(
                        f"GGUF SentencePiece vocabulary of {len(tokens)} tokens makes more than {most_merges} "
                        f"merges ({_MAX_SPM_MERGES_PER_TOKEN} a token; real ones make about 2): "
                        "entries nested in one another, not a vocabulary SentencePiece makes"
                    )
    ranked.sort(key=lambda item: item[:3])
    return [[left, right] for *_, left, right in ranked]


def _spm_json(vocab: _Vocab, add_space_prefix: bool) -> dict[str, Any]:
    ids = vocab.ids()
    n_bytes = sum(1 for kind in vocab.types if kind == _BYTE)
    if n_bytes < 256:
        log.warning("GGUF SentencePiece vocabulary has %d byte tokens (<0xXX>) of 256: no byte fallback", n_bytes)
    normalizers: list[dict[str, Any]] = []
    if add_space_prefix:
        normalizers.append({"type": "Prepend", "prepend": "▁"})
    normalizers.append({"type": "Replace", "pattern": {"String": " "}, "content": "▁"})
    decoders: list[dict[str, Any]] = [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if add_space_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": vocab.added_tokens(),
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": vocab.text(vocab.unk),
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": ids,
            "merges": _spm_merges(vocab.tokens, vocab.scores, ids),
        },
    }


# --------------------------------------------------------------------------- shared parts


def _post_processor(vocab: _Vocab, add_bos: bool, add_eos: bool) -> dict[str, Any]:
    """BOS/EOS around the text, as llama.cpp's ``add_special``."""
    specials: dict[str, dict[str, Any]] = {}

    def special(token_id: int | None, flag: str, type_id: int) -> list[dict[str, Any]]:
        if token_id is None:
            raise ValueError(f"GGUF sets {flag} but has no such token id")
        text = vocab.tokens[token_id]
        specials[text] = {"id": text, "ids": [token_id], "tokens": [text]}
        return [{"SpecialToken": {"id": text, "type_id": type_id}}]

    def sequence(name: str, type_id: int) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        if add_bos:
            items += special(vocab.bos, "tokenizer.ggml.add_bos_token", type_id)
        items.append({"Sequence": {"id": name, "type_id": type_id}})
        if add_eos:
            items += special(vocab.eos, "tokenizer.ggml.add_eos_token", type_id)
        return items

    return {
        "type": "TemplateProcessing",
        "single": sequence("A", 0),
        "pair": sequence("A", 0) + sequence("B", 1),
        "special_tokens": specials,
    }


def _tokenizer_config(fields: Mapping[str, Any], vocab: _Vocab, add_bos: bool, add_eos: bool) -> dict[str, Any]:
    config: dict[str, Any] = {
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "bos_token": vocab.text(vocab.bos),
        "eos_token": vocab.text(vocab.eos),
        "unk_token": vocab.text(vocab.unk),
        "pad_token": vocab.text(vocab.pad),
        # llama-server streams token pieces as they are: no clean-up of spaces.
        "clean_up_tokenization_spaces": False,
        # transformers then loads tokenizer.json as it is (onnxruntime-genai ignores the class).
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    template = fields.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        config["chat_template"] = template
    return config
