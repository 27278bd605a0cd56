"""SentencePiece (Llama-2-style) tokenizers, through ``/tokenize`` on a real server, against
onnxruntime-genai's tokenizer and transformers' (the real Phi-3 tokenizer, from the
tiny-phi3v fixture, over the tiny Qwen2's graph: only the tokens are looked at here).

What ortserve follows, and why ("Tokenization" in docs/guides/accelerators.md):
- the folder's ``tokenizer.json`` as written, with its normalizer or pre-tokenizer: it is
  what the model's publisher converted the SentencePiece model to, and what transformers'
  fast tokenizers (and so vLLM) read. On Phi-3's layout (a ``Prepend("▁")`` normalizer)
  og agrees token for token, so chat prompts are og's; on the newer ``Metaspace`` layout
  (prefix only at the start: Mistral, Llama-2 conversions) og still prefixes every piece
  after a special token and splits space runs differently, and ortserve follows the file;
- a completions prompt starts with the BOS that ``tokenizer.json``'s post-processor adds
  (transformers adds it too; og's ``Tokenizer.encode`` leaves it out, which is what makes
  og's own greedy text garbage on a Gemma-3 folder); a chat prompt has the BOS its template writes.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import onnxruntime_genai as og
import pytest
from images import TINY_PHI3V
from ortserve_server import ServerConfig, create_app
from serving import TINY_MODEL, running

TEXTS = ["Hello world", "a   b", "  leading", "x\n\n  y", "tab\there", "café 🙂 ünïcödé", "   ", "\n"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "code:\n    indent = 4\n"}]
RENDERED = "<|system|>\nBe brief.<|end|>\n<|user|>\ncode:\n    indent = 4\n<|end|>\n<|assistant|>\n"
# transformers 5.24 (AutoTokenizer on the Metaspace layout below, add_special_tokens=False):
# the same as the tokenizers library reading that file.
TRANSFORMERS_METASPACE = {
    "  leading": [29871, 8236],
    "   ": [1678],
    RENDERED: [
        *(32006, 13, 3629, 11473, 29889, 32007, 13, 32010, 13, 401, 29901),
        *(13, 1678, 29536, 353, 29871, 29946, 13, 32007, 13, 32001),
    ],
}


def sentencepiece_folder(base: Path, metaspace: bool) -> Path:
    """The tiny Qwen2 text model with the real Phi-3 tokenizer (and its chat template);
    ``metaspace``: its tokenizer.json rewritten to the newer conversion layout."""
    folder = base / ("metaspace" if metaspace else "phi3")
    shutil.copytree(TINY_MODEL, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(TINY_PHI3V / name, folder / name)
    if metaspace:
        spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        spec["normalizer"] = None
        spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
        (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Path]]]:
    base = tmp_path_factory.mktemp("sentencepiece")
    folders = {"phi3": sentencepiece_folder(base, False), "metaspace": sentencepiece_folder(base, True)}
    with running(create_app(ServerConfig(models=folders))) as url:
        yield url, folders


def tokens(url: str, model: str, **body: object) -> list[int]:
    reply = httpx.post(f"{url}/v1/tokenize", json={"model": model, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    return list(reply.json()["tokens"])


def og_tokens(folder: Path, text: str) -> list[int]:
    return [int(t) for t in og.Tokenizer(og.Model(str(folder))).encode(text)]


def test_phi3_layout_chat_is_og_s_tokens_and_a_prompt_adds_the_bos(server: tuple[str, dict[str, Path]]) -> None:
    url, folders = server
    assert tokens(url, "phi3", messages=CHAT) == og_tokens(folders["phi3"], RENDERED)
    for text in TEXTS:
        assert tokens(url, "phi3", prompt=text) == [1, *og_tokens(folders["phi3"], text)], text


def test_metaspace_layout_follows_the_file_as_transformers_does(server: tuple[str, dict[str, Path]]) -> None:
    url, folders = server
    assert tokens(url, "metaspace", messages=CHAT) == TRANSFORMERS_METASPACE[RENDERED]
    for text in ("  leading", "   "):
        assert tokens(url, "metaspace", prompt=text) == [1, *TRANSFORMERS_METASPACE[text]]
    # og prefixes the piece after each special token and counts a leading space run once more:
    # where it disagrees with the file, the file wins (og's tokens are shown, not followed).
    assert og_tokens(folders["metaspace"], RENDERED)[:3] == [32006, 29871, 13]
    assert og_tokens(folders["metaspace"], "   ") == [268]
