"""Qwen2.5-VL, Qwen3-VL and Gemma 4 (images, and Gemma 4's audio) through a real server and
the openai SDK, against onnxruntime-genai's own processor and generator on the same prompt
(tiny random models: see ``build_qwen_vl`` and ``build_gemma4_mm`` in
tests/fixtures/build_fixtures.py)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnxruntime_genai as og
import openai
import pytest
import soundfile
from audio import tone_wav
from images import image_bytes, image_part
from ortserve_server import ServerConfig, create_app
from PIL import Image, ImageOps
from serving import running
from tokenizers import Tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
FAMILIES = {
    "qwen2.5-vl": FIXTURES / "tiny-qwen2.5-vl",
    "qwen3-vl": FIXTURES / "tiny-qwen3-vl",
    "gemma4": FIXTURES / "tiny-gemma4-mm",
    "gemma3": FIXTURES / "tiny-gemma3-mm",
    "mistral3": FIXTURES / "tiny-mistral3-mm",
    "lfm2-vl": FIXTURES / "tiny-lfm2-vl",
}
IMAGE = {
    "qwen2.5-vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen3-vl": "<|vision_start|><|image_pad|><|vision_end|>",
}
IMAGE |= {"gemma4": "<|image>", "gemma3": "<start_of_image>", "mistral3": "[IMG]", "lfm2-vl": "<image>"}
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
RED, BLUE = image_bytes(64, 48, (220, 20, 20)), image_bytes(40, 72, (20, 20, 220))
SAME_SIZE = {"mistral3"}
"""Families whose og processor takes several images in a request only when they have one size."""
LOW, HIGH = tone_wav(1.0, 220.0), tone_wav(0.6, 1500.0)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with running(create_app(ServerConfig(models=FAMILIES))) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        yield client


def og_reply(folder: Path, text: str, images: list[bytes], n: int, audios: list[bytes] = ()) -> tuple[str, int]:  # type: ignore[assignment]
    """og's greedy reply to ``text`` with ``images`` and ``audios`` (its own processor and
    generator loop), decoded as the server decodes, and the prompt's length in tokens."""
    model = og.Model(str(folder))
    processor = model.create_multimodal_processor()
    inputs = processor(
        text,
        images=og.Images.open_bytes(*images) if images else None,
        audios=og.Audios.open_bytes(*audios) if audios else None,
    )
    prompt = inputs["input_ids"].as_numpy().size
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=max(prompt + n, 128), do_sample=False)  # gemma4: at least its window
    generator = og.Generator(model, params)
    generator.set_inputs(inputs)
    out: list[int] = []
    while not generator.is_done() and len(out) < n:
        generator.generate_next_token()
        out.append(int(generator.get_next_tokens()[0]))
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ends = {tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")}
    out = out[: next((i for i, t in enumerate(out) if t in ends), len(out))]  # the server sends no EOS
    return tokenizer.decode(out), prompt


def chat(client: openai.OpenAI, family: str, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=family,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=kwargs.pop("max_tokens", 10),
        temperature=0,
        **kwargs,
    )


def audio_part(wav: bytes) -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}


def pictures(family: str) -> tuple[bytes, bytes]:
    return (RED, image_bytes(64, 48, (20, 20, 220))) if family in SAME_SIZE else (RED, BLUE)


@pytest.mark.parametrize("family", FAMILIES)
def test_images_anywhere_in_the_conversation_give_og_s_reply(client: openai.OpenAI, family: str) -> None:
    """Two images in the first turn (before and between text), one in a later turn."""
    red, blue = pictures(family)
    messages = [
        {
            "role": "user",
            "content": [
                image_part(red),
                {"type": "text", "text": "and"},
                image_part(blue),
                {"type": "text", "text": "Compare them."},
            ],
        },
        {"role": "assistant", "content": "They differ."},
        {"role": "user", "content": [{"type": "text", "text": "And this one?"}, image_part(red)]},
    ]
    reply = chat(client, family, messages)
    image = IMAGE[family]
    text = (
        f"{SYSTEM}<|im_start|>user\n{image}and{image}Compare them.<|im_end|>\n"
        f"<|im_start|>assistantThey differ.<|im_end|>\n"  # the fixtures' template drops that newline
        f"<|im_start|>user\nAnd this one?{image}<|im_end|>\n<|im_start|>assistant\n"
    )
    expected, prompt_tokens = og_reply(FAMILIES[family], text, [red, blue, red], 10)
    assert reply.choices[0].message.content == expected
    assert reply.usage is not None and reply.usage.prompt_tokens == prompt_tokens


def test_a_photo_is_seen_upright_by_its_exif_orientation(client: openai.OpenAI) -> None:
    """A phone's portrait photo is stored sideways with an EXIF orientation saying how to
    turn it (6: 90 degrees clockwise); it was given to the model as its pixels lie."""
    picture = Image.new("RGB", (84, 28), (220, 20, 20))
    picture.paste((20, 20, 220), (42, 0, 84, 28))
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    picture.save(buffer, format="JPEG", quality=95, exif=exif.tobytes())
    photo = buffer.getvalue()

    def png(image: Image.Image) -> bytes:
        out = io.BytesIO()
        image.save(out, format="PNG")
        return out.getvalue()

    def logprobs(image: bytes, media_type: str = "image/png") -> Any:
        """The first tokens' logprobs of the reply to ``image`` (the same pixels, the same ones)."""
        part = image_part(image, media_type)
        messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]
        return chat(client, "qwen2.5-vl", messages, max_tokens=3, logprobs=True, top_logprobs=5).choices[0].logprobs

    stored = Image.open(io.BytesIO(photo))
    upright, sideways = logprobs(png(ImageOps.exif_transpose(stored))), logprobs(png(stored.convert("RGB")))
    assert upright != sideways  # the model tells them apart
    assert logprobs(photo, "image/jpeg") == upright


@pytest.mark.parametrize("family", FAMILIES)
def test_the_model_sees_the_images_and_their_order(client: openai.OpenAI, family: str) -> None:
    red, blue = pictures(family)

    def ask(*images: bytes) -> str | None:
        parts = [*(image_part(image) for image in images), {"type": "text", "text": "What is this?"}]
        return chat(client, family, [{"role": "user", "content": parts}]).choices[0].message.content

    seen_red, seen_blue = ask(red), ask(blue)
    assert seen_red != seen_blue and ask(red) == seen_red
    assert ask(red, blue) != ask(blue, red)
    text_only = chat(client, family, [{"role": "user", "content": "What is this?"}])
    expected, _ = og_reply(
        FAMILIES[family], f"{SYSTEM}<|im_start|>user\nWhat is this?<|im_end|>\n<|im_start|>assistant\n", [], 10
    )
    assert text_only.choices[0].message.content == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_and_responses_api_answers_match(client: openai.OpenAI, family: str) -> None:
    parts = [image_part(BLUE), {"type": "text", "text": "Describe it."}]
    whole = chat(client, family, [{"role": "user", "content": parts}]).choices[0].message.content
    stream = chat(client, family, [{"role": "user", "content": parts}], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole
    response = client.responses.create(
        model=family,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": parts[0]["image_url"]["url"], "detail": "auto"},  # type: ignore[index]
                    {"type": "input_text", "text": "Describe it."},
                ],
            }
        ],
        max_output_tokens=10,
        temperature=0,
    )
    assert response.output_text == whole


def test_gemma4_hears_audio_in_chat_and_responses(client: openai.OpenAI) -> None:
    def hear(wav: bytes) -> Any:
        return chat(client, "gemma4", [{"role": "user", "content": [audio_part(wav), {"type": "text", "text": "Hm?"}]}])

    low, high = hear(LOW), hear(HIGH)
    expected, prompt_tokens = og_reply(
        FAMILIES["gemma4"], f"{SYSTEM}<|im_start|>user\n<|audio>Hm?<|im_end|>\n<|im_start|>assistant\n", [], 10, [LOW]
    )
    assert low.choices[0].message.content == expected and low.usage.prompt_tokens == prompt_tokens
    assert high.choices[0].message.content != expected  # the model hears the difference
    both = chat(
        client,
        "gemma4",
        [{"role": "user", "content": [image_part(RED), {"type": "text", "text": "and"}, audio_part(LOW)]}],
    )
    expected, _ = og_reply(
        FAMILIES["gemma4"],
        f"{SYSTEM}<|im_start|>user\n<|image>and<|audio><|im_end|>\n<|im_start|>assistant\n",
        [RED],
        10,
        [LOW],
    )
    assert both.choices[0].message.content == expected
    response = client.responses.create(
        model="gemma4",
        input=[{"role": "user", "content": [audio_part(LOW), {"type": "input_text", "text": "Hm?"}]}],  # type: ignore[list-item]
        max_output_tokens=10,
        temperature=0,
    )
    assert response.output_text == low.choices[0].message.content


def clip(seconds: float, rate: int, channels: int = 1, fmt: str = "FLAC", hertz: float = 0.0) -> bytes:
    """A 16-bit clip, a tone (or silence) in every channel, encoded as ``fmt``."""
    t = np.arange(int(seconds * rate)) / rate
    tone = (np.sin(2 * np.pi * hertz * t) * 0.3 * 32767).astype(np.int16)
    buffer = io.BytesIO()
    soundfile.write(buffer, np.repeat(tone[:, None], channels, axis=1), rate, format=fmt, subtype="PCM_16")
    return buffer.getvalue()


def test_gemma4_audio_is_bounded_from_its_header_and_heard_as_og_hears_the_clip(
    url: str, client: openai.OpenAI
) -> None:
    """Issue 45: og decodes a clip whole into floats before its processor keeps 30 s of it;
    an hour of silence, a 180 KB FLAC, took the og process +416 MiB (answered 200), half an
    hour of 48 kHz stereo +1.6 GiB. Now a request's clips are bounded from their headers
    and og is given the frames the header says, decoded here, as og hears the clip itself."""

    def ask(data: bytes) -> httpx.Response:
        messages = [{"role": "user", "content": [audio_part(data), {"type": "text", "text": "Hm?"}]}]
        return httpx.post(f"{url}/v1/chat/completions", json={"model": "gemma4", "messages": messages, "max_tokens": 2})

    hour = clip(3600, 16_000)
    assert len(hour) < 400_000
    error = ask(hour).json()["error"]
    assert error["param"] == "messages[0].content[0]", error
    assert (
        "57600000 samples (frames x channels; below 16 kHz, at 16 kHz) in all, more than the 19200000"
        in error["message"]
    )
    # A FLAC whose header leaves its length open (as written to a pipe): libsndfile counts
    # it as 2^63 - 1 frames; it is said so, not counted.
    open_ended = bytearray(clip(1, 16_000))
    open_ended[21] &= 0xF0
    open_ended[22:26] = bytes(4)
    error = ask(bytes(open_ended)).json()["error"]
    assert error["param"] == "messages[0].content[0]" and "does not give its length" in error["message"], error
    for broken, words in ((b"RIFF" + bytes(40), "could not be decoded"), (clip(0, 16_000, fmt="WAV"), "no samples")):
        error = ask(broken).json()["error"]
        assert error["param"] == "messages[0].content[0]" and words in error["message"], error
    # 48 kHz stereo FLAC: the same reply as og's own decoder gives for the clip itself.
    stereo = clip(1.5, 48_000, channels=2, hertz=440.0)
    expected, prompt_tokens = og_reply(
        FAMILIES["gemma4"],
        f"{SYSTEM}<|im_start|>user\n<|audio>Hm?<|im_end|>\n<|im_start|>assistant\n",
        [],
        10,
        [stereo],
    )
    heard = chat(client, "gemma4", [{"role": "user", "content": [audio_part(stereo), {"type": "text", "text": "Hm?"}]}])
    assert heard.choices[0].message.content == expected and heard.usage.prompt_tokens == prompt_tokens
    # Seventeen channels: og's processor died of SIGFPE on them (a 503, the model reloaded:
    # twenty-eighth probe); past two they are mixed down to one here, heard for their length.
    many = ask(clip(1.5, 16_000, channels=17, fmt="WAV", hertz=440.0))
    assert many.status_code == 200 and many.json()["usage"]["prompt_tokens"] == prompt_tokens, many.text
    # 8 kHz telephone audio, which og alone refuses ("only down-sampling supported"), is
    # brought up to 16 kHz and heard for its length, as a 16 kHz clip of it is.
    phone = ask(clip(1.5, 8_000, fmt="WAV", hertz=440.0))
    assert phone.status_code == 200, phone.text
    _, same_length = og_reply(
        FAMILIES["gemma4"],
        f"{SYSTEM}<|im_start|>user\n<|audio>Hm?<|im_end|>\n<|im_start|>assistant\n",
        [],
        1,
        [clip(1.5, 16_000)],
    )
    assert phone.json()["usage"]["prompt_tokens"] == same_length


def test_what_a_family_cannot_take_is_a_400_naming_the_part(url: str) -> None:
    sizes = [{"role": "user", "content": [image_part(RED), image_part(BLUE)]}]
    reply = httpx.post(f"{url}/v1/chat/completions", json={"model": "mistral3", "messages": sizes, "max_tokens": 2})
    assert reply.status_code == 400 and "different sizes" in reply.json()["error"]["message"], reply.text
    two_clips = [{"role": "user", "content": [audio_part(LOW), audio_part(HIGH)]}]
    reply = httpx.post(f"{url}/v1/chat/completions", json={"model": "gemma4", "messages": two_clips, "max_tokens": 2})
    assert reply.status_code == 400 and "1 audio clip" in reply.json()["error"]["message"], reply.text
    heard = [{"role": "user", "content": [audio_part(LOW)]}]
    reply = httpx.post(f"{url}/v1/chat/completions", json={"model": "qwen2.5-vl", "messages": heard, "max_tokens": 2})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert "does not take audio" in error["message"] and error["param"] == "messages[0].content[0]"
    ok = httpx.post(f"{url}/v1/chat/completions", json={"model": "gemma4", "messages": heard, "max_tokens": 2})
    assert ok.status_code == 200  # and the server goes on serving


def test_models_list_what_each_family_takes(client: openai.OpenAI) -> None:
    models = {m.id: m.model_extra or {} for m in client.models.list()}
    assert models["gemma4"]["input_modalities"] == ["text", "audio", "image"]
    for family in ("qwen2.5-vl", "qwen3-vl", "gemma3", "mistral3", "lfm2-vl"):
        assert models[family]["engine"] == "og-generator" and models[family]["input_modalities"] == ["text", "image"]


def _webp_claiming(side: int) -> bytes:
    """A 38-byte lossless WebP whose header says ``side`` x ``side`` with alpha (Pillow
    decodes that many pixels from it)."""
    buffer = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buffer, "WEBP", lossless=True)
    webp = bytearray(buffer.getvalue())
    bits = int.from_bytes(webp[21:25], "little") & ~((1 << 29) - 1) | (side - 1) | (side - 1) << 14 | 1 << 28
    webp[21:25] = bits.to_bytes(4, "little")
    return bytes(webp)


def test_two_images_at_the_pixel_bound_are_refused_together(url: str) -> None:
    """Twenty-seventh probe, issue 45: two 38-byte WebPs saying 5000x5000 with alpha (50
    megapixels, the request's bound then) took Qwen2.5-VL's og process +555-567 MiB. A
    request's images hold 40 megapixels together now (25 and 15: +406-454 MiB)."""
    part = image_part(_webp_claiming(5000), "image/webp")
    messages = [{"role": "user", "content": [part, part, {"type": "text", "text": "and?"}]}]
    refused = httpx.post(
        f"{url}/v1/chat/completions", json={"model": "qwen2.5-vl", "messages": messages, "max_tokens": 1}
    )
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "messages" and "50000000 pixels in all, more than the 40000000" in error["message"], error


@pytest.mark.parametrize(("family", "token"), [("gemma3", 1021), ("qwen2.5-vl", 1020), ("gemma4", 1020)])
def test_a_model_s_media_token_is_never_fed_to_it_without_media(url: str, family: str, token: int) -> None:
    """Twenty-seventh probe, issue 45: the token og's processor puts where an image (audio)
    goes, fed to the model without one, fails its graph (ScatterND): a logit_bias on it, a
    prompt of ids holding it, or the tiny model sampling it by itself (3 of 8 plain n=4
    requests under load) was a 500. It is never sampled, and a request may not give it."""
    chat_url = f"{url}/v1/chat/completions"
    bias = {
        "model": family,
        "max_tokens": 4,
        "logit_bias": {str(token): 100},
        "messages": [{"role": "user", "content": "hi"}],
    }
    refused = httpx.post(chat_url, json=bias)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logit_bias", refused.text
    prompt = httpx.post(f"{url}/v1/completions", json={"model": family, "max_tokens": 2, "prompt": [5, token, 6]})
    assert prompt.status_code == 400 and prompt.json()["error"]["param"] == "prompt", prompt.text
    # Sampled as often as anything else: all of a short reply's alternatives but that one.
    messages = [{"role": "user", "content": [image_part(RED), {"type": "text", "text": "hi"}]}]
    body = {"model": family, "max_tokens": 8, "n": 4, "temperature": 2.0, "seed": 7, "messages": messages}
    sampled = httpx.post(chat_url, json={**body, "logprobs": True, "top_logprobs": 20}, timeout=60)
    assert sampled.status_code == 200, sampled.text
    tokenizer = Tokenizer.from_file(str(FAMILIES[family] / "tokenizer.json"))
    media_token = tokenizer.id_to_token(token)
    for choice in sampled.json()["choices"]:
        for step in choice["logprobs"]["content"]:
            assert media_token not in [alternative["token"] for alternative in step["top_logprobs"]]
