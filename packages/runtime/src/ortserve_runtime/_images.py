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

__all__ = ["png_for_og"]


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
    import PIL.Image  # here, not at import: a text model's server starts without Pillow's 20 ms

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PIL.Image.DecompressionBombWarning)
            with PIL.Image.open(io.BytesIO(data)) as opened:
                if opened.width * opened.height > max_pixels:
                    raise InvalidRequestError(
                        f"the image is {opened.width}x{opened.height} pixels, more than the "
                        f"{max_pixels} this server accepts",
                        param=param,
                    )
                opened.load()  # truncated or corrupt data fails here, not in onnxruntime-genai
                if opened.format == "PNG" and not rewrite_png:
                    return data
                # convert() copies even an RGB image: one decoded copy less held at the peak
                rgb = opened if opened.mode == "RGB" else opened.convert("RGB")
                out = io.BytesIO()
                rgb.save(out, format="PNG", compress_level=0)
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
