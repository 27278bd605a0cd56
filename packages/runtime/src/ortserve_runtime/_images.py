"""Images as onnxruntime-genai may read them: decoded by Pillow first.

Runs in a model's og process (``_og_child``), beside the processor that reads what it
returns: Pillow holds the GIL for much of a decode (a 25-megapixel WebP, some 100 ms of the
GIL at a time), which in the server's process was the event loop's wait (twenty-third
probe, issue 45: four such images at once, /health up to 0.5 s).
"""

from __future__ import annotations

import io
import warnings

from ._errors import InvalidRequestError

__all__ = ["FORMATS", "ImageHeader", "image_header", "png_for_og"]

FORMATS = ("PNG", "JPEG", "WebP", "GIF", "BMP")
"""The image formats taken (OpenAI's four, and BMP). Pillow reads more, but some at a cost
its header does not show: an ICO whose directory says 16x16 holding a 13,000-pixel-square
PNG is decoded whole when it is opened (+609-646 MiB a request: twenty-fifth probe, issue
45)."""
_PILLOW_FORMATS = tuple(kind.upper() for kind in FORMATS)  # Pillow's names (a JPEG of several pictures too)
_METADATA_BYTES = 1 << 20
"""Bytes an image may hold beyond what its pixels could need uncompressed (4 a pixel):
metadata, colour profiles, a few frames. An 8x8 GIF with a 12 MB comment of 4 million
sub-blocks took the server +495-595 MiB as Pillow read its header (twenty-fifth probe)."""
_JPEG_MARKERS = 10_000
"""Markers a JPEG's header may hold before its frame's size (2.4 million empty APP markers
took 7 s to read)."""

_ORIENTATION = 0x0112  # the EXIF tag: 1 upright, 2-8 mirrored or turned by 90, 180 or 270 degrees
_UPRIGHT = {2: 0, 3: 3, 4: 1, 5: 5, 6: 4, 7: 6, 8: 2}
"""Each orientation's undoing as a Pillow ``Image.Transpose`` (FLIP_LEFT_RIGHT 0,
FLIP_TOP_BOTTOM 1, ROTATE_90 2, ROTATE_180 3, ROTATE_270 4, TRANSPOSE 5, TRANSVERSE 6), as
``ImageOps.exif_transpose`` does it."""

ImageHeader = tuple[str, int, int]
"""An image's format (one of :data:`FORMATS`), width and height, as its header says."""


def image_header(data: bytes) -> ImageHeader | None:
    """The format and size an image's first bytes declare, read without decoding anything;
    ``None`` for any other format, a header that cannot be read, or a side of 0 pixels
    (twenty-sixth probe, issue 45: a 0x0 PNG made the token count divide by zero, a 500)."""
    header = _declared(data)
    return header if header is not None and header[1] > 0 and header[2] > 0 else None


def _declared(data: bytes) -> ImageHeader | None:
    if len(data) < 30:  # shorter than any header read here, with its size in it
        return None
    try:
        if data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR":
            return "PNG", int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        if data[:6] in (b"GIF87a", b"GIF89a"):
            return "GIF", int.from_bytes(data[6:8], "little"), int.from_bytes(data[8:10], "little")
        if data.startswith(b"BM") and len(data) >= 26:
            if int.from_bytes(data[14:18], "little") == 12:  # OS/2's header
                return "BMP", int.from_bytes(data[18:20], "little"), int.from_bytes(data[20:22], "little")
            width = int.from_bytes(data[18:22], "little", signed=True)
            return "BMP", abs(width), abs(int.from_bytes(data[22:26], "little", signed=True))
        if data.startswith(b"RIFF") and data[8:12] == b"WEBP":
            return _webp_header(data)
        if data.startswith(b"\xff\xd8"):
            return _jpeg_header(data)
    except IndexError:
        return None
    return None


def _webp_header(data: bytes) -> ImageHeader | None:
    chunk = data[12:16]
    if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
        width, height = int.from_bytes(data[26:28], "little"), int.from_bytes(data[28:30], "little")
        return "WebP", width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L" and data[20:21] == b"\x2f":
        bits = int.from_bytes(data[21:25], "little")
        return "WebP", (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X" and len(data) >= 30:
        return "WebP", int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    return None


def _jpeg_header(data: bytes) -> ImageHeader | None:
    """The size of a JPEG's first frame, from its markers (each segment skipped by its length)."""
    at = 2
    for _ in range(_JPEG_MARKERS):
        while data[at] == 0xFF and data[at + 1] == 0xFF:  # fill bytes
            at += 1
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker in _JPEG_FRAMES:
            if at + 9 > len(data):
                return None
            height, width = int.from_bytes(data[at + 5 : at + 7], "big"), int.from_bytes(data[at + 7 : at + 9], "big")
            return "JPEG", width, height
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # no length
            at += 2
            continue
        at += 2 + int.from_bytes(data[at + 2 : at + 4], "big")
    return None


_JPEG_FRAMES = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


def _checked_header(data: bytes, max_pixels: int, param: str) -> ImageHeader:
    """The image's header, or a 400: a format not taken, more pixels than ``max_pixels``,
    or more bytes than its pixels could need."""
    header = image_header(data)
    if header is None:
        raise InvalidRequestError(
            f"the image could not be decoded: its format is not one this server takes ({', '.join(FORMATS)}), "
            "or its header cannot be read",
            param=param,
        )
    kind, width, height = header
    if width * height > max_pixels:
        raise InvalidRequestError(
            f"the image is {width}x{height} pixels, more than the {max_pixels} this server accepts", param=param
        )
    if len(data) > 4 * width * height + _METADATA_BYTES:
        raise InvalidRequestError(
            f"the image is {len(data)} bytes for {width}x{height} pixels: more than its pixels could need "
            f"(a {kind} holds at most {_METADATA_BYTES} bytes of metadata here)",
            param=param,
        )
    return header


def png_for_og(data: bytes, *, max_pixels: int, param: str, rewrite_png: bool = False) -> bytes:
    """PNG bytes onnxruntime-genai can read safely, or :class:`InvalidRequestError`.

    onnxruntime-genai decodes PNG with libpng (errors come back as exceptions) and anything
    else with libjpeg, whose error handler exits the whole process (measured: a BMP or a
    few garbage bytes end the process). So Pillow decodes every image first: a PNG it reads
    whole goes on as it is (unless ``rewrite_png``: libpng is stricter than Pillow, which
    takes a bad chunk checksum or an unknown critical chunk); anything else (JPEG included: the exit lives in its decoder)
    goes on re-encoded as an uncompressed PNG (the fastest to write and to read back:
    0.5 s for a 12-megapixel photo here, against 1.3 s at compression level 1).
    """
    if not data:
        raise InvalidRequestError("the image is empty", param=param)
    _, width, height = _checked_header(data, max_pixels, param)
    import PIL.Image  # here, not at import: a text model's server starts without Pillow's 20 ms

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PIL.Image.DecompressionBombWarning)
            with PIL.Image.open(io.BytesIO(data), formats=_PILLOW_FORMATS) as opened:
                if opened.size != (width, height):
                    raise InvalidRequestError(
                        f"the image could not be decoded: its header says {width}x{height} pixels, its "
                        f"data {opened.width}x{opened.height}",
                        param=param,
                    )
                opened.load()  # truncated or corrupt data fails here, not in onnxruntime-genai
                orientation = opened.getexif().get(_ORIENTATION)  # any value a hostile EXIF holds
                turn = _UPRIGHT.get(orientation) if isinstance(orientation, int) else None
                if opened.format == "PNG" and not rewrite_png and turn is None:
                    return data
                # convert() copies even an RGB image: one decoded copy less held at the peak
                rgb = opened if opened.mode == "RGB" else opened.convert("RGB")
                if rgb is not opened:
                    # Its pixels go before the PNG is written: an RGBA decode of 25 megapixels
                    # is 100 MB beside the RGB copy's 75 (two such WebPs took a Qwen og process
                    # +555-567 MiB: twenty-seventh probe, issue 45).
                    opened.close()
                if turn is not None:
                    # A photo is seen as it is shown: upright by its EXIF orientation (a
                    # phone's portrait photo is stored sideways), as browsers and transformers'
                    # load_image show it. Turned once in RGB, each copy let go at once (turned
                    # before the conversion, the RGBA copies took the og process past +512 MiB:
                    # twenty-eighth probe).
                    upright = rgb.transpose(PIL.Image.Transpose(turn))
                    rgb.close()
                    rgb = upright
                out = io.BytesIO()
                rgb.save(out, format="PNG", compress_level=0)
                del rgb
    except InvalidRequestError:
        raise
    except PIL.UnidentifiedImageError:
        raise InvalidRequestError(
            "the image could not be decoded: not an image format Pillow reads", param=param
        ) from None
    except (
        OSError,
        ValueError,
        SyntaxError,
        PIL.Image.DecompressionBombError,
        PIL.Image.DecompressionBombWarning,
    ) as exc:
        raise InvalidRequestError(f"the image could not be decoded: {exc}", param=param) from exc
    return out.getvalue()
